"""`triage` on every input kind gives the daemon's verdict for the seed crash loop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands.demo import seed_lines, write_demo_journal
from vllm_supervisor.commands.triage import collect
from vllm_supervisor.config import Config
from vllm_supervisor.journal.saved import sniff

ROOT_CAUSE = "flashinfer-cubin version (0.6.3) does not match flashinfer version (0.6.4)"


@pytest.fixture(name="demo_journal", scope="module")
def _demo_journal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("demo") / "journal"
    write_demo_journal(directory)
    return directory


def _triage_json(*args: str, stdin: bytes | None = None) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-m", "vllm_supervisor", "triage", "--format", "json", *args],
        input=stdin,
        capture_output=True,
        check=True,
        timeout=60,
    )
    return json.loads(result.stdout)


class TestSeed:
    """The seed's crash loop, end to end through the CLI."""

    def test_directory_gives_fatal_halt_with_both_versions(self, demo_journal: Path) -> None:
        """Every crash of the loop is the flashinfer mismatch: fatal, halt, both versions."""
        report = _triage_json(str(demo_journal))
        invocations = report["invocations"]
        assert isinstance(invocations, list)
        assert len(invocations) == 3
        for item in invocations:
            verdict, decision = item["verdict"], item["decision"]
            assert item["unit"] == "vllm.service"
            assert (item["exit_code"], item["exit_status"], item["result"]) == (
                "exited",
                1,
                "exit-code",
            )
            assert verdict["signature"] == "flashinfer_cubin_mismatch"
            assert verdict["severity"] == "fatal"
            assert ROOT_CAUSE in verdict["root_cause"]
            assert "deepseek_v2.py" in verdict["crash_site"]
            assert verdict["captures"] == {"cubin": "0.6.3", "flashinfer": "0.6.4"}
            assert "0.6.3" in verdict["remediation"] and "0.6.4" in verdict["remediation"]
            assert decision["action"] == "halt"
        assert [i["restarts"] for i in invocations] == [0, 1, 2]

    @pytest.mark.parametrize("output", ["json", "export"])
    def test_journalctl_output_on_stdin(self, demo_journal: Path, output: str) -> None:
        """Saved `journalctl -o json` and `-o export` output give the same verdicts."""
        dump = subprocess.run(
            ["journalctl", f"--directory={demo_journal}", f"--output={output}", "--all"],
            capture_output=True,
            check=True,
        ).stdout
        report = _triage_json("-", stdin=dump)
        verdicts = [i["verdict"] for i in report["invocations"]]  # type: ignore[index]
        assert [v["signature"] for v in verdicts] == ["flashinfer_cubin_mismatch"] * 3

    def test_journal_file(self, demo_journal: Path) -> None:
        """A single journal file is read with journalctl --file."""
        report = _triage_json(str(demo_journal / "remote.journal"))
        assert len(report["invocations"]) == 3  # type: ignore[arg-type]

    def test_plain_text_is_one_invocation(self, tmp_path: Path) -> None:
        """Pasted text is one invocation with no unit and no invocation id."""
        path = tmp_path / "crash.log"
        path.write_text("\n".join(seed_lines()))
        (item,) = _triage_json(str(path))["invocations"]  # type: ignore[misc]
        assert (item["unit"], item["invocation_id"]) == (None, None)
        assert item["verdict"]["signature"] == "flashinfer_cubin_mismatch"
        assert item["decision"]["action"] == "halt"

    def test_text_output_names_cause_site_and_decision(self, demo_journal: Path) -> None:
        """The text view shows what a person needs first: cause, site, fix, decision."""
        out = subprocess.run(
            [sys.executable, "-m", "vllm_supervisor", "triage", str(demo_journal)],
            capture_output=True,
            check=True,
            text=True,
            timeout=60,
        ).stdout
        assert ROOT_CAUSE in out
        assert "crash site:" in out and "deepseek_v2.py" in out
        assert "decision:    halt (decided; nothing is done by triage)" in out


class TestInputs:
    """Input detection and bad input."""

    @pytest.mark.parametrize(
        ("data", "kind"),
        [
            (b'{"MESSAGE": "x", "__CURSOR": "c"}\n', "json"),
            (b"__CURSOR=s=1\nMESSAGE=x\n\n", "export"),
            (b"Traceback (most recent call last):\n", "text"),
            (b"{not json at all\n", "text"),
            (b"", "text"),
        ],
    )
    def test_sniff(self, data: bytes, kind: str) -> None:
        """The input kind is told from the first line."""
        assert sniff(data) == kind

    def test_missing_file_is_one_line_exit_2(self, tmp_path: Path) -> None:
        """A path that does not exist is a clear error, not a traceback."""
        result = subprocess.run(
            [sys.executable, "-m", "vllm_supervisor", "triage", str(tmp_path / "nope.log")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2
        assert "nope.log" in result.stderr and "Traceback" not in result.stderr

    def test_clean_journal_reports_nothing(self, tmp_path: Path) -> None:
        """An invocation that ended cleanly is not reported as a failure."""
        lines = "\n".join(
            [
                json.dumps(
                    {
                        "__CURSOR": "a",
                        "MESSAGE": "Application startup complete.",
                        "_SYSTEMD_UNIT": "vllm.service",
                        "_SYSTEMD_INVOCATION_ID": "i",
                    }
                ),
                json.dumps(
                    {
                        "__CURSOR": "b",
                        "MESSAGE": "vllm.service: Deactivated successfully.",
                        "_PID": "1",
                        "UNIT": "vllm.service",
                        "INVOCATION_ID": "i",
                        "MESSAGE_ID": "7ad2d189f7e94e70a38c781354912448",
                    }
                ),
            ]
        )
        path = tmp_path / "clean.json"
        path.write_text(lines)
        config = Config()
        assert collect(str(path), config=config, table=load_table(config)) == []
