"""Validate one signature TOML file into plain specs, with messages that name the fix.

Kept apart from `signatures.py` (which compiles and matches) so that the rules of the file
format read in one place. Every error names the file, the signature id and the field, e.g.
`config/signatures/vllm.toml: signature 'x': patterns[1]: invalid regex: missing )`.
"""

from __future__ import annotations

import re
import string
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..environment.probe import normalize_name
from ..errors import SignatureTableError
from ..model import Severity

_ID = re.compile(r"[a-z][a-z0-9_]*\Z")
_NAMED_GROUP = re.compile(r"\(\?P<([A-Za-z_]\w*)>")
_KEYS = {
    "id": str,
    "patterns": list,
    "severity": str,
    "title": str,
    "remediation": str,
    "priority": int,
    "source": str,
    "notes": str,
    "kind": str,
    "wrapper": bool,
    "frames": list,
    "startup_severity": str,
    "serving_severity": str,
    "written_from": list,
    "packages": list,
    "examples": list,
}
_REQUIRED = ("id", "patterns", "title")
_KINDS = ("cause", "noise")
_SEVERITIES = {"fatal": Severity.FATAL, "transient": Severity.TRANSIENT}
# A phase may also say "unknown": the line names the crash, not whether it repeats then.
_PHASE_SEVERITIES = {**_SEVERITIES, "unknown": Severity.UNKNOWN}
_SOURCE_KEYS = ("log", "upstream", "url", "invocation")
# `vllm-supervisor signatures propose`'s source: the unit and the invocation it was written from.
_INVOCATION = re.compile(r"[\w@:.\\-]{1,256} [0-9a-f]{32}\Z")
_DISTRIBUTION = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,98}[A-Za-z0-9])?\Z")
_LOG_NAME = re.compile(r"[\w.+-]+\.log\Z")
_URL = re.compile(r"https?://[^\s/]+/?\S*\Z")


@dataclass(frozen=True, slots=True, kw_only=True)
class WrittenFrom:
    """One source a signature was written from: a log of the crash corpus (tests/data/corpus,
    by file name, with its public URL when it has one), or an upstream URL (an issue thread,
    documentation or source code) when no corpus log holds the text it was written from."""

    log: str | None = None
    url: str | None = None
    upstream: str | None = None
    invocation: str | None = None  # "UNIT INVOCATION_ID": proposed from a recorded crash


@dataclass(frozen=True, slots=True)
class SignatureSpec:
    """A validated `[[signature]]` entry, not yet compiled."""

    id: str
    title: str
    severity: Severity
    remediation: str | None
    priority: int
    source: str | None
    kind: str  # cause | noise | wrapper
    domain: str
    patterns: tuple[str, ...]
    frames: tuple[str, ...]
    notes: str | None
    # The severity before the server ever served, and after it served, when the phase decides
    # (an OOM while loading with the same config every time, versus one under load).
    startup_severity: Severity | None = None
    serving_severity: Severity | None = None
    written_from: tuple[WrittenFrom, ...] = ()
    # The distributions whose versions the crash is about (flashinfer-python, -cubin): a halt
    # lifts when one of these changes, not when any package does (supervisor.actions.evidence).
    packages: tuple[str, ...] = ()
    examples: tuple[str, ...] = ()  # lines its patterns must match (checked at load)

    def unmatched_example(self, compile_: Callable[[str], Any]) -> str | None:
        """The first example none of its patterns (compiled by `compile_`) matches, as an
        error naming the field; None when all match."""
        if not self.examples:
            return None
        compiled = [compile_(pattern) for pattern in self.patterns]
        for index, example in enumerate(self.examples):
            if not any(pattern.search(example) for pattern in compiled):
                shown = example if len(example) <= 120 else example[:117] + "..."
                return f"examples[{index}]: not matched by its patterns: {shown!r}"
        return None


class _Where:
    """Builds error messages that point at one field of one signature."""

    def __init__(self, path: Path, sig_id: str | None) -> None:
        self.prefix = f"{path}: signature '{sig_id}'" if sig_id else f"{path}: signature"

    def error(self, field_name: str, message: str) -> SignatureTableError:
        return SignatureTableError(f"{self.prefix}: {field_name}: {message}")


def _check_types(raw: dict[str, Any], where: _Where) -> None:
    """Unknown keys, missing keys and wrong types."""
    for key, value in raw.items():
        if key not in _KEYS:
            allowed = ", ".join(sorted(_KEYS))
            raise where.error(key, f"unknown key (allowed: {allowed})")
        expected = _KEYS[key]
        # bool is an int subclass; `priority = true` is a mistake, not 1.
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise where.error(key, f"must be a {expected.__name__}, got {type(value).__name__}")
    for key in _REQUIRED:
        if key not in raw:
            raise where.error(key, "missing (required)")


def _regex_list(
    raw: dict[str, Any], key: str, where: _Where, compile_: Callable[[str], Any]
) -> tuple[str, ...]:
    """A list of valid regexes under `key`."""
    values = raw.get(key, [])
    if key == "patterns" and not values:
        raise where.error(key, "must hold at least one regex")
    for index, pattern in enumerate(values):
        if not isinstance(pattern, str):
            raise where.error(f"{key}[{index}]", f"must be a str, got {type(pattern).__name__}")
        try:
            compile_(pattern)
        except ValueError as exc:
            raise where.error(f"{key}[{index}]", str(exc)) from exc
    return tuple(values)


def _examples(raw: dict[str, Any], where: _Where) -> tuple[str, ...]:
    """The optional `examples`: lines (as the classifier sees them) one of the patterns must
    match, checked at every load (supervisor.classify.signatures): a signature's own vectors."""
    examples = raw.get("examples", [])
    for index, example in enumerate(examples):
        if not isinstance(example, str):
            kind = type(example).__name__
            raise where.error(f"examples[{index}]", f"must be a str, got {kind}")
    return tuple(examples)


def _kind(raw: dict[str, Any], where: _Where) -> str:
    """cause | noise | wrapper, from `kind` and `wrapper`."""
    kind = raw.get("kind", "cause")
    if kind not in _KINDS:
        raise where.error("kind", f"must be one of {', '.join(_KINDS)}, got {kind!r}")
    if raw.get("wrapper", False):
        if kind == "noise":
            raise where.error("wrapper", "a noise entry cannot also be a wrapper")
        return "wrapper"
    return str(kind)


def _severity(raw: dict[str, Any], kind: str, where: _Where) -> Severity:
    """Required for causes; optional for wrappers; absent for noise."""
    value = raw.get("severity")
    if value is None:
        if kind == "cause":
            raise where.error("severity", "missing (required): fatal or transient")
        return Severity.UNKNOWN
    if kind == "noise":
        raise where.error("severity", "a noise entry has no severity")
    if value not in _SEVERITIES:
        raise where.error("severity", f"must be fatal or transient, got {value!r}")
    return _SEVERITIES[value]


def _check_template(template: str, patterns: tuple[str, ...], where: _Where) -> None:
    """Every `{name}` in the remediation must be a named group of some pattern."""
    defined = {name for p in patterns for name in _NAMED_GROUP.findall(p)}
    try:
        fields = [
            (name, spec, conversion)
            for _, name, spec, conversion in string.Formatter().parse(template)
            if name is not None
        ]
    except ValueError as exc:
        raise where.error("remediation", f"bad template: {exc}") from exc
    for name, spec, conversion in fields:
        # A field that fails on text (`{x!z}`, `{x:d}`, a spec nesting a field) would fail only
        # when a line is classified, and the crash would go undecided. Captures are always text
        # and text formats alike whatever it holds, so one that renders "?" renders them all.
        if not name.isidentifier() or not _renders_text(spec, conversion):
            field = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise where.error(
                "remediation", f"template field {{{field}}} must be a plain name such as {{x}}"
            )
        if name not in defined:
            known = ", ".join(sorted(defined)) or "none"
            raise where.error(
                "remediation",
                f"names capture {{{name}}} that no pattern defines (defined: {known})",
            )


def _renders_text(spec: str | None, conversion: str | None) -> bool:
    spec = spec or ""
    if conversion not in (None, "r", "s", "a") or "{" in spec:
        return False
    try:
        format("?", spec)
    except ValueError:
        return False
    return True


def _spec(raw: Any, path: Path, compile_: Callable[[str], Any]) -> SignatureSpec:
    """Validate one raw `[[signature]]` table."""
    if not isinstance(raw, dict):
        raise SignatureTableError(f"{path}: each [[signature]] must be a table")
    sig_id = raw.get("id") if isinstance(raw.get("id"), str) else None
    where = _Where(path, sig_id)
    _check_types(raw, where)
    if not _ID.match(raw["id"]):
        raise where.error("id", "must be snake_case ([a-z][a-z0-9_]*)")
    patterns = _regex_list(raw, "patterns", where, compile_)
    kind = _kind(raw, where)
    remediation = raw.get("remediation")
    if remediation is not None:
        _check_template(remediation, patterns, where)
    return SignatureSpec(
        id=raw["id"],
        title=raw["title"],
        severity=_severity(raw, kind, where),
        remediation=remediation,
        priority=raw.get("priority", 0),
        source=raw.get("source"),
        kind=kind,
        domain=path.stem,
        patterns=patterns,
        frames=_regex_list(raw, "frames", where, compile_),
        notes=raw.get("notes"),
        startup_severity=_phase_severity(raw, "startup_severity", kind, where),
        serving_severity=_phase_severity(raw, "serving_severity", kind, where),
        written_from=_written_from(raw, where),
        packages=_packages(raw, where),
        examples=_examples(raw, where),
    )


def _packages(raw: dict[str, Any], where: _Where) -> tuple[str, ...]:
    """The optional `packages` list: distribution names, kept in their normalised form."""
    names = raw.get("packages", [])
    if not all(isinstance(n, str) and _DISTRIBUTION.match(n) for n in names):
        raise where.error("packages", "must be a list of distribution names (flashinfer-python)")
    return tuple(dict.fromkeys(normalize_name(n) for n in names))


def _written_from(raw: dict[str, Any], where: _Where) -> tuple[WrittenFrom, ...]:
    """The optional `written_from` list: `{ log = ..., url = ... }` or `{ upstream = ... }`."""
    if "written_from" not in raw:
        return ()
    items = raw["written_from"]
    if not items:
        raise where.error("written_from", "must name at least one source")
    entries: list[WrittenFrom] = []
    for index, item in enumerate(items):
        field_name = f"written_from[{index}]"
        if not isinstance(item, dict):
            kind = type(item).__name__
            raise where.error(
                field_name, f"must be a table {{ log = ... }} or {{ upstream = ... }}, got {kind}"
            )
        entry = _source_entry(item, field_name, where)
        if entry in entries:
            same = entries.index(entry)
            raise where.error(field_name, f"the same source as written_from[{same}]")
        entries.append(entry)
    return tuple(entries)


def _source_entry(item: dict[str, Any], field_name: str, where: _Where) -> WrittenFrom:
    """One validated `written_from` entry."""
    for key in item:
        if key not in _SOURCE_KEYS:
            allowed = ", ".join(_SOURCE_KEYS)
            raise where.error(field_name, f"unknown key {key!r} (allowed: {allowed})")
    for key, value in item.items():
        if not isinstance(value, str):
            raise where.error(f"{field_name}.{key}", f"must be a str, got {type(value).__name__}")
    if "invocation" in item:
        if len(item) > 1:
            raise where.error(field_name, "an invocation source names nothing else")
        if not _INVOCATION.match(item["invocation"]):
            raise where.error(
                f"{field_name}.invocation",
                f"must be 'UNIT INVOCATION_ID' (32 hex digits), got {item['invocation']!r}",
            )
        return WrittenFrom(invocation=item["invocation"])
    if "log" in item and "upstream" in item:
        raise where.error(field_name, "names log or upstream, not both")
    if "log" not in item and "upstream" not in item:
        raise where.error(
            field_name, "names neither log (a corpus log) nor upstream (a URL outside the corpus)"
        )
    if "upstream" in item and "url" in item:
        raise where.error(f"{field_name}.url", "only a log entry has a url; upstream is the URL")
    if "log" in item and not _LOG_NAME.match(item["log"]):
        raise where.error(
            f"{field_name}.log",
            f"must be a corpus log's file name (NN-name.log), got {item['log']!r}",
        )
    for key in ("url", "upstream"):
        if key in item and not _URL.match(item[key]):
            raise where.error(f"{field_name}.{key}", f"must be an http(s) URL, got {item[key]!r}")
    return WrittenFrom(log=item.get("log"), url=item.get("url"), upstream=item.get("upstream"))


def _phase_severity(raw: dict[str, Any], key: str, kind: str, where: _Where) -> Severity | None:
    """An optional severity for one phase: fatal, transient or unknown, not on a noise entry."""
    value = raw.get(key)
    if value is None:
        return None
    if kind == "noise":
        raise where.error(key, "a noise entry has no severity")
    if value not in _PHASE_SEVERITIES:
        raise where.error(key, f"must be fatal, transient or unknown, got {value!r}")
    return _PHASE_SEVERITIES[value]


def parse_table_file(path: Path, compile_: Callable[[str], Any]) -> list[SignatureSpec]:
    """Read one TOML file of `[[signature]]` entries; raise SignatureTableError on any fault."""
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise SignatureTableError(f"{path}: cannot read: {exc}") from exc
    return parse_table_bytes(path, content, compile_)


def parse_table_bytes(
    path: Path, content: bytes, compile_: Callable[[str], Any]
) -> list[SignatureSpec]:
    """`parse_table_file` of content already read from `path` (named in every error)."""
    try:
        # As `Path.read_text` reads it: universal newlines.
        text = content.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
        data = tomllib.loads(text)
    except UnicodeDecodeError as exc:
        raise SignatureTableError(f"{path}: cannot read: {exc}") from exc
    except (tomllib.TOMLDecodeError, RecursionError) as exc:  # the latter: nested too deeply
        raise SignatureTableError(f"{path}: invalid TOML: {exc}") from exc
    extra = sorted(set(data) - {"signature"})
    if extra:
        raise SignatureTableError(f"{path}: unknown top-level key(s) {extra}; only [[signature]]")
    entries = data.get("signature", [])
    if not isinstance(entries, list):
        raise SignatureTableError(f"{path}: 'signature' must be an array of tables [[signature]]")
    specs = [_spec(raw, path, compile_) for raw in entries]
    ids = [s.id for s in specs]
    for sig_id in ids:
        if ids.count(sig_id) > 1:
            raise SignatureTableError(f"{path}: signature '{sig_id}': id: duplicate in this file")
    return specs
