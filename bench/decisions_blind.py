"""`python -m bench.decisions --blind`: score each log without the signatures written from it.

Every shipped signature names the corpus logs (and upstream URLs) it was written from, in its
TOML's `written_from`. A log's *source* is the public page it was copied from (INDEX.tsv's
`source_url`: logs from one issue are one source) together with its near duplicates: logs whose
root-cause line is the same message once numbers, paths, versions, ids and quoted text are
masked (`near_duplicate_key`, built on the fingerprint's normalisation). Both relations are
followed transitively, so the corpus falls into source groups. For every log of a group the
table lacks each signature that names a log of the group, or one of the group's URLs; what is
left is what the daemon would know of a crash nobody had listed. The root-cause line is the one
`triage` finds in the log read as plain text with the whole table (no journal, no timing), so
the groups do not depend on the replay they are used for.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.decisions_report import Tally, per_day
from vllm_supervisor.classify.fingerprint import normalise
from vllm_supervisor.classify.schema import SignatureSpec, parse_table_file
from vllm_supervisor.classify.signatures import (
    DEFAULT_SIGNATURE_DIR,
    SignatureTable,
    compile_pattern,
)
from vllm_supervisor.commands.triage import collect
from vllm_supervisor.config import Config

# Quoted text: a model id, a module name, a path or a flag a user chose. An apostrophe inside a
# word (can't) opens no quote.
_QUOTED = re.compile(r"(?<!\w)'[^'\n]*'|\"[^\"\n]*\"|`[^`\n]*`")
JSON_KEYS = (
    "fatal",
    "fatal_first_crash",
    "fatal_with_cause",
    "fatal_with_cause_first_crash",
    "restarts_wasted",
    "transient",
    "transient_halted",
    "root_cause_right",
    "logs",
    "restarts_per_day",
    "unbounded_loops",
)


def near_duplicate_key(root_cause: str) -> str:
    """The root-cause line as a message: quoted text, numbers, paths, versions and ids masked.
    Two logs with the same key are near duplicates: one crash, reported twice."""
    return normalise(_QUOTED.sub("<q>", root_cause))


def source_urls(directory: Path) -> dict[str, str]:
    """file -> the source its INDEX.tsv row names (a URL, or how it was recorded), if any."""
    with (directory / "INDEX.tsv").open(encoding="utf-8", newline="") as handle:
        rows = csv.DictReader(handle, delimiter="\t")
        return {
            row["file"].strip(): url.rstrip("/")
            for row in rows
            if (url := (row.get("source_url") or "").strip())
        }


def signature_specs(paths: Sequence[Path] = ()) -> list[SignatureSpec]:
    """The validated entries of the table the bench runs (the shipped one by default)."""
    files: list[Path] = []
    for path in paths or (DEFAULT_SIGNATURE_DIR,):
        files.extend(sorted(path.glob("*.toml")) if path.is_dir() else [path])
    return [spec for file in files for spec in parse_table_file(file, compile_pattern)]


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceGroup:
    """Logs that count as one source, and the signatures a blind run of any of them lacks."""

    logs: frozenset[tuple[str, str]]  # (corpus directory, file)
    urls: frozenset[str]
    removed: frozenset[str]  # signature ids


class _Components:
    """Union-find over hashable items."""

    def __init__(self) -> None:
        self._parent: dict[object, object] = {}

    def find(self, item: object) -> object:
        self._parent.setdefault(item, item)
        while (parent := self._parent[item]) != item:
            self._parent[item] = self._parent.get(parent, parent)
            item = parent
        return item

    def join(self, first: object, second: object) -> None:
        self._parent[self.find(first)] = self.find(second)


def source_groups(
    logs: Iterable[tuple[str, str]],
    urls: Mapping[tuple[str, str], str],
    root_causes: Mapping[tuple[str, str], str | None],
) -> list[frozenset[tuple[str, str]]]:
    """The logs joined by a shared source URL or a near-duplicate root-cause line."""
    components = _Components()
    logs = list(logs)
    for log in logs:
        components.find(log)
        if url := urls.get(log):
            components.join(log, ("url", url))
        if root := root_causes.get(log):
            components.join(log, ("root", near_duplicate_key(root)))
    members: dict[object, set[tuple[str, str]]] = {}
    for log in logs:
        members.setdefault(components.find(log), set()).add(log)
    return [frozenset(group) for group in members.values()]


def removed_signatures(
    specs: Iterable[SignatureSpec], files: Iterable[str], urls: Iterable[str]
) -> frozenset[str]:
    """The signatures written from any of these corpus files or source URLs."""
    files, urls = set(files), set(urls)
    return frozenset(
        spec.id
        for spec in specs
        for source in spec.written_from
        if source.log in files or (source.url or source.upstream or "").rstrip("/") in urls
    )


def plain_root_cause(path: Path, *, config: Config, table: SignatureTable) -> str | None:
    """The root-cause line `triage` finds in the log read as plain text."""
    outcomes = collect(str(path), config=config, table=table)
    if not outcomes:
        return None
    root = (outcomes[0].to_json().get("verdict") or {}).get("root_cause")
    return root if isinstance(root, str) else None


def plan(
    logs: Sequence[tuple[str, str]],
    *,
    specs: Sequence[SignatureSpec],
    default_corpus: str,
    urls: Mapping[tuple[str, str], str],
    root_causes: Mapping[tuple[str, str], str | None],
) -> dict[tuple[str, str], SourceGroup]:
    """For every log (corpus directory, file): its source group and what its blind table lacks.
    `written_from` names logs of the default corpus by file name."""
    result: dict[tuple[str, str], SourceGroup] = {}
    for members in source_groups(logs, urls, root_causes):
        group_urls = frozenset(url for log in members if (url := urls.get(log)))
        files = (file for corpus, file in members if corpus == default_corpus)
        group = SourceGroup(
            logs=members, urls=group_urls, removed=removed_signatures(specs, files, group_urls)
        )
        result.update(dict.fromkeys(members, group))
    return result


def without(table: SignatureTable, removed: frozenset[str]) -> SignatureTable:
    """The table less the `removed` signatures; the rest keep their rank and table order."""
    kept = [s for s in table.signatures if s.id not in removed]
    return SignatureTable(kept, max_line_chars=table.max_line_chars)


def figures(tallies: Mapping[str, Tally]) -> dict[str, dict[str, int]]:
    """`--format json`: the headline counts for the whole corpus ("all") and per engine."""
    return {
        ("all" if row == "overall" else row): {
            "fatal": t.fatal,
            "fatal_first_crash": t.fatal_halted_first,
            # The fatal logs whose label names a cause line in the excerpt: what can be known.
            "fatal_with_cause": t.fatal_keyed,
            "fatal_with_cause_first_crash": t.fatal_keyed_halted_first,
            "restarts_wasted": t.restarts_wasted,
            "transient": t.transient,
            "transient_halted": t.transient_halted,
            "root_cause_right": t.root_ok,
            "logs": t.logs,
            # Whole restarts: the day's figure is a model's (bench.decisions.DayModel).
            "restarts_per_day": round(t.restarts_per_day),
            "unbounded_loops": t.unbounded_loops,
        }
        for row, t in sorted(tallies.items(), key=lambda item: item[0] != "overall")
    }


def side_by_side(blind: Mapping[str, Tally], seen: Mapping[str, Tally]) -> str:
    """Blind and seen figures in one Markdown table, a row per engine and one for all."""
    rows = [
        "| engine | logs | fatal halted 1st: blind / seen | restarts wasted: blind / seen | "
        "restarts a day: blind / seen | unbounded loops: blind / seen | "
        "transient halted: blind / seen | root cause right: blind / seen | "
        "fatal whose cause line is in the log, halted 1st: blind / seen |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in sorted(blind, key=lambda row: row == "overall"):
        b, s = blind[name], seen[name]
        if not b.logs and name != "overall":
            continue
        cells = [
            "**all**" if name == "overall" else name,
            str(b.logs),
            f"{b.fatal_halted_first} / {s.fatal_halted_first} of {b.fatal}",
            f"{b.restarts_wasted} / {s.restarts_wasted}",
            f"{per_day(b)} / {per_day(s)}",
            f"{b.unbounded_loops} / {s.unbounded_loops}",
            f"{b.transient_halted} / {s.transient_halted} of {b.transient}",
            f"{b.root_ok} / {s.root_ok}",
            f"{b.fatal_keyed_halted_first} / {s.fatal_keyed_halted_first} of {b.fatal_keyed}",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
