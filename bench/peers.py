"""The peers a live follower is measured against, each as `follow(directory, unit, tally)`.

Each follows `directory` from its head, keeps the last MESSAGE of every entry of `unit` in a
bounded deque (what any follower that remembers recent lines does) and counts what it handled in
`tally`, forever: it runs in a thread of `bench.live`'s follower process, which measures its CPU
the same way as the supervisor's and exits at SIGTERM. The peers:
- `python_systemd`: systemd's own binding (`pip install systemd-python`), `Reader` with a
  `_SYSTEMD_UNIT` match, every field decoded by its default converters, `wait()` between reads;
- `cysystemd`: the Cython binding (`pip install cysystemd`), the same shape;
- `journalctl_json`: `journalctl -f -o json -u UNIT` read line by line with `json.loads`, how log
  shippers that run journalctl consume the journal.
The two bindings are optional (`pip install -e '.[bench]'`); without one its rows say so.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

KEEP = 400  # messages each follower remembers


@dataclass
class Tally:
    handled: int = 0
    child: subprocess.Popen[bytes] | None = None  # journalctl, to kill at the end
    # Set once the journal is open and read up to now: where the CPU window starts.
    ready: threading.Event = field(default_factory=threading.Event)


Follow = Callable[[Path, str, Tally], None]


def python_systemd(directory: Path, unit: str, tally: Tally) -> None:
    from systemd import journal

    reader = journal.Reader(path=str(directory))
    reader.add_match(_SYSTEMD_UNIT=unit)
    reader.seek_head()
    kept: deque[object] = deque(maxlen=KEEP)
    while True:
        for entry in reader:
            kept.append(entry.get("MESSAGE"))
            tally.handled += 1
        tally.ready.set()
        reader.wait()  # no timeout: idle is 0 wake-ups


def cysystemd(directory: Path, unit: str, tally: Tally) -> None:
    from cysystemd.reader import JournalReader, Rule

    reader = JournalReader()
    reader.open_directory(str(directory))
    reader.add_filter(Rule("_SYSTEMD_UNIT", unit))
    reader.seek_head()
    kept: deque[object] = deque(maxlen=KEEP)
    while True:
        for record in reader:
            kept.append(record.data.get("MESSAGE"))
            tally.handled += 1
        tally.ready.set()
        reader.wait()  # no timeout: idle is 0 wake-ups


def journalctl_json(directory: Path, unit: str, tally: Tally) -> None:
    argv = ["journalctl", "-D", str(directory), "-u", unit, "-f", "-o", "json", "--no-tail"]
    process = tally.child = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert process.stdout is not None
    kept: deque[object] = deque(maxlen=KEEP)
    tally.ready.set()  # journalctl's own start is its cost, as the supervisor's child's is not
    for line in process.stdout:
        kept.append(json.loads(line).get("MESSAGE"))
        tally.handled += 1


PEERS: dict[str, tuple[Follow, str | None]] = {
    # name: (follow, the module it needs, None for none)
    "python_systemd": (python_systemd, "systemd.journal"),
    "cysystemd": (cysystemd, "cysystemd.reader"),
    "journalctl_json": (journalctl_json, None),
}


def available(name: str) -> bool:
    """Is the peer's binding installed?"""
    module = PEERS[name][1]
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False
