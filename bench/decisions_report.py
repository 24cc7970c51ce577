"""The tables and the list of misses that `python -m bench.decisions` prints."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.decisions import DayModel, LogRun, Score

ROWS = ("vllm", "sglang", "tgi", "other", "overall")


@dataclass(slots=True)
class Tally:
    """The counts of one table row."""

    logs: int = 0
    fatal: int = 0
    fatal_halted_first: int = 0
    # Fatal logs whose label names the line that says the cause (a root-cause key): the
    # others are excerpts cut before it, where a first-crash halt would rest on nothing.
    fatal_keyed: int = 0
    fatal_keyed_halted_first: int = 0
    restarts_wasted: int = 0
    # Every loop, fatal, transient or either: its restarts over a day on a real unit
    # (bench.decisions.DayModel), and the loops neither halted nor held within the replay.
    restarts_per_day: float = 0.0
    unbounded_loops: int = 0
    transient: int = 0
    transient_halted: int = 0
    either: int = 0
    either_halted_first: int = 0
    root_ok: int = 0
    keyed: int = 0  # logs whose label has a root-cause key (the others count as right)
    keyed_ok: int = 0
    no_cause: int = 0
    errors: int = 0

    def add(self, run: LogRun, score: Score) -> None:
        """Count one log."""
        self.logs += 1
        severity = run.log.severity
        if severity == "fatal":
            self.fatal += 1
            self.fatal_halted_first += score.halted_first
            self.restarts_wasted += score.restarts_wasted or 0
            if run.log.key:
                self.fatal_keyed += 1
                self.fatal_keyed_halted_first += score.halted_first
        elif severity == "transient":
            self.transient += 1
            self.transient_halted += bool(score.wrongly_halted)
        else:
            self.either += 1
            self.either_halted_first += score.halted_first
        self.restarts_per_day += score.restarts_per_day
        self.unbounded_loops += score.unbounded
        self.root_ok += score.root_ok
        if run.log.key:
            self.keyed += 1
            self.keyed_ok += score.root_ok
        self.no_cause += score.no_cause
        self.errors += run.error is not None


def tally_all(runs: Sequence[LogRun], scores: Sequence[Score]) -> dict[str, Tally]:
    """One tally per engine and one overall."""
    tallies = {row: Tally() for row in ROWS}
    for run, score in zip(runs, scores, strict=True):
        tallies[run.log.engine].add(run, score)
        tallies["overall"].add(run, score)
    return tallies


def _pct(part: int, whole: int) -> str:
    return f"{part} ({100 * part / whole:.0f}%)" if whole else "-"


def per_day(t: Tally) -> str:
    """A row's restarts a day: the sum over its loops, and the mean of a loop."""
    return f"{t.restarts_per_day:,.0f} ({t.restarts_per_day / max(t.logs, 1):.1f} a loop)"


def table(tallies: dict[str, Tally]) -> str:
    """The per-engine table, as Markdown (pasted as is into bench/README.md)."""
    head = (
        "| engine | logs | fatal loops | fatal halted on 1st crash | restarts wasted | "
        "restarts a day | unbounded loops | transient loops | transient halted | "
        "either: halted 1st / not | root cause right | no cause (inv. 1) | pipeline errors |"
    )
    rows = [head, "|" + "---|" * 13]
    for name, t in tallies.items():
        if not t.logs and name != "overall":
            continue
        cells = [
            f"**{name}**" if name == "overall" else name,
            str(t.logs),
            str(t.fatal),
            _pct(t.fatal_halted_first, t.fatal),
            str(t.restarts_wasted),
            per_day(t),
            str(t.unbounded_loops),
            str(t.transient),
            str(t.transient_halted),
            f"{t.either_halted_first} / {t.either - t.either_halted_first}",
            f"{_pct(t.root_ok, t.logs)}, keyed {t.keyed_ok}/{t.keyed}",
            str(t.no_cause),
            str(t.errors),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _what_happened(run: LogRun, score: Score) -> str:
    actions = " ".join(a or "-" for a in score.actions)
    if score.halted_at is None:
        when = "never halted"
    elif score.halted_first:
        when = "halted on the 1st crash"
    else:
        when = f"halted on crash {score.halted_at}"
    basis = f", basis {score.basis}" if score.basis is not None else ""
    confidence = f", confidence {score.confidence}" if score.confidence is not None else ""
    verdict = f"{score.verdict_severity} {score.verdict_signature or '-'}{basis}{confidence}"
    return f"{when} [{actions}]; inv. 1: {verdict}: {score.reason}"


def misses(runs: Sequence[LogRun], scores: Sequence[Score]) -> Iterator[tuple[str, str]]:
    """(file, one paragraph) for every log whose loop did not come out as labelled."""
    for run, score in zip(runs, scores, strict=True):
        log = run.log
        wrong: list[str] = []
        if log.severity == "fatal" and not score.halted_first:
            wrong.append(f"fatal loop not halted on the 1st crash ({score.restarts_wasted} wasted)")
        if score.wrongly_halted:
            wrong.append("transient loop halted")
        if not score.root_ok:
            wrong.append(f"root cause lacks {log.key!r}")
        if score.no_cause:
            wrong.append("no root-cause line")
        wrong += score.problems
        if not wrong:
            continue
        phase = f", phase {log.phase}" if log.phase else ""
        yield (
            log.file,
            f"{log.file}  [{log.severity}, {log.engine}{phase}]  {'; '.join(wrong)}\n"
            f"    happened:   {_what_happened(run, score)}\n"
            f"    root cause: {_cut(score.root_cause)}",
        )


_AFTER_SERVING_RULES = frozenset({"fatal_after_serving", "unknown_after_serving"})


def served_before_crashing(outcome: Mapping[str, Any]) -> bool:
    """The start served before it crashed, as the policy read it: the journal's serving line,
    a rule for crashes after serving, or the verdict's phase (`Phase.describe()` in its
    severity_reason: frames of request handling where the journal shows no serving line).
    Pacing (policy rule 7) counts only crashes of starts that never served."""
    verdict, decision = outcome.get("verdict") or {}, outcome.get("decision") or {}
    return (
        outcome.get("served") is True
        or decision.get("rule") in _AFTER_SERVING_RULES
        or "after serving" in str(verdict.get("severity_reason") or "")
    )


def unbounded(runs: Sequence[LogRun], scores: Sequence[Score]) -> Iterator[str]:
    """One line for every loop neither halted nor held within the replay (systemd restarts it
    at its own pace all day): its decisions, which starts served before crashing (s) and
    invocation 1's rule."""
    for run, score in zip(runs, scores, strict=True):
        if not score.unbounded:
            continue
        served = "".join("s" if served_before_crashing(o) else "-" for o in run.outcomes)
        rule = (run.outcomes[0].get("decision") or {}).get("rule") if run.outcomes else None
        actions = " ".join(a or "-" for a in score.actions)
        yield (
            f"{run.log.file}  [{run.log.severity}, {run.log.engine}]  [{actions}]  "
            f"served [{served or '?'}]  rule {rule}  {score.restarts_per_day:.1f} a day"
        )


def _cut(text: str | None, limit: int = 240) -> str:
    if text is None:
        return "None"
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f" ... ({len(text)} chars)"


def render(
    runs: Sequence[LogRun],
    scores: Sequence[Score],
    *,
    seconds: float,
    jobs: int,
    reader: str,
    model: DayModel,
) -> str:
    """The whole printed report."""
    corpora = sorted({run.log.corpus for run in runs})
    out = [
        f"{len(runs)} labelled logs from {', '.join(corpora)}: each a 5-invocation crash loop "
        f"of vllm.service in a real journal, through supervisor.commands.triage.collect",
        f"{seconds:.1f} s wall with {jobs} job(s), [journal] reader = {reader!r}; "
        f"{sum(r.seconds for r in runs) / max(len(runs), 1):.2f} s per log",
        "",
        table(tally_all(runs, scores)),
        f"restarts a day: {model.describe()}",
        "",
    ]
    loose = list(unbounded(runs, scores))
    out.append(
        f"unbounded loops ({len(loose)}): neither halted nor held within the replay, restarted "
        "at systemd's pace all day (served: s = that start served before it crashed)"
        if loose
        else "unbounded loops: none"
    )
    out += [*loose, ""]
    listed = list(misses(runs, scores))
    out.append(f"misses ({len(listed)}):" if listed else "misses: none")
    out += [paragraph for _, paragraph in listed]
    errors = [run for run in runs if run.error]
    if errors:
        out += ["", f"pipeline errors ({len(errors)}):"]
        out += [f"--- {run.log.file}\n{run.error.rstrip()}" for run in errors if run.error]
    return "\n".join(out)
