"""The gate fails open on the supervisor's own trouble and closed only on a quarantine record.

A config typo must not skip every supervised start: before, `gate` exited 2 on a config it
could not parse, and systemd took that as "condition failed" for every start of every served
unit while `systemctl start` returned 0. Whatever the config holds, the gate's answer is 0
(start) or 1 (a record says quarantined), never another code, never a traceback.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vllm_supervisor import cli
from vllm_supervisor.actions.quarantine import Quarantine

UNIT = "vllm.service"
TYPO = '[[unit]]\nname = "vllm.service"\nunknown_repeat_limit = three\n'


def run_gate(tmp_path: Path, *extra: str) -> tuple[int, str]:
    """`vllm-supervisor gate UNIT` in this process, with the test's directories."""
    err = io.StringIO()
    argv = [
        "gate",
        *extra,
        "--runtime-dir",
        str(tmp_path / "run"),
        "--state-dir",
        str(tmp_path / "state"),
        UNIT,
    ]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        code = cli.main(argv)
    return code, err.getvalue()


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "supervisor.toml"
    path.write_text(text, encoding="utf-8")
    return path


class TestConfigTrouble:
    def test_a_config_typo_lets_the_start_through_and_says_why(self, tmp_path: Path) -> None:
        config = write_config(tmp_path, TYPO)
        code, text = run_gate(tmp_path, "--config", str(config))
        assert code == 0
        assert f"{UNIT}: start allowed" in text
        assert str(config) in text and "does not load" in text
        assert "Traceback" not in text

    def test_a_record_still_refuses_when_the_config_does_not_load(self, tmp_path: Path) -> None:
        config = write_config(tmp_path, TYPO)
        Quarantine(tmp_path / "run" / "quarantine").write(UNIT, {"signature": "sig"})
        code, text = run_gate(tmp_path, "--config", str(config))
        assert code == 1
        assert "quarantined" in text

    def test_a_config_that_is_a_directory_lets_the_start_through(self, tmp_path: Path) -> None:
        (tmp_path / "conf.d").mkdir()
        code, text = run_gate(tmp_path, "--config", str(tmp_path / "conf.d"))
        assert code == 0
        assert "start allowed" in text

    def test_a_missing_config_named_by_the_environment_lets_the_start_through(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv(cli.CONFIG_ENV, str(tmp_path / "nowhere.toml"))
        code, text = run_gate(tmp_path)
        assert code == 0
        assert "start allowed" in text


TOML_ISH = st.text(
    alphabet=st.sampled_from(list("[]\"=\n .abcdefgtunirmsl_0123456789#'{},\\")), max_size=120
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.one_of(TOML_ISH, st.just(TYPO)), quarantined=st.booleans())
def test_whatever_the_config_says_only_a_record_refuses(
    tmp_path: Path, text: str, quarantined: bool
) -> None:
    """Generated configs (most of them broken): exit 1 exactly when a record exists, else 0."""
    config = write_config(tmp_path, text)
    record = Quarantine(tmp_path / "run" / "quarantine")
    if quarantined:
        record.write(UNIT, {"signature": "sig"})
    elif record.directory.is_dir():
        record.release(UNIT)
    code, output = run_gate(tmp_path, "--config", str(config))
    assert code == (1 if quarantined else 0), output
    assert "Traceback" not in output


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(unit=st.text(min_size=1, max_size=30).filter(lambda u: "\x00" not in u), held=st.booleans())
@example(unit="\udcff.service", held=False)  # a byte of argv that is not UTF-8
@example(unit="\udcff.service", held=True)
def test_whatever_the_unit_name_only_its_record_refuses(
    tmp_path: Path, unit: str, held: bool
) -> None:
    """Any unit name on the command line: 1 exactly when its record exists, else 0."""
    records = Quarantine(tmp_path / "run" / "quarantine")
    if held:
        records.write(unit, {"signature": "sig"})
    elif records.directory.is_dir():
        records.release(unit)
    err = io.StringIO()
    argv = ["gate", "--runtime-dir", str(tmp_path / "run"), "--state-dir", str(tmp_path / "state")]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        code = cli.main([*argv, "--", unit])
    assert code == (1 if held else 0), err.getvalue()
    assert cli.UNEXPECTED not in err.getvalue()


class TestFaultsOfItsOwn:
    """Whatever the gate itself gets wrong, its answer stays 0 or 1, never the last net's 2."""

    def test_a_loader_fault_lets_the_start_through(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The config loader raising something other than ConfigError: start allowed."""

        def broken(path: Path | None) -> None:
            raise RuntimeError("a fault of the loader")

        monkeypatch.setattr("vllm_supervisor.commands.gate.load_config", broken)
        code, text = run_gate(tmp_path, "--config", str(write_config(tmp_path, "")))
        assert code == 0, text
        assert "does not load (RuntimeError('a fault of the loader'); please report it)" in text

    @pytest.mark.parametrize("held", [True, False])
    def test_a_fault_reading_the_records_refuses_only_on_a_record(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: bool
    ) -> None:
        """Reading a record raising something unforeseen: refused while its file is there,
        allowed once it is gone; said in words either way."""
        records = Quarantine(tmp_path / "run" / "quarantine")
        records.write(UNIT, {"signature": "sig"})
        if not held:
            records.release(UNIT)

        def broken(self: Quarantine, unit: str) -> None:
            raise RuntimeError("a fault of the reader")

        monkeypatch.setattr(Quarantine, "read", broken)
        code, text = run_gate(tmp_path)
        assert code == (1 if held else 0), text
        assert cli.UNEXPECTED not in text
        if held:
            assert "the gate failed reading the records" in text
            assert f"start refused, quarantined: a record is at {records.path(UNIT)}" in text
