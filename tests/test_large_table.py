"""A signature table of any size loads and matches, or is refused in one line.

Before, every pattern went into one RE2 set with RE2's default 8 MiB budget: a table of ~950
signatures (the shipped ones, varied) failed with `re2.Error: failed to compile Set`, a
traceback from `check-config` and a dead daemon after `systemctl reload`.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from bench.scale_tables import signature_toml, varied_signature
from vllm_supervisor.classify import signatures
from vllm_supervisor.classify.signatures import DEFAULT_SIGNATURE_DIR, load_signature_table
from vllm_supervisor.errors import SignatureTableError

CUBIN_LINE = (
    "RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version (0.6.4)"
)


def varied_table(directory: Path, copies: int) -> int:
    """The shipped table `copies` times over, each copy's patterns needing ` [copy K]` at the
    end of the line, so a line names the one copy that must match. Returns the count."""
    directory.mkdir()
    count = 0
    for source in sorted(DEFAULT_SIGNATURE_DIR.glob("*.toml")):
        entries = tomllib.loads(source.read_text(encoding="utf-8")).get("signature", [])
        lines = []
        for copy in range(copies):
            for entry in entries:
                lines += signature_toml(varied_signature(entry, copy))
                count += 1
        (directory / source.name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return count


@pytest.fixture(scope="module")
def big_table_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("big") / "signatures"
    assert varied_table(directory, copies=7) >= 900
    return directory


def test_a_table_of_900_signatures_loads_and_every_copy_matches(big_table_dir: Path) -> None:
    table = load_signature_table([big_table_dir])
    assert len(table) >= 900
    for copy in (0, 3, 6):  # the first, a middle and the last sets
        found = table.match(f"{CUBIN_LINE} [copy {copy}]")
        assert found is not None
        assert found.signature.id == f"flashinfer_cubin_mismatch_copy{copy}"
        assert found.captures == {"cubin": "0.6.3", "flashinfer": "0.6.4"}
    assert table.match(f"{CUBIN_LINE} [copy 9]") is None


def test_check_config_accepts_it_in_one_line(big_table_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "supervisor.toml"
    config.write_text(
        f'[signatures]\npaths = ["{big_table_dir}"]\n\n[[unit]]\nname = "vllm.service"\n'
    )
    result = subprocess.run(
        [sys.executable, "-m", "vllm_supervisor", "check-config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "config ok" in result.stdout and "Traceback" not in result.stderr


def test_patterns_that_cannot_share_a_set_are_one_error_naming_their_file(
    tmp_path: Path,
) -> None:
    """Each of these patterns compiles alone; sixteen of them exceed what one set may hold."""
    directory = tmp_path / "signatures"
    directory.mkdir()
    entries = [
        f'[[signature]]\nid = "huge_{k}"\ntitle = "t"\nseverity = "fatal"\n'
        f"patterns = ['k{k}.{{1000}}.{{1000}}']\n"
        'remediation = "r"\nsource = "https://example.invalid/x"\n'
        for k in range(64)
    ]
    (directory / "huge.toml").write_text("\n".join(entries))
    with pytest.raises(SignatureTableError) as caught:
        load_signature_table([directory])
    message = str(caught.value)
    assert "huge" in message and "RE2 cannot compile" in message and "\n" not in message


def test_loading_validates_patterns_without_compiling_each(
    big_table_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validation parses each pattern (as the sets take it) instead of compiling it alone: a
    table of 5,000 signatures spent 0.6 s of its 1.6 s load compiling regexes it then threw
    away. A regex is compiled only when a line needs its captures."""
    compiled: list[str] = []
    real = signatures.compile_pattern

    def counting(pattern: str) -> object:
        compiled.append(pattern)
        return real(pattern)

    monkeypatch.setattr(signatures, "compile_pattern", counting)
    table = load_signature_table([big_table_dir])
    assert compiled == []
    assert table.match(f"{CUBIN_LINE} [copy 3]") is not None
    assert len(compiled) >= 1


def test_an_invalid_pattern_still_names_re2s_reason(tmp_path: Path) -> None:
    """The parse-only check reports what RE2 says of the pattern, as compiling it did."""
    path = tmp_path / "mine.toml"
    path.write_text(
        '[[signature]]\nid = "bad"\ntitle = "t"\nseverity = "fatal"\npatterns = ["ok", "a(b"]\n'
    )
    with pytest.raises(SignatureTableError) as raised:
        load_signature_table([path])
    assert str(raised.value) == (
        f"{path}: signature 'bad': patterns[1]: invalid regex: missing ): a(b"
    )
