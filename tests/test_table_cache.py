"""The validated signature table kept between loads (`classify/table_cache.py`).

A load of unchanged files reads the table back instead of parsing TOML; anything wrong with the
cache (damaged, truncated, another table's, unwritable) is ignored and the table is exactly
what parsing the files gives; a table that does not validate is refused whatever is cached.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_supervisor.classify import table_cache
from vllm_supervisor.classify.schema import parse_table_file
from vllm_supervisor.classify.signatures import (
    DEFAULT_SIGNATURE_DIR,
    SignatureTable,
    check_pattern,
    load_signature_table,
)
from vllm_supervisor.errors import SignatureTableError


@pytest.fixture(name="table_dir")
def _table_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "signatures"
    shutil.copytree(DEFAULT_SIGNATURE_DIR, directory)
    return directory


def _same(a: SignatureTable, b: SignatureTable) -> None:
    assert a.signatures == b.signatures
    line = (
        "RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version"
        " (0.6.4). Please install the same version of both packages."
    )
    first, second = a.match(line), b.match(line)
    assert first is not None and second is not None
    assert (first.signature.id, dict(first.captures)) == (
        second.signature.id,
        dict(second.captures),
    )


def _cache_file(cache: Path) -> Path:
    [path] = list(cache.glob("*.marshal"))
    return path


def test_a_second_load_of_unchanged_files_reads_the_cache(table_dir: Path, tmp_path: Path) -> None:
    """The first load parses and saves; the second is read back, the same table."""
    cache = tmp_path / "run" / "signature-cache"
    first = load_signature_table([table_dir], cache_dir=cache)
    second = load_signature_table([table_dir], cache_dir=cache)
    assert (first.from_cache, second.from_cache) == (False, True)
    _same(first, load_signature_table([table_dir]))
    _same(second, first)
    files = sorted(table_dir.glob("*.toml"))
    parsed = [spec for path in files for spec in parse_table_file(path, check_pattern)]
    key = table_cache.cache_key([(path, path.read_bytes()) for path in files])
    assert parsed == table_cache.load(cache, key)  # every field, written_from included


def test_an_edited_file_is_parsed_again(table_dir: Path, tmp_path: Path) -> None:
    """A changed byte in any file is another key: the edit is seen, not the cached table."""
    cache = tmp_path / "cache"
    load_signature_table([table_dir], cache_dir=cache)
    path = table_dir / "vllm.toml"
    path.write_text(path.read_text().replace('id = "', 'id = "edited_', 1))
    table = load_signature_table([table_dir], cache_dir=cache)
    assert not table.from_cache
    assert any(s.id.startswith("edited_") for s in table.signatures)
    assert load_signature_table([table_dir], cache_dir=cache).from_cache


def test_an_invalid_table_is_refused_whatever_is_cached(table_dir: Path, tmp_path: Path) -> None:
    """A cache never hides an error: a broken regex is a one-line error naming its file."""
    cache = tmp_path / "cache"
    load_signature_table([table_dir], cache_dir=cache)
    path = table_dir / "nccl.toml"
    path.write_text(path.read_text() + '\n[[signature]]\nid = "bad"\ntitle = "t"\n'
                    'severity = "fatal"\npatterns = ["(unclosed"]\n')  # fmt: skip
    with pytest.raises(SignatureTableError) as error:
        load_signature_table([table_dir], cache_dir=cache)
    assert str(error.value).startswith(f"{path}: signature 'bad': patterns[0]: invalid regex")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: b"",
        lambda data: data[: len(data) // 2],
        lambda data: data[:-1] + bytes([data[-1] ^ 1]),
        lambda data: b"garbage" * 100,
        lambda data: table_cache.MAGIC + data[len(table_cache.MAGIC) + 1 :],
    ],
    ids=["empty", "truncated", "flipped-bit", "garbage", "short-checksum"],
)
def test_a_damaged_cache_is_ignored_and_rewritten(
    table_dir: Path, tmp_path: Path, damage: object
) -> None:
    """Damage of any kind: parsed from the files, the same table, and the cache mended."""
    cache = tmp_path / "cache"
    reference = load_signature_table([table_dir], cache_dir=cache)
    path = _cache_file(cache)
    assert callable(damage)
    path.write_bytes(damage(path.read_bytes()))
    table = load_signature_table([table_dir], cache_dir=cache)
    assert not table.from_cache
    _same(table, reference)
    assert load_signature_table([table_dir], cache_dir=cache).from_cache


def test_an_unwritable_cache_directory_does_not_stop_a_load(
    table_dir: Path, tmp_path: Path
) -> None:
    """A file where the cache directory should be: the table loads, uncached."""
    blocker = tmp_path / "cache"
    blocker.write_text("not a directory")
    table = load_signature_table([table_dir], cache_dir=blocker / "signature-cache")
    assert not table.from_cache and len(table) > 100


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(max_size=300), st.integers(min_value=0, max_value=1 << 20))
def test_any_bytes_in_the_cache_never_change_the_table(
    table_dir: Path, tmp_path: Path, junk: bytes, at: int
) -> None:
    """Whatever the cache file holds (junk, or the real one with junk spliced in), the load
    succeeds with the table the files give."""
    cache = tmp_path / "any"
    reference = load_signature_table([table_dir], cache_dir=cache)
    path = _cache_file(cache)
    data = path.read_bytes()
    at %= len(data) + 1
    damaged = data[:at] + junk + data[at + len(junk) :] if at % 2 else junk
    path.write_bytes(damaged)
    table = load_signature_table([table_dir], cache_dir=cache)
    _same(table, reference)
    assert table.from_cache == (damaged == data)
