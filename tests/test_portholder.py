"""Who holds a port: a real listening process, found in /proc; and what the daemon makes of it.

The holder is a Python child this test starts (killed by its PID); the crash is the real vLLM
0.33 port-in-use log of the corpus (206), judged as the pipeline judges it. The parsers of
/proc's texts take any input (hypothesis).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from conftest import wait_for
from corpus_judge import failed_invocation, invocation_of, judge, label_of
from hypothesis import example, given
from hypothesis import strategies as st

from vllm_supervisor.classify.classifier import Classifier
from vllm_supervisor.classify.signatures import load_signature_table
from vllm_supervisor.commands.preflight import Status, check_port
from vllm_supervisor.config import Config, UnitConfig
from vllm_supervisor.decide.policy import RestartPolicy
from vllm_supervisor.decide.port_evidence import PortEvidence, port_of
from vllm_supervisor.environment.ports import (
    Holder,
    holders,
    parse_listeners,
    process_start,
    unit_of_cgroup,
)
from vllm_supervisor.model import (
    Action,
    Ending,
    JournalEntry,
    LifecycleEvent,
    Outcome,
    Severity,
)

UNIT = "vllm.service"
LISTENER = (
    "import socket, sys, time\n"
    "six = sys.argv[1] == '6'\n"
    "family, host = (socket.AF_INET6, '::1') if six else (socket.AF_INET, '127.0.0.1')\n"
    "s = socket.socket(family)\n"
    "s.bind((host, 0)); s.listen()\n"
    "print(s.getsockname()[1], flush=True)\n"
    "time.sleep(600)\n"
)


@dataclasses.dataclass
class Listening:
    process: subprocess.Popen[str]
    port: int


def _listen(family: str) -> Iterator[Listening]:
    process = subprocess.Popen(
        [sys.executable, "-c", LISTENER, family], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    port = int(process.stdout.readline())
    try:
        yield Listening(process, port)
    finally:
        process.kill()
        process.wait(timeout=10)


@pytest.fixture
def listening() -> Iterator[Listening]:
    """A process of ours listening on a free loopback port (IPv6: /proc/net/tcp6)."""
    yield from _listen("6")


@pytest.fixture
def listening4() -> Iterator[Listening]:
    """The same on 127.0.0.1 (/proc/net/tcp), which a wildcard bind collides with."""
    yield from _listen("4")


def _crash(
    *, started_s_ago: float, ended_s_ago: float = 0.5, invocation: str = "1" * 32
) -> Outcome:
    """The real port-in-use crash of vLLM 0.33 (corpus 206), as the pipeline decides it."""
    label = label_of("206-real-vllm-port-in-use.log")
    now_us = int(time.time() * 1e6)
    inv = dataclasses.replace(
        invocation_of(label, invocation_id=invocation),
        started_us=now_us - int(started_s_ago * 1e6),
        ended_us=now_us - int(ended_s_ago * 1e6),
    )
    verdict, phase = judge(Classifier(load_signature_table()), inv)
    assert verdict.signature == "port_in_use" and verdict.severity is Severity.TRANSIENT
    return Outcome(
        invocation=inv, verdict=verdict, decision=RestartPolicy().decide(inv, verdict, phase)
    )


def _config(port: int, *, dry_run: bool = False) -> Config:
    return Config(units=(UnitConfig(name=UNIT, port=port, dry_run=dry_run),))


def _starting(invocation: str) -> JournalEntry:
    return JournalEntry(
        cursor="s",
        realtime_us=int(time.time() * 1e6),
        message=f"Starting {UNIT}...",
        unit=UNIT,
        invocation_id=invocation,
        from_pid1=True,
        message_id=LifecycleEvent.STARTING.value,
    )


class TestHolders:
    def test_a_listening_process_is_found_by_pid_and_command(self, listening: Listening) -> None:
        """The socket in /proc/net/tcp6, its process by its open files, its command line."""
        (holder,) = holders(listening.port)
        assert holder.pid == listening.process.pid
        assert holder.command is not None and holder.command.startswith(sys.executable)
        assert holder.started is not None and holder.started <= time.time()
        assert holder.describe().startswith(f"PID {listening.process.pid} ({sys.executable} -c")
        listening.process.kill()
        listening.process.wait(timeout=10)
        wait_for(lambda: holders(listening.port) == [], timeout=10, what="the socket to close")

    def test_preflight_names_the_holder(self, listening4: Listening) -> None:
        """`preflight`'s port check fails and says who holds the port."""
        result = check_port(listening4.port, lambda ids, captures: None)
        assert result.status is Status.FAILED
        assert f"by PID {listening4.process.pid} ({sys.executable} -c" in result.detail


class TestPortEvidence:
    async def test_a_holder_older_than_the_start_halts_the_first_crash(
        self, listening: Listening
    ) -> None:
        """The holder was there before the server started: no restart can bind the port."""
        hook = PortEvidence(_config(listening.port))
        outcome = await hook.outcome(_crash(started_s_ago=0.1))
        assert (outcome.decision.action, outcome.decision.rule) == (Action.HALT, "port_held")
        assert outcome.verdict.severity is Severity.FATAL
        assert f"PID {listening.process.pid}" in outcome.decision.reason
        assert outcome.verdict.confidence == "high"

    async def test_a_younger_holder_halts_when_it_holds_the_port_at_the_next_crash(
        self, listening: Listening
    ) -> None:
        """A holder that came after the start (a person's test run?) may be gone at the next
        start: named, restarted; still there at the next crash: halted."""
        hook = PortEvidence(_config(listening.port))
        first = await hook.outcome(_crash(started_s_ago=3600))
        assert first.decision.action is Action.ALLOW_RESTART
        assert any("halted if it still holds it" in n for n in first.verdict.notes)
        second = await hook.outcome(_crash(started_s_ago=3600, invocation="2" * 32))
        assert (second.decision.action, second.decision.rule) == (Action.HALT, "port_held")

    async def test_an_invisible_holder_seen_at_the_start_halts_the_first_crash(
        self, listening: Listening
    ) -> None:
        """Under the hardened unit another user's open files are hidden: the socket that
        listened when PID 1 started the unit, still listening at its crash, is the proof."""

        def invisible(port: int) -> list[Holder]:
            return [
                dataclasses.replace(h, pid=None, command=None, started=None) for h in holders(port)
            ]

        hook = PortEvidence(_config(listening.port), find=invisible)
        hook.entries([_starting("3" * 32)])
        outcome = await hook.outcome(_crash(started_s_ago=3600, invocation="3" * 32))
        assert (outcome.decision.action, outcome.decision.rule) == (Action.HALT, "port_held")
        assert "its PID is not visible to this daemon" in outcome.decision.reason
        assert outcome.verdict.confidence == "medium"

    async def test_a_free_port_and_a_late_crash_change_nothing(self, listening: Listening) -> None:
        """No holder now: a restart can bind (noted). A crash read late: history, untouched."""
        crash = _crash(started_s_ago=0.1)
        free = await PortEvidence(
            _config(listening.port + 1 if listening.port < 65535 else 1)
        ).outcome(crash)
        assert free.decision == crash.decision
        assert any("not held by another process now" in n for n in free.verdict.notes)
        late = _crash(started_s_ago=7200, ended_s_ago=3600)
        assert await PortEvidence(_config(listening.port)).outcome(late) == late

    async def test_dry_run_reports_the_halt(self, listening: Listening) -> None:
        """A dry-run unit: the same judgement, marked, nothing to stop."""
        hook = PortEvidence(_config(listening.port, dry_run=True))
        outcome = await hook.outcome(_crash(started_s_ago=0.1))
        assert outcome.decision.dry_run
        assert outcome.decision.reason.startswith("dry run, would halt: fatal: port")


class TestParsers:
    def test_listeners_from_the_socket_table(self) -> None:
        """LISTEN (0A) rows only; the port is hex; malformed rows are skipped."""
        text = (
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid"
            "  timeout inode\n"
            "   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000  998"
            "        0 31337 1 0000000000000000 100 0 0 10 0\n"
            "   1: 0100007F:1F40 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  998"
            "        0 31338 1\n"
            "   2: garbage\n"
        )
        (found,) = parse_listeners(text)
        assert (found.port, found.uid, found.inode) == (8000, 998, 31337)

    @pytest.mark.parametrize(
        ("text", "unit"),
        [
            ("0::/system.slice/blocker.service\n", "blocker.service"),
            ("0::/user.slice/user-0.slice/session-3.scope\n", "session-3.scope"),
            ("12:pids:/x\n1:name=systemd:/system.slice/vllm.service\n", "vllm.service"),
            ("0::/system.slice/vllm.service/worker\n", "vllm.service"),
            ("0::/\n", None),
        ],
    )
    def test_unit_of_cgroup(self, text: str, unit: str | None) -> None:
        assert unit_of_cgroup(text) == unit

    def test_process_start(self) -> None:
        """starttime is field 22, after a command that may hold spaces and parentheses."""
        stat = "4242 (python3 (x) y) S 1 4242 4242 0 -1 4194560 " + " ".join(["0"] * 12) + " 500 1"
        assert process_start(stat, "cpu 1 2\nbtime 1700000000\n", 100) == 1700000005.0

    @pytest.mark.parametrize(
        ("captures", "text", "configured", "port"),
        [
            ({}, "OSError: [Errno 98] Address already in use", 8000, 8000),
            (
                {},
                "[Errno 98] error while attempting to bind on address ('0.0.0.0', 44319)",
                None,
                44319,
            ),
            ({}, "The server socket has failed to bind to [::]:29500 (errno: 98)", 8000, 29500),
            ({"port": "40290"}, "metrics_port at 40290 is not available", None, 40290),
            ({}, "OSError: [Errno 98] Address already in use", None, None),
        ],
    )
    def test_port_of_a_crash(
        self, captures: dict[str, str], text: str, configured: int | None, port: int | None
    ) -> None:
        """The message's own port first, the unit's configured port otherwise."""
        assert port_of(captures, text, configured) == port

    @given(text=st.text(max_size=400), ticks=st.integers(-5, 1000))
    @example(text="²", ticks=0)  # str.isdigit() is true for it, int() is not: found by this test
    def test_any_proc_text_parses_or_is_skipped(self, text: str, ticks: int) -> None:
        """No text breaks the parsers: they return what they understood."""
        for found in parse_listeners(text):
            assert found.port >= 0 and found.inode >= 0
        unit = unit_of_cgroup(text)
        assert unit is None or unit.endswith((".service", ".scope"))
        start = process_start(text, text, ticks)
        assert start is None or isinstance(start, float)
        port = port_of({"port": text}, text, None)
        assert port is None or 0 < port < 65536


class TestPortEvidenceLeavesOthersAlone:
    """What a review found halting on weak evidence: none of these may halt now."""

    @pytest.mark.parametrize(
        "change",
        [
            # A person's `systemctl stop` whose log holds the port line: an operator stop.
            pytest.param({"ending": Ending.STOPPED, "stop_requested": True}, id="operator-stop"),
            # It served (its serving line): it had bound its port; the line is not its end.
            pytest.param({"served_us": 1}, id="served"),
            # Another host's crash in a journal directory: this host's /proc says nothing.
            pytest.param({"host": "b" * 32}, id="other-host"),
        ],
    )
    async def test_no_halt(self, listening: Listening, change: dict[str, object]) -> None:
        crash = _crash(started_s_ago=0.1)
        inv = dataclasses.replace(crash.invocation, **change)  # type: ignore[arg-type]
        verdict, phase = judge(Classifier(load_signature_table()), inv)
        outcome = Outcome(
            invocation=inv, verdict=verdict, decision=RestartPolicy().decide(inv, verdict, phase)
        )
        hook = PortEvidence(_config(listening.port), machine_id="a" * 32)
        assert await hook.outcome(outcome) == outcome

    async def test_a_warning_about_the_port_is_no_bind_failure(self, listening: Listening) -> None:
        """`WARNING ... Port N is already in use, trying N+1`, then an unrelated exit: the
        warning names the port, the server went on; nothing is added."""
        now_us = int(time.time() * 1e6)
        inv = failed_invocation(
            [
                f"WARNING 11-30 10:00:01 [utils.py:3] Port {listening.port} is already in use,"
                f" trying {listening.port + 1}",
                "INFO 11-30 10:00:02 [loader.py:40] Loading weights took 3.1 s",
            ],
            started_us=now_us - 100_000,
            ended_us=now_us - 10_000,
        )
        verdict, phase = judge(Classifier(load_signature_table()), inv)
        outcome = Outcome(
            invocation=inv, verdict=verdict, decision=RestartPolicy().decide(inv, verdict, phase)
        )
        assert (await PortEvidence(_config(listening.port)).outcome(outcome)).decision == (
            outcome.decision
        )

    async def test_halt_inferred_off_makes_it_a_note(self, listening: Listening) -> None:
        """`halt_inferred = false`: the holder is named, the unit restarts."""
        config = Config(units=(UnitConfig(name=UNIT, port=listening.port, halt_inferred=False),))
        outcome = await PortEvidence(config).outcome(_crash(started_s_ago=0.1))
        assert outcome.decision.action is Action.ALLOW_RESTART
        assert any("there before this start" in n for n in outcome.verdict.notes)
