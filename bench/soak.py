"""A compressed soak: the real daemon follows a journal written at a steady rate, with crashes.

`python -m bench.soak --seconds N --rate R --crash-every S [--keep-files K] [--out PATH]`

A `python -m vllm_supervisor run` child (systemd actions off, its own state and runtime directories)
follows a journal directory that systemd-journal-remote writes: vLLM request lines at R lines/s in
10 ms ticks, and every S seconds a crashed invocation (rotating through a fatal flashinfer
mismatch, a transient NCCL timeout and an unknown traceback) with PID 1's exit, failure and
restart messages, then a new start. journal-remote rotates its file by itself at ~100 MB (about
every 170k entries); with `--keep-files K` the writer also runs `journalctl --vacuum-files=K`
after each rotation, so old files are deleted under the follower, as on a host.

Figures (printed, and written as JSON): lines written and handled, crashes written and
classified (the daemon's history table), VmRSS of the daemon sampled each second from
/proc/PID/status with the medians of the second and last quarters and a least-squares slope,
the daemon's CPU, file rotations and vacuums, and every log event at level warning or above.

The issue's target, 1 hour at 5k lines/s with a crash every 5 minutes, is 18M lines and 12
crashes; the compression keeps the rate and shortens the interval between crashes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from bench.generate import UNIT, Encoder, finish_remote, seed_lines, start_remote, stdout_fields
from vllm_supervisor.journal.writer import crashed_invocation, lifecycle, vacuum_files
from vllm_supervisor.model import LifecycleEvent

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "soak.json"
TICK_S = 0.01
SAMPLE_S = 1.0
DRAIN_TIMEOUT_S = 120.0
NCCL = (
    "(Worker_TP1 pid=5301) [rank1]:[E1130 10:11:03.123456 5301 ProcessGroupNCCL.cpp:632] [Rank 1]"
    " Watchdog caught collective operation timeout: WorkNCCL(SeqNum={n}, OpType=ALLREDUCE,"
    " NumelIn=4194304, NumelOut=4194304, Timeout(ms)=600000) ran for 600081 milliseconds before"
    " timing out."
)
KINDS = ("fatal", "transient", "unknown")


def crash_lines(kind: str, serial: int) -> list[str]:
    """The lines of one crashed invocation of the given kind, unique per serial."""
    if kind == "fatal":
        return seed_lines()
    if kind == "transient":
        # It served first: an NCCL timeout while serving is transient (before, unknown).
        return [
            "(APIServer pid=5150) INFO:     Application startup complete.",
            NCCL.format(n=serial),
            "(APIServer pid=5150) ERROR Engine core proc died.",
        ]
    prefix = "(EngineCore_DP0 pid=6200) ERROR 11-30 11:00:09 [core.py:708]"
    return [
        f"{prefix} Traceback (most recent call last):",
        f'{prefix}   File "/opt/vllm/mod{serial}.py", line {serial}, in frobnicate',
        f"{prefix} RuntimeError: widget {serial} fell over",
    ]


def config_text(root: Path) -> str:
    """The daemon's config: this journal directory, private state, no systemd, any free port."""
    return (
        "[systemd]\nenabled = false\n"
        f'[journal]\ndirectory = "{root / "journal"}"\nstart_at = "head"\n'
        f'[state]\nstate_dir = "{root / "state"}"\nruntime_dir = "{root / "run"}"\n'
        '[metrics]\nlisten = "127.0.0.1:0"\n'
        f'[[unit]]\nname = "{UNIT}"\n'
    )


class Writer:
    """Writes the traffic through journal-remote at a fixed rate, crashes on schedule."""

    def __init__(self, journal: Path, keep_files: int) -> None:
        self.journal = journal
        self.keep_files = keep_files
        self.remote = start_remote(journal)
        self.encoder = Encoder(start_us=_now_us(), step_us=1)
        self.written = self.crashes = self.vacuumed = self.n = 0
        self.files_seen = 1
        self.kinds: list[str] = []
        self._new_invocation()
        self._send([self.encoder.entry(self._started(), now_us=_now_us())])

    def _new_invocation(self) -> None:
        self.inv, self.pid = uuid.uuid4().hex, 5000 + self.crashes
        self.constant = stdout_fields(
            UNIT, self.inv, self.pid, comm="python3", cmdline="python3 -m vllm"
        )

    def _started(self) -> dict[str, Any]:
        return lifecycle(UNIT, self.inv, LifecycleEvent.JOB_STARTED, f"Started {UNIT}.")

    def _send(self, chunk: list[bytes]) -> None:
        assert self.remote.stdin is not None
        self.remote.stdin.write(b"".join(chunk))
        self.remote.stdin.flush()
        self.written += len(chunk)

    def tick(self, lines: int, crash: bool) -> None:
        """One tick's lines, and a whole crash plus the next start when it is due."""
        now, stamp = _now_us(), time.strftime("%m-%d %H:%M:%S")
        chunk = []
        for _ in range(lines):
            self.n += 1
            message = (
                f"(APIServer pid={self.pid}) INFO {stamp} [logger.py:43] Received request "
                f"chatcmpl-{self.n:032x}: prompt: 'summarize this document', params: "
                "SamplingParams(n=1, temperature=0.7, max_tokens=512), lora_request: None."
            )
            chunk.append(self.encoder.line(self.constant, message.encode(), now_us=now))
        if crash:
            self.crashes += 1
            kind = KINDS[self.crashes % len(KINDS)]
            self.kinds.append(kind)
            entries = crashed_invocation(
                UNIT, crash_lines(kind, self.crashes), invocation_id=self.inv, restarts=self.crashes
            )
            chunk += [self.encoder.entry(fields, now_us=now) for fields in entries[1:]]
            self._new_invocation()
            chunk.append(self.encoder.entry(self._started(), now_us=now))
        self._send(chunk)

    def vacuum_if_rotated(self) -> None:
        """After journal-remote rotated its file, delete the oldest beyond `keep_files`."""
        files = len(list(self.journal.glob("*.journal")))
        if files == self.files_seen or self.keep_files <= 0:
            self.files_seen = files
            return
        self.vacuumed += len(vacuum_files(self.journal, self.keep_files))
        self.files_seen = len(list(self.journal.glob("*.journal")))

    def nudge(self) -> None:
        """Wake the follower as journald would (see JournalWriter.nudge)."""
        path = self.journal / "remote.journal"
        if path.exists():
            os.truncate(path, path.stat().st_size)

    def rotations(self) -> int:
        """Archived files journal-remote made, the vacuumed ones included."""
        return len(list(self.journal.glob("remote@*.journal"))) + self.vacuumed

    def close(self) -> None:
        """Let journal-remote finish its file."""
        finish_remote(self.remote)


def run_soak(seconds: float, rate: int, crash_every: float, keep_files: int) -> dict[str, Any]:
    """Run one soak and return its figures."""
    with tempfile.TemporaryDirectory(prefix="vllm-supervisor-soak-") as tmp:
        root = Path(tmp)
        writer = Writer(root / "journal", keep_files)
        (root / "config.toml").write_text(config_text(root), encoding="utf-8")
        log_path = root / "supervisor.log"
        with log_path.open("wb") as log:
            daemon = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "vllm_supervisor",
                    "run",
                    "--config",
                    str(root / "config.toml"),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                cwd=REPO,
                env={**os.environ, "VLLM_SUPERVISOR_LOG_LEVEL": "info"},
            )
        try:
            port = _wait_ready(log_path, daemon)
            cpu0 = _cpu_s(daemon.pid)
            samples = _drive(writer, daemon.pid, seconds, rate, crash_every)
            drained = _drain(writer, root / "state", daemon.pid, port)
            cpu_s = _cpu_s(daemon.pid) - cpu0
        finally:
            daemon.send_signal(signal.SIGTERM)
            exit_status = daemon.wait(timeout=30)
            writer.close()
        events = _events(log_path)
        history = _history(root / "state")
    return _figures(
        seconds=seconds,
        rate=rate,
        crash_every=crash_every,
        writer=writer,
        samples=samples,
        drained_s=drained,
        cpu_s=cpu_s,
        exit_status=exit_status,
        events=events,
        history=history,
    )


def _wait_ready(log_path: Path, daemon: subprocess.Popen[bytes]) -> int:
    """Poll the daemon's log until it follows the journal (with a deadline); its metrics port."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and daemon.poll() is None:
        events = _events(log_path)
        ports = [e["port"] for e in events if e.get("event") == "metrics_listening"]
        if ports and any(e.get("event") == "following_journal" for e in events):
            return int(ports[-1])
        time.sleep(0.05)  # polling another process's log, with a deadline
    raise SystemExit(f"the daemon did not start: {log_path.read_text()[-2000:]}")


def _drive(
    writer: Writer, pid: int, seconds: float, rate: int, crash_every: float
) -> list[tuple[float, int]]:
    """Write for `seconds`, sampling the daemon's RSS; the samples as (seconds, kB)."""
    start = time.monotonic()
    next_crash, next_sample = start + crash_every, start
    samples: list[tuple[float, int]] = []
    lines = 0
    while (now := time.monotonic()) < start + seconds:
        crash = now >= next_crash
        if crash:
            next_crash += crash_every
        # Catch up after a slow tick, so the rate holds whenever the machine can sustain it.
        due = int(rate * (now - start + TICK_S)) - lines
        lines += due
        writer.tick(due, crash)
        if now >= next_sample:
            next_sample += SAMPLE_S
            samples.append((now - start, _rss_kb(pid)))
            writer.vacuum_if_rotated()
        pause = start + TICK_S * (1 + (now - start) // TICK_S) - time.monotonic()
        if pause > 0:
            time.sleep(pause)  # pacing the writer, not synchronisation
    return samples


def _drain(writer: Writer, state: Path, pid: int, port: int) -> float:
    """Poll until every line is read and every crash is in the history; how long it took."""
    start = time.monotonic()
    while _entries_read(port) < writer.written or len(_history(state)) < writer.crashes:
        if time.monotonic() - start > DRAIN_TIMEOUT_S or not Path(f"/proc/{pid}").exists():
            break
        writer.nudge()
        time.sleep(0.05)  # polling another process's state, with a deadline
    return time.monotonic() - start


def _entries_read(port: int) -> float:
    """The daemon's vllm_supervisor_journal_entries_total (loopback; -1 when unreachable)."""
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return -1.0
    for line in text.splitlines():
        if line.startswith("vllm_supervisor_journal_entries_total "):
            return float(line.split()[1])
    return -1.0


def _figures(
    *,
    seconds: float,
    rate: int,
    crash_every: float,
    writer: Writer,
    samples: list[tuple[float, int]],
    drained_s: float,
    cpu_s: float,
    exit_status: int,
    events: list[dict[str, Any]],
    history: list[tuple[str, str | None]],
) -> dict[str, Any]:
    stopped = [e for e in events if e.get("event") == "supervisor_stopped"]
    rss_mb = [kb / 1024 for _, kb in samples]
    quarter = max(1, len(rss_mb) // 4)
    severities = [severity for severity, _ in history]
    return {
        "command": f"python -m bench.soak --seconds {seconds:g} --rate {rate} "
        f"--crash-every {crash_every:g} --keep-files {writer.keep_files}",
        "seconds": seconds,
        "rate": rate,
        "crash_every_s": crash_every,
        "lines_written": writer.written,
        "achieved_rate": writer.written / seconds,
        "lines_handled": stopped[-1]["entries"] if stopped else None,
        "crashes_written": writer.crashes,
        "crashes_classified": len(history),
        "severities_expected": {k: writer.kinds.count(k) for k in KINDS},
        "severities_classified": {k: severities.count(k) for k in KINDS},
        "drain_s": drained_s,
        "daemon_cpu_percent": 100 * cpu_s / (seconds + drained_s),
        "daemon_exit_status": exit_status,
        "rotations": writer.rotations(),
        "files_vacuumed": writer.vacuumed,
        "rss_mb_first": rss_mb[0] if rss_mb else None,
        "rss_mb_last": rss_mb[-1] if rss_mb else None,
        "rss_mb_max": max(rss_mb, default=None),
        "rss_mb_q2_median": statistics.median(rss_mb[quarter : 2 * quarter]) if rss_mb else None,
        "rss_mb_q4_median": statistics.median(rss_mb[-quarter:]) if rss_mb else None,
        "rss_mb_per_min_slope": _slope(samples) * 60 / 1024,
        "rss_samples": [(round(t, 1), kb) for t, kb in samples],
        "warnings": [e for e in events if e.get("level") == "warning"],
        "errors": [e for e in events if e.get("level") in ("error", "critical")],
        "tracebacks": sum(1 for e in events if "Traceback" in json.dumps(e)),
    }


def _slope(samples: list[tuple[float, int]]) -> float:
    """Least-squares slope of kB over seconds (0 with fewer than two samples)."""
    if len(samples) < 2:
        return 0.0
    return statistics.linear_regression([t for t, _ in samples], [kb for _, kb in samples]).slope


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_s(pid: int) -> float:
    """User + system CPU of a running process, from /proc/PID/stat."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _events(path: Path) -> list[dict[str, Any]]:
    events = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                events.append({"level": "error", "event": "unparsable_log_line", "line": line})
        elif line.strip():
            events.append({"level": "error", "event": "stderr_text", "line": line[:500]})
    return events


def _history(state: Path) -> list[tuple[str, str | None]]:
    """(severity, signature) of each classified invocation, read-only ([] before it exists)."""
    path = state / "state.sqlite3"
    if not path.exists():
        return []
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)
        try:
            rows = db.execute("SELECT outcome FROM history ORDER BY id").fetchall()
        finally:
            db.close()
    except sqlite3.Error:
        return []
    verdicts = [json.loads(outcome)["verdict"] for (outcome,) in rows]
    return [(v["severity"], v["signature"]) for v in verdicts]


def _now_us() -> int:
    return int(time.time() * 1e6)


def main(argv: list[str] | None = None) -> int:
    """Run the soak, print a summary, write the JSON; exit 1 when a crash went unclassified."""
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--rate", type=int, default=5000, help="lines per second")
    parser.add_argument("--crash-every", type=float, default=5.0, help="seconds between crashes")
    parser.add_argument("--keep-files", type=int, default=3, help="vacuum to this many; 0: never")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    figures = run_soak(args.seconds, args.rate, args.crash_every, args.keep_files)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
    summary = {k: v for k, v in figures.items() if k not in ("rss_samples", "warnings", "errors")}
    summary["warnings"] = len(figures["warnings"])
    summary["errors"] = len(figures["errors"])
    print(json.dumps(summary, indent=1))
    return 0 if figures["crashes_classified"] == figures["crashes_written"] else 1


if __name__ == "__main__":
    sys.exit(main())
