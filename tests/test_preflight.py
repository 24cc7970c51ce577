"""Preflight: each check against real venvs, a real bound socket and real quarantine records."""

from __future__ import annotations

import io
import json
import platform
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakevenv import Venvs, session_venvs

from vllm_supervisor.actions.preflight import QUARANTINED, run_preflight
from vllm_supervisor.actions.quarantine import Quarantine
from vllm_supervisor.classify.identities import identities
from vllm_supervisor.classify.signatures import SignatureTable, load_signature_table
from vllm_supervisor.commands.preflight import EXIT_FAILED, EXIT_OK, preflight_main
from vllm_supervisor.environment.execstart import serving_port
from vllm_supervisor.environment.log import EnvironmentLog
from vllm_supervisor.environment.ports import PORT_SIGNATURES
from vllm_supervisor.environment.preflight import (
    PROBE_FAILED,
    REQUIREMENT_SIGNATURE,
    PreflightReport,
    Status,
    check_families,
)
from vllm_supervisor.environment.requirements import DEFAULT_FAMILIES
from vllm_supervisor.environment.snapshot import EnvSnapshot
from vllm_supervisor.store import Store

UNIT = "vllm.service"


@pytest.fixture(scope="session")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> Venvs:
    return session_venvs(tmp_path_factory)


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port bound (not listening) on loopback for the duration of a test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def table_of(directory: Path, signature_id: str, title: str, remediation: str) -> SignatureTable:
    """A signature table of one entry (its pattern captures `cubin`), written and loaded."""
    path = directory / "own.toml"
    path.write_text(
        f'[[signature]]\nid = "{signature_id}"\ntitle = "{title}"\nseverity = "fatal"\n'
        f"patterns = ['{signature_id} (?P<cubin>\\S+)']\nremediation = \"{remediation}\"\n",
        encoding="utf-8",
    )
    return load_signature_table([path])


def preflight(python: Path | None, **kwargs: object) -> PreflightReport:
    """run_preflight with no port, no quarantine and no table unless a test gives them."""
    args: dict[str, object] = {"port": None, "quarantine_dir": None, "table": None}
    args.update(kwargs)
    return run_preflight(python=python, unit=UNIT, **args)  # type: ignore[arg-type]


def failures(report: PreflightReport) -> list[str]:
    """The signature ids of the failed checks."""
    return [
        r.identity.signature for r in report.results if r.status is Status.FAILED and r.identity
    ]


class TestPackages:
    def test_mismatched_flashinfer_fails_fast(self, venvs: Venvs) -> None:
        """flashinfer-python 0.6.4 with cubin 0.6.3 fails as the crash would, in under 2 s."""
        started = time.monotonic()
        report = preflight(venvs["upgraded"])
        elapsed = time.monotonic() - started
        assert failures(report) == ["flashinfer_cubin_mismatch"]
        assert [r.status for r in report.results if r.check == "requirements"] == [Status.SKIPPED]
        assert elapsed < 2.0  # an upper bound only; typical runs take a small fraction
        failed = next(r for r in report.results if r.status is Status.FAILED)
        assert "flashinfer-python 0.6.4" in failed.detail
        assert "flashinfer-cubin 0.6.3" in failed.detail

    def test_consistent_environment_passes(self, venvs: Venvs) -> None:
        """One flashinfer version (local label ignored), met requirements, markers honoured."""
        report = preflight(venvs["good"])
        assert report.ok, report.render_text()
        statuses = {r.check: r.status for r in report.results}
        assert statuses["families"] is Status.PASSED
        assert statuses["requirements"] is Status.PASSED

    def test_unsatisfied_requirement_fails(self, venvs: Venvs) -> None:
        """vllm pinning torch==2.9.0 with torch 2.8.0 installed fails and names both."""
        report = preflight(venvs["unsatisfied"])
        assert failures(report) == ["requirement_unsatisfied"]
        failed = next(r for r in report.results if r.status is Status.FAILED)
        assert failed.detail == "vllm 0.11.0 requires torch==2.9.0, but torch 2.8.0 is installed"

    def test_missing_interpreter_fails(self, tmp_path: Path) -> None:
        """An interpreter that cannot run fails the start it would fail anyway."""
        report = preflight(tmp_path / "nope" / "python")
        assert failures(report) == ["environment_probe_failed"]

    def test_no_interpreter_skips_package_checks(self) -> None:
        """A unit without python (TGI's launcher) passes with the package checks skipped."""
        report = preflight(None)
        assert report.ok
        assert [r.status for r in report.results if r.check == "interpreter"] == [Status.SKIPPED]

    def test_table_entry_wins_over_builtin(self, venvs: Venvs, tmp_path: Path) -> None:
        """With the id in the table, its title and rendered remediation are reported."""
        table = table_of(
            tmp_path, "flashinfer_cubin_mismatch", "cubin mismatch", "pin cubin {cubin}"
        )
        report = preflight(venvs["upgraded"], table=table)
        failed = next(r for r in report.results if r.status is Status.FAILED)
        assert failed.identity is not None
        assert (failed.identity.title, failed.identity.remediation) == (
            "cubin mismatch",
            "pin cubin 0.6.3",
        )


class TestPort:
    def test_bound_port_fails(self, held_port: int) -> None:
        """A port another socket holds fails with the port-in-use signature."""
        report = preflight(None, port=held_port)
        assert failures(report) == ["port_in_use"]

    def test_free_port_passes(self) -> None:
        """A port nobody holds passes."""
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        assert preflight(None, port=port).ok


class TestQuarantine:
    def test_quarantined_unit_fails_with_its_crash(self, tmp_path: Path) -> None:
        """A quarantine record fails with the signature the halt recorded."""
        record = {
            "signature": "cuda_oom",
            "title": "CUDA out of memory",
            "remediation": "Lower it.",
        }
        Quarantine(tmp_path).write(UNIT, record)
        report = preflight(None, quarantine_dir=tmp_path)
        assert failures(report) == ["cuda_oom"]
        failed = next(r for r in report.results if r.status is Status.FAILED)
        assert failed.identity is not None
        assert failed.identity.remediation.startswith("Lower it.")

    def test_unreadable_record_still_fails(self, tmp_path: Path) -> None:
        """A record without a verdict (or corrupt) still quarantines, fail closed."""
        (tmp_path / f"{UNIT}.json").write_text("{not json", encoding="utf-8")
        report = preflight(None, quarantine_dir=[tmp_path / "empty", tmp_path])
        assert failures(report) == ["quarantined"]

    def test_other_unit_record_passes(self, tmp_path: Path) -> None:
        """Another unit's record does not block this one."""
        Quarantine(tmp_path).write("sglang.service", {"signature": "x"})
        assert preflight(None, quarantine_dir=tmp_path).ok


class TestMain:
    def test_exit_status_and_text(self, venvs: Venvs, tmp_path: Path) -> None:
        """A failure exits 1 and prints `FAIL <id>: <title>`, the detail, then the remediation."""
        table = table_of(tmp_path, "flashinfer_cubin_mismatch", "cubin differs", "pin {cubin}")
        out = io.StringIO()
        status = preflight_main(
            UNIT,
            python=venvs["upgraded"],
            port=None,
            runtime_dir=tmp_path / "run",
            state_dir=tmp_path / "state",
            output_format="text",
            exec_start=lambda unit: None,
            table=table,
            out=out,
        )
        lines = out.getvalue().splitlines()
        assert status == EXIT_FAILED
        index = lines.index("FAIL flashinfer_cubin_mismatch: cubin differs")
        assert lines[index + 2] == "  pin 0.6.3"

    def test_json_and_exec_start_fallback(self, venvs: Venvs, tmp_path: Path) -> None:
        """Python and port come from ExecStart= when not given; JSON lists every check."""
        argv = [str(venvs["good"]), "-m", "vllm.entrypoints.openai.api_server", "--port", "0"]
        out = io.StringIO()
        status = preflight_main(
            UNIT,
            python=None,
            port=None,
            runtime_dir=tmp_path / "run",
            state_dir=tmp_path / "state",
            output_format="json",
            exec_start=lambda unit: argv,
            out=out,
        )
        report = json.loads(out.getvalue())
        assert status == EXIT_OK
        assert (report["ok"], report["python"], report["port"]) == (True, argv[0], 0)
        assert {c["check"] for c in report["checks"]} >= {"families", "requirements", "port"}

    def test_reports_drift_since_last_good_start(self, venvs: Venvs, tmp_path: Path) -> None:
        """With a good start on record, the report names what changed since."""
        store = Store.in_directory(tmp_path)
        good = EnvSnapshot(
            python=platform.python_version(),
            packages={"flashinfer-python": "0.6.3", "flashinfer-cubin": "0.6.3"},
            checked=("flashinfer-cubin", "flashinfer-python"),
        )
        EnvironmentLog(store).record_start(UNIT, "inv1", good, 1.0)
        EnvironmentLog(store).mark_good(UNIT, "inv1")
        store.close()
        report = preflight(venvs["upgraded"], state_dir=tmp_path)
        assert report.drift == "flashinfer-python 0.6.3 → 0.6.4"


@pytest.mark.parametrize(
    ("argv", "port"),
    [
        # An explicit port, in either spelling.
        (["/v/bin/vllm", "serve", "m", "--port", "8001"], 8001),
        (["/v/bin/python", "-m", "sglang.launch_server", "--port=31000"], 31000),
        # Each server's default when ExecStart= passes none.
        (["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"], 8000),
        (["/v/bin/python", "-m", "sglang.launch_server", "--model-path", "m"], 30000),
        (["/usr/bin/text-generation-launcher", "--model-id", "m"], 3000),
        # Something else: unknown.
        (["/usr/bin/other"], None),
    ],
)
def test_port_from_exec_start(argv: list[str], port: int | None) -> None:
    """The port comes from --port, else the server's default."""
    assert serving_port(argv) == port


def test_family_signatures_are_in_the_shipped_table() -> None:
    """Every family's id exists in the signature table, so preflight and crash agree."""
    table = load_signature_table()
    ids = {s.id for s in table.signatures}
    assert {f.signature for f in DEFAULT_FAMILIES} <= ids


@pytest.mark.parametrize(
    ("versions", "expected"),
    [
        # cubin behind flashinfer-python: the cubin crash.
        (
            {"flashinfer-python": "0.6.4", "flashinfer-cubin": "0.6.3"},
            ["flashinfer_cubin_mismatch"],
        ),
        # jit-cache's CUDA local label is not a difference.
        ({"flashinfer-python": "0.6.3", "flashinfer-jit-cache": "0.6.3+cu129"}, []),
        # jit-cache behind: its own crash, not the cubin one.
        (
            {"flashinfer-python": "0.6.4", "flashinfer-jit-cache": "0.6.3+cu129"},
            ["flashinfer_jit_cache_mismatch"],
        ),
        # A post release is a different version, as flashinfer's own check sees it.
        (
            {"flashinfer-python": "0.6.8", "flashinfer-cubin": "0.6.8.post1"},
            ["flashinfer_cubin_mismatch"],
        ),
        # Only flashinfer-python: nothing to disagree with.
        ({"flashinfer-python": "0.6.4"}, []),
    ],
)
def test_check_families(versions: dict[str, str], expected: list[str]) -> None:
    """Each family fails with its own signature when its installed members differ."""
    lookup = identities(None)
    results = list(check_families(versions, DEFAULT_FAMILIES, lookup))
    found = [r.identity.signature for r in results if r.status is Status.FAILED and r.identity]
    assert found == expected


def test_every_id_a_check_looks_up_is_in_the_shipped_table() -> None:
    """The ids preflight reports in the table's words are all there (so a failure says what its
    crash would), and the two it names itself, not being crashes, are not."""
    ids = {s.id for s in load_signature_table().signatures}
    looked_up = {*(f.signature for f in DEFAULT_FAMILIES), REQUIREMENT_SIGNATURE, *PORT_SIGNATURES}
    assert looked_up - ids == set()
    assert {PROBE_FAILED.signature, QUARANTINED.signature} & ids == set()


def test_without_a_table_a_failure_says_what_the_crash_would(held_port: int) -> None:
    """A table that did not load (None) leaves the shipped table's words, the crash's own."""
    shipped = load_signature_table().get("port_in_use")
    assert shipped is not None
    report = preflight(None, port=held_port, table=None)
    failed = next(r for r in report.results if r.status is Status.FAILED)
    assert failed.identity is not None
    assert (failed.identity.title, failed.identity.severity) == (
        shipped.title,
        shipped.severity.value,
    )
