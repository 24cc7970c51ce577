"""The signature tables `bench.scale` measures on: the shipped one grown to N signatures.

`signature_table(n)` writes the shipped table as it is, then varied copies of it (ids
`<id>_copyK`, each pattern needing ` [copy K]` at the end of the line) until it holds `n`
signatures: patterns as complex as the real ones, none of the copies matching a real line, so a
real crash is classified by the same signature whatever the table's size. Cached by size.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from bench.generate import cache_root
from vllm_supervisor.classify.signatures import DEFAULT_SIGNATURE_DIR

VERSION = 1  # bump when the content changes: the cache is keyed by it


def signature_table(signatures: int, *, root: Path | None = None) -> Path:
    """The directory of a table of `signatures` signatures (at least the shipped ones)."""
    directory = (root or cache_root()) / f"scale-table-{signatures}-v{VERSION}"
    done = directory / ".complete"
    if done.exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    sources = {
        path.name: tomllib.loads(path.read_text(encoding="utf-8")).get("signature", [])
        for path in sorted(DEFAULT_SIGNATURE_DIR.glob("*.toml"))
    }
    chunks: dict[str, list[str]] = {name: [] for name in sources}
    count, copy = 0, 0
    while count < signatures or copy == 0:
        for name, entries in sources.items():
            for entry in entries:
                if count >= signatures and copy > 0:
                    break
                chunks[name] += signature_toml(
                    entry if copy == 0 else varied_signature(entry, copy)
                )
                count += 1
        copy += 1
    for name, lines in chunks.items():
        (directory / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    done.write_text(str(count))
    return directory


def varied_signature(entry: dict[str, object], copy: int) -> dict[str, object]:
    """`entry` as copy `copy`: its id suffixed, each pattern (and example) needing ` [copy K]` at
    the end."""
    patterns = entry["patterns"]
    assert isinstance(patterns, list)
    varied = {
        **entry,
        "id": f"{entry['id']}_copy{copy}",
        "patterns": [f"{p}.* \\[copy {copy}\\]$" for p in patterns],
    }
    varied.pop("vectors", None)
    if isinstance(examples := entry.get("examples"), list):  # checked against the patterns
        varied["examples"] = [f"{example} [copy {copy}]" for example in examples]
    return varied


def signature_toml(entry: dict[str, object]) -> list[str]:
    """The TOML lines of one `[[signature]]` table."""
    return ["[[signature]]", *(f"{key} = {toml_value(value)}" for key, value in entry.items())]


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)
