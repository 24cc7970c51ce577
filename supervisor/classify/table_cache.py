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
It also keeps the table's prefilter (`prefilter.py`), so a load from it compiles no set at all,
and, instead of every spec, where each signature's `[[signature]]` table lies in its file: a
signature is parsed from that piece when the table first needs it (a crash needs a few). The
bytes hashed and read at a load are then the files' and a cache of ~1 MB for 5,000 signatures.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import marshal
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from ..util.files import FILE_MODE, make_dirs
from . import prefilter, schema
from .prefilter import Prefilter
from .schema import SignatureSpec

log = structlog.get_logger(__name__)

FORMAT = 2  # bump when what the cache holds changes (2: the prefilter, specs as file pieces)
SUFFIX = ".marshal"
MAGIC = b"vllm-supervisor signature cache\n"  # then the payload's sha256, then the payload
# The code whose rules a cached table passed: a change to it is a new key.
_RULES = hashlib.sha256(
    b"".join(
        Path(module).read_bytes() for module in (schema.__file__, prefilter.__file__, __file__)
    )
).hexdigest()


def cache_key(files: Sequence[tuple[Path, bytes]]) -> str:
    """The key of a table made of these files (path and content, in load order)."""
    digest = hashlib.sha256(f"{FORMAT}\0{_RULES}\0".encode())
    for path, content in files:
        name = os.fsencode(path)
        digest.update(len(name).to_bytes(8, "little") + name)
        digest.update(len(content).to_bytes(8, "little") + hashlib.sha256(content).digest())
    return digest.hexdigest()


# A line that opens one `[[signature]]` table: a file splits into one such piece per signature.
_HEADER = re.compile(rb"^[ \t]*\[\[[ \t]*signature[ \t]*\]\][ \t]*(?:#[^\n]*)?\r?$", re.MULTILINE)
Files = Sequence[tuple[Path, bytes]]


class CachedTable:
    """A table read back from the cache: what matching needs up front (ids, rank, each
    signature's number of patterns, the prefilter); a signature's spec is read when asked for,
    from its own `[[signature]]` piece of its file (whose bytes the key vouches for). A daemon's
    life needs a handful of a table's signatures."""

    __slots__ = (
        "_files",
        "_pieces",
        "domains",
        "ids",
        "kinds",
        "pattern_counts",
        "prefilter",
        "priorities",
    )

    def __init__(self, head: tuple[Any, ...], files: Files) -> None:
        ids, domains, kinds, priorities, pattern_counts, index, pieces = head
        columns = (domains, kinds, priorities, pattern_counts)
        if not all(len(column) == len(ids) for column in columns) or len(pieces) != 24 * len(ids):
            raise ValueError("a table of uneven columns")
        self.ids: tuple[str, ...] = ids
        self.domains: tuple[str, ...] = domains
        self.kinds: tuple[str, ...] = kinds
        self.priorities: tuple[int, ...] = priorities
        self.pattern_counts: tuple[int, ...] = pattern_counts
        self.prefilter = Prefilter.undump(index)
        self._pieces = array.array("q")
        self._pieces.frombytes(pieces)  # file, start, end of each signature, flat
        self._files = files

    def __len__(self) -> int:
        return len(self.ids)

    def spec(self, index: int) -> SignatureSpec:
        """The spec of the signature at `index`, parsed now from its piece of its file (checked
        when the table was saved; `_no_check` keeps the patterns from being parsed again)."""
        file, start, end = self._pieces[3 * index : 3 * index + 3]
        path, content = self._files[file]
        [spec] = schema.parse_table_bytes(path, content[start:end], _no_check)
        if spec.id != self.ids[index]:
            raise ValueError(f"{path}: the cached table does not hold '{spec.id}' at {index}")
        return spec


def _no_check(pattern: str) -> None:
    """Patterns of a cached table were checked when it was saved."""


def load(directory: Path, key: str, files: Files | None = None) -> list[SignatureSpec] | None:
    """The specs saved under `key`, or None when there are none that can be trusted. `files`
    (path and content, in load order) are the table's files, read again when not given."""
    cached = load_table(directory, key, files)
    return [cached.spec(i) for i in range(len(cached))] if cached is not None else None


def load_table(directory: Path, key: str, files: Files | None = None) -> CachedTable | None:
    """The table saved under `key`, or None (see `load`)."""
    path = directory / f"{key}{SUFFIX}"
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        return _table(data, key, files)
    except Exception as exc:  # any damage means "not cached": the files are parsed instead
        log.info("signature_cache_ignored", path=str(path), error=f"{type(exc).__name__}: {exc}")
        return None


def pieces(files: Files, specs: Sequence[SignatureSpec]) -> list[tuple[int, int, int]] | None:
    """Where each spec's `[[signature]]` table lies in its file: (file, start, end), or None
    when the files cannot be cut that way. A header-like line could sit inside a multi-line
    string: the pieces of a file holding `\'\'\'` or `\"\"\"` are parsed again to be sure."""
    found = [
        (number, start, end)
        for number, (_, content) in enumerate(files)
        for start, end in _cuts(content)
    ]
    if len(found) != len(specs):
        return None
    stems = [path.stem for path, _ in files]
    multiline = [b"'''" in content or b'"""' in content for _, content in files]
    for (number, start, end), spec in zip(found, specs, strict=True):
        if stems[number] != spec.domain:
            return None
        path, content = files[number]
        if multiline[number] and schema.parse_table_bytes(path, content[start:end], _no_check) != [
            spec
        ]:
            return None
    return found


def _cuts(content: bytes) -> list[tuple[int, int]]:
    starts = [m.start() for m in _HEADER.finditer(content)]
    return list(zip(starts, [*starts[1:], len(content)], strict=True))


def save(
    directory: Path,
    key: str,
    specs: Sequence[SignatureSpec],
    files: Files,
    index: Prefilter | None = None,
) -> None:
    """Keep `specs` (read from `files`) and the prefilter `index` built for them under `key`,
    atomically, dropping the tables saved before; best effort. Files that cannot be cut into
    one piece per signature (`pieces`) are not cached."""
    where = pieces(files, specs)
    if where is None:
        log.info("signature_cache_not_written", directory=str(directory), error="uncut files")
        return
    if index is None:
        index = Prefilter.build([pattern for spec in specs for pattern in spec.patterns])
    head = (
        tuple(spec.id for spec in specs),
        tuple(spec.domain for spec in specs),
        tuple(spec.kind for spec in specs),
        tuple(spec.priority for spec in specs),
        tuple(len(spec.patterns) for spec in specs),
        index.dump(),
        array.array("q", [number for piece in where for number in piece]).tobytes(),
    )
    paths = tuple(os.fsencode(path) for path, _ in files)
    payload = marshal.dumps((FORMAT, key, paths, head))
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


def _table(data: bytes, key: str, files: Files | None) -> CachedTable:
    # The checksum is checked before anything is unmarshalled: marshal is not meant for bytes
    # it did not write.
    head = len(MAGIC) + hashlib.sha256().digest_size
    payload = memoryview(data)[head:]  # not a copy: the cache of a large table is a megabyte
    if data[: len(MAGIC)] != MAGIC or hashlib.sha256(payload).digest() != data[len(MAGIC) : head]:
        raise ValueError("not a signature cache, or damaged")
    format_, saved_key, paths, table_head = marshal.loads(payload)  # noqa: S302 - checksummed
    if format_ != FORMAT or saved_key != key:
        raise ValueError("another format or table")
    if files is None:
        files = [(Path(os.fsdecode(path)), Path(os.fsdecode(path)).read_bytes()) for path in paths]
        if cache_key(files) != key:
            raise ValueError("the table's files changed")
    return CachedTable(table_head, files)
