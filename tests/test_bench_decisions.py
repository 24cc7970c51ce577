"""CI guard on the daemon's decisions for the corpus's crash loops (bench/decisions.py).

Each labelled log of tests/data/corpus is replayed as a 5-invocation `Restart=always` crash loop in
a real journal and read by `supervisor.commands.triage.collect`. The guard fails when
(a) a transient-labelled loop is halted on a signature's or an inference's word, or by the
    unknown-repeat rule (K identical crashes with no known cause, before serving) unless
    bench/decisions_baseline.json lists it (a replay repeats a one-off crash K times; the list
    may only shrink), or
(b) a fatal-labelled loop listed in bench/decisions_baseline.json (the loops that halted on the
    first crash when it was written) no longer halts on its first crash.
After an improvement, `python -m bench.decisions --write-baseline` records the new sets.
Nothing here is timed.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.decisions import (
    BASELINE,
    CORPUS,
    INVOCATIONS,
    LabelledLog,
    LogRun,
    Score,
    infer_engine,
    journal_lines,
    read_index,
    run_all,
    score,
    select,
)

REPO = Path(__file__).resolve().parent.parent

needs_journal = pytest.mark.skipif(
    shutil.which("journalctl") is None or not Path("/lib/systemd/systemd-journal-remote").exists(),
    reason="needs journalctl and systemd-journal-remote",
)


@pytest.fixture(scope="module")
def corpus_runs() -> list[tuple[LogRun, Score]]:
    runs = run_all(read_index(CORPUS), jobs=1)
    return [(run, score(run)) for run in runs]


def _describe(run: LogRun, s: Score) -> str:
    verdict = f"{s.verdict_severity} {s.verdict_signature}"
    return (
        f"{run.log.file}: decisions {list(s.actions)}; inv. 1 {verdict}: {s.reason}; "
        f"root cause {s.root_cause!r}"
    )


@needs_journal
class TestCorpusDecisions:
    def test_every_loop_ran(self, corpus_runs: list[tuple[LogRun, Score]]) -> None:
        """The pipeline raised on no log and decided all 5 invocations of every loop."""
        broken = [
            f"{run.log.file}: {'; '.join(s.problems)}\n{run.error or ''}"
            for run, s in corpus_runs
            if s.problems
        ]
        assert not broken, "\n".join(broken)

    def test_no_transient_loop_is_halted(self, corpus_runs: list[tuple[LogRun, Score]]) -> None:
        """(a) A transient crash never halts the loop: a restart may work. The only halts
        allowed are the baseline's, by repetition of a crash whose cause the log lacks."""
        known = set(json.loads(BASELINE.read_text())["transient_halted_by_repetition"])
        halted = [
            _describe(run, s)
            for run, s in corpus_runs
            if s.wrongly_halted and not (run.log.file in known and s.halt_rule == "unknown_repeat")
        ]
        assert not halted, "transient-labelled loops halted:\n" + "\n".join(halted)

    def test_repeat_halted_transients_have_no_cause(self) -> None:
        """The baseline's repeat-halted transient logs are transient, and either their excerpt
        lacks the root cause or it names only a wrapper: nothing a rule could read."""
        labels = {log.file: log for log in read_index(CORPUS)}
        known = json.loads(BASELINE.read_text())["transient_halted_by_repetition"]
        assert known == sorted(known)
        assert {labels[f].severity for f in known} <= {"transient"}
        assert len(known) <= 2, "the list may only shrink"

    def test_baseline_fatal_loops_still_halt_first(
        self, corpus_runs: list[tuple[LogRun, Score]]
    ) -> None:
        """(b) Every fatal loop that halted on its first crash in the baseline still does."""
        baseline = set(json.loads(BASELINE.read_text())["halted_first"])
        assert baseline, f"{BASELINE} lists no file"
        by_file = {run.log.file: (run, s) for run, s in corpus_runs}
        assert baseline <= set(by_file), f"not in the corpus: {sorted(baseline - set(by_file))}"
        regressed = [
            _describe(*by_file[f]) for f in sorted(baseline) if not by_file[f][1].halted_first
        ]
        assert not regressed, "no longer halted on the first crash:\n" + "\n".join(regressed)

    def test_baseline_names_fatal_logs(self) -> None:
        """The baseline lists only fatal-labelled logs of the corpus, as --write-baseline does."""
        labels = {log.file: log.severity for log in read_index(CORPUS)}
        baseline = json.loads(BASELINE.read_text())["halted_first"]
        assert baseline == sorted(baseline)
        assert {labels.get(f) for f in baseline} == {"fatal"}


def _outcome(invocation_id: str, action: str, root_cause: str | None) -> dict[str, Any]:
    return {
        "unit": "vllm.service",
        "invocation_id": invocation_id,
        "exit_code": "exited",
        "exit_status": 1,
        "result": "exit-code",
        "restarts": int(invocation_id[-1]),
        "lines": 3,
        "verdict": {"signature": None, "severity": "unknown", "root_cause": root_cause},
        "decision": {"action": action, "reason": "test"},
    }


def _run(severity: str, key: str, actions: list[str], root: str | None = "X: boom") -> LogRun:
    ids = tuple(f"inv{n}" for n in range(INVOCATIONS))
    log = LabelledLog(corpus="c", file="f.log", severity=severity, key=key, engine="vllm")
    outcomes = tuple(_outcome(i, a, root) for i, a in zip(ids, actions, strict=True))
    return LogRun(log=log, invocation_ids=ids, outcomes=outcomes)


HALT, ALLOW = "halt", "allow-restart"


class TestScore:
    @pytest.mark.parametrize(
        ("severity", "actions", "halted_at", "wasted", "wrongly"),
        [
            # A fatal crash halted at once wastes no restart.
            ("fatal", [HALT] * 5, 1, 0, None),
            # Halted on the third crash: the 2nd and 3rd starts crashed again.
            ("fatal", [ALLOW, ALLOW, HALT, HALT, HALT], 3, 2, None),
            # Never halted: every one of the 4 restarts crashed again.
            ("fatal", [ALLOW] * 5, None, 4, None),
            # A transient loop halted anywhere is wrong.
            ("transient", [ALLOW, ALLOW, HALT, HALT, HALT], 3, None, True),
            ("transient", [ALLOW] * 5, None, None, False),
            # `either` is neither counted as wasted nor as wrongly halted.
            ("either", [HALT] * 5, 1, None, None),
        ],
    )
    def test_halts(
        self,
        severity: str,
        actions: list[str],
        halted_at: int | None,
        wasted: int | None,
        wrongly: bool | None,
    ) -> None:
        """The first halt, restarts wasted and wrong halts follow from the decisions."""
        s = score(_run(severity, "", actions))
        assert (s.halted_at, s.halted_first) == (halted_at, halted_at == 1)
        assert (s.restarts_wasted, s.wrongly_halted) == (wasted, wrongly)
        assert not s.problems

    @pytest.mark.parametrize(
        ("key", "root", "root_ok", "no_cause"),
        [
            ("boom", "X: boom", True, False),  # the key is in the root cause
            ("bang", "X: boom", False, False),  # a root cause, the wrong one
            ("", None, True, True),  # no key to check; no cause line is still counted
            ("boom", None, False, True),
        ],
    )
    def test_root_cause(self, key: str, root: str | None, root_ok: bool, no_cause: bool) -> None:
        """Invocation 1's root cause is checked against the key; a missing one is counted."""
        s = score(_run("fatal", key, [HALT] * 5, root))
        assert (s.root_ok, s.no_cause) == (root_ok, no_cause)

    def test_missing_outcomes_and_absent_fields(self) -> None:
        """A loop with a lost invocation is a problem; absent verdict fields are just absent."""
        run = _run("fatal", "", [HALT] * 5)
        run = LogRun(log=run.log, invocation_ids=run.invocation_ids, outcomes=run.outcomes[1:])
        s = score(run)
        assert s.actions == (None, HALT, HALT, HALT, HALT)
        assert s.halted_at == 2
        assert (s.basis, s.confidence) == (None, None)
        assert any("no outcome for invocation(s) [1]" in p for p in s.problems)

    def test_pipeline_error(self) -> None:
        """A traceback counts as no halt and is named as a problem."""
        log = LabelledLog(corpus="c", file="f.log", severity="fatal", key="", engine="vllm")
        error = "Traceback (most recent call last):\nValueError: bad"
        s = score(LogRun(log=log, invocation_ids=(), outcomes=(), error=error))
        assert (s.halted_at, s.restarts_wasted) == (None, 4)
        assert s.problems == ("the pipeline raised: ValueError: bad",)


class TestInputs:
    @pytest.mark.parametrize(
        ("text", "engine"),
        [
            ("2024-01-01T00:00:00Z ERROR text_generation_launcher: Shard 0 failed", "tgi"),
            ('File "/opt/text_generation_server/cli.py", line 1', "tgi"),
            ("[2025-08-06 20:26:20 TP0] Scheduler hit an exception", "sglang"),
            ("[2025-08-06 20:26:20 DP1 TP3] Load weight begin", "sglang"),
            ('  File "/usr/lib/python3/site-packages/sglang/srt/server.py"', "sglang"),
            ("(EngineCore_DP0 pid=68) ERROR 11-30 09:12:31 [core.py:708] boom", "vllm"),
            ("NVRM: Xid (PCI:0000:dc:00): 45", "vllm"),
        ],
    )
    def test_infer_engine(self, text: str, engine: str) -> None:
        """TGI and SGLang are recognised by their module names and prefixes; vLLM otherwise."""
        assert infer_engine(text) == engine

    def test_journal_lines(self) -> None:
        """Lines split at newlines only, as journald splits stdout; a CR stays in the line."""
        assert journal_lines("a\r\nb\n\nc\n") == ["a\r", "b", "", "c"]
        assert journal_lines("one") == ["one"]

    def test_index_with_engine_and_phase(self, tmp_path: Path) -> None:
        """Extra columns are read; an empty engine is inferred, an unknown one is 'other'."""
        (tmp_path / "a.log").write_text("[2025-08-06 20:26:20 TP0] boom\n")
        (tmp_path / "b.log").write_text("boom\n")
        (tmp_path / "c.log").write_text("boom\n")
        with (tmp_path / "INDEX.tsv").open("w", newline="") as handle:
            writer = csv.writer(handle, delimiter="\t")
            writer.writerow(["file", "expected_severity", "root_cause_key", "engine", "phase"])
            writer.writerow(["a.log", "fatal", "boom", "", "load"])
            writer.writerow(["b.log", "transient", "", "TGI", ""])
            writer.writerow(["c.log", "either", "", "kernel", "serve"])
        logs = read_index(tmp_path)
        assert [(g.engine, g.phase, g.severity) for g in logs] == [
            ("sglang", "load", "fatal"),
            ("tgi", None, "transient"),
            ("other", "serve", "either"),
        ]
        assert [g.file for g in select(logs, "*.log")] == ["a.log", "b.log", "c.log"]
        assert [g.file for g in select(logs, "b")] == ["b.log"]


@needs_journal
def test_command_line(tmp_path: Path) -> None:
    """`python -m bench.decisions --corpus DIR --only P --json PATH` prints and writes it all."""
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "x-tgi.log").write_text(
        "2024-01-01T00:00:00Z ERROR text_generation_launcher: Shard 0 failed to start\n"
        "RuntimeError: weight model.layers.0.self_attn.q_proj.weight does not exist\n"
    )
    (extra / "INDEX.tsv").write_text(
        "file\texpected_severity\troot_cause_key\tphase\nx-tgi.log\tfatal\tdoes not exist\tload\n"
    )
    out = tmp_path / "out.json"
    argv = ["--corpus", str(extra), "--only", "tgi", "--json", str(out), "--jobs", "1"]
    result = subprocess.run(
        [sys.executable, "-m", "bench.decisions", *argv],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    assert "| **overall** |" in result.stdout
    data = json.loads(out.read_text())
    files = [log["file"] for log in data["logs"]]
    assert "x-tgi.log" in files
    assert all("tgi" in f for f in files)
    mine = next(log for log in data["logs"] if log["file"] == "x-tgi.log")
    assert (mine["engine"], mine["phase"]) == ("tgi", "load")
    assert len(mine["outcomes"]) == INVOCATIONS
    assert data["tables"]["overall"]["logs"] == len(files)
