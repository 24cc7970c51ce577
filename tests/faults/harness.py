"""Shared pieces of the fault-injection tests: a real `vllm-supervisor run` child, its config,
crash invocations for the journal, and read-only views of its state database."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_supervisor.commands.demo import seed_lines
from vllm_supervisor.journal.writer import FieldValue, crashed_invocation

UNIT = "vllm.service"
NCCL_TIMEOUT = [
    "(APIServer pid=5150) INFO 11-30 10:01:03 [api_server.py:1839] vLLM API server version 0.11.0",
    # It served (for ten minutes, by the watchdog's SeqNum): an NCCL timeout then is transient.
    "(APIServer pid=5150) INFO:     Application startup complete.",
    "(Worker_TP1 pid=5301) [rank1]:[E1130 10:11:03.123456 5301 ProcessGroupNCCL.cpp:632] [Rank 1]"
    " Watchdog caught collective operation timeout: WorkNCCL(SeqNum=52311, OpType=ALLREDUCE,"
    " NumelIn=4194304, NumelOut=4194304, Timeout(ms)=600000) ran for 600081 milliseconds before"
    " timing out.",
    "(Worker_TP1 pid=5301) terminate called after throwing an instance of 'c10::DistBackendError'",
    "(APIServer pid=5150) ERROR 11-30 10:11:04 [core_client.py:564] Engine core proc"
    " EngineCore_DP0 died unexpectedly, shutting down client.",
]


def write_config(
    root: Path,
    *,
    slack_url: str | None = None,
    extra: str = "",
    state: str = "",
    systemd: str = "enabled = false\n",
    reader: str = "auto",
    slack_timeout_s: float = 2.0,
) -> Path:
    """A config for a supervisor following `root/journal` with private state (and by default
    no systemd; `systemd` replaces the [systemd] section's body)."""
    slack = ""
    if slack_url is not None:
        slack = (
            f'[slack]\nwebhook_url = "{slack_url}"\nmin_interval_s = 0.01\n'
            f"timeout_s = {slack_timeout_s}\nbackoff_max_s = 0.5\nmax_attempts = 1000\n"
        )
    text = (
        f"[systemd]\n{systemd}"
        f'[journal]\ndirectory = "{root / "journal"}"\nstart_at = "head"\nreader = "{reader}"\n'
        "restart_backoff_s = 0.1\nrestart_backoff_max_s = 0.5\n"
        f'[state]\nstate_dir = "{root / "state"}"\nruntime_dir = "{root / "run"}"\n'
        f"{state}"
        '[metrics]\nlisten = "127.0.0.1:0"\n'
        f"{slack}{extra}"
        '[[unit]]\nname = "vllm.service"\n'
    )
    path = root / "config.toml"
    path.write_text(text, encoding="utf-8")
    return path


def crash(
    kind: str, serial: int, *, invocation_id: str | None = None
) -> list[dict[str, FieldValue]]:
    """One crashed invocation whose restart counter is `serial` (so every message is unique).

    kind: "fatal" (the seed's flashinfer crash), "transient" (NCCL timeout) or "unknown" (a
    traceback no signature knows, unique per serial so repeats never halt on a fingerprint).
    """
    # The serial goes into the root-cause line, so every Slack message names its own crash.
    if kind == "fatal":
        lines = [
            line.replace("version (0.6.4)", f"version (0.6.{serial})") for line in seed_lines()
        ]
    elif kind == "transient":
        lines = [line.replace("SeqNum=52311", f"SeqNum={serial}") for line in NCCL_TIMEOUT]
    else:
        prefix = "(EngineCore_DP0 pid=6200) ERROR 11-30 11:00:09 [core.py:708]"
        lines = [
            f"{prefix} EngineCore failed to start.",
            f"{prefix} Traceback (most recent call last):",
            f'{prefix}   File "/opt/vllm/mod{serial}.py", line {serial}, in frobnicate',
            f"{prefix}     raise RuntimeError(widget)",
            f"{prefix} RuntimeError: widget {serial} fell over",
        ]
    # Each invocation's server is a process of its own, as under systemd.
    return crashed_invocation(
        UNIT,
        lines,
        restarts=serial,
        invocation_id=invocation_id or f"{serial:032x}",
        pid=4000 + serial,
    )


@dataclass
class Supervisor:
    """A `python -m vllm_supervisor run` child started by the test (and killed only by it)."""

    root: Path
    config: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)
    orphans: list[int] = field(default_factory=list)

    def start(self) -> subprocess.Popen[bytes]:
        """Start a new run; its stderr (JSON log lines) goes to a file of its own."""
        log = self.root / f"supervisor-{len(self.logs)}.log"
        self.logs.append(log)
        env = {
            **os.environ,
            "VLLM_SUPERVISOR_LOG_LEVEL": "info",
            "PYTHONFAULTHANDLER": "1",
            **self.env,
        }
        env.pop("VLLM_SUPERVISOR_SLACK_WEBHOOK_URL", None)
        with log.open("wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "vllm_supervisor", "run", "--config", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env,
            )
        return self.process

    @property
    def pid(self) -> int:
        """The running child's PID."""
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        """True while the child runs."""
        return self.process is not None and self.process.poll() is None

    def kill9(self) -> None:
        """SIGKILL the child (ours) and reap it."""
        assert self.process is not None
        self.orphans += children(self.pid)
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM the child and return its exit status (SIGKILL if it overstays `timeout`)."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise

    def stop_quietly(self) -> None:
        """Teardown: make sure the child is gone."""
        if self.alive():
            assert self.process is not None
            self.process.kill()
            self.process.wait(timeout=10)

    def events(self) -> list[dict[str, Any]]:
        """Every JSON log event of every run so far."""
        out = []
        for log in self.logs:
            for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
                if line.startswith("{"):
                    out.append(json.loads(line))
        return out

    def following(self) -> bool:
        """Has the current run started following the journal (its signal handlers are set)?"""
        text = self.logs[-1].read_text(encoding="utf-8", errors="replace")
        return '"event": "following_journal"' in text

    def stderr_text(self) -> str:
        """All runs' stderr, for failure messages."""
        return "\n".join(p.read_text(errors="replace")[-4000:] for p in self.logs)


def children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    out: list[int] = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        out += [int(p) for p in path.read_text().split()]
    return out


def comm(pid: int) -> str:
    """A process's command name ('' once it is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def is_reader(pid: int) -> bool:
    """Is `pid` a journal reader child: journalctl, or the native libsystemd reader?"""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return comm(pid) == "journalctl" or argv[0].endswith(b"/vllm-supervisor-journal-reader")


def is_follower(pid: int) -> bool:
    """Is `pid` the journal reader child that follows (not one of the journalctl fallback's
    short runs that catch up a backlog before it)?"""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return is_reader(pid) and b"--follow" in argv


def db_rows(state_dir: Path, sql: str) -> list[Any]:
    """Read the state database without writing to it ([] before it exists or while locked)."""
    path = state_dir / "state.sqlite3"
    if not path.exists():
        return []
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)
        try:
            return db.execute(sql).fetchall()
        finally:
            db.close()
    except sqlite3.Error:
        return []


def classified(state_dir: Path) -> list[str]:
    """Invocation ids in the history table, oldest first."""
    return [r[0] for r in db_rows(state_dir, "SELECT invocation_id FROM history ORDER BY id")]


def saved_cursor(state_dir: Path) -> str | None:
    """The checkpoint's cursor."""
    rows = db_rows(state_dir, "SELECT value FROM meta WHERE key = 'cursor'")
    return rows[0][0] if rows else None


def history_cli(state_dir: Path) -> list[dict[str, Any]]:
    """`vllm-supervisor history --format json --state-dir S`, parsed."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_supervisor",
            "history",
            "--format",
            "json",
            "--state-dir",
            str(state_dir),
        ],
        capture_output=True,
        check=True,
        timeout=60,
    )
    return list(json.loads(result.stdout)["invocations"])


def last_cursor(journal: Path) -> str:
    """The cursor of the journal's last entry (journalctl itself)."""
    result = subprocess.run(
        [
            "journalctl",
            f"--directory={journal}",
            "--boot=all",
            "-n1",
            "-o",
            "export",
            "--output-fields=MESSAGE",
        ],
        capture_output=True,
        check=True,
        timeout=30,
    )
    for line in result.stdout.split(b"\n"):
        if line.startswith(b"__CURSOR="):
            return line[len(b"__CURSOR=") :].decode()
    raise AssertionError("no entry in the journal")
