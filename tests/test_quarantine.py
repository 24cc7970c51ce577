"""Quarantine records: atomic, private, one file per unit whatever its name, fail closed."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from vllm_supervisor.actions.quarantine import Quarantine, record_name, unit_from_name


@pytest.fixture
def quarantine(tmp_path: Path) -> Quarantine:
    return Quarantine(tmp_path / "run" / "quarantine")


class TestNames:
    @pytest.mark.parametrize(
        "unit",
        [
            "vllm.service",
            "vllm@0.service",  # template instance
            "vllm@gpu\\x2d0.service",  # systemd-escaped "-" inside an instance
            "a:b.service",
            "weird/slash.service",  # not a valid unit name, but never a path traversal
            ".hidden.service",
            "..",
        ],
    )
    def test_name_is_one_safe_reversible_file(self, unit: str) -> None:
        """Every unit name maps to one plain, non-hidden file name that maps back to it."""
        name = record_name(unit)
        assert "/" not in name
        assert not name.startswith(".")
        assert unit_from_name(name) == unit

    @given(unit=st.text(min_size=1, max_size=40))
    @example(unit="\udcff.service")  # a non-UTF-8 byte of argv, as Python decodes it
    def test_any_name_is_one_safe_reversible_file(self, unit: str) -> None:
        """Any text (lone surrogates included: argv's undecodable bytes) names one file."""
        name = record_name(unit)
        assert "/" not in name and "\x00" not in name
        assert not name.startswith(".")
        assert unit_from_name(name) == unit


class TestWriteRead:
    def test_write_then_read_round_trips(self, quarantine: Quarantine) -> None:
        """A written record reads back with the unit name added."""
        path = quarantine.write("vllm.service", {"signature": "x", "reason": "fatal"})
        assert path.name == "vllm.service.json"
        assert quarantine.read("vllm.service") == {
            "signature": "x",
            "reason": "fatal",
            "unit": "vllm.service",
        }
        assert quarantine.is_quarantined("vllm.service")

    def test_modes_are_private(self, quarantine: Quarantine) -> None:
        """The record is 0640 and its directory 0750 whatever the umask."""
        path = quarantine.write("vllm.service", {})
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o750

    def test_no_temp_file_is_left_behind(self, quarantine: Quarantine) -> None:
        """An atomic write leaves exactly the record in the directory."""
        quarantine.write("vllm.service", {"a": 1})
        quarantine.write("vllm.service", {"a": 2})
        assert [p.name for p in quarantine.directory.iterdir()] == ["vllm.service.json"]
        assert quarantine.read("vllm.service") == {"a": 2, "unit": "vllm.service"}

    def test_missing_directory_means_not_quarantined(self, quarantine: Quarantine) -> None:
        """Before any halt there is no directory and nothing is quarantined."""
        assert quarantine.read("vllm.service") is None
        assert not quarantine.is_quarantined("vllm.service")
        assert quarantine.list() == {}


class TestCorrupt:
    @pytest.mark.parametrize("text", ["", "{not json", "[1, 2]", "\x00\x01"])
    def test_corrupt_record_still_quarantines(self, quarantine: Quarantine, text: str) -> None:
        """A record that does not parse is reported as corrupt but still counts (fail closed)."""
        quarantine.write("vllm.service", {})
        quarantine.path("vllm.service").write_text(text)
        record = quarantine.read("vllm.service")
        assert record is not None
        assert record["corrupt"] is True
        assert "vllm.service.json" in record["error"]
        assert quarantine.is_quarantined("vllm.service")


class TestReleaseAndList:
    def test_release_removes_and_returns_the_record(self, quarantine: Quarantine) -> None:
        """Release hands back what was removed; a second release finds nothing."""
        quarantine.write("vllm@1.service", {"signature": "s"})
        released = quarantine.release("vllm@1.service")
        assert released is not None
        assert released["signature"] == "s"
        assert not quarantine.is_quarantined("vllm@1.service")
        assert quarantine.release("vllm@1.service") is None

    def test_list_decodes_unit_names_and_skips_temp_files(self, quarantine: Quarantine) -> None:
        """list() returns every record by its real unit name and ignores stray temp files."""
        quarantine.write("vllm@a:b.service", {"n": 1})
        quarantine.write("tgi.service", {"n": 2})
        (quarantine.directory / ".tmp-stray").write_text("{}")
        listed = quarantine.list()
        assert sorted(listed) == ["tgi.service", "vllm@a:b.service"]
        assert json.loads(json.dumps(listed))["tgi.service"]["n"] == 2
