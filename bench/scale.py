"""`python -m bench.scale`: the daemon's costs against the size of each input, no cliffs.

    python -m bench.scale                                 # every section, 3 interleaved runs
    python -m bench.scale --sections backlog --runs 3     # one section
    python -m bench.scale --quick                         # small inputs, 1 run: the CI smoke
    python -m bench.scale --code /tmp/before --label before   # another checkout's daemon

Sections (journals from `bench.scale_journals`, written once through journal-remote and cached):
- `units`: 1, 64, 100 and 500 supervised units, each serving 600 lines, crashes in units 1,
  64, 65, 100 and 500: crashes decided of those written, reader restarts, the daemon's
  anonymous memory once caught up, and the cost of one more unit (the slope, MB per unit).
- `backlog`: journals of 170k, 1M and 5M entries (0.1, 0.6 and 3.0 GB; after downtime) in
  which the unit is 1 %, each read from its head:
  `journalctl -u UNIT -o export > /dev/null` (the index's speed, the baseline of each run), the
  native reader child alone until it caught up, and the daemon: its first and last decision and
  when it caught up. Ratios are against journalctl in the same run (medians of the ratios).
- `lines`: 8 units each logging 2,700 error lines of 100 B to 64 KiB, runs still open: the
  daemon's anonymous memory and peak once everything is read.
- `tracker`: the tracker alone, CPU microseconds per line fed, for the same line sizes.
- `table`: signature tables of 135 (the shipped one) to 5,000 signatures (`bench.scale_tables`):
  validation, the whole load, a load through the table cache, and the seed crash's
  classification the first time and after, each against the smallest table in the same run.
- `matches` (only when named): on the units journals of 64 units and more, `journalctl`
  reading every entry against `journalctl` with the units' matches (`reader.unit_matches`):
  whether the fallback reader's catch-up through matches would pay past 64 units.

Beside the daemon with its native reader: the daemon with the journalctl reader (the fallback;
`--no-fallback` leaves it out), python-systemd's Reader through the same matches (when
installed: the `bench` extra or Debian's python3-systemd), and `journalctl -u` with the units,
the baseline of time. The first table printed puts every input's figures side by side.

Each measurement runs in a fresh interpreter (`bench.scale_worker`), interleaved over the runs
(A B C A B C ...). `--code PATH` measures the checkout at PATH instead (its `supervisor/`
built in place): the before/after of a change come from two runs of this same script. Results go
to `bench/results/scale-LABEL.json`; the tables are printed (Markdown).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.scale_journals import (
    UNIT,
    ScaleJournal,
    backlog_journal,
    lines_journal,
    units_journal,
)
from bench.scale_tables import signature_table

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
SECTIONS = ("units", "backlog", "lines", "tracker", "table")
OPTIONAL_SECTIONS = ("matches",)  # only when named in --sections
TRACKER_LINES = 500_000
TRACKER_BYTES = 256 << 20  # lines of one tracker run: this much text, 500k to 16k lines
TRACKER_LINES_MIN = 16_000  # 2,000 a unit: well past its head and tail


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--units", default="1,64,100,500")
    parser.add_argument("--backlog-entries", default="170000,1000000,5000000")
    parser.add_argument("--backlog-share", type=float, default=0.01)
    parser.add_argument("--line-sizes", default="100,1024,16384,65536")
    parser.add_argument("--tables", default="135,1000,5000", help="signatures in each table")
    parser.add_argument(
        "--no-fallback",
        dest="with_fallback",
        action="store_false",
        help="units, backlog: not the daemon with the journalctl reader too",
    )
    parser.add_argument("--with-fallback", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--code", type=Path, default=None, help="a checkout to measure instead")
    parser.add_argument("--label", default="latest")
    parser.add_argument("--cache", type=Path, default=None, help="journal cache directory")
    parser.add_argument("--timeout", type=float, default=600.0, help="per daemon run, seconds")
    parser.add_argument("--quick", action="store_true", help="small inputs, one run")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs = 1
        args.units = "1,100"
        args.backlog_entries = "50000"
        args.line_sizes = "1024"
        args.tables = "135,1000"
        args.timeout = min(args.timeout, 60.0)
    return args


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


class Worker:
    """Runs `bench.scale_worker` in a fresh interpreter, on this checkout or on `code`'s."""

    def __init__(self, code: Path | None, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.env = {**os.environ, "PYTHONHASHSEED": "0"}
        self._shim: tempfile.TemporaryDirectory[str] | None = None
        if code is not None:
            # The package is `vllm_supervisor`, its directory `supervisor/`: a link names it.
            self._shim = tempfile.TemporaryDirectory(prefix="vllm-supervisor-code-")
            (Path(self._shim.name) / "vllm_supervisor").symlink_to(code.resolve() / "supervisor")
            self.env["PYTHONPATH"] = self._shim.name

    def run(self, mode: str, journal: ScaleJournal, **spec: Any) -> dict[str, Any]:
        """One measurement; its JSON."""
        full = {
            "journal": str(journal.directory),
            "units": list(journal.units),
            "expect": journal.crashes,
            "reader": "auto",
            "timeout_s": self.timeout_s,
            **spec,
        }
        with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
            json.dump(full, file)
            file.flush()
            result = subprocess.run(
                [sys.executable, "-m", "bench.scale_worker", mode, file.name],
                capture_output=True,
                check=False,
                cwd=REPO,
                env=self.env,
                timeout=self.timeout_s + 120,
            )
        if result.returncode != 0:
            raise SystemExit(f"bench.scale_worker {mode} failed: {result.stderr.decode()[-800:]}")
        data: dict[str, Any] = json.loads(result.stdout.decode().strip().splitlines()[-1])
        return data


JOURNALCTL_UNITS_TIMEOUT_S = 60.0  # journalctl 252 with 500 --unit took over 300 s


def journalctl_unit(journal: ScaleJournal, timeout_s: float | None = None) -> dict[str, Any]:
    """`journalctl -D DIR -u UNIT... -o export > /dev/null` (the journal's units): wall and CPU
    seconds; both None when it had not finished after `timeout_s` (then it is killed)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    units = [f"--unit={unit}" for unit in journal.units or (UNIT,)]
    try:
        subprocess.run(
            ["journalctl", f"--directory={journal.directory}", *units, "--output=export",
             "--no-pager", "--quiet"],
            stdout=subprocess.DEVNULL,
            check=True,
            timeout=timeout_s,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"wall_s": None, "cpu_s": None, "timed_out_s": timeout_s}
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall_s": wall, "cpu_s": cpu}


def median(values: list[float | None]) -> float | None:
    """The median of the values present (None when there are none)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def section_units(args: argparse.Namespace, worker: Worker) -> dict[str, Any]:
    """Decisions, restarts and memory against the number of units."""
    counts = _ints(args.units)
    journals = {n: units_journal(n, root=args.cache) for n in counts}
    raw: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    others = _others(args)
    peers: dict[int, dict[str, list[dict[str, Any]]]] = {n: {m: [] for m in others} for n in counts}
    for run in range(args.runs):
        for n in counts:
            result = worker.run("daemon", journals[n])
            raw[n].append(result)
            print(
                f"  units run {run + 1}/{args.runs} {n:>4} units: {result['decided']}"
                f"/{journals[n].crashes} decided, {result['reader_restarts']} restarts, "
                f"{result['rss_anon_mb']:.1f} MB anon",
                flush=True,
            )
            for mode in others:
                peers[n][mode].append(_other(mode, worker, journals[n]))
    rows = {
        str(n): {
            "units": n,
            "crashes": journals[n].crashes,
            "decided": min(r["decided"] for r in raw[n]),
            "reader_restarts": max(r["reader_restarts"] for r in raw[n]),
            "caught_up_s": median([r["caught_up_s"] for r in raw[n]]),
            "last_s": median([r["last_s"] for r in raw[n]]),
            "rss_anon_mb": median([r["rss_anon_mb"] for r in raw[n]]),
            "child_anon_mb": median([r.get("child_anon_mb") for r in raw[n]]),
            "runs": raw[n],
            "others": _summaries(peers[n], raw[n]),
        }
        for n in counts
    }
    low, high = rows[str(min(counts))], rows[str(max(counts))]
    slope = None
    if len(counts) > 1 and low["rss_anon_mb"] is not None and high["rss_anon_mb"] is not None:
        slope = (high["rss_anon_mb"] - low["rss_anon_mb"]) / (max(counts) - min(counts))
    return {"rows": rows, "mb_per_unit": slope}


def section_backlog(args: argparse.Namespace, worker: Worker) -> dict[str, Any]:
    """Catch-up on backlogs of each size against `journalctl -u` on the same files."""
    return {
        str(entries): backlog_size(args, worker, entries) for entries in _ints(args.backlog_entries)
    }


def backlog_size(args: argparse.Namespace, worker: Worker, entries: int) -> dict[str, Any]:
    """Catch-up on one backlog against `journalctl -u` on the same files, in the same run."""
    journal = backlog_journal(entries, args.backlog_share, root=args.cache)
    modes: dict[str, Callable[[], dict[str, Any]]] = {
        "journalctl_u": lambda: journalctl_unit(journal),
        "child": lambda: worker.run("child", journal),
        "daemon": lambda: worker.run("daemon", journal),
    }
    if args.with_fallback:
        modes["daemon_journalctl"] = lambda: worker.run("daemon", journal, reader="journalctl")
    if peer_available():
        modes["python_systemd"] = lambda: worker.run("python_systemd", journal)
    raw: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for run in range(args.runs):
        for mode, measure in modes.items():
            result = measure()
            raw[mode].append(result)
            wall = result.get("wall_s", result.get("caught_up_s"))
            print(
                f"  backlog {entries:,} run {run + 1}/{args.runs} {mode:<18} {wall or 0:.2f} s",
                flush=True,
            )
    base = raw["journalctl_u"]
    rows: dict[str, Any] = {}
    for mode, runs in raw.items():
        walls = [r.get("wall_s", r.get("caught_up_s")) for r in runs]
        ratios = [
            w / b["wall_s"] if w is not None and b["wall_s"] else None
            for w, b in zip(walls, base, strict=True)
        ]
        rows[mode] = {
            "wall_s": median(walls),
            "cpu_s": median([r["cpu_s"] for r in runs]),
            "vs_journalctl_u": median(ratios),
            "first_decision_s": median([r.get("first_s") for r in runs]),
            "last_decision_s": median([r.get("last_s") for r in runs]),
            "decided": min((r.get("decided", 0) for r in runs), default=0),
            "runs": runs,
        }
    return {
        "entries": journal.entries,
        "bytes_on_disk": journal.bytes_on_disk,
        "share": args.backlog_share,
        "crashes": journal.crashes,
        "rows": rows,
    }


def section_lines(args: argparse.Namespace, worker: Worker) -> dict[str, Any]:
    """The daemon's memory with 8 units of long error lines, their runs open."""
    sizes = _ints(args.line_sizes)
    journals = {size: lines_journal(size, root=args.cache) for size in sizes}
    raw: dict[int, list[dict[str, Any]]] = {size: [] for size in sizes}
    peer: dict[int, list[dict[str, Any]]] = {size: [] for size in sizes}
    for run in range(args.runs):
        for size in sizes:
            result = worker.run("daemon", journals[size])
            raw[size].append(result)
            print(
                f"  lines run {run + 1}/{args.runs} {size:>6} B: {result['rss_anon_mb']:.1f} MB"
                f" anon, peak {result['hwm_mb']:.1f} MB",
                flush=True,
            )
            if peer_available():
                peer[size].append(worker.run("python_systemd", journals[size]))
    return {
        "rows": {
            str(size): {
                "line_bytes": size,
                "entries": journals[size].entries,
                "rss_anon_mb": median([r["rss_anon_mb"] for r in raw[size]]),
                "hwm_mb": median([r["hwm_mb"] for r in raw[size]]),
                "caught_up_s": median([r["caught_up_s"] for r in raw[size]]),
                "runs": raw[size],
                "python_systemd_anon_mb": median([r["rss_anon_mb"] for r in peer[size]]),
            }
            for size in sizes
        }
    }


def section_tracker(args: argparse.Namespace, worker: Worker) -> dict[str, Any]:
    """CPU per line of the tracker alone, for each line size (what keeping lines costs)."""
    sizes = _ints(args.line_sizes)
    most = 50_000 if args.quick else TRACKER_LINES
    none = ScaleJournal(directory=Path("/nonexistent"), entries=0, units=(), crashes=0,
                        bytes_on_disk=0)  # fmt: skip
    raw: dict[int, list[dict[str, Any]]] = {size: [] for size in sizes}
    for run in range(args.runs):
        for size in sizes:
            count = _tracker_lines(most, size)
            result = worker.run("tracker", none, lines=count, size=size)
            raw[size].append(result)
            print(
                f"  tracker run {run + 1}/{args.runs} {size:>6} B: "
                f"{result['us_per_line']:.2f} us/line",
                flush=True,
            )
    return {
        "rows": {
            str(size): {
                "line_bytes": size,
                "lines": _tracker_lines(most, size),
                "us_per_line": median([r["us_per_line"] for r in raw[size]]),
                "runs": raw[size],
            }
            for size in sizes
        },
    }


def section_table(args: argparse.Namespace, worker: Worker) -> dict[str, Any]:
    """A signature table's load, validation and one crash's classification, for each size;
    ratios against the smallest table in the same run."""
    sizes = _ints(args.tables)
    directories = {n: signature_table(n, root=args.cache) for n in sizes}
    none = ScaleJournal(directory=Path("/nonexistent"), entries=0, units=(), crashes=0,
                        bytes_on_disk=0)  # fmt: skip
    raw: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
    for run in range(args.runs):
        for n in sizes:
            result = worker.run("table", none, table=str(directories[n]))
            raw[n].append(result)
            print(
                f"  table run {run + 1}/{args.runs} {n:>5} signatures: load "
                f"{result['load_s']:.3f} s, classify {result['classify_first_ms']:.1f} ms",
                flush=True,
            )
    base = raw[min(sizes)]
    keys = (
        "validate_s",
        "toml_s",
        "re2_sets_s",
        "load_s",
        "cached_load_s",
        "classify_first_ms",
        "classify_ms",
    )
    rows = {}
    for n in sizes:
        row: dict[str, Any] = {"signatures": raw[n][0]["signatures"], "runs": raw[n]}
        for key in keys:
            row[key] = median([r.get(key) for r in raw[n]])
            row[f"{key}_ratio"] = median(
                [
                    r[key] / b[key] if r.get(key) is not None and b.get(key) else None
                    for r, b in zip(raw[n], base, strict=True)
                ]
            )
        for load in ("load_s", "cached_load_s"):
            row[f"{load}_and_first_ratio"] = median(
                [
                    (r[load] + r["classify_first_ms"] / 1e3)
                    / (b[load] + b["classify_first_ms"] / 1e3)
                    if r.get(load) is not None and b.get(load) is not None
                    else None
                    for r, b in zip(raw[n], base, strict=True)
                ]
            )
        row["load_and_first_ratio"] = row["load_s_and_first_ratio"]
        # The least a load that parses and checks every pattern can take, against the smallest
        # table's whole load: tomllib's parse and RE2's compile of the patterns, nothing else.
        row["floor_vs_smallest_load"] = median(
            [
                (r["toml_s"] + r["re2_sets_s"]) / b["load_s"]
                if r.get("toml_s") is not None and b.get("load_s")
                else None
                for r, b in zip(raw[n], base, strict=True)
            ]
        )
        rows[str(n)] = row
    return {"rows": rows}


def section_matches(args: argparse.Namespace, worker: Worker) -> dict[str, Any]:
    """journalctl with the units' matches against journalctl reading every entry, on the units
    journals of 64 units and more (every entry is a supervised unit's there)."""
    from vllm_supervisor.journal.reader import unit_matches

    counts = [n for n in _ints(args.units) if n >= 64]
    journals = {n: units_journal(n, root=args.cache) for n in counts}
    raw: dict[int, dict[str, list[dict[str, Any]]]] = {
        n: {"all": [], "matched": []} for n in counts
    }
    for run in range(args.runs):
        for n in counts:
            journal = journals[n]
            for mode, extra in (("all", []), ("matched", unit_matches(journal.units))):
                result = _journalctl(journal, extra, JOURNALCTL_UNITS_TIMEOUT_S)
                raw[n][mode].append(result)
                print(f"  matches run {run + 1}/{args.runs} {n:>4} units {mode:<8} {result}")
    return {
        "rows": {
            str(n): {
                "units": n,
                **{
                    f"{mode}_{key}": median([r[key] for r in raw[n][mode]])
                    for mode in ("all", "matched")
                    for key in ("wall_s", "cpu_s")
                },
                "runs": raw[n],
            }
            for n in counts
        }
    }


def _journalctl(journal: ScaleJournal, extra: list[str], timeout_s: float) -> dict[str, Any]:
    """`journalctl -D DIR -o export EXTRA... > /dev/null`: wall and CPU seconds (None when it
    had not finished after `timeout_s`)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    try:
        subprocess.run(
            ["journalctl", f"--directory={journal.directory}", "--output=export", "--no-pager",
             "--quiet", *extra],
            stdout=subprocess.DEVNULL,
            check=True,
            timeout=timeout_s,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"wall_s": None, "cpu_s": None}
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall_s": time.monotonic() - started, "cpu_s": cpu}


def peer_available() -> bool:
    """Is python-systemd installed (the `bench` extra, or Debian's python3-systemd)?"""
    return importlib.util.find_spec("systemd") is not None


def _others(args: argparse.Namespace) -> list[str]:
    """What runs beside the daemon in the units section: its fallback reader, python-systemd
    and `journalctl -u` with every unit."""
    modes = ["daemon_journalctl"] if args.with_fallback else []
    if peer_available():
        modes.append("python_systemd")
    return [*modes, "journalctl_u"]


def _other(mode: str, worker: Worker, journal: ScaleJournal) -> dict[str, Any]:
    if mode == "daemon_journalctl":
        return worker.run("daemon", journal, reader="journalctl")
    if mode == "python_systemd":
        return worker.run("python_systemd", journal)
    return journalctl_unit(journal, JOURNALCTL_UNITS_TIMEOUT_S)


def _summaries(
    runs: dict[str, list[dict[str, Any]]], daemon: list[dict[str, Any]]
) -> dict[str, Any]:
    """Each mode's medians: caught up (s), memory, crashes decided; and the daemon's caught-up
    time against `journalctl -u` in the same run."""
    out: dict[str, Any] = {}
    for mode, results in runs.items():
        out[mode] = {
            "caught_up_s": median([r.get("caught_up_s", r.get("wall_s")) for r in results]),
            "rss_anon_mb": median([r.get("rss_anon_mb") for r in results]),
            "decided": min((r.get("decided", 0) for r in results), default=0),
        }
    base = runs.get("journalctl_u")
    if base:
        out["daemon_vs_journalctl_u"] = median(
            [
                d["caught_up_s"] / b["wall_s"] if d["caught_up_s"] and b["wall_s"] else None
                for d, b in zip(daemon, base, strict=True)
            ]
        )
    return out


def _tracker_lines(most: int, size: int) -> int:
    return min(most, max(TRACKER_LINES_MIN, TRACKER_BYTES // size))


def _sum(*values: float | None) -> float | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


BACKLOG_LABELS = {
    "journalctl_u": f"journalctl -u {UNIT} -o export > /dev/null",
    "child": "native reader child alone",
    "daemon": "daemon (native reader)",
    "daemon_journalctl": "daemon (journalctl reader)",
    "python_systemd": "python-systemd Reader, the unit's matches",
}


def summary(result: dict[str, Any]) -> str:
    """Every input's figures side by side: the daemon with each reader, python-systemd, and
    `journalctl -u` (the baseline of time, in the same run)."""
    out = [
        "| input | daemon: caught up | daemon (journalctl reader) | python-systemd"
        " | journalctl -u | daemon memory (MB anon) | python-systemd memory | decided |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in (result.get("units") or {}).get("rows", {}).values():
        others = row.get("others", {})
        base = (others.get("journalctl_u") or {}).get("caught_up_s")

        def vs(seconds: float | None, base: float | None = base) -> str:
            if seconds is None:
                return "-"
            return f"{seconds:.2f} s ({_x(seconds / base) if base else '-'})"

        fallback = others.get("daemon_journalctl", {})
        peer = others.get("python_systemd", {})
        baseline = vs(base) if base else f"not in {JOURNALCTL_UNITS_TIMEOUT_S:.0f} s"
        decided = f"{row['decided']} of {row['crashes']}"
        if fallback:
            decided += f" / {fallback.get('decided', 0)} of {row['crashes']}"
        out.append(
            f"| {row['units']} units | {vs(row['caught_up_s'])} | {vs(fallback.get('caught_up_s'))}"
            f" | {vs(peer.get('caught_up_s'))} | {baseline} | {_fmt(row['rss_anon_mb'], '.1f')}"
            f" | {_fmt(peer.get('rss_anon_mb'), '.1f')} | {decided} |"
        )
    for size in (result.get("backlog") or {}).values():
        rows = size["rows"]

        def at(mode: str, rows: dict[str, Any] = rows) -> str:
            row = rows.get(mode)
            if row is None or row["wall_s"] is None:
                return "-"
            return f"{row['wall_s']:.2f} s ({_x(row['vs_journalctl_u'])})"

        decided = f"{rows['daemon']['decided']} of {size['crashes']}"
        if "daemon_journalctl" in rows:
            decided += f" / {rows['daemon_journalctl']['decided']} of {size['crashes']}"
        memory = (rows["daemon"]["runs"][0] or {}).get("rss_anon_mb")
        peer_memory = (rows.get("python_systemd") or {}).get("runs", [{}])[0].get("rss_anon_mb")
        out.append(
            f"| backlog {size['bytes_on_disk'] / 1e9:.1f} GB ({size['entries']:,} entries)"
            f" | {at('daemon')} | {at('daemon_journalctl')} | {at('python_systemd')}"
            f" | {at('journalctl_u')} | {_fmt(memory, '.1f')} | {_fmt(peer_memory, '.1f')}"
            f" | {decided} |"
        )
    for row in (result.get("lines") or {}).get("rows", {}).values():
        out.append(
            f"| 8 units, lines of {row['line_bytes']:,} B | {_fmt(row['caught_up_s'])} s | - | -"
            f" | - | {_fmt(row['rss_anon_mb'], '.1f')}"
            f" | {_fmt(row.get('python_systemd_anon_mb'), '.1f')} | - |"
        )
    for row in (result.get("table") or {}).get("rows", {}).values():
        cached = row.get("cached_load_s")
        again = f", cached {cached:.3f} s ({_x(row['cached_load_s_ratio'])})" if cached else ""
        out.append(
            f"| table of {row['signatures']:,} signatures | load {row['load_s']:.3f} s"
            f" ({_x(row['load_s_ratio'])}){again}, first crash {row['classify_first_ms']:.1f} ms"
            f" ({_x(row['classify_first_ms_ratio'])}), next {row['classify_ms']:.1f} ms"
            f" ({_x(row['classify_ms_ratio'])}) | - | - | - | - | - | - |"
        )
    return "\n".join(out)


def tables(result: dict[str, Any]) -> str:
    """The summary, then every measured section as a Markdown table."""
    out: list[str] = [summary(result), ""]
    units = result.get("units")
    if units:
        out += [
            "| units | crashes decided | reader restarts | caught up (s) | daemon anon (MB)"
            " | reader child anon (MB) |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for row in units["rows"].values():
            out.append(
                f"| {row['units']} | {row['decided']} of {row['crashes']} "
                f"| {row['reader_restarts']} | {_fmt(row['caught_up_s'])} "
                f"| {_fmt(row['rss_anon_mb'], '.1f')} | {_fmt(row['child_anon_mb'], '.1f')} |"
            )
        out += [f"\nOne more unit: {_fmt(units['mb_per_unit'], '.3f')} MB anonymous.\n"]
    for size in (result.get("backlog") or {}).values():
        out += [
            f"Backlog: {size['entries']:,} entries, {size['bytes_on_disk'] / 1e9:.1f} GB,"
            f" {UNIT} {size['share']:.0%} of them, {size['crashes']} crashes.\n",
            "| reader | caught up (s) | CPU (s) | vs journalctl -u | first decision (s)"
            " | last decision (s) | decided |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for mode, row in size["rows"].items():
            decided = "-" if mode in ("journalctl_u", "child", "python_systemd") else row["decided"]
            out.append(
                f"| {BACKLOG_LABELS[mode]} | {_fmt(row['wall_s'])} | {_fmt(row['cpu_s'])} "
                f"| {_x(row['vs_journalctl_u'])} | {_fmt(row['first_decision_s'])} "
                f"| {_fmt(row['last_decision_s'])} | {decided} |"
            )
        out.append("")
    lines = result.get("lines")
    if lines:
        out += [
            "| 8 units, error lines of | daemon anon (MB) | daemon peak RSS (MB)"
            " | python-systemd anon (MB) |",
            "|---:|---:|---:|---:|",
        ]
        for row in lines["rows"].values():
            out.append(
                f"| {row['line_bytes']:,} B | {_fmt(row['rss_anon_mb'], '.1f')} "
                f"| {_fmt(row['hwm_mb'], '.1f')} "
                f"| {_fmt(row.get('python_systemd_anon_mb'), '.1f')} |"
            )
    tracker = result.get("tracker")
    if tracker:
        out += [
            "",
            "| tracker alone, lines over 8 units | lines fed | CPU us / line |",
            "|---:|---:|---:|",
        ]
        for row in tracker["rows"].values():
            out.append(
                f"| {row['line_bytes']:,} B | {row['lines']:,} | {_fmt(row['us_per_line'])} |"
            )
    matches = result.get("matches")
    if matches:
        out += [
            "",
            "| units | journalctl, every entry: wall (s) | CPU (s)"
            " | journalctl, the units' matches: wall (s) | CPU (s) |",
            "|---:|---:|---:|---:|---:|",
        ]
        for row in matches["rows"].values():
            out.append(
                f"| {row['units']} | {_fmt(row['all_wall_s'])} | {_fmt(row['all_cpu_s'])}"
                f" | {_fmt(row['matched_wall_s'])} | {_fmt(row['matched_cpu_s'])} |"
            )
    table = result.get("table")
    if table:
        out += [
            "",
            "| signatures | validate (s) | load (s) | load, cached (s) | first crash (ms)"
            " | next crash (ms) | load + first crash vs smallest | cached load + first crash"
            " | floor: tomllib + RE2 sets (s), vs smallest load |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in table["rows"].values():
            out.append(
                f"| {row['signatures']:,} | {row['validate_s']:.3f} ({_x(row['validate_s_ratio'])})"
                f" | {row['load_s']:.3f} ({_x(row['load_s_ratio'])})"
                f" | {_fmt(row.get('cached_load_s'), '.3f')} ({_x(row.get('cached_load_s_ratio'))})"
                f" | {row['classify_first_ms']:.1f} ({_x(row['classify_first_ms_ratio'])})"
                f" | {row['classify_ms']:.1f} ({_x(row['classify_ms_ratio'])})"
                f" | {_x(row['load_and_first_ratio'])}"
                f" | {_x(row.get('cached_load_s_and_first_ratio'))}"
                f" | {_fmt(_sum(row.get('toml_s'), row.get('re2_sets_s')), '.3f')}"
                f" ({_x(row.get('floor_vs_smallest_load'))}) |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    worker = Worker(args.code, args.timeout)
    sections = {
        "units": section_units,
        "backlog": section_backlog,
        "lines": section_lines,
        "tracker": section_tracker,
        "table": section_table,
        "matches": section_matches,
    }
    result: dict[str, Any] = {
        "label": args.label,
        "code": str(args.code or REPO),
        "runs": args.runs,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    for name in args.sections.split(","):
        print(f"== {name}", flush=True)
        result[name] = sections[name](args, worker)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"scale-{args.label}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{tables(result)}\n\n(written to {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
