"""The classifier against the corpus of real crash logs: every root cause and severity.

The corpus is part of the repository (`tests/data/corpus`, copied with its README and sources
from the project's shared collection), so a clean clone scores it with nothing beside it.
Its absence is a failure, not a skip: this is the project's main measure of the table.
INDEX.tsv gives per file the expected severity (fatal, transient, or either = fatal or
transient) and a root-cause key the verdict's root cause must contain; the README says an empty
key means the excerpt lacks the root cause, so only the severity is checked and `unknown` is
acceptable there.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import pytest

from supervisor.classify import Classifier
from supervisor.model import LogLine, Verdict
from supervisor.signatures import load_signature_table

CORPUS = Path(__file__).resolve().parent / "data" / "corpus"


def corpus_dir() -> Path:
    """The corpus directory inside the repository."""
    return CORPUS


@dataclass(frozen=True)
class Label:
    """One row of INDEX.tsv."""

    file: str
    severity: str  # fatal | transient | either
    key: str  # text the root cause must contain; empty when not in the excerpt


def _labels(directory: Path) -> list[Label]:
    with (directory / "INDEX.tsv").open(encoding="utf-8", newline="") as handle:
        rows = csv.DictReader(handle, delimiter="\t")
        return [Label(r["file"], r["expected_severity"], r["root_cause_key"]) for r in rows]


def _allowed(label: Label) -> set[str]:
    allowed = {"fatal", "transient"} if label.severity == "either" else {label.severity}
    if not label.key:
        allowed.add("unknown")
    return allowed


def _classify(classifier: Classifier, path: Path) -> Verdict:
    text = path.read_text(encoding="utf-8", errors="replace")
    return classifier.classify([LogLine(text=line) for line in text.splitlines()])


class TestCorpus:
    def test_corpus_is_present(self) -> None:
        """The corpus directory and its index exist in the repository."""
        directory = corpus_dir()
        assert (directory / "INDEX.tsv").is_file(), f"crash-log corpus not found at {directory}"

    def test_every_log_is_indexed(self) -> None:
        """Every .log file has a label, so no file escapes the score."""
        directory = corpus_dir()
        files = {p.name for p in directory.glob("*.log")}
        assert files
        assert files <= {label.file for label in _labels(directory)}

    def test_root_causes_and_severities(self, capsys: pytest.CaptureFixture[str]) -> None:
        """All files: root cause contains the key and severity matches the label (100 %)."""
        directory = corpus_dir()
        classifier = Classifier(load_signature_table())
        labels = _labels(directory)
        root_ok = severity_ok = 0
        failures: list[str] = []
        for label in labels:
            verdict = _classify(classifier, directory / label.file)
            has_root = not label.key or (
                verdict.root_cause is not None and label.key in verdict.root_cause
            )
            has_severity = verdict.severity.value in _allowed(label)
            root_ok += has_root
            severity_ok += has_severity
            if not (has_root and has_severity):
                failures.append(
                    f"{label.file}: expected {label.severity} containing {label.key!r}, got "
                    f"{verdict.severity.value} {verdict.signature} {verdict.root_cause!r}"
                )
        total = len(labels)
        score = f"corpus: {root_ok}/{total} root causes, {severity_ok}/{total} severities"
        with capsys.disabled():
            print(f"\n{score}")
        assert not failures, score + "\n" + "\n".join(failures)
