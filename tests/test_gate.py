"""`gate` and `release`: the ExecCondition exit codes, their messages, and failing closed."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_supervisor.actions.quarantine import Quarantine
from vllm_supervisor.commands.gate import EXIT_ALLOW, EXIT_QUARANTINED, gate_main, release_main


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "run", tmp_path / "state"


def gate(unit: str, dirs: tuple[Path, Path]) -> tuple[int, str]:
    out = io.StringIO()
    return gate_main(unit, *dirs, wait_s=1.0, out=out, defaults=()), out.getvalue()


class TestGate:
    def test_free_unit_may_start(self, dirs: tuple[Path, Path]) -> None:
        """With no record anywhere and no daemon the gate exits 0 and says, in one line, that
        nothing supervises the start."""
        code, text = gate("vllm.service", dirs)
        assert code == EXIT_ALLOW
        assert text.count("\n") == 1
        assert "start allowed: no supervisor is running" in text

    @pytest.mark.parametrize("where", [0, 1])  # runtime dir, persistent state dir
    def test_quarantined_unit_is_refused(self, dirs: tuple[Path, Path], where: int) -> None:
        """A record in either directory makes the gate exit 1 and explain why."""
        Quarantine(dirs[where] / "quarantine").write(
            "vllm.service", {"signature": "flashinfer_cubin_mismatch", "reason": "fatal"}
        )
        code, text = gate("vllm.service", dirs)
        assert code == EXIT_QUARANTINED
        assert "flashinfer_cubin_mismatch" in text
        assert "vllm-supervisor release vllm.service" in text

    def test_the_refusal_never_echoes_the_root_cause(self, dirs: tuple[Path, Path]) -> None:
        """The gate's lines land in the next run's journal: an echoed `RuntimeError: ...` of
        the halted crash became the root cause of the next crash after a lifted halt."""
        cause = "RuntimeError: flashinfer-cubin version (0.6.3) does not match"
        Quarantine(dirs[0] / "quarantine").write(
            "vllm.service", {"signature": "flashinfer_cubin_mismatch", "root_cause": cause}
        )
        status, said = gate("vllm.service", dirs)
        assert status == EXIT_QUARANTINED
        assert "flashinfer_cubin_mismatch" in said and "RuntimeError" not in said

    def test_other_units_are_not_affected(self, dirs: tuple[Path, Path]) -> None:
        """Only the quarantined unit is refused."""
        Quarantine(dirs[0] / "quarantine").write("vllm@0.service", {})
        assert gate("vllm@1.service", dirs)[0] == EXIT_ALLOW

    def test_corrupt_record_fails_closed(self, dirs: tuple[Path, Path]) -> None:
        """An unreadable record still refuses the start and says it is unreadable."""
        q = Quarantine(dirs[0] / "quarantine")
        q.write("vllm.service", {})
        q.path("vllm.service").write_text("{torn")
        code, text = gate("vllm.service", dirs)
        assert code == EXIT_QUARANTINED
        assert "unreadable" in text

    def test_a_record_that_is_not_utf8_fails_closed(self, dirs: tuple[Path, Path]) -> None:
        """Bytes that are no text are a corrupt record, not a crash of the gate (which exited 2
        through the command line's last net: found by the CLI property test)."""
        q = Quarantine(dirs[0] / "quarantine")
        q.write("vllm.service", {})
        q.path("vllm.service").write_bytes(b"\x80")
        code, text = gate("vllm.service", dirs)
        assert code == EXIT_QUARANTINED
        assert "unreadable" in text

    def test_a_directory_it_cannot_search_lets_the_start_through(
        self, dirs: tuple[Path, Path]
    ) -> None:
        """A broken layout (a file where the directory should be) hides no record: the
        supervisor's own trouble must not take the server down, so the start goes on and one
        line says what the gate could not check."""
        dirs[0].mkdir()
        (dirs[0] / "quarantine").write_text("not a directory")
        code, text = gate("vllm.service", dirs)
        assert code == EXIT_ALLOW
        assert "cannot search" in text and str(dirs[0] / "quarantine") in text

    def test_a_record_beside_a_broken_directory_still_refuses(
        self, dirs: tuple[Path, Path]
    ) -> None:
        """Failing open on one directory never hides a record found in another."""
        dirs[0].mkdir()
        (dirs[0] / "quarantine").write_text("not a directory")
        Quarantine(dirs[1] / "quarantine").write("vllm.service", {"signature": "sig"})
        assert gate("vllm.service", dirs)[0] == EXIT_QUARANTINED


class TestRelease:
    def test_release_removes_every_record(self, dirs: tuple[Path, Path]) -> None:
        """Release clears the unit from both directories and prints what it removed."""
        for base in dirs:
            Quarantine(base / "quarantine").write("vllm.service", {"signature": "sig"})
        out = io.StringIO()
        assert release_main("vllm.service", *dirs, out=out, defaults=()) == 0
        text = out.getvalue()
        assert text.count("released vllm.service") == 2
        assert "systemctl start vllm.service" in text
        assert gate("vllm.service", dirs)[0] == EXIT_ALLOW

    def test_release_of_a_free_unit_is_a_no_op(self, dirs: tuple[Path, Path]) -> None:
        """Releasing a unit that is not quarantined succeeds and says so."""
        out = io.StringIO()
        assert release_main("vllm.service", *dirs, out=out, defaults=()) == 0
        assert "not quarantined" in out.getvalue()

    def test_release_clears_a_corrupt_record(self, dirs: tuple[Path, Path]) -> None:
        """A corrupt record can be released like any other."""
        q = Quarantine(dirs[0] / "quarantine")
        q.write("vllm.service", {})
        q.path("vllm.service").write_text("")
        out = io.StringIO()
        assert release_main("vllm.service", *dirs, out=out, defaults=()) == 0
        assert "unreadable" in out.getvalue()
        assert not q.is_quarantined("vllm.service")


def test_the_gate_loads_no_classifier_database_or_packaging_code() -> None:
    """`gate` runs before every start of a served unit: importing it loads neither RE2 (the
    signature table), sqlite3 (the state database) nor packaging (preflight's checks)."""
    code = (
        "import sys, vllm_supervisor.commands.gate; "
        "print(*sorted(m for m in ('re2', 'sqlite3', 'packaging') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == []


@given(title=st.text(), holder_line=st.text())
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_no_value_of_a_record_starts_a_line_of_its_own(
    tmp_path: Path, title: str, holder_line: str
) -> None:
    """The gate's lines land in the unit's journal: a record's title (a signature's, a crash's)
    holding a newline and a fake "start allowed" must stay inside its own line, shown escaped."""
    dirs = (tmp_path / f"run-{abs(hash((title, holder_line)))}", tmp_path / "state")
    forged = f"{title}\nvllm.service: start allowed: {holder_line}"
    Quarantine(dirs[0] / "quarantine").write("vllm.service", {"title": forged, "reason": "fatal"})
    code, text = gate("vllm.service", dirs)
    assert code == EXIT_QUARANTINED
    lines = text.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("vllm.service: start refused, quarantined: ")
    assert lines[1] == "release it with: vllm-supervisor release vllm.service"
