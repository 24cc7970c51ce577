"""`python -m bench.lineparse`: the line parser's cost per line, this checkout against another.

    python -m bench.lineparse --code /tmp/before --runs 7

Every line of the crash corpus (tests/data/corpus/*.log, ~4,000 lines in ~170 formats and
their mixes), repeated to `--lines`, goes through what every journal line of a supervised unit
meets: `parse_lines` (the classifier's prefix stripping, reusing a repeated prefix),
`parse_line` (one line alone, as the hang detector does), `is_serving_line` (the tracker asks
each line of a start) and `signature_match` (the shipped table's `match` of the stripped line,
as the classifier asks of a crash's lines). Each measurement runs in a fresh interpreter; the
checkouts alternate (A B A B ...); each measurement is the fastest of 5 passes in CPU time, and
the medians of the runs and their ratio (this / `--code`) are printed, as JSON with `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "tests" / "data" / "corpus"
MEASURES = ("parse_lines", "parse_line", "is_serving_line", "signature_match")


def corpus_lines(count: int) -> list[str]:
    """The corpus's lines, in file order, repeated until there are `count`."""
    lines = [
        line
        for path in sorted(CORPUS.glob("*.log"))
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines()
    ]
    return (lines * (count // len(lines) + 1))[:count]


def _time_us(work: Callable[[], object], lines: int, repeats: int = 5) -> float:
    """The fastest of `repeats` passes, in this process's CPU time: other work on a shared
    machine only ever adds time, and waiting for a core is not the parser's."""
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        work()
        best = min(best, time.process_time() - started)
    return best / lines * 1e6


def measure(count: int) -> dict[str, float]:
    """Microseconds per line of each measure, in this interpreter (the worker's job)."""
    from vllm_supervisor.classify.logline import parse_line, parse_lines
    from vllm_supervisor.classify.signatures import load_signature_table
    from vllm_supervisor.environment.serving import is_serving_line
    from vllm_supervisor.model import LogLine

    texts = corpus_lines(count)
    lines = [LogLine(text=text) for text in texts]
    parse_lines(lines[:1000])  # warm the regex caches
    table = load_signature_table()
    stripped = [parse_line(line).text.strip() for line in lines]
    return {
        "parse_lines": _time_us(lambda: parse_lines(lines), count),
        "parse_line": _time_us(lambda: [parse_line(line) for line in lines], count),
        "is_serving_line": _time_us(lambda: [is_serving_line(t) for t in texts], count),
        "signature_match": _time_us(lambda: [table.match(t) for t in stripped], count),
    }


def _worker_env(code: Path | None, shim: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    if code is not None:
        # The package is `vllm_supervisor`, its directory `supervisor/`: a link names it.
        link = shim / "vllm_supervisor"
        if not link.exists():
            link.symlink_to(code.resolve() / "supervisor")
        env["PYTHONPATH"] = str(shim)
    return env


def run_worker(env: dict[str, str], count: int) -> dict[str, float]:
    """One measurement in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.lineparse", "--worker", "--lines", str(count)],
        capture_output=True,
        check=False,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    if done.returncode != 0:
        raise SystemExit(f"bench.lineparse worker failed: {done.stderr.decode()[-800:]}")
    result: dict[str, float] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return result


def compare(code: Path | None, runs: int, count: int) -> dict[str, Any]:
    """Medians of `runs` alternating measurements of this checkout and of `code`'s."""
    samples: dict[str, list[dict[str, float]]] = {"this": [], "baseline": []}
    with tempfile.TemporaryDirectory(prefix="vllm-supervisor-code-") as shim:
        envs = {"this": _worker_env(None, Path(shim))}
        if code is not None:
            envs["baseline"] = _worker_env(code, Path(shim))
        for _ in range(runs):
            for label, env in envs.items():
                samples[label].append(run_worker(env, count))
    report: dict[str, Any] = {"lines": count, "runs": runs, "code": str(code or "")}
    for label, results in samples.items():
        if results:
            report[label] = {m: statistics.median(r[m] for r in results) for m in MEASURES}
    if "baseline" in report:
        report["ratio"] = {m: report["this"][m] / report["baseline"][m] for m in MEASURES}
    return report


def render(report: dict[str, Any]) -> str:
    """The table: µs per line (median) of each checkout, and their ratio."""
    rows = ["| measure | this (µs/line) | baseline (µs/line) | ratio |", "|---|---|---|---|"]
    for measure_name in MEASURES:
        this = report["this"][measure_name]
        base = report.get("baseline", {}).get(measure_name)
        ratio = report.get("ratio", {}).get(measure_name)
        rows.append(
            f"| {measure_name} | {this:.2f} | {'' if base is None else f'{base:.2f}'} | "
            f"{'' if ratio is None else f'{ratio:.3f}'} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lineparse", description=__doc__)
    parser.add_argument("--code", type=Path, default=None, help="a checkout to compare with")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--lines", type=int, default=30_000)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.lines)))
        return 0
    report = compare(args.code, args.runs, args.lines)
    print(f"{report['lines']} corpus lines, median of {report['runs']} runs each")
    print(render(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
