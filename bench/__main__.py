"""`python -m bench`: the supervisor's journal ingest against the usual JSON pipeline, same run.

Options: `--entries N` (default 500k), `--runs K` (default 5), `--quick` (a small journal, 2 runs,
a short live phase: the CI smoke), `--no-live`, `--out PATH` (default bench/results/latest.json),
`--rss-entries N` (also stream the journal through one Pipeline until N entries, e.g. 10M, and
report the RSS then).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.generate import UNIT, journal_for
from bench.ingest import MODES, PEER_MODES
from bench.peers import PEERS, available

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest.json"
LABELS = {
    "supervisor": "supervisor ingest (native reader + Pipeline)",
    "supervisor_journalctl": "supervisor ingest, fallback (journalctl -o export + Pipeline)",
    "json": "baseline: journalctl -o json \\| json.loads",
    "export": "ceiling: journalctl -o export > /dev/null",
    "export_fields": "ceiling: same, with our --output-fields",
    "native": "ceiling: native reader child > /dev/null",
    "python_systemd": "peer: python-systemd Reader (every field decoded)",
    "cysystemd": "peer: cysystemd JournalReader (every field decoded)",
}
LIVE_LABELS = {
    "supervisor": "supervisor (the daemon as run_daemon builds it)",
    "python_systemd": "python-systemd follower, last 400 messages",
    "cysystemd": "cysystemd follower, last 400 messages",
    "journalctl_json": "journalctl -f -o json \\| json.loads",
}
CHILD_ONLY = ("export", "export_fields", "native")  # no Python consumer: no Python CPU or RSS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--entries", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small and fast: the CI smoke")
    parser.add_argument("--no-live", action="store_true", help="skip the follow-mode figures")
    parser.add_argument("--live-seconds", type=float, default=10.0)
    parser.add_argument("--live-rates", default="200,2000,10000")
    parser.add_argument("--live-runs", type=int, default=1, help="interleaved runs per rate")
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument(
        "--exit-crashes",
        type=int,
        default=20,
        help="crashes for exit -> quarantine under systemd 252 in nspawn (0: skip; needs root)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--cache", type=Path, default=None, help="journal cache directory")
    parser.add_argument(
        "--rss-entries", type=int, default=0, help="also feed this many entries to one Pipeline"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.entries = min(args.entries, 20_000)
        args.runs = min(args.runs, 2)
        args.live_seconds = min(args.live_seconds, 2.0)
        args.live_rates = "2000"
        args.idle_seconds = min(args.idle_seconds, 1.0)
        args.exit_crashes = 0
    return args


def run_once(mode: str, directory: Path) -> dict[str, Any]:
    """One measured read in a fresh interpreter (its own rusage, its own journalctl child)."""
    for _ in range(2):  # asyncio's child watcher has lost journalctl's exit status under load
        result = _run_worker(mode, directory)
        if result is not None:
            return result
    raise SystemExit(f"bench.ingest {mode} failed twice")


def _run_worker(mode: str, directory: Path) -> dict[str, Any] | None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.ingest", mode, str(directory), UNIT],
        capture_output=True,
        check=False,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    if result.returncode != 0:
        print(f"  bench.ingest {mode} failed: {result.stderr.decode()[-300:]}", flush=True)
        return None
    return json.loads(result.stdout.decode().strip().splitlines()[-1])


def measure_rss(directory: Path, total: int) -> dict[str, Any]:
    """`bench.ingest rss` in a fresh interpreter: RSS after `total` entries through one Pipeline."""
    result = subprocess.run(
        [sys.executable, "-m", "bench.ingest", "rss", str(directory), UNIT, str(total)],
        capture_output=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    data: dict[str, Any] = json.loads(result.stdout.decode().strip().splitlines()[-1])
    return data


def summarise(mode: str, runs: list[dict[str, Any]], entries: int) -> dict[str, Any]:
    """Medians over runs; peak RSS is the maximum over runs."""
    rates = [entries / r["wall_s"] for r in runs]
    cpu = [(r["cpu_self_s"] + r["cpu_journalctl_s"]) / entries * 1e6 for r in runs]
    return {
        "label": LABELS[mode],
        "runs": len(runs),
        "entries": entries,
        "entries_per_s": statistics.median(rates),
        "entries_per_s_min": min(rates),
        "entries_per_s_max": max(rates),
        "cpu_s_per_million": statistics.median(cpu),
        "cpu_python_s_per_million": statistics.median(
            r["cpu_self_s"] / entries * 1e6 for r in runs
        ),
        "cpu_journalctl_s_per_million": statistics.median(
            r["cpu_journalctl_s"] / entries * 1e6 for r in runs
        ),
        "rss_python_mb": max(r["rss_self_kb"] for r in runs) / 1024,
        "rss_journalctl_mb": max(r["rss_journalctl_kb"] for r in runs) / 1024,
        "wall_s": [round(r["wall_s"], 3) for r in runs],
    }


def ingest_modes() -> tuple[str, ...]:
    """The batch modes of this run: ours, the baseline, the ceilings, the installed peers."""
    return (*MODES, *(m for m in PEER_MODES if available(m)))


def live_followers() -> tuple[str, ...]:
    """The live followers of this run: the daemon and the installed peers."""
    return ("supervisor", *(name for name in PEERS if available(name)))


def measure_ingest(directory: Path, entries: int, runs: int) -> dict[str, Any]:
    """Every mode `runs` times, interleaved (A B C D A B C D ...), summarised."""
    modes = ingest_modes()
    raw: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for index in range(runs):
        for mode in modes:
            result = run_once(mode, directory)
            if mode not in CHILD_ONLY and result["entries"] != entries:
                raise SystemExit(f"{mode} read {result['entries']} entries, expected {entries}")
            raw[mode].append(result)
            rate = entries / result["wall_s"]
            print(f"  run {index + 1}/{runs} {mode:<14} {rate:>10,.0f} entries/s", flush=True)
    summary = {mode: summarise(mode, raw[mode], entries) for mode in modes}
    base = summary["json"]
    for item in summary.values():
        item["speed_vs_baseline"] = item["entries_per_s"] / base["entries_per_s"]
        item["cpu_vs_baseline"] = item["cpu_s_per_million"] / base["cpu_s_per_million"]
    sup = raw["supervisor"]
    classify = [ms for r in sup for ms in r["classify_ms"]]
    summary["supervisor"]["classification"] = {
        "invocations": sup[-1]["invocations"],
        "crashed": sup[-1]["crashed"],
        "halts": sup[-1]["halts"],
        "signatures": sup[-1]["signatures"],
        "classify_ms_p50": statistics.median(classify) if classify else 0.0,
        "classify_ms_max": max(classify) if classify else 0.0,
    }
    return summary


def table(ingest: dict[str, Any]) -> str:
    """The side-by-side table (Markdown)."""
    rows = [
        "| reader | entries/s (median) | vs baseline | CPU s / M entries (python + journalctl)"
        " | CPU vs baseline | peak RSS python / journalctl (MB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode in ingest:
        s = ingest[mode]
        if not isinstance(s, dict) or "label" not in s:
            continue
        python_cpu = "-" if mode in CHILD_ONLY else f"{s['cpu_python_s_per_million']:.1f}"
        rss_python = "-" if mode in CHILD_ONLY else f"{s['rss_python_mb']:.0f}"
        rows.append(
            f"| {s['label']} | {s['entries_per_s']:,.0f} | {s['speed_vs_baseline']:.2f}x "
            f"| {s['cpu_s_per_million']:.1f} ({python_cpu} + "
            f"{s['cpu_journalctl_s_per_million']:.1f}) | {s['cpu_vs_baseline']:.0%} "
            f"| {rss_python} / {s['rss_journalctl_mb']:.0f} |"
        )
    return "\n".join(rows)


def live_table(live: list[dict[str, Any]], batch_us: float) -> str:
    """The follow-mode figures (Markdown): medians over the interleaved runs of each rate."""
    rows = [
        "| rate (lines/s) | follower | CPU % of a core | cost / entry (us) | vs batch "
        "| lag p50 / p99 (ms) | crash latency p50 / p99 (ms) | loop lag p99 (ms) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for item in live:
        per_entry = item["cpu_s"] / max(1, item["handled"]) * 1e6
        ours = item["follower"] == "supervisor"
        rows.append(
            f"| {item['rate']:,} | {LIVE_LABELS[item['follower']]} | {item['cpu_percent']:.1f} "
            f"| {per_entry:.1f} | {per_entry / batch_us:.1f}x "
            + (
                f"| {item['lag_ms_p50']:.0f} / {item['lag_ms_p99']:.0f} "
                f"| {item['crash_ms_p50']:.0f} / {item['crash_ms_p99']:.0f} "
                f"| {item['loop_lag_ms_p99']:.1f} |"
                if ours
                else "| - | - | - |"
            )
        )
    return "\n".join(rows)


def idle_table(idle: list[dict[str, Any]]) -> str:
    """Idle wake-ups and memory (Markdown)."""
    rows = [
        "| follower | wake-ups / s | RSS (MB) | anonymous (MB) | reader child RSS (MB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for item in idle:
        rows.append(
            f"| {LIVE_LABELS[item['follower']]} | {item['wakeups_per_s']:.2f} "
            f"| {item['rss_mb']:.1f} | {item['rss_anon_mb']:.1f} | {item['child_rss_mb']:.1f} |"
        )
    return "\n".join(rows)


def median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One live figure set from interleaved runs: the run of median CPU."""
    return sorted(runs, key=lambda r: r["cpu_percent"])[len(runs) // 2]


def main(argv: list[str] | None = None) -> int:
    """Generate (or reuse) the journal, measure, print the tables, write the JSON."""
    args = parse_args(argv)
    journal = journal_for(args.entries, root=args.cache)
    print(
        f"journal: {journal.entries:,} entries ({journal.unit_entries:,} of {UNIT}), "
        f"{journal.bytes_on_disk / 1e6:.0f} MB, {journal.crashes} crashes: {journal.directory}"
    )
    started = time.time()
    ingest = measure_ingest(journal.directory, journal.unit_entries, args.runs)
    print()
    print(table(ingest))
    c = ingest["supervisor"]["classification"]
    print(
        f"\nclassification: {c['crashed']} crashed invocations -> {c['signatures']}, "
        f"{c['halts']} halts; per invocation p50 {c['classify_ms_p50']:.1f} ms, "
        f"max {c['classify_ms_max']:.1f} ms"
    )
    rss: dict[str, Any] | None = None
    if args.rss_entries:
        print(f"\nrss: {args.rss_entries:,} entries through one Pipeline ...", flush=True)
        rss = measure_rss(journal.directory, args.rss_entries)
        print(
            f"rss after {rss['entries']:,} entries ({rss['passes']} passes, "
            f"{rss['entries'] / rss['wall_s']:,.0f} entries/s): {rss['rss_mb_end']:.0f} MB "
            f"(peak {rss['rss_mb_peak']:.0f} MB; reader child peak {rss['rss_child_mb_peak']:.0f}"
            f" MB); after each pass: {rss['rss_mb_after_each_pass']}"
        )
    live: list[dict[str, Any]] = []
    idle: list[dict[str, Any]] = []
    exit_latency: dict[str, Any] | None = None
    if not args.no_live:
        from bench.live import measure_idle, measure_live

        followers = live_followers()
        for rate in (int(r) for r in args.live_rates.split(",") if r):
            runs: dict[str, list[dict[str, Any]]] = {f: [] for f in followers}
            for index in range(args.live_runs):
                for follower in followers:  # interleaved: A B C D A B C D
                    print(
                        f"live: {rate:,} lines/s, {follower}, run {index + 1}/{args.live_runs}",
                        flush=True,
                    )
                    runs[follower].append(measure_live(rate, args.live_seconds, follower))
            live += [median_runs(runs[f]) for f in followers]
        for follower in followers:
            print(f"idle: {follower} for {args.idle_seconds:.0f} s", flush=True)
            idle.append(measure_idle(args.idle_seconds, follower))
        batch_us = ingest["supervisor"]["cpu_s_per_million"]
        print()
        print(live_table(live, batch_us))
        print()
        print(idle_table(idle))
    if args.exit_crashes:
        exit_latency = _exit_latency(args.exit_crashes)
    native = ingest["native"]["entries_per_s"]
    ours = ingest["supervisor"]["entries_per_s"]
    print(f"\nbatch: supervisor ingest at {ours / native:.0%} of its reader child alone")
    result = {
        "command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_1m": os.getloadavg()[0],
        },
        "journal": {
            "entries": journal.entries,
            "unit_entries": journal.unit_entries,
            "crashes": journal.crashes,
            "bytes_on_disk": journal.bytes_on_disk,
            "directory": str(journal.directory),
        },
        "runs": args.runs,
        "ingest": ingest,
        "rss": rss,
        "live": live,
        "idle": idle,
        "exit_latency": exit_latency,
        "batch_vs_child": ours / native,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


def _exit_latency(crashes: int) -> dict[str, Any] | None:
    """Exit -> quarantine under systemd 252 in nspawn, or None (said) where nspawn cannot run."""
    from bench.exit_latency import measure_exit_latency, unavailable

    reason = unavailable()
    if reason is not None:
        print(f"\nexit -> quarantine: skipped, systemd-nspawn cannot run here: {reason}")
        return None
    print(f"\nexit -> quarantine: {crashes} crashes under systemd 252 in nspawn ...", flush=True)
    result = measure_exit_latency(crashes)
    p50, p99 = result["exit_to_quarantine_ms_p50"], result["exit_to_quarantine_ms_p99"]
    print(
        f"exit -> quarantine over {result['crashes']} crashes: p50 {p50:.1f} ms, "
        f"p99 {p99:.1f} ms, max {result['exit_to_quarantine_ms_max']:.1f} ms"
    )
    return result


if __name__ == "__main__":
    sys.exit(main())
