"""A halt lasts until what caused it changes, no longer.

Seen on systemd 252: an unrelated local user listened on the unit's port during a restart and
went away; `port_held` quarantined the unit and every start after was refused until a person
ran `release`. A model on a network mount not there yet at boot (`FileNotFoundError`) that
appeared 20 s later: halted at the 1st crash, and still halted after the path existed.
A flashinfer-cubin/flashinfer-python mismatch fixed with `pip install flashinfer-cubin==0.6.4`
in the unit's venv: the next start was refused all the same, until a person ran `release`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from corpus_judge import failed_invocation
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_supervisor.actions import evidence
from vllm_supervisor.actions.amend import amend
from vllm_supervisor.actions.evidence import changed, evidence_of
from vllm_supervisor.actions.halt import RECORD_TEXT_LIMIT, Halter, quarantine_record
from vllm_supervisor.actions.quarantine import Quarantine
from vllm_supervisor.classify.classifier import Classifier
from vllm_supervisor.classify.signatures import load_signature_table
from vllm_supervisor.commands.demo import Dist, make_venv, site_packages, write_dist
from vllm_supervisor.commands.gate import EXIT_ALLOW, EXIT_QUARANTINED, gate_main
from vllm_supervisor.environment.fingerprint import UnitSettings, take
from vllm_supervisor.environment.unit_view import UnitView
from vllm_supervisor.model import Action, Decision, Outcome, Rule

UNIT = "vllm.service"


def outcome(root_cause_lines: list[str], rule: Rule) -> Outcome:
    invocation = failed_invocation(root_cause_lines)
    verdict = Classifier(load_signature_table()).classify(invocation.lines)
    return Outcome(
        invocation=invocation,
        verdict=verdict,
        decision=Decision(action=Action.HALT, reason="test", rule=rule),
    )


@pytest.fixture(name="listening")
def _listening() -> Iterator[socket.socket]:
    """A socket another process would hold: listening on a free loopback port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


def gate(tmp_path: Path) -> tuple[int, str]:
    out = io.StringIO()
    code = gate_main(UNIT, tmp_path / "run", tmp_path / "state", wait_s=1.0, out=out, defaults=())
    return code, out.getvalue()


def quarantine(tmp_path: Path, record: dict[str, Any]) -> Quarantine:
    records = Quarantine(tmp_path / "run" / "quarantine")
    records.write(UNIT, record)
    return records


class TestPortHeld:
    def test_the_record_keeps_the_port(self, listening: socket.socket) -> None:
        port = listening.getsockname()[1]
        lines = [
            "OSError: [Errno 98] error while attempting to bind on address "
            f"('0.0.0.0', {port}): address already in use"
        ]
        record = quarantine_record(outcome(lines, Rule.PORT_HELD))
        assert record["evidence"] == {"kind": "port_held", "port": port}

    def test_refused_while_held_then_let_through_once_free(
        self, tmp_path: Path, listening: socket.socket
    ) -> None:
        port = listening.getsockname()[1]
        records = quarantine(tmp_path, {"evidence": {"kind": "port_held", "port": port}})
        assert gate(tmp_path)[0] == EXIT_QUARANTINED
        assert records.is_quarantined(UNIT)
        listening.close()
        code, text = gate(tmp_path)
        assert code == EXIT_ALLOW
        assert f"port {port} is free now" in text and "halt is lifted" in text
        assert not records.is_quarantined(UNIT)


class TestMissingPath:
    def test_the_record_keeps_the_missing_path(self, tmp_path: Path) -> None:
        missing = tmp_path / "mnt" / "models" / "llama" / "config.json"
        lines = [
            "Traceback (most recent call last):",
            '  File "/opt/venv/lib/python3.12/site-packages/vllm/config.py", line 1, in load',
            "    open(path)",
            f"FileNotFoundError: [Errno 2] No such file or directory: '{missing}'",
        ]
        record = quarantine_record(outcome(lines, Rule.INFERRED_FATAL))
        assert record["evidence"] == {"kind": "missing_path", "path": str(missing)}

    def test_refused_while_missing_then_let_through_once_it_exists(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # What systemd answers the gate for a unit run as root with no mount settings (the
        # answers for other units: tests/test_unit_view.py and the e2e's PrivateTmp= unit).
        monkeypatch.setattr(evidence, "ask_unit_view", lambda unit, timeout_s: UnitView())
        missing = tmp_path / "mnt" / "models"
        records = quarantine(tmp_path, {"evidence": {"kind": "missing_path", "path": str(missing)}})
        assert gate(tmp_path)[0] == EXIT_QUARANTINED
        missing.mkdir(parents=True)  # the network mount arrives
        code, text = gate(tmp_path)
        assert code == EXIT_ALLOW and f"{missing} exists now, as {UNIT} sees it" in text
        assert not records.is_quarantined(UNIT)


def test_a_halt_with_nothing_that_can_change_stays(tmp_path: Path) -> None:
    """The flashinfer mismatch: no evidence the gate can re-check, so only `release` lifts it."""
    lines = ["RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version "
             "(0.6.4)"]  # fmt: skip
    record = quarantine_record(outcome(lines, Rule.FATAL_SIGNATURE))
    assert record["evidence"] is None
    quarantine(tmp_path, record)
    assert gate(tmp_path)[0] == EXIT_QUARANTINED


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


@given(
    st.dictionaries(
        st.sampled_from(["evidence", "kind", "port", "path"]),
        JSON | st.fixed_dictionaries({"kind": st.sampled_from(["port_held", "missing_path"])}),
    )
)
def test_no_record_crashes_the_check(record: dict[str, Any]) -> None:
    """A record is read back from disk: whatever it holds, the check answers, never raises."""
    result = changed(record)
    assert result is None or isinstance(result, str)


def test_no_outcome_without_evidence_gets_some() -> None:
    assert evidence_of(outcome(["ValueError: bad"], Rule.INFERRED_FATAL)) is None


CUBIN_MISMATCH = [
    "RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version (0.6.4)"
]
SERVED: tuple[Dist, ...] = (
    ("flashinfer-python", "0.6.4", ()),
    ("flashinfer-cubin", "0.6.3", ()),
    ("torch", "2.9.0", ()),
)


@pytest.fixture(name="venv")
def _venv(tmp_path: Path) -> Path:
    """The served unit's interpreter: a real venv holding flashinfer 0.6.4 with cubin 0.6.3."""
    return make_venv(tmp_path / "venv", SERVED)


def pip_install(python: Path, name: str, old: str, new: str) -> None:
    """What `pip install name==new` leaves in site-packages: the old dist-info gone, a new one."""
    site = site_packages(python.parent.parent)
    shutil.rmtree(site / f"{name.replace('-', '_')}-{old}.dist-info")
    write_dist(site, name, new)


async def halted(tmp_path: Path, python: Path) -> dict[str, Any]:
    """The record the daemon's halt writes for the flashinfer mismatch (no systemd here: the
    unit's configured `python` names its interpreter)."""
    records = Quarantine(tmp_path / "run" / "quarantine")
    halter = Halter(records, None, attempts=1, timeout_s=1.0, python_of=lambda unit: str(python))
    result = await halter.halt(UNIT, outcome(CUBIN_MISMATCH, Rule.FATAL_SIGNATURE), stop=False)
    record = records.read(UNIT)
    assert result.quarantined is not None and record is not None
    return record


def lifted_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "halt is lifted" in line]


def is_quarantined(tmp_path: Path) -> bool:
    return Quarantine(tmp_path / "run" / "quarantine").is_quarantined(UNIT)


class TestEnvironmentChanged:
    """The venv the unit runs: a package installed since the halt lifts it, nothing else."""

    async def test_a_package_upgrade_lifts_the_halt(self, tmp_path: Path, venv: Path) -> None:
        """`pip install flashinfer-cubin==0.6.4` after the halt: the next start goes, one line
        says why, and the record is gone."""
        record = await halted(tmp_path, venv)
        site = str(site_packages(tmp_path / "venv"))
        assert record["environment"]["packages"][site]["flashinfer-cubin"] == "0.6.3"
        assert gate(tmp_path)[0] == EXIT_QUARANTINED
        pip_install(venv, "flashinfer-cubin", "0.6.3", "0.6.4")
        code, text = gate(tmp_path)
        assert code == EXIT_ALLOW
        (line,) = lifted_lines(text)
        assert "flashinfer-cubin 0.6.3 → 0.6.4 since the halt" in line
        assert not is_quarantined(tmp_path)

    async def test_nothing_changed_stays_refused(self, tmp_path: Path, venv: Path) -> None:
        await halted(tmp_path, venv)
        for _ in range(2):
            code, text = gate(tmp_path)
            assert code == EXIT_QUARANTINED and not lifted_lines(text)
        assert is_quarantined(tmp_path)

    async def test_a_package_the_halt_named_added_or_removed_lifts_it(
        self, tmp_path: Path, venv: Path
    ) -> None:
        """The signature names flashinfer-python and flashinfer-cubin: another package added
        or removed lifts nothing (before: any did, one more wasted start); one of these does."""
        record = await halted(tmp_path, venv)
        assert record["packages"] == ["flashinfer-python", "flashinfer-cubin"]
        site = site_packages(tmp_path / "venv")
        write_dist(site, "flashinfer-jit-cache", "0.6.4+cu129")
        shutil.rmtree(site / "torch-2.9.0.dist-info")
        code, text = gate(tmp_path)
        assert code == EXIT_QUARANTINED and not lifted_lines(text), text
        shutil.rmtree(site / "flashinfer_cubin-0.6.3.dist-info")
        code, text = gate(tmp_path)
        assert code == EXIT_ALLOW
        (line,) = lifted_lines(text)
        assert "flashinfer-cubin removed (was 0.6.3)" in line
        assert "torch" not in line

    async def test_a_venv_gone_at_the_gate_stays_refused(self, tmp_path: Path, venv: Path) -> None:
        """A venv that cannot be listed now says nothing changed: no start on a guess."""
        await halted(tmp_path, venv)
        (tmp_path / "venv").rename(tmp_path / "moved")
        assert gate(tmp_path)[0] == EXIT_QUARANTINED
        site = site_packages(tmp_path / "venv")
        site.mkdir(parents=True)
        site.rmdir()
        site.write_text("not a directory\n")  # listing it fails with ENOTDIR, even for root
        assert gate(tmp_path)[0] == EXIT_QUARANTINED

    async def test_a_venv_unread_at_the_halt_is_not_compared(
        self, tmp_path: Path, venv: Path
    ) -> None:
        """What the halt could not read is not recorded, so no later state of it lifts."""
        site = site_packages(tmp_path / "venv")
        aside = site.with_name("aside")
        site.rename(aside)
        record = await halted(tmp_path, venv)
        assert "packages" not in (record["environment"] or {})
        aside.rename(site)
        pip_install(venv, "flashinfer-cubin", "0.6.3", "0.6.4")
        assert gate(tmp_path)[0] == EXIT_QUARANTINED


class TestAmend:
    """The fingerprint is added after the record is in force; a release meanwhile wins."""

    def test_the_record_in_force_gets_it_and_keeps_its_time(self, tmp_path: Path) -> None:
        records = quarantine(tmp_path, {"invocation_id": "a", "signature": "x"})
        path = records.path(UNIT)
        os.utime(path, ns=(1_000_000_000, 2_000_000_000))
        assert amend(records, UNIT, "a", {"environment": {"nvidia_driver": "550.54"}})
        assert records.read(UNIT) == {
            "invocation_id": "a",
            "signature": "x",
            "unit": UNIT,
            "environment": {"nvidia_driver": "550.54"},
        }
        assert path.stat().st_mtime_ns == 2_000_000_000
        assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file left

    def test_a_released_record_is_not_brought_back(self, tmp_path: Path) -> None:
        records = quarantine(tmp_path, {"invocation_id": "a"})
        records.release(UNIT)
        assert not amend(records, UNIT, "a", {"environment": {"x": 1}})
        assert not records.is_quarantined(UNIT)
        assert list(records.directory.iterdir()) == []

    def test_another_halts_record_is_left_alone(self, tmp_path: Path) -> None:
        records = quarantine(tmp_path, {"invocation_id": "b"})
        before = records.path(UNIT).read_bytes()
        assert not amend(records, UNIT, "a", {"environment": {"x": 1}})
        assert records.path(UNIT).read_bytes() == before


def never_hidden(path: str) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class UnitFiles:
    """A unit file, its drop-in and its environment file, as real files."""

    fragment: Path
    drop_in: Path
    env: Path


@pytest.fixture(name="files")
def _files(tmp_path: Path) -> UnitFiles:
    files = UnitFiles(
        fragment=tmp_path / "vllm.service",
        drop_in=tmp_path / "vllm.service.d" / "10-x.conf",
        env=tmp_path / "vllm.env",
    )
    files.drop_in.parent.mkdir()
    files.fragment.write_text("[Service]\nExecStart=/opt/venv/bin/vllm serve m\n")
    files.drop_in.write_text(f"[Service]\nEnvironmentFile=-{files.env}\n")
    files.env.write_text("VLLM_USE_FLASHINFER_SAMPLER=1\n")
    return files


def loaded(files: UnitFiles, **changes: Any) -> UnitSettings:
    """What systemd reports for the unit of `files` (over D-Bus in the daemon and the gate)."""
    settings = UnitSettings(
        exec_start=(("/opt/venv/bin/vllm", "/opt/venv/bin/vllm", "serve", "m"),),
        environment=("HF_TOKEN=hf_secret_value", "VLLM_LOGGING_LEVEL=INFO"),
        environment_files=(str(files.env),),
        unit_files=(str(files.fragment), str(files.drop_in)),
    )
    return dataclasses.replace(settings, **changes)


def halt_record(settings: UnitSettings) -> dict[str, Any]:
    return {"environment": take(interpreter=None, settings=settings, hidden=never_hidden)}


class TestConfigChanged:
    """The unit's loaded config (ExecStart=, Environment=, its files) since the halt."""

    def test_unchanged_is_not_lifted(self, files: UnitFiles) -> None:
        before = loaded(files)
        assert changed(halt_record(before), unit=UNIT, settings=lambda unit: before) is None

    def test_an_exec_start_change_lifts_it(self, files: UnitFiles) -> None:
        before = loaded(files)
        after = loaded(
            files,
            exec_start=(("/opt/venv/bin/vllm", "/opt/venv/bin/vllm", "serve", "m", "--eager"),),
        )
        what = changed(halt_record(before), unit=UNIT, settings=lambda unit: after)
        assert what == "ExecStart= changed since the halt"

    def test_an_environment_change_lifts_it_and_no_value_is_kept(self, files: UnitFiles) -> None:
        before = loaded(files)
        record = halt_record(before)
        assert "hf_secret_value" not in json.dumps(record)
        after = loaded(files, environment=("HF_TOKEN=hf_secret_value",))
        what = changed(record, unit=UNIT, settings=lambda unit: after)
        assert what == "Environment= changed since the halt"

    @pytest.mark.parametrize("systemd_answers", [True, False])
    def test_an_environment_file_edit_lifts_it(
        self, files: UnitFiles, systemd_answers: bool
    ) -> None:
        """Read at each start, the file counts without systemd's word (none: the bus is down)."""
        before = loaded(files)
        record = halt_record(before)
        files.env.write_text("VLLM_USE_FLASHINFER_SAMPLER=0\n")
        now = before if systemd_answers else None
        what = changed(record, unit=UNIT, settings=lambda unit: now)
        assert what == f"{files.env} changed since the halt"

    def test_an_environment_file_created_lifts_it(self, files: UnitFiles) -> None:
        before = loaded(files, environment_files=(str(files.env.with_name("later.env")),))
        record = halt_record(before)
        assert changed(record, unit=UNIT, settings=lambda unit: before) is None
        files.env.with_name("later.env").write_text("A=1\n")
        what = changed(record, unit=UNIT, settings=lambda unit: before)
        assert what == f"{files.env.with_name('later.env')} created since the halt"

    def test_a_missing_file_a_sandbox_may_hide_is_not_recorded_as_missing(
        self, files: UnitFiles
    ) -> None:
        """The daemon's PrivateTmp= hides the host's /tmp: absent for it says nothing."""
        before = loaded(files, environment_files=(str(files.env.with_name("later.env")),))
        record = {"environment": take(interpreter=None, settings=before)}  # the daemon's view
        files.env.with_name("later.env").write_text("A=1\n")
        assert changed(record, unit=UNIT, settings=lambda unit: before) is None

    def test_a_unit_file_edit_counts_once_systemd_loaded_it(self, files: UnitFiles) -> None:
        before = loaded(files)
        record = halt_record(before)
        files.drop_in.write_text("[Service]\nLimitMEMLOCK=infinity\n")
        pending = dataclasses.replace(before, needs_reload=True)
        assert changed(record, unit=UNIT, settings=lambda unit: pending) is None
        assert changed(record, unit=UNIT, settings=lambda unit: None) is None
        what = changed(record, unit=UNIT, settings=lambda unit: before)
        assert what == f"unit file {files.drop_in} changed since the halt"

    def test_a_new_drop_in_lifts_it(self, files: UnitFiles) -> None:
        before = loaded(files)
        override = files.drop_in.with_name("override.conf")
        override.write_text("[Service]\nEnvironment=VLLM_USE_V1=0\n")
        after = loaded(files, unit_files=(*before.unit_files, str(override)))
        what = changed(halt_record(before), unit=UNIT, settings=lambda unit: after)
        assert what == f"unit file {override} added since the halt"

    def test_through_the_gate_an_environment_file_edit_lifts_it(
        self, tmp_path: Path, files: UnitFiles
    ) -> None:
        quarantine(tmp_path, halt_record(loaded(files)))
        assert gate(tmp_path)[0] == EXIT_QUARANTINED
        files.env.write_text("VLLM_USE_FLASHINFER_SAMPLER=0\n")
        code, text = gate(tmp_path)
        assert code == EXIT_ALLOW
        (line,) = lifted_lines(text)
        assert f"the halt is lifted, {files.env} changed since the halt (was: " in line

    def test_unanswered_systemd_compares_only_the_files(self, files: UnitFiles) -> None:
        before = loaded(files)
        assert changed(halt_record(before), unit=UNIT, settings=lambda unit: None) is None

    def test_many_changes_fit_one_line(self, files: UnitFiles) -> None:
        before = loaded(files)
        added = tuple(str(files.drop_in.with_name(f"{n}.conf")) for n in range(8))
        after = loaded(files, unit_files=(*before.unit_files, *added))
        what = changed(halt_record(before), unit=UNIT, settings=lambda unit: after)
        assert what is not None and "\n" not in what and "and 3 more since the halt" in what


FINGERPRINT_PARTS = st.sampled_from(
    [
        "packages",
        "interpreter",
        "nvidia_driver",
        "exec_start",
        "environment",
        "environment_files",
        "unit_files",
    ]
)
PATHS = st.sampled_from(["/", "/dev/null", "/proc/self/status", "/nonexistent", "/tmp"]) | st.text(
    max_size=12
)
FINGERPRINTS = st.dictionaries(
    FINGERPRINT_PARTS,
    JSON | st.dictionaries(PATHS, JSON | st.dictionaries(st.text(max_size=8), JSON), max_size=3),
)
SETTINGS = st.none() | st.builds(
    UnitSettings,
    exec_start=st.lists(st.tuples(st.text(max_size=8)), max_size=2).map(tuple),
    environment=st.lists(st.text(max_size=8), max_size=2).map(tuple),
    environment_files=st.lists(PATHS, max_size=2).map(tuple),
    unit_files=st.lists(PATHS, max_size=2).map(tuple),
    needs_reload=st.booleans(),
)


@given(JSON | FINGERPRINTS, SETTINGS)
def test_no_fingerprint_crashes_the_check(fingerprint: Any, now: UnitSettings | None) -> None:
    """Whatever a record's fingerprint holds, and whatever systemd says, the check answers."""
    result = changed({"environment": fingerprint}, unit=UNIT, settings=lambda unit: now)
    assert result is None or isinstance(result, str)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=50)
@given(JSON)
def test_a_malformed_environment_never_lifts_a_halt(tmp_path: Path, fingerprint: Any) -> None:
    """Through the gate: a record whose fingerprint is not one keeps refusing, and never
    makes the gate fail (it would then let the start go)."""
    records = Quarantine(tmp_path / "run" / "quarantine")
    records.write(UNIT, {"signature": "x", "environment": fingerprint})
    assert gate(tmp_path)[0] == EXIT_QUARANTINED


async def test_a_record_that_cannot_be_written_says_why_in_the_halt(tmp_path: Path) -> None:
    """The halt's detail (history's `taken_detail`, the messages) names the unit and the
    reason the record was not written, not only that it was not."""
    (tmp_path / "run").write_text("a file where the runtime directory should be\n")
    halter = Halter(Quarantine(tmp_path / "run" / "quarantine"), None, attempts=1, timeout_s=1.0)
    result = await halter.halt(UNIT, outcome(CUBIN_MISMATCH, Rule.FATAL_SIGNATURE), stop=False)
    assert result.quarantined is None
    assert result.detail.startswith(f"could not quarantine {UNIT}: NotADirectoryError: "), (
        result.detail
    )
    assert result.detail.endswith("no stop was asked: systemd may start it again")


@given(reason=st.text(max_size=6000), title=st.text(max_size=300))
@settings(max_examples=60, deadline=None)
def test_outside_text_enters_a_record_escaped_and_bounded(reason: str, title: str) -> None:
    """A halt's reason may quote a port holder's command line (anyone's text): the record keeps
    it with its control characters escaped and its length bounded, as history, status, Slack
    and Alertmanager show it."""
    base = outcome(["RuntimeError: x"], Rule.PORT_HELD)
    halted = dataclasses.replace(
        base,
        verdict=dataclasses.replace(base.verdict, title=title),
        decision=Decision(action=Action.HALT, reason=reason, rule=Rule.PORT_HELD),
    )
    record = quarantine_record(halted)
    for key in ("reason", "title"):
        text = record[key]
        assert not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in text), (key, text)
        assert len(text) <= RECORD_TEXT_LIMIT + 1
