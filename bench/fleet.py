"""A fleet of daemons sharing one real Alertmanager: what a proof shared saves a rollout.

`python -m bench.fleet --hosts N --format json` runs N `vllm-supervisor run` daemons on this
machine, each following a journal directory of its own as one host (its own machine id and
hostname; the boot is this machine's, which the daemon checks), one real Alertmanager from
Debian's packages with the shipped route and inhibit rule (deploy/alertmanager/alertmanager.yml,
its Slack receiver swapped for a loopback webhook that counts), and a loopback Slack stand-in
that every daemon's `[slack]` posts to. The bench plays systemd: it writes each start's crash
into the host's journal (systemd 252's entries, through systemd-journal-remote), waits for the
daemon's decision in its state database, and starts the unit again unless it was halted.

Scenarios:
- **rollout**, sharing on: an unknown crash (its cause line named, no signature, no clue
  either way; the units' `unknown_repeat_limit` is `--repeat-limit`, 2 by default: a loop
  halted at its second start, as one leaning fatal is) rolled out to the hosts one after
  another: each host's first start comes once the previous host's first crash was decided.
  `restarts_wasted` counts the starts after a host's first that crashed the same way.
- **baseline_no_sharing**: the same rollout with `[fleet] share = false` (fresh daemons).
- **outage**, sharing on: a hub outage (`OSError: We couldn't connect to
  'https://huggingface.co'`, transient) crashes every host at once, `--outage-starts` times;
  a second unit of the same daemons. `hosts_halted` must be 0.
- **notifications**: what the Slack stand-in and the Alertmanager receiver got from the
  rollout's start until the group's updates are done (the last halt + `group_wait` +
  `group_interval` + 5 s). The bench's group interval is `--group-interval` (1m by default;
  the shipped 5m can only send as many or fewer updates in any window).
- **memory**: each daemon's RSS (its reader child apart) after the rollout: median and max.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench.live import children_of, status_kb
from vllm_supervisor.commands.demo import make_venv
from vllm_supervisor.journal.writer import EntryFactory, JournalWriter, crashed_invocation

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_ROUTE = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
ALERTMANAGER = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"
ROLLOUT_UNIT = "vllm.service"
OUTAGE_UNIT = "vllm-hub.service"
PREFIX = "(EngineCore_DP0 pid=6200) ERROR 12-05 10:00:09 [core.py:708]"
# No signature knows it and no clue leans either way: only repetition halts it, alone.
ROLLOUT_CRASH = [
    f"{PREFIX} EngineCore failed to start.",
    f"{PREFIX} RuntimeError: frobnicator kernel image missing for sm_90",
]
HUB_OUTAGE = [
    "(APIServer pid=1) ERROR 12-05 10:00:09 [api_server.py:1] OSError: We couldn't connect to"
    " 'https://huggingface.co' to load this file, couldn't find it in the cached files and it"
    " looks like meta-llama/Llama-3.1-8B is not the path to a directory containing a file"
    " named config.json."
]
MAX_STARTS = 6  # a host's loop the bench plays, at most (a daemon that never halts ends here)
DECISION_TIMEOUT_S = 120.0
START_BATCH = 10  # daemons started at once (2 cores: a hundred imports at once crawl)


# -- loopback receivers ------------------------------------------------------------------------


class Counter:
    """A loopback HTTP server that answers 200 to every POST and keeps the bodies."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.lock = threading.Lock()
        counter = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with counter.lock:
                    counter.bodies.append(body)
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def since(self, mark: int) -> list[bytes]:
        with self.lock:
            return self.bodies[mark:]

    def mark(self) -> int:
        with self.lock:
            return len(self.bodies)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def alertmanager(root: Path, receiver: str, group_wait: str, group_interval: str) -> Iterator[str]:
    """A real Alertmanager with the shipped route, on loopback; its URL. Stopped by PID."""
    text = SHIPPED_ROUTE.read_text(encoding="utf-8")
    head = text[: text.index("\nreceivers:")]
    head = head.replace("group_wait: 30s", f"group_wait: {group_wait}")
    head = head.replace("group_interval: 5m", f"group_interval: {group_interval}")
    root.mkdir(parents=True, exist_ok=True)
    config = root / "alertmanager.yml"
    config.write_text(
        f"{head}\nreceivers:\n  - name: vllm-supervisor\n    webhook_configs:\n"
        f"      - url: {receiver}\n        send_resolved: true\n",
        encoding="utf-8",
    )
    port = free_port()
    log = (root / "alertmanager.log").open("wb")
    process = subprocess.Popen(
        [ALERTMANAGER, f"--config.file={config}", f"--storage.path={root / 'am'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _until(lambda: _ready(url), 30, "Alertmanager ready")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def _ready(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# -- hosts ---------------------------------------------------------------------------------------


@dataclass
class Host:
    """One host: its journal (written through journal-remote), its daemon, its state."""

    name: str
    root: Path
    factory: EntryFactory
    process: subprocess.Popen[bytes] | None = None
    writer: JournalWriter | None = None
    starts: dict[str, int] = field(default_factory=dict)  # unit -> starts written

    def start(self, config: str) -> None:
        (self.root / "config.toml").write_text(config, encoding="utf-8")
        self.writer = JournalWriter(self.root / "journal", factory=self.factory)
        env = {**os.environ, "VLLM_SUPERVISOR_LOG_LEVEL": "info"}
        env.pop("VLLM_SUPERVISOR_SLACK_WEBHOOK_URL", None)
        with (self.root / "daemon.log").open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "vllm_supervisor", "run", "--config",
                 str(self.root / "config.toml")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=env,
            )  # fmt: skip

    def following(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise SystemExit(f"{self.name}'s daemon exited: {self._log_tail()}")
        return b'"event": "following_journal"' in (self.root / "daemon.log").read_bytes()

    def crash(self, unit: str, lines: Sequence[str]) -> None:
        """The unit's next start, crashing with `lines` (systemd 252's entries)."""
        assert self.writer is not None
        serial = self.starts[unit] = self.starts.get(unit, 0) + 1
        entries = crashed_invocation(
            unit, lines, restarts=serial, invocation_id=uuid.uuid4().hex, pid=4000 + serial
        )
        now_us = int(time.time() * 1e6)  # written now, as journald stamps them
        self.writer.write([{**entry, "__REALTIME_TIMESTAMP": now_us} for entry in entries])

    def decisions(self, unit: str) -> list[dict[str, Any]]:
        """The unit's decisions so far, oldest first (read-only; [] while the file is new)."""
        path = self.root / "state" / "state.sqlite3"
        if not path.exists():
            return []
        try:
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)
            try:
                rows = db.execute(
                    "SELECT outcome FROM history WHERE unit = ? ORDER BY id", (unit,)
                ).fetchall()
            finally:
                db.close()
        except sqlite3.Error:
            return []
        return [json.loads(row[0])["decision"] for row in rows]

    def rss_mb(self) -> tuple[float, float]:
        """The daemon's RSS and its children's (the reader), in MB."""
        assert self.process is not None
        own = status_kb(self.process.pid, "VmRSS")
        children = sum(status_kb(pid, "VmRSS") for pid in children_of(self.process.pid))
        return own / 1024, children / 1024

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.writer is not None:
            self.writer.close()

    def _log_tail(self) -> str:
        return (self.root / "daemon.log").read_text(errors="replace")[-2000:]


def host_config(
    host: Host, *, python: Path, slack: str, am: str, share: bool, repeat_limit: int
) -> str:
    units = "".join(
        f'[[unit]]\nname = "{unit}"\npython = "{python}"\nunknown_repeat_limit = {repeat_limit}\n'
        for unit in (ROLLOUT_UNIT, OUTAGE_UNIT)
    )
    return (
        "[systemd]\nenabled = false\n"
        f'[journal]\ndirectory = "{host.root / "journal"}"\nstart_at = "head"\n'
        f'machine_id = "{host.factory.machine_id}"\nkernel = false\n'
        f'[state]\nstate_dir = "{host.root / "state"}"\nruntime_dir = "{host.root / "run"}"\n'
        "[metrics]\nenabled = false\n"
        f'[slack]\nwebhook_url = "{slack}"\nmin_interval_s = 0.01\n'
        f'[alertmanager]\nurl = "{am}"\nresend_s = 5.0\n'
        f'[fleet]\nshare = {"true" if share else "false"}\nhost = "{host.name}"\n'
        f"{units}"
    )


@contextlib.contextmanager
def fleet(
    root: Path, count: int, *, python: Path, slack: str, am: str, share: bool, repeat_limit: int
) -> Iterator[list[Host]]:
    """`count` hosts, their daemons following; every daemon stopped (by PID) at the end."""
    hosts = [
        Host(
            name=f"gpu-{n:03d}",
            root=root / f"gpu-{n:03d}",
            factory=EntryFactory(
                machine_id=uuid.uuid5(uuid.NAMESPACE_DNS, f"{root}/{n}").hex,
                hostname=f"gpu-{n:03d}",
            ),
        )
        for n in range(1, count + 1)
    ]
    try:
        for batch in range(0, count, START_BATCH):
            group = hosts[batch : batch + START_BATCH]
            for host in group:
                host.root.mkdir(parents=True)
                host.start(
                    host_config(
                        host, python=python, slack=slack, am=am, share=share,
                        repeat_limit=repeat_limit,
                    )
                )  # fmt: skip
            for host in group:
                _until(host.following, 180, f"{host.name} following")
        yield hosts
    finally:
        for host in hosts:
            host.stop()


# -- scenarios -----------------------------------------------------------------------------------


def play_loop(host: Host, unit: str, lines: Sequence[str], first_decided: threading.Event) -> None:
    """systemd's part for one host: start (crash), wait for the decision, start again unless
    halted, at most MAX_STARTS times."""
    for start in range(1, MAX_STARTS + 1):
        host.crash(unit, lines)
        _until(lambda n=start: len(host.decisions(unit)) >= n, DECISION_TIMEOUT_S, host.name)
        first_decided.set()
        if host.decisions(unit)[-1]["action"] == "halt":
            return


def rollout(hosts: list[Host]) -> dict[str, Any]:
    """Each host's first start once the previous host's first crash was decided; each then
    loops on its own. Its waste, halts at the first crash, and when the last halt came."""
    threads = []
    for host in hosts:
        decided = threading.Event()
        thread = threading.Thread(
            target=play_loop, args=(host, ROLLOUT_UNIT, ROLLOUT_CRASH, decided)
        )
        thread.start()
        threads.append(thread)
        if not decided.wait(DECISION_TIMEOUT_S):
            raise SystemExit(f"{host.name}: no decision within {DECISION_TIMEOUT_S:.0f} s")
    for thread in threads:
        thread.join()
    decisions = {host.name: host.decisions(ROLLOUT_UNIT) for host in hosts}
    halted_at = {
        name: next((i for i, d in enumerate(made, 1) if d["action"] == "halt"), None)
        for name, made in decisions.items()
    }
    rules: dict[str, int] = {}
    for made in decisions.values():
        for decision in made:
            rules[decision["rule"]] = rules.get(decision["rule"], 0) + 1
    return {
        "restarts_wasted": sum(len(made) - 1 for made in decisions.values()),
        "hosts_halted_first_crash": sum(1 for at in halted_at.values() if at == 1),
        "hosts_halted": sum(1 for at in halted_at.values() if at is not None),
        "rules": dict(sorted(rules.items())),
    }


def outage(hosts: list[Host], starts: int) -> dict[str, Any]:
    """Every host's second unit crashes at once on the hub's outage, `starts` times."""
    for start in range(1, starts + 1):
        for host in hosts:
            host.crash(OUTAGE_UNIT, HUB_OUTAGE)
        for host in hosts:
            _until(
                lambda host=host, n=start: len(host.decisions(OUTAGE_UNIT)) >= n,  # type: ignore[misc]
                DECISION_TIMEOUT_S,
                f"{host.name} outage",
            )
    actions: dict[str, int] = {}
    for host in hosts:
        for decision in host.decisions(OUTAGE_UNIT):
            actions[decision["action"]] = actions.get(decision["action"], 0) + 1
    halted = sum(
        1 for host in hosts if any(d["action"] == "halt" for d in host.decisions(OUTAGE_UNIT))
    )
    return {
        "starts_each": starts,
        "hosts_halted": halted,
        "decisions": dict(sorted(actions.items())),
    }


def memory(hosts: list[Host]) -> dict[str, float]:
    own, readers = zip(*(host.rss_mb() for host in hosts), strict=True)
    return {
        "daemon_rss_mb_median": round(statistics.median(own), 1),
        "daemon_rss_mb_max": round(max(own), 1),
        "reader_rss_mb_median": round(statistics.median(readers), 1),
        "all_hosts_rss_mb": round(sum(own) + sum(readers), 1),
    }


def run(
    count: int,
    *,
    repeat_limit: int,
    group_wait: str,
    group_interval: str,
    outage_starts: int,
    keep: Path | None = None,
) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        if keep is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vsup-fleet-")))
        else:
            root = keep
            root.mkdir(parents=True)
        python = make_venv(root / "venv", [("vllm", "0.11.0", ()), ("torch", "2.9.0", ())])
        slack, receiver = Counter(), Counter()
        result: dict[str, Any] = {"hosts": count, "repeat_limit": repeat_limit}
        settle_s = _seconds(group_wait) + _seconds(group_interval) + 5.0
        try:
            for share in (True, False):
                name = "shared" if share else "alone"
                waits = (group_wait, group_interval)
                with (
                    alertmanager(root / f"am-{name}", receiver.url, *waits) as am,
                    fleet(
                        root / name, count, python=python, slack=slack.url, am=am, share=share,
                        repeat_limit=repeat_limit,
                    ) as hosts,
                ):  # fmt: skip
                    marks = (slack.mark(), receiver.mark())
                    started = time.monotonic()
                    played = rollout(hosts)
                    played["seconds"] = round(time.monotonic() - started, 1)
                    if share:
                        result["memory"] = memory(hosts)
                    time.sleep(settle_s)  # Alertmanager's group flushes, on its clock
                    played["notifications"] = _told(slack, receiver, marks)
                    if share:
                        result["rollout"] = played
                        result["notifications"] = played.pop("notifications")
                        result["outage"] = outage(hosts, outage_starts)
                    else:
                        result["baseline_no_sharing"] = played
        finally:
            slack.close()
            receiver.close()
        result["alertmanager"] = {"group_wait": group_wait, "group_interval": group_interval}
        return result


def _told(slack: Counter, receiver: Counter, marks: tuple[int, int]) -> dict[str, Any]:
    """What reached people since `marks`: Slack messages and the receiver's notifications,
    with the hosts each of the latter named."""
    notified = [json.loads(body) for body in receiver.since(marks[1])]
    return {
        "slack": len(slack.since(marks[0])),
        "alertmanager": len(notified),
        "total": len(slack.since(marks[0])) + len(notified),
        "alertmanager_hosts_named": [
            len({a["labels"].get("host") for a in told.get("alerts", [])}) for told in notified
        ],
    }


# -- small parts ---------------------------------------------------------------------------------


def _until(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling another process's state, with a deadline


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    for suffix in ("ms", "s", "m", "h"):
        if duration.endswith(suffix):
            return float(duration[: -len(suffix)]) * units[suffix]
    raise SystemExit(f"not a duration: {duration!r} (e.g. 30s, 1m)")


def _text(result: dict[str, Any]) -> str:
    roll, base, told = result["rollout"], result["baseline_no_sharing"], result["notifications"]
    return "\n".join(
        [
            f"hosts: {result['hosts']}  (units halt an unknown crash at its "
            f"{result['repeat_limit']}nd start alone)",
            f"rollout, sharing:     {roll['restarts_wasted']} restarts wasted, "
            f"{roll['hosts_halted_first_crash']} hosts halted at their 1st crash, "
            f"{roll['seconds']} s",
            f"rollout, no sharing:  {base['restarts_wasted']} restarts wasted, "
            f"{base['hosts_halted_first_crash']} hosts halted at their 1st crash",
            f"outage:               {result['outage']['hosts_halted']} hosts halted",
            f"notifications:        {told['total']} ({told['slack']} Slack, "
            f"{told['alertmanager']} Alertmanager naming {told['alertmanager_hosts_named']} "
            f"hosts); without sharing {base['notifications']['total']}",
            f"memory:               {json.dumps(result['memory'])}",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__)
    parser.add_argument("--hosts", type=int, default=100)
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--repeat-limit", type=int, default=2)
    parser.add_argument("--group-wait", default="30s", help="the shipped route's is 30s")
    parser.add_argument("--group-interval", default="1m", help="the shipped route's is 5m")
    parser.add_argument("--outage-starts", type=int, default=3)
    parser.add_argument(
        "--keep", type=Path, help="a new directory for the hosts' journals and state, kept"
    )
    args = parser.parse_args(argv)
    result = run(
        args.hosts,
        repeat_limit=args.repeat_limit,
        group_wait=args.group_wait,
        group_interval=args.group_interval,
        outage_starts=args.outage_starts,
        keep=args.keep,
    )
    print(json.dumps(result, indent=2) if args.format == "json" else _text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
