"""The validated signature table of the last load, kept on disk and keyed by its files' content.

tomllib is pure Python: a table of 5,000 signatures spent ~0.5 s of its ~1.2 s load parsing TOML
and most of the rest validating it. A load of files it has seen before reads the specs back
from `<directory>/<key>.marshal` instead, where the key is a sha256 over this cache's format,
the validating code and every file's path and bytes: an edited file, a file added or removed, or
a new release of the rules is another key, so it is parsed and validated again.

The cache only ever saves work. A file that is missing, unreadable, of another format or whose
checksum does not hold is ignored (and rewritten by that load); a directory that cannot be
written is skipped. It is written only after the table it holds was built (its regexes compiled
into RE2 sets), under a temporary name renamed into place, so a reader never sees half of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import marshal
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from ..model import Severity
from ..util.files import FILE_MODE, make_dirs
from . import schema
from .schema import SignatureSpec, WrittenFrom

log = structlog.get_logger(__name__)

FORMAT = 1  # bump when what a spec holds changes
SUFFIX = ".marshal"
MAGIC = b"vllm-supervisor signature cache\n"  # then the payload's sha256, then the payload
# The code whose rules a cached table passed: a change to it is a new key.
_RULES = hashlib.sha256(
    b"".join(Path(module).read_bytes() for module in (schema.__file__, __file__))
).hexdigest()


def cache_key(files: Sequence[tuple[Path, bytes]]) -> str:
    """The key of a table made of these files (path and content, in load order)."""
    digest = hashlib.sha256(f"{FORMAT}\0{_RULES}\0".encode())
    for path, content in files:
        name = os.fsencode(path)
        digest.update(len(name).to_bytes(8, "little") + name)
        digest.update(len(content).to_bytes(8, "little") + hashlib.sha256(content).digest())
    return digest.hexdigest()


def load(directory: Path, key: str) -> list[SignatureSpec] | None:
    """The specs saved under `key`, or None when there are none that can be trusted."""
    path = directory / f"{key}{SUFFIX}"
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        return _specs(data, key)
    except Exception as exc:  # any damage means "not cached": the files are parsed instead
        log.info("signature_cache_ignored", path=str(path), error=f"{type(exc).__name__}: {exc}")
        return None


def save(directory: Path, key: str, specs: Sequence[SignatureSpec]) -> None:
    """Keep `specs` under `key` (atomically), dropping the tables saved before; best effort."""
    payload = marshal.dumps((FORMAT, key, tuple(_row(spec) for spec in specs)))
    data = MAGIC + hashlib.sha256(payload).digest() + payload
    try:
        make_dirs(directory)
        fd, name = tempfile.mkstemp(prefix=".tmp-", suffix=SUFFIX, dir=directory)
        staged = Path(name)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            staged.chmod(FILE_MODE)
            staged.replace(directory / f"{key}{SUFFIX}")
        except BaseException:
            with contextlib.suppress(OSError):
                staged.unlink()
            raise
        for old in directory.glob(f"*{SUFFIX}"):
            if old.name != f"{key}{SUFFIX}" and not old.name.startswith(".tmp-"):
                with contextlib.suppress(OSError):
                    old.unlink()
    except OSError as exc:
        log.info("signature_cache_not_written", directory=str(directory), error=str(exc))


def _specs(data: bytes, key: str) -> list[SignatureSpec]:
    # The checksum is checked before anything is unmarshalled: marshal is not meant for bytes
    # it did not write.
    head = len(MAGIC) + hashlib.sha256().digest_size
    if (
        data[: len(MAGIC)] != MAGIC
        or hashlib.sha256(data[head:]).digest() != data[len(MAGIC) : head]
    ):
        raise ValueError("not a signature cache, or damaged")
    format_, saved_key, rows = marshal.loads(data[head:])  # noqa: S302 - checksummed, ours
    if format_ != FORMAT or saved_key != key:
        raise ValueError("another format or table")
    return [_spec(row) for row in rows]


def _row(spec: SignatureSpec) -> tuple[Any, ...]:
    return (
        spec.id,
        spec.title,
        spec.severity.value,
        spec.remediation,
        spec.priority,
        spec.source,
        spec.kind,
        spec.domain,
        spec.patterns,
        spec.frames,
        spec.notes,
        spec.startup_severity.value if spec.startup_severity else None,
        spec.serving_severity.value if spec.serving_severity else None,
        tuple((w.log, w.url, w.upstream) for w in spec.written_from),
    )


def _spec(row: tuple[Any, ...]) -> SignatureSpec:
    (
        id_,
        title,
        severity,
        remediation,
        priority,
        source,
        kind,
        domain,
        patterns,
        frames,
        notes,
        startup,
        serving,
        written_from,
    ) = row
    return SignatureSpec(
        id=id_,
        title=title,
        severity=Severity(severity),
        remediation=remediation,
        priority=priority,
        source=source,
        kind=kind,
        domain=domain,
        patterns=tuple(patterns),
        frames=tuple(frames),
        notes=notes,
        startup_severity=Severity(startup) if startup is not None else None,
        serving_severity=Severity(serving) if serving is not None else None,
        written_from=tuple(WrittenFrom(log=a, url=b, upstream=c) for a, b, c in written_from),
    )
