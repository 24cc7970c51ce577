"""A table read back from the cache does no work that grows with the table until a line needs it.

Before, a load of 5,000 cached signatures still compiled every pattern into RE2 sets (~0.2 s,
holding the GIL) and built every signature, and the first crash built the sets' automata: the
load and first crash took ~22 times the shipped table's. Now the cache keeps the prefilter's
index and where each signature lies in its file; the load compiles nothing and builds no
signature, and a line compiles only what its words lead to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.scale_tables import signature_table
from vllm_supervisor.classify import signatures
from vllm_supervisor.classify.signatures import load_signature_table

CUBIN_LINE = (
    "RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version (0.6.4)"
)


@pytest.fixture(scope="module", name="big_table_dir")
def _big_table_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return signature_table(1000, root=tmp_path_factory.mktemp("tables"))


class _Counting:
    """Records calls to a module function, then calls it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.calls: list[tuple[Any, ...]] = []
        real = getattr(signatures, name)

        def counting(*args: Any) -> Any:
            self.calls.append(args)
            return real(*args)

        monkeypatch.setattr(signatures, name, counting)


def test_a_cached_load_compiles_no_set_and_builds_no_signature(
    big_table_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loaded from the cache: no RE2 set compiled, no signature built; a crash line then
    compiles sets only for the patterns no word indexes, and builds the signatures it matched
    or nearly matched, not the table."""
    cache = tmp_path / "cache"
    reference = load_signature_table([big_table_dir])
    load_signature_table([big_table_dir], cache_dir=cache)
    sets = _Counting(monkeypatch, "_compile_set")
    built = _Counting(monkeypatch, "_build")
    table = load_signature_table([big_table_dir], cache_dir=cache)
    assert table.from_cache
    assert (sets.calls, built.calls) == ([], [])
    found, expected = (t.match(f"{CUBIN_LINE} [copy 3]") for t in (table, reference))
    assert found is not None and expected is not None
    assert (found.signature, found.captures) == (expected.signature, expected.captures)
    patterns = sum(len(s.patterns) for s in reference.signatures)
    assert sum(len(call[1]) for call in sets.calls) < patterns / 20
    assert len(built.calls) <= 5  # the signatures this line may match, not the table
    assert table.ids == reference.ids
    assert table.get("nccl_timeout_copy5") == reference.get("nccl_timeout_copy5")


def test_a_cached_table_is_the_parsed_one(big_table_dir: Path, tmp_path: Path) -> None:
    """Signature by signature (each read back from its piece of its file), the same table."""
    cache = tmp_path / "cache"
    parsed = load_signature_table([big_table_dir], cache_dir=cache)
    cached = load_signature_table([big_table_dir], cache_dir=cache)
    assert (parsed.from_cache, cached.from_cache) == (False, True)
    assert list(cached.signatures) == list(parsed.signatures)
    assert cached.domains == parsed.domains


TRICKY = """
[[signature]]
id = "first"
title = "First"
severity = "fatal"
patterns = ['first (?P<what>\\w+) happened']
notes = '''
A note that holds a line like a table header:
[[signature]]
id = "not_a_signature"
'''

[[signature]] # a comment after the header
id = "second"
title = "Second"
severity = "transient"
patterns = ["second thing"]
"""


def test_a_header_inside_a_multiline_string_does_not_cut_the_file(tmp_path: Path) -> None:
    """A `[[signature]]` line inside a multi-line string is text, not a table: the cached table
    is still the parsed one (or the file is not cached at all)."""
    path = tmp_path / "tricky.toml"
    path.write_text(TRICKY, encoding="utf-8")
    cache = tmp_path / "cache"
    parsed = load_signature_table([path], cache_dir=cache)
    again = load_signature_table([path], cache_dir=cache)
    assert list(again.signatures) == list(parsed.signatures)
    assert [s.id for s in again.signatures] == ["first", "second"]
    found = again.match("first crash happened")
    assert found is not None and found.signature.id == "first"


def test_pieces_follow_the_headers_as_written(tmp_path: Path) -> None:
    """Headers with comments, CRLF line ends and text before the first one: read back the same."""
    path = tmp_path / "crlf.toml"
    body = "# the table\r\n" + TRICKY.split("notes = '''")[0].replace("\n", "\r\n")
    body += '\r\n[[signature]]  # x\r\nid = "third"\r\ntitle = "T"\r\nseverity = "fatal"\r\n'
    body += 'patterns = ["third"]\r\n'
    path.write_bytes(body.encode())
    cache = tmp_path / "cache"
    parsed = load_signature_table([path], cache_dir=cache)
    again = load_signature_table([path], cache_dir=cache)
    assert again.from_cache
    assert list(again.signatures) == list(parsed.signatures)


def test_a_subset_of_a_cached_table_matches_like_the_whole(
    big_table_dir: Path, tmp_path: Path
) -> None:
    """A unit's signature sets taken from a cached table: the same matches for its domains."""
    cache = tmp_path / "cache"
    load_signature_table([big_table_dir], cache_dir=cache)
    table = load_signature_table([big_table_dir], cache_dir=cache)
    subset = table.subset(["flashinfer"])
    found, whole = subset.match(CUBIN_LINE), table.match(CUBIN_LINE)
    assert found is not None and whole is not None
    assert found.signature == whole.signature == table.get("flashinfer_cubin_mismatch")
    nccl = "torch.distributed.DistBackendError: NCCL error in: x.cpp:1, unhandled system error"
    assert subset.match(nccl) is None and table.match(nccl) is not None
