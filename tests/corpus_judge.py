"""A corpus log judged as the daemon judges one failed invocation of it.

The lines go in as one invocation that exited with status 1 after `STARTUP_RAN_S` (a startup
log) or after serving `served_s` seconds (a serving log, which logged that it serves at its
start); the classifier, `determinism.assess` and, for a decision, the policy do the rest, as
`Pipeline.decide` does.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_supervisor.classify.classifier import Classifier
from vllm_supervisor.classify.determinism import Phase
from vllm_supervisor.classify.determinism import judge as judge_invocation
from vllm_supervisor.model import Invocation, LogLine, Verdict

CORPUS = Path(__file__).resolve().parent / "data" / "corpus"
UNIT = "vllm.service"
GOOD_START_S = 600.0  # the shipped [drift] good_start_s
STARTUP_RAN_S = 60.0  # a startup log's invocation ran this long before it crashed
DEFAULT_SERVED_S = 1800.0  # a serving log without served_s


@dataclass(frozen=True)
class Label:
    """One row of INDEX.tsv."""

    file: str
    severity: str  # fatal | transient | either
    key: str  # text the root cause must contain; empty when not in the excerpt
    served_s: float | None = None  # serving logs: how long it had served before the crash


def labels(directory: Path = CORPUS) -> list[Label]:
    """Every row of the corpus index."""
    with (directory / "INDEX.tsv").open(encoding="utf-8", newline="") as handle:
        rows = csv.DictReader(handle, delimiter="\t")
        return [
            Label(
                r["file"],
                r["expected_severity"],
                r["root_cause_key"],
                float(r.get("served_s") or DEFAULT_SERVED_S)
                if r.get("phase") == "serving"
                else None,
            )
            for r in rows
        ]


def label_of(file: str) -> Label:
    """The label of one corpus file."""
    (label,) = [label for label in labels() if label.file == file]
    return label


def failed_invocation(
    texts: Sequence[str],
    *,
    invocation_id: str = "0" * 32,
    started_us: int = 0,
    ended_us: int = int(STARTUP_RAN_S * 1e6),
    served_us: int | None = None,
) -> Invocation:
    """Lines as one invocation of UNIT that exited with status 1 (its start read)."""
    lines = tuple(LogLine(text=text) for text in texts)
    return Invocation(
        unit=UNIT,
        invocation_id=invocation_id,
        lines=lines,
        total_lines=len(lines),
        exit_code="exited",
        exit_status=1,
        result="exit-code",
        started_us=started_us,
        served_us=served_us,
        ended_us=ended_us,
    )


def invocation_of(label: Label, *, invocation_id: str = "0" * 32) -> Invocation:
    """The log as one invocation that failed with exit status 1."""
    text = (CORPUS / label.file).read_text(encoding="utf-8", errors="replace")
    return failed_invocation(
        text.splitlines(),
        invocation_id=invocation_id,
        ended_us=int(((label.served_s or 0) + STARTUP_RAN_S) * 1e6),
        served_us=None if label.served_s is None else 1,
    )


def judge(classifier: Classifier, invocation: Invocation) -> tuple[Verdict, Phase]:
    """The verdict (assessed) and phase the pipeline gives the invocation."""
    return judge_invocation(classifier, invocation, GOOD_START_S)
