"""`python -m bench.decisions`: what the daemon decides when a labelled crash log loops.

Every labelled log of the corpus (tests/data/corpus, plus `--corpus DIR`...) is written as a
5-invocation crash loop of `vllm.service` under `Restart=always` into a real journal
(bench/crashloop.py, systemd-journal-remote) and read back by `supervisor.commands.triage.collect`,
the daemon's own Pipeline, with the one reading of the host the daemon makes at a crash's end
and `triage` does not (whether the listen address it could not bind is on the host: this
host, where the recorded logs were made). Per log: the decision of each invocation, whether
the first crash halted, the restarts a fatal loop wasted, whether a transient loop was
halted, whether invocation 1's root cause holds the label's key, what the loop would cost a real
unit over a day (`restarts_per_day`, DayModel) and whether it was left unbounded (neither
halted nor held). Verdicts and decisions are read only through `Outcome.to_json()` (the JSON
contract), so the bench survives rewrites of the tracker, classifier and policy.

Options: `--corpus DIR` (repeatable; INDEX.tsv with file, expected_severity, root_cause_key and
optionally engine, phase, served_s: a serving log is replayed after a serving line and that
many seconds of serving, 1800 by default; ended: `exited:N` or `killed:N`, how systemd recorded
the main process's end in the log's real journal, `exited:1` by default; source: `kernel` for
a log of the kernel's own lines, dmesg or `journalctl -k`, replayed through journald's kernel
transport just before each exit of a unit that prints nothing), `--only PATTERN`
(substring or glob of file names), `--json PATH`, `--jobs N` (logs replayed in parallel,
default 2), `--signatures PATH`
(repeatable: another signature table, e.g. an older one, to tell what the table knows from what
the rest infers), `--write-baseline` (the fatal logs that halt on the first crash and the
transient ones halted by repetition, for tests/test_bench_decisions.py),
`--reader auto|native|journalctl`, `--blind` (each log scored with a table that lacks the
signatures written from its own source and its near duplicates: bench/decisions_blind.py; the
text report then puts blind and seen side by side), `--format json` (only the headline counts,
for "all" and per engine, on stdout), `--load-s S` and `--restart-s S` (the day's cost model:
each start of a loop loads for S seconds before it crashes, 600 by default, a large model's
10 minutes; systemd's RestartSec=, 10 by default, the shipped drop-in's).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import fnmatch
import functools
import json
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.crashloop import LoopTiming, write_crash_loop
from bench.decisions_blind import (
    SourceGroup,
    figures,
    plain_root_cause,
    plan,
    side_by_side,
    signature_specs,
    source_urls,
    without,
)
from bench.decisions_report import Tally, render, tally_all
from vllm_supervisor.classify.signatures import SignatureTable
from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands.triage import collect
from vllm_supervisor.config import Config, JournalConfig, SignaturesConfig, UnitConfig
from vllm_supervisor.decide.address_evidence import AddressEvidence
from vllm_supervisor.decide.pacing import SECONDS_PER_DAY, Schedule
from vllm_supervisor.model import Ended, Evidence

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "tests" / "data" / "corpus"
BASELINE = Path(__file__).resolve().parent / "decisions_baseline.json"
UNIT = "vllm.service"
INVOCATIONS = 5
DEFAULT_SERVED_S = 1800.0  # a serving log without served_s: it had served for half an hour
DEFAULT_LOAD_S = 600.0  # a large model's load: what a start of a loop runs before it crashes
DEFAULT_RESTART_S = 10.0  # RestartSec= of the shipped drop-in (deploy/)
ENGINES = ("vllm", "sglang", "tgi", "other")
SEVERITIES = ("fatal", "transient", "either")
_SGLANG_PREFIX = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?: [A-Z]{2}\d+)+\]")


@dataclass(frozen=True, slots=True, kw_only=True)
class LabelledLog:
    """One row of a corpus INDEX.tsv."""

    corpus: str  # the corpus directory
    file: str
    severity: str  # fatal | transient | either
    key: str  # text invocation 1's root cause must contain; empty = not in the excerpt
    engine: str  # vllm | sglang | tgi | other
    phase: str | None = None
    served_s: float = 0.0  # serving logs: how long it had served before the crash
    exit_status: int = 1  # how the main process ended (INDEX.tsv `ended`: exited:N, killed:N)
    signal: int | None = None
    # INDEX.tsv `source`: "kernel" when the log is the kernel's own (dmesg, `journalctl -k`):
    # replayed through journald's kernel transport beside a unit that exits without a word.
    kernel: bool = False

    @property
    def path(self) -> Path:
        """The log file."""
        return Path(self.corpus) / self.file


@dataclass(frozen=True, slots=True, kw_only=True)
class LogRun:
    """What the pipeline returned for one log's crash loop."""

    log: LabelledLog
    invocation_ids: tuple[str, ...]  # as written, oldest first
    outcomes: tuple[dict[str, Any], ...]  # Outcome.to_json() of each, in the pipeline's order
    error: str | None = None  # the traceback, when writing or reading the loop raised
    seconds: float = 0.0


def read_index(directory: Path) -> list[LabelledLog]:
    """The labelled logs of one corpus directory, engine inferred where the index has none."""
    with (directory / "INDEX.tsv").open(encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    logs = []
    for number, row in enumerate(rows, start=2):
        severity = (row.get("expected_severity") or "").strip()
        if severity not in SEVERITIES:
            raise SystemExit(f"{directory}/INDEX.tsv:{number}: expected_severity {severity!r}")
        file = row["file"].strip()
        engine = (row.get("engine") or "").strip().lower()
        if not engine:
            engine = infer_engine((directory / file).read_text(encoding="utf-8", errors="replace"))
        logs.append(
            LabelledLog(
                corpus=str(directory),
                file=file,
                severity=severity,
                key=row.get("root_cause_key") or "",
                engine=engine if engine in ENGINES else "other",
                phase=(row.get("phase") or "").strip() or None,
                served_s=_served_s(row, directory, number),
                kernel=_kernel(row, directory, number),
                **_ended(row, directory, number),
            )
        )
    return logs


def _ended(row: dict[str, str], directory: Path, number: int) -> dict[str, Any]:
    """INDEX.tsv's `ended` (how systemd recorded the main process's end in the log's real
    journal): `exited:N` or `killed:N`; empty: exited with status 1."""
    text = (row.get("ended") or "").strip()
    if not text:
        return {}
    code, _, value = text.partition(":")
    if code not in ("exited", "killed") or not value.isdigit():
        raise SystemExit(f"{directory}/INDEX.tsv:{number}: ended {text!r}")
    if code == "killed":
        return {"signal": int(value)}
    return {"exit_status": int(value)}


def _kernel(row: dict[str, str], directory: Path, number: int) -> bool:
    text = (row.get("source") or "").strip()
    if text not in ("", "unit", "kernel"):
        raise SystemExit(f"{directory}/INDEX.tsv:{number}: source {text!r} (unit or kernel)")
    return text == "kernel"


_DMESG_TIME = re.compile(r"^(?:kernel: |\[ *\d+\.\d+\] )")


def kernel_records(text: str) -> list[str]:
    """The kernel's records in a dmesg or `journalctl -k` paste, as journald stores them:
    the `kernel: ` or `[ seconds]` prefix gone, and an indented line without one (dmesg's
    way of printing a record of several lines) joined to its record with a newline."""
    records: list[str] = []
    for line in journal_lines(text):
        if not line.strip():
            continue
        if records and not _DMESG_TIME.match(line) and line[:1].isspace():
            records[-1] += "\n" + line.strip()
        elif record := _DMESG_TIME.sub("", line, count=1).strip():
            records.append(record)
    return records


def _served_s(row: dict[str, str], directory: Path, number: int) -> float:
    text = (row.get("served_s") or "").strip()
    if not text:
        return DEFAULT_SERVED_S if (row.get("phase") or "").strip() == "serving" else 0.0
    try:
        return float(text)
    except ValueError:
        raise SystemExit(f"{directory}/INDEX.tsv:{number}: served_s {text!r}") from None


def infer_engine(text: str) -> str:
    """TGI, SGLang or (by default) vLLM, from the log's text."""
    if "text_generation_launcher" in text or "text_generation_server" in text:
        return "tgi"
    if "sglang" in text.lower() or _SGLANG_PREFIX.search(text):
        return "sglang"
    return "vllm"


def journal_lines(text: str) -> list[str]:
    """The lines journald would store for this stdout: split at newlines only, kept verbatim."""
    lines = text.split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


_TABLES: dict[tuple[tuple[Path, ...], frozenset[str]], SignatureTable] = {}
NOTHING: frozenset[str] = frozenset()


def _the_host_at_the_crash(config: Config) -> Callable[[Ended, Evidence], Evidence]:
    """What the daemon reads of its own host the moment a crash ends, which `triage` never
    reads: whether the listen address a crash could not bind is on the host (AddressEvidence).
    The replay's host is this one, where the recorded logs were made; a pasted log's address
    is on no interface here either, as its own error said of its host."""

    def provide(ended: Ended, evidence: Evidence) -> Evidence:
        at_s = (ended.invocation.ended_us or 0) / 1e6 + 1.0
        hook = AddressEvidence(config, clock=lambda: at_s)
        return asyncio.run(hook.evidence(ended, evidence))

    return provide


def _config_and_table(
    reader: str, signatures: tuple[Path, ...], removed: frozenset[str] = NOTHING
) -> tuple[Config, SignatureTable]:
    config = Config(
        units=(UnitConfig(name=UNIT),),
        journal=JournalConfig(reader=reader),
        signatures=SignaturesConfig(paths=signatures),
    )
    if (signatures, NOTHING) not in _TABLES:  # one table per worker process, loaded on first use
        _TABLES[signatures, NOTHING] = load_table(config)
    if (signatures, removed) not in _TABLES:  # and one per blind source group it replays
        _TABLES[signatures, removed] = without(_TABLES[signatures, NOTHING], removed)
    return config, _TABLES[signatures, removed]


def replay(
    log: LabelledLog,
    workdir: Path,
    reader: str = "auto",
    signatures: tuple[Path, ...] = (),
    removed: frozenset[str] = NOTHING,
) -> LogRun:
    """Write the log's crash loop into a fresh journal and run it through the Pipeline, with
    the table less the `removed` signatures."""
    started = time.perf_counter()
    directory = Path(tempfile.mkdtemp(prefix="loop-", dir=workdir))
    ids: tuple[str, ...] = ()
    try:
        text = log.path.read_text(encoding="utf-8", errors="replace")
        lines, kernel = ([], kernel_records(text)) if log.kernel else (journal_lines(text), [])
        name = f"{Path(log.corpus).name}/{log.file}"  # the ids do not depend on the checkout
        timing = LoopTiming(
            served_for_s=log.served_s, exit_status=log.exit_status, signal=log.signal
        )
        ids = write_crash_loop(
            directory,
            UNIT,
            lines,
            name=name,
            invocations=INVOCATIONS,
            timing=timing,
            kernel_lines=kernel,
        ).invocation_ids
        config, table = _config_and_table(reader, signatures, removed)
        live = (_the_host_at_the_crash(config),)
        found = collect(str(directory), config=config, table=table, providers=live)
        outcomes = tuple(o.to_json() for o in found)
    except Exception:  # reported with its traceback, never hidden: see LogRun.error
        return LogRun(
            log=log,
            invocation_ids=ids,
            outcomes=(),
            error=traceback.format_exc(),
            seconds=time.perf_counter() - started,
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return LogRun(
        log=log, invocation_ids=ids, outcomes=outcomes, seconds=time.perf_counter() - started
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class DayModel:
    """What a loop costs a real unit over a day, where the replay stops after 5 crashes: each
    start loads for `load_s` (and a serving log's start then serves its `served_s`) before it
    crashes, systemd waits `restart_s` (RestartSec=) before the next, and a held loop's starts
    follow the shipped pacing schedule."""

    load_s: float = DEFAULT_LOAD_S
    restart_s: float = DEFAULT_RESTART_S
    schedule: Schedule = field(default_factory=Schedule)

    def describe(self) -> str:
        """In words, for the printed report."""
        return (
            f"each start loads {self.load_s:g} s (a serving log's then serves its served_s) "
            f"before it crashes, RestartSec={self.restart_s:g} s, held loops paced by "
            f"the shipped schedule ({self.schedule.first_s:g} s doubling to "
            f"{self.schedule.max_s:g} s)"
        )


def restarts_per_day(actions: Sequence[str | None], *, run_s: float, model: DayModel) -> float:
    """A loop's restarts over 24 h from its replayed decisions, each start running `run_s`
    before it crashes: halted at its k-th crash, k - 1 for the whole day (the halt holds until
    a person acts); held, the pacing schedule's starts less the first; neither, systemd
    restarts it at its own pace all day."""
    if "halt" in actions:
        return float(list(actions).index("halt"))
    if "hold" in actions:
        return model.schedule.starts_per_day(run_s, model.restart_s) - 1
    return SECONDS_PER_DAY / (run_s + model.restart_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class Score:
    """The figures of one log's loop."""

    actions: tuple[str | None, ...]  # per written invocation; None = no outcome for it
    halted_first: bool
    halted_at: int | None  # 1-based index of the first halt
    halt_rule: str | None  # the policy rule of that halt (decision.rule)
    restarts_wasted: int | None  # fatal logs: restarts that ran only to crash again
    wrongly_halted: bool | None  # transient logs: any halt
    restarts_per_day: float  # every log: its loop's restarts over a day (DayModel)
    # Neither halted nor held in the replay though its starts end within the pacing's reset:
    # systemd restarts it at its own pace all day.
    unbounded: bool
    root_ok: bool
    no_cause: bool  # invocation 1 failed and has no root-cause line
    root_cause: str | None  # invocation 1's verdict, as the JSON contract names it
    verdict_severity: str | None
    verdict_signature: str | None
    reason: str | None  # invocation 1's decision reason
    basis: Any = None  # verdict.basis / verdict.confidence when the pipeline gives them
    confidence: Any = None
    problems: tuple[str, ...] = ()  # anything not as a 5-invocation loop should come out


def score(run: LogRun, model: DayModel | None = None) -> Score:
    """The figures of one run (pure: only the JSON contract's fields are read); a day's cost
    by `model` (DayModel's defaults when None)."""
    log, model = run.log, model or DayModel()
    by_id = {o.get("invocation_id"): o for o in run.outcomes}
    ordered = [by_id.get(i) for i in run.invocation_ids] or [None] * INVOCATIONS
    actions = tuple((o or {}).get("decision", {}).get("action") for o in ordered)
    halted_at = next((n for n, a in enumerate(actions, start=1) if a == "halt"), None)
    halt = (ordered[halted_at - 1] or {}).get("decision", {}) if halted_at else {}
    first = ordered[0] or {}
    verdict = first.get("verdict") or {}
    root_cause = verdict.get("root_cause")
    fatal, transient = log.severity == "fatal", log.severity == "transient"
    return Score(
        actions=actions,
        halted_first=halted_at == 1,
        halted_at=halted_at,
        halt_rule=halt.get("rule"),
        # Every restart after the first crash that ran only to crash again.
        restarts_wasted=(halted_at or INVOCATIONS) - 1 if fatal else None,
        wrongly_halted=halted_at is not None if transient else None,
        restarts_per_day=restarts_per_day(actions, run_s=model.load_s + log.served_s, model=model),
        # A loop whose starts each run past the reset (they served for half an hour) is bounded
        # by its own runs: pacing, like Kubernetes' back-off, starts afresh after 10 minutes.
        unbounded=halted_at is None
        and "hold" not in actions
        and log.served_s < model.schedule.reset_s,
        root_ok=not log.key or (root_cause is not None and log.key in root_cause),
        no_cause=_failed(first) and root_cause is None,
        root_cause=root_cause,
        verdict_severity=verdict.get("severity"),
        verdict_signature=verdict.get("signature"),
        reason=(first.get("decision") or {}).get("reason"),
        basis=verdict.get("basis"),
        confidence=verdict.get("confidence"),
        problems=tuple(_problems(run, ordered)),
    )


def _failed(outcome: dict[str, Any]) -> bool:
    """The invocation ended badly: a result other than success, or a non-zero exit status."""
    if not outcome:
        return False
    return outcome.get("result") not in (None, "success") or outcome.get("exit_status") not in (
        None,
        0,
    )


def _problems(run: LogRun, ordered: Sequence[dict[str, Any] | None]) -> Iterable[str]:
    if run.error is not None:
        yield "the pipeline raised: " + run.error.strip().splitlines()[-1]
        return
    if len(run.outcomes) != len(run.invocation_ids):
        yield f"{len(run.outcomes)} outcomes for {len(run.invocation_ids)} invocations written"
    known = set(run.invocation_ids)
    for outcome in run.outcomes:
        if outcome.get("invocation_id") not in known or outcome.get("unit") != UNIT:
            yield f"an outcome of no written invocation: {outcome.get('invocation_id')}"
    missing = [n for n, o in enumerate(ordered, start=1) if o is None]
    if missing and run.invocation_ids:
        yield f"no outcome for invocation(s) {missing}"
    restarts = [o.get("restarts") for o in ordered if o is not None]
    if restarts != list(range(len(restarts))) and not missing:
        yield f"restart counters {restarts}, expected 0..{len(restarts) - 1}"
    causes = {(o.get("verdict") or {}).get("root_cause") for o in ordered if o is not None}
    if len(causes) > 1:
        yield f"the same lines gave {len(causes)} different root causes across invocations"


def select(logs: Iterable[LabelledLog], pattern: str | None) -> list[LabelledLog]:
    """The logs whose file name matches `pattern` (a glob, or else a substring)."""
    if not pattern:
        return list(logs)
    if any(c in pattern for c in "*?["):
        return [log for log in logs if fnmatch.fnmatch(log.file, pattern)]
    return [log for log in logs if pattern in log.file]


def run_all(
    logs: Sequence[LabelledLog],
    *,
    jobs: int,
    reader: str = "auto",
    signatures: tuple[Path, ...] = (),
    blind: Mapping[LabelledLog, SourceGroup] | None = None,
) -> list[LogRun]:
    """Replay every log; `jobs` worker processes share the work. With `blind`, each log's table
    lacks its source group's signatures."""
    removed = [blind[log].removed if blind else NOTHING for log in logs]
    with tempfile.TemporaryDirectory(prefix="vllm-supervisor-decisions-") as tmp:
        work = functools.partial(replay, workdir=Path(tmp), reader=reader, signatures=signatures)
        if jobs <= 1 or len(logs) <= 1:
            return [work(log, removed=r) for log, r in zip(logs, removed, strict=True)]
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(_replay_without, [work] * len(logs), logs, removed))


def _replay_without(
    work: functools.partial[LogRun], log: LabelledLog, removed: frozenset[str]
) -> LogRun:
    return work(log, removed=removed)


def blind_groups(
    logs: Sequence[LabelledLog], *, reader: str = "auto", signatures: tuple[Path, ...] = ()
) -> dict[LabelledLog, SourceGroup]:
    """Every log's source group (its source URL and near duplicates among `logs`) and the
    signatures written from it, which its blind replay goes without."""
    config, table = _config_and_table(reader, signatures)
    urls = {
        (corpus, file): url
        for corpus in sorted({log.corpus for log in logs})
        for file, url in source_urls(Path(corpus)).items()
    }
    keys = [(log.corpus, log.file) for log in logs]
    roots = {
        key: plain_root_cause(log.path, config=config, table=table)
        for key, log in zip(keys, logs, strict=True)
    }
    groups = plan(
        keys,
        specs=signature_specs(signatures),
        default_corpus=str(CORPUS),
        urls=urls,
        root_causes=roots,
    )
    return {log: groups[key] for key, log in zip(keys, logs, strict=True)}


def baseline_files(runs: Iterable[LogRun], scores: Sequence[Score]) -> list[str]:
    """The fatal logs of the default corpus whose first crash halts."""
    return sorted(
        run.log.file
        for run, s in zip(runs, scores, strict=True)
        if run.log.corpus == str(CORPUS) and run.log.severity == "fatal" and s.halted_first
    )


def repeat_halted_transients(runs: Iterable[LogRun], scores: Sequence[Score]) -> list[str]:
    """The transient logs of the default corpus that the unknown-repeat rule halts: a crash
    with no known cause that ended K invocations in a row before serving (the replay repeats a
    one-off crash; the policy cannot tell it from a deterministic one it cannot read)."""
    return sorted(
        run.log.file
        for run, s in zip(runs, scores, strict=True)
        if run.log.corpus == str(CORPUS) and s.wrongly_halted and s.halt_rule == "unknown_repeat"
    )


def report_json(
    runs: Sequence[LogRun],
    scores: Sequence[Score],
    *,
    seconds: float,
    argv: Sequence[str],
    reader: str,
    blind: Mapping[LabelledLog, SourceGroup] | None = None,
    model: DayModel | None = None,
) -> dict[str, Any]:
    """Everything the run found, as one JSON object (a blind run adds each log's group)."""
    extra = (
        (lambda log: {})
        if blind is None
        else lambda log: {
            "blind_removed": sorted(blind[log].removed),
            "blind_group": sorted(file for _, file in blind[log].logs),
        }
    )
    return {
        "command": ["python", "-m", "bench.decisions", *argv],
        "reader": reader,
        "corpora": sorted({run.log.corpus for run in runs}),
        "unit": UNIT,
        "invocations_per_loop": INVOCATIONS,
        "day_model": asdict(model or DayModel()),
        "seconds": round(seconds, 2),
        "tables": {k: asdict(v) for k, v in tally_all(runs, scores).items()},
        "logs": [
            {
                **asdict(run.log),
                **asdict(s),
                "outcomes": list(run.outcomes),
                "error": run.error,
                "seconds": round(run.seconds, 3),
                **extra(run.log),
            }
            for run, s in zip(runs, scores, strict=True)
        ],
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m bench.decisions", description=__doc__)
    parser.add_argument("--corpus", type=Path, action="append", default=[], metavar="DIR")
    parser.add_argument("--only", metavar="PATTERN", help="only files matching (glob/substring)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write everything as JSON")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument(
        "--reader",
        choices=("auto", "native", "journalctl"),
        default="auto",
        help="[journal] reader of the config (auto: native if it was built)",
    )
    parser.add_argument(
        "--signatures",
        type=Path,
        action="append",
        default=[],
        metavar="PATH",
        help="a signature table (TOML file or directory) instead of the shipped one",
    )
    parser.add_argument("--write-baseline", action="store_true", help=f"write {BASELINE.name}")
    parser.add_argument(
        "--blind",
        action="store_true",
        help="each log without the signatures written from its source or its near duplicates",
    )
    parser.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="json: only the headline counts, for all logs and per engine",
    )
    parser.add_argument(
        "--load-s",
        type=_seconds,
        default=DEFAULT_LOAD_S,
        metavar="S",
        help="restarts_per_day: what each start of a loop runs before it crashes (a large "
        "model's load; default %(default)g)",
    )
    parser.add_argument(
        "--restart-s",
        type=_seconds,
        default=DEFAULT_RESTART_S,
        metavar="S",
        help="restarts_per_day: systemd's RestartSec= (default %(default)g, the shipped drop-in's)",
    )
    args = parser.parse_args(argv)
    if args.load_s + args.restart_s <= 0:
        parser.error("--load-s and --restart-s: a start and its restart take some time")
    if args.write_baseline and (args.only or args.signatures or args.corpus or args.blind):
        parser.error("--write-baseline is for the shipped table on tests/data/corpus alone")
    return args


def _seconds(text: str) -> float:
    """A non-negative number of seconds from the command line."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench; 1 when the pipeline raised on some log, else 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    corpus = [log for d in (CORPUS, *args.corpus) for log in read_index(d.resolve())]
    logs = select(corpus, args.only)
    if not logs:
        raise SystemExit(f"no labelled log matches {args.only!r}")
    started = time.perf_counter()
    signatures = tuple(p.resolve() for p in args.signatures)
    # The groups span every labelled log, so `--only` keeps a log's near duplicates out too.
    blind = blind_groups(corpus, reader=args.reader, signatures=signatures) if args.blind else None
    if blind is not None and not any(group.removed for group in blind.values()):
        print(
            "--blind: no signature names a source here (written_from): blind = seen",
            file=sys.stderr,
        )
    runs = run_all(logs, jobs=args.jobs, reader=args.reader, signatures=signatures, blind=blind)
    seconds = time.perf_counter() - started
    model = DayModel(load_s=args.load_s, restart_s=args.restart_s)
    scores = [score(run, model) for run in runs]
    notes = sys.stderr if args.format == "json" else sys.stdout
    if args.format == "json":
        print(json.dumps(figures(tally_all(runs, scores)), indent=2))
    else:
        if blind is not None:
            print("BLIND: every log below was replayed without the signatures written from it")
        print(
            render(runs, scores, seconds=seconds, jobs=args.jobs, reader=args.reader, model=model)
        )
    if blind is not None and args.format == "text":
        seen = run_all(logs, jobs=args.jobs, reader=args.reader, signatures=signatures)
        seen_tallies = tally_all(seen, [score(run, model) for run in seen])
        print(_blind_summary(logs, blind, tally_all(runs, scores), seen_tallies))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = report_json(
            runs, scores, seconds=seconds, argv=argv, reader=args.reader, blind=blind, model=model
        )
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {args.json}", file=notes)
    if args.write_baseline:
        files = baseline_files(runs, scores)
        payload = {
            "about": "fatal logs of tests/data/corpus whose crash loop halts on the first crash, "
            "and transient logs halted only by the unknown-repeat rule; written by "
            "`python -m bench.decisions --write-baseline`",
            "halted_first": files,
            "transient_halted_by_repetition": repeat_halted_transients(runs, scores),
        }
        BASELINE.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {BASELINE.relative_to(REPO)} ({len(files)} files)")
    return 1 if any(run.error for run in runs) else 0


def _blind_summary(
    logs: Sequence[LabelledLog],
    blind: Mapping[LabelledLog, SourceGroup],
    tallies: Mapping[str, Tally],
    seen: Mapping[str, Tally],
) -> str:
    """What the blind tables lacked, then blind and seen side by side."""
    groups = {blind[log] for log in logs}
    lacking = sum(bool(blind[log].removed) for log in logs)
    average = sum(len(blind[log].removed) for log in logs) / max(len(logs), 1)
    return "\n".join(
        [
            "",
            f"BLIND: each log replayed without the signatures written from its source group: "
            f"{len(logs)} logs in {len(groups)} source groups, {lacking} of them without at "
            f"least one signature ({average:.1f} on average). Blind / seen (the whole table):",
            "",
            side_by_side(tallies, seen),
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
