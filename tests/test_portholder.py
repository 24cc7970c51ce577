"""Who holds a port: a real listening process, found in /proc; and what the daemon makes of it.

The holder is a Python child this test starts (killed by its PID); the crash is the real vLLM
0.33 port-in-use log of the corpus (206), judged as the pipeline judges it. The parsers of
/proc's texts and of sock_diag's answers take any input (hypothesis).

The daemon's sandbox (`PrivateUsers=yes`) is a real user namespace here too: a reader in one
that maps root only (`unshare --user --map-root-user`) sees a holder of uid 991 as 65534, and
none of its open files, as the daemon does.
"""

from __future__ import annotations

import dataclasses
import io
import json
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_for
from corpus_judge import GOOD_START_S, failed_invocation, invocation_of, label_of
from hypothesis import example, given
from hypothesis import strategies as st

from vllm_supervisor.actions.evidence import evidence_of, still_holds
from vllm_supervisor.actions.quarantine import Quarantine
from vllm_supervisor.classify.classifier import Classifier
from vllm_supervisor.classify.signatures import load_signature_table
from vllm_supervisor.commands.gate import EXIT_QUARANTINED, gate_main
from vllm_supervisor.config import Config, DriftConfig, UnitConfig
from vllm_supervisor.decide.port_evidence import PortEvidence, port_of
from vllm_supervisor.environment import ports
from vllm_supervisor.environment.ports import (
    HIDDEN_UID,
    Holder,
    holders,
    listeners,
    parse_listeners,
    process_start,
    uid_of_cgroup,
    unit_of_cgroup,
    with_unit_uid,
)
from vllm_supervisor.environment.preflight import Status, check_port
from vllm_supervisor.environment.socket_cgroups import (
    cgroup_path,
    cgroup_pids,
    listening_cgroups,
    parse_dump,
)
from vllm_supervisor.environment.userns import IdMap, parse_uid_map
from vllm_supervisor.errors import SystemdError
from vllm_supervisor.model import (
    Action,
    Ended,
    Ending,
    Invocation,
    JournalEntry,
    LifecycleEvent,
    Outcome,
    Severity,
)
from vllm_supervisor.pipeline import Pipeline

UNIT = "vllm.service"
HOLDER_AGE_S = 0.3


def _started_of(pid: int) -> list[float]:
    """The start of a live process, as the holders' reading computes it."""
    started = ports._started(ports.PROC, pid)
    return [] if started is None else [started]


OVERFLOW_UID = 65534
# The daemon's namespace under PrivateUsers=yes on systemd 252 (its /proc/self/uid_map):
# root and its own user (993) mapped, nobody else.
SANDBOX = IdMap(((0, 0, 1), (993, 993, 1)))
HOST = IdMap()
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


def _listen(family: str, *, as_uid: int | None = None) -> Iterator[Listening]:
    setpriv = ["setpriv", f"--reuid={as_uid}", f"--regid={as_uid}", "--clear-groups"]
    process = subprocess.Popen(
        [*(setpriv if as_uid is not None else []), sys.executable, "-c", LISTENER, family],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    port = int(process.stdout.readline())
    # The tests' units start a moment (0.1 s) before their crash: a holder there before them
    # must be older than that, which a fast machine's fork-to-listen does not make it.
    wait_for(
        lambda: all(time.time() - (h.started or 0.0) >= HOLDER_AGE_S for h in holders(port)),
        timeout=10,
        what="the listener to be older than the units' starts",
    )
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
def listening_as_991() -> Iterator[Listening]:
    """The same, run as uid 991: another user than this test's (root)."""
    yield from _listen("4", as_uid=991)


@pytest.fixture
def listening4() -> Iterator[Listening]:
    """The same on 127.0.0.1 (/proc/net/tcp), which a wildcard bind collides with."""
    yield from _listen("4")


def _crash(*, started_s_ago: float, ended_s_ago: float = 0.5, invocation: str = "1" * 32) -> Ended:
    """The real port-in-use crash of vLLM 0.33 (corpus 206), read as the pipeline reads it."""
    label = label_of("206-real-vllm-port-in-use.log")
    now_us = int(time.time() * 1e6)
    inv = dataclasses.replace(
        invocation_of(label, invocation_id=invocation),
        started_us=now_us - int(started_s_ago * 1e6),
        ended_us=now_us - int(ended_s_ago * 1e6),
    )
    ended = _read(inv)
    assert ended.reading.signature == "port_in_use"
    assert ended.reading.severity is Severity.TRANSIENT
    return ended


def _read(inv: Invocation) -> Ended:
    reading, facts = Classifier(load_signature_table()).examine(inv)
    return Ended(invocation=inv, reading=reading, facts=facts)


def _pipeline(config: Config) -> Pipeline:
    return Pipeline(dataclasses.replace(config, drift=DriftConfig(good_start_s=GOOD_START_S)),
                    load_signature_table())  # fmt: skip


async def _decided(hook: PortEvidence, ended: Ended) -> Outcome:
    """Decided as the daemon decides it: the hook's evidence first, then the one decide."""
    pipeline = _pipeline(hook.config)
    return pipeline.decide(ended, await hook.evidence(ended, pipeline.evidence(ended)))


def _without_evidence(ended: Ended, config: Config) -> Outcome:
    """Decided with no port evidence at all."""
    pipeline = _pipeline(config)
    return pipeline.decide(ended, pipeline.evidence(ended))


def _as_the_sandbox_sees_it(port: int) -> list[Holder]:
    """The holders as the hardened daemon finds another user's: the uid hidden, the process
    named by the cgroup its socket was opened in (here put in a unit, as systemd would)."""
    return [
        dataclasses.replace(
            h, uid=None, user=None, pid=None, command=None, unit="blocker.service", pids=(h.pid,)
        )
        for h in holders(port)
        if h.pid is not None
    ]


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


READER = (
    "import json, sys\n"
    "from vllm_supervisor.environment.ports import holders, listeners\n"
    "port = int(sys.argv[1])\n"
    "seen = [s.uid for s in listeners(port)]\n"
    "found = [[h.uid, h.pid, h.describe()] for h in holders(port)]\n"
    "print(json.dumps({'seen': seen, 'found': found}))\n"
)


class TestHiddenUsers:
    """Another user's holder, read from a namespace that maps only some users (the daemon's
    PrivateUsers=yes): its uid is hidden, never named 65534; what can be known is named."""

    def test_a_holder_read_from_a_private_user_namespace_is_not_uid_65534(
        self, listening_as_991: Listening
    ) -> None:
        """Before: `a process of uid 65534`. The kernel shows 65534 for every unmapped uid;
        on this cgroup v1 host no cgroup names the holder either, so its uid is hidden."""
        reader = ["unshare", "--user", "--map-root-user", sys.executable, "-c", READER]
        out = subprocess.run(
            [*reader, str(listening_as_991.port)],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        answer = json.loads(out.stdout)
        assert answer["seen"] == [OVERFLOW_UID]  # what the namespace shows: the reproduction
        ((uid, pid, said),) = answer["found"]
        assert (uid, pid) == (None, None)
        assert said == f"a process ({HIDDEN_UID}; its PID is not visible to this daemon)"

    def test_the_same_holder_read_from_the_host_is_named(self, listening_as_991: Listening) -> None:
        (holder,) = holders(listening_as_991.port)
        assert (holder.uid, holder.pid) == (991, listening_as_991.process.pid)
        assert holder.owner().endswith("uid 991")
        assert holder.describe().endswith(f"({holder.owner()})")

    @pytest.mark.parametrize(
        ("ids", "seen", "hidden"),
        [
            (SANDBOX, OVERFLOW_UID, True),  # someone the sandbox cannot name
            (SANDBOX, 0, False),  # root is mapped
            (SANDBOX, 993, False),  # so is the daemon's own user
            (HOST, OVERFLOW_UID, False),  # on the host 65534 is the real nobody
            (IdMap(((0, 0, 1), (OVERFLOW_UID, OVERFLOW_UID, 1))), OVERFLOW_UID, False),
            (IdMap(((0, 0, 1),), overflow=65533), 65533, True),  # another overflowuid
        ],
    )
    def test_which_uid_is_hidden(self, ids: IdMap, seen: int, hidden: bool) -> None:
        assert ids.hides(seen) is hidden

    def test_the_sandbox_uid_map(self) -> None:
        """/proc/self/uid_map of the daemon under systemd 252's PrivateUsers=yes."""
        text = "         0          0          1\n       993        993          1\n"
        assert parse_uid_map(text) == SANDBOX.ranges
        assert parse_uid_map("0 0 4294967295\n") == HOST.ranges
        assert parse_uid_map("0 0\n") is None and parse_uid_map("") is None

    @pytest.mark.parametrize(
        ("uid", "ids", "named"),
        [
            (991, SANDBOX, 991),  # systemd's word fits: 991 is unmapped, it would show 65534
            (0, SANDBOX, None),  # root would have shown as 0: the unit changed users
            (993, SANDBOX, None),  # so would the daemon's own user
            (None, SANDBOX, None),  # systemd set none
            (991, HOST, None),  # a namespace that maps 991 hides nothing
        ],
    )
    def test_the_units_uid_fills_a_hidden_one_only_where_it_fits(
        self, uid: int | None, ids: IdMap, named: int | None
    ) -> None:
        hidden = Holder(port=8000, uid=None, inode=1, unit="blocker.service")
        assert with_unit_uid(hidden, uid, ids).uid == named
        visible = Holder(port=8000, uid=998, inode=1, unit="blocker.service")
        assert with_unit_uid(visible, uid, ids) == visible

    @pytest.mark.parametrize(
        ("path", "uid"),
        [
            ("/user.slice/user-991.slice/session-3.scope", 991),
            ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/x.service\n", 1000),
            ("/system.slice/blocker.service", None),
            ("/user.slice/user-.slice/x.scope", None),
        ],
    )
    def test_uid_of_a_user_slice(self, path: str, uid: int | None) -> None:
        assert uid_of_cgroup(path) == uid

    def test_describe_names_what_is_known(self) -> None:
        base = Holder(port=8000, uid=None, inode=1)
        assert base.describe() == (
            "a process (uid hidden by PrivateUsers=; its PID is not visible to this daemon)"
        )
        group = dataclasses.replace(base, unit="x.service", pids=tuple(range(10, 17)))
        assert group.describe() == (
            "a process of x.service (PIDs 10, 11, 12, 13, 14 and 2 more; "
            "uid hidden by PrivateUsers=)"
        )
        one = dataclasses.replace(
            base, uid=991, user="holder", pid=66, command="python3 -m http.server", unit="b.service"
        )
        assert (
            one.describe() == "PID 66 (python3 -m http.server) of b.service (user holder, uid 991)"
        )


class TestGate:
    def test_a_refused_start_names_who_holds_the_port_now(
        self, tmp_path: Path, listening_as_991: Listening
    ) -> None:
        """The gate runs as root (ExecCondition=+): where the daemon's record could only say
        the uid was hidden, the gate's refusal names the holder's PID and uid."""
        port, pid = listening_as_991.port, listening_as_991.process.pid
        record = {
            "reason": f"fatal: port {port} is held by a process ({HIDDEN_UID}; its PID is not "
            "visible to this daemon), which was there before this start",
            "evidence": {"kind": "port_held", "port": port},
        }
        Quarantine(tmp_path / "run" / "quarantine").write(UNIT, record)
        out = io.StringIO()
        code = gate_main(
            UNIT, tmp_path / "run", tmp_path / "state", wait_s=1.0, out=out, defaults=()
        )
        assert code == EXIT_QUARANTINED
        lines = out.getvalue().splitlines()
        assert lines[0].startswith(f"{UNIT}: start refused, quarantined: ")
        assert lines[1].startswith(f"{UNIT}: port {port} is still held by PID {pid} (")
        assert lines[1].endswith("uid 991)")

    def test_no_holder_line_for_other_evidence(self) -> None:
        assert still_holds({"evidence": {"kind": "missing_path", "path": "/x"}}) is None
        assert still_holds({"evidence": {"kind": "port_held", "port": "8000"}}) is None
        assert still_holds({}) is None


class TestSocketCgroups:
    """The cgroup a socket was opened in, from sock_diag, and the cgroup's directory."""

    def test_the_kernel_reports_the_listeners_cgroup(self, listening: Listening) -> None:
        """The real sock_diag answer has the socket /proc/net/tcp6 lists, with a cgroup id."""
        (listener,) = listeners(listening.port)
        opened_in = listening_cgroups(listening.port)
        assert set(opened_in) == {listener.inode}
        assert opened_in[listener.inode] > 0

    def test_a_cgroup_is_found_by_its_directorys_inode(self, tmp_path: Path) -> None:
        """cgroup2's ids are its directories' inode numbers (checked on the nspawn container's
        /sys/fs/cgroup/unified): the same walk finds a directory of any tree."""
        unit = tmp_path / "system.slice" / "blocker.service"
        unit.mkdir(parents=True)
        (unit / "cgroup.procs").write_text("66\n67\n")
        (tmp_path / "init.scope").mkdir()
        assert cgroup_path(tmp_path, unit.stat().st_ino) == "/system.slice/blocker.service"
        assert cgroup_pids(tmp_path, "/system.slice/blocker.service") == [66, 67]
        assert cgroup_path(tmp_path, tmp_path.stat().st_ino) is None  # the root names nothing
        assert cgroup_path(tmp_path, 1 << 62) is None
        assert cgroup_pids(tmp_path, "/init.scope") == []

    def test_a_sock_diag_answer(self) -> None:
        """One inet_diag_msg for port 8000 (inode 31337, cgroup 4242), then the dump's end."""
        message = (
            struct.pack("=BBBB", socket.AF_INET, 10, 0, 0)
            + struct.pack(">HH", 8000, 0)
            + bytes(44)
            + struct.pack("=IIIII", 0, 0, 128, OVERFLOW_UID, 31337)
            + struct.pack("=HH", 12, 21)
            + struct.pack("=Q", 4242)
        )
        data = struct.pack("=IHHII", 16 + len(message), 20, 2, 1, 0) + message
        data += struct.pack("=IHHII", 20, 3, 2, 1, 0) + bytes(4)
        ((found,), done) = parse_dump(data)
        assert (found.port, found.inode, found.cgroup_id, done) == (8000, 31337, 4242, True)

    @given(data=st.binary(max_size=300))
    @example(data=struct.pack("=IHHII", 20, 2, 0, 1, 0) + struct.pack("=i", -13))
    def test_any_sock_diag_bytes_parse_or_raise_oserror(self, data: bytes) -> None:
        try:
            found, _ = parse_dump(data)
        except OSError:
            return
        for diag in found:
            assert 0 <= diag.port < 65536 and diag.inode >= 0


class TestPortEvidence:
    async def test_a_holder_older_than_the_start_halts_the_first_crash(
        self, listening: Listening
    ) -> None:
        """The holder was there before the server started: no restart can bind the port."""
        hook = PortEvidence(_config(listening.port))
        outcome = await _decided(hook, _crash(started_s_ago=0.1))
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
        first = await _decided(hook, _crash(started_s_ago=3600))
        assert first.decision.action is Action.ALLOW_RESTART
        assert any("halted if it still holds it" in n for n in first.verdict.notes)
        second = await _decided(hook, _crash(started_s_ago=3600, invocation="2" * 32))
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
        outcome = await _decided(hook, _crash(started_s_ago=3600, invocation="3" * 32))
        assert (outcome.decision.action, outcome.decision.rule) == (Action.HALT, "port_held")
        assert "its PID is not visible to this daemon" in outcome.decision.reason
        assert outcome.verdict.confidence == "medium"

    async def test_a_hidden_holder_is_named_by_its_unit_and_systemds_uid(
        self, listening: Listening
    ) -> None:
        """Under PrivateUsers=yes the socket's cgroup names the unit and its processes, and
        systemd (D-Bus) the uid it runs that unit as: the reason names them, not uid 65534.
        The record keeps the port for the gate's re-check, though the log line has none."""
        seen: list[str] = []

        async def systemd_says(unit: str) -> int | None:
            seen.append(unit)
            return 991

        hook = PortEvidence(
            _config(listening.port),
            find=_as_the_sandbox_sees_it,
            unit_uid=systemd_says,
            ids=SANDBOX,
        )
        outcome = await _decided(hook, _crash(started_s_ago=0.1))
        assert (outcome.decision.action, outcome.decision.rule) == (Action.HALT, "port_held")
        assert seen == ["blocker.service"]
        named = f"a process of blocker.service (PIDs {listening.process.pid}; uid 991)"
        assert f"port {listening.port} is held by {named}" in outcome.decision.reason
        assert str(OVERFLOW_UID) not in outcome.decision.reason
        assert evidence_of(outcome) == {"kind": "port_held", "port": listening.port}

    async def test_a_uid_systemd_cannot_tell_is_said_to_be_hidden(
        self, listening: Listening
    ) -> None:
        """No answer over D-Bus: the halt stands on the socket, the uid is hidden, not 65534."""

        async def systemd_fails(unit: str) -> int | None:
            raise SystemdError("GetUnit: no answer in time", reason="timeout", retryable=True)

        hook = PortEvidence(
            _config(listening.port),
            find=_as_the_sandbox_sees_it,
            unit_uid=systemd_fails,
            ids=SANDBOX,
        )
        outcome = await _decided(hook, _crash(started_s_ago=0.1))
        assert outcome.decision.action is Action.HALT
        assert f"blocker.service (PIDs {listening.process.pid}; {HIDDEN_UID})" in (
            outcome.decision.reason
        )
        assert str(OVERFLOW_UID) not in " ".join((outcome.decision.reason, *outcome.verdict.notes))

    async def test_a_free_port_and_a_late_crash_change_nothing(self, listening: Listening) -> None:
        """No holder now: a restart can bind (noted). A crash read late: history, untouched."""
        crash = _crash(started_s_ago=0.1)
        config = _config(listening.port + 1 if listening.port < 65535 else 1)
        free = await _decided(PortEvidence(config), crash)
        assert free.decision == _without_evidence(crash, config).decision
        assert any("not held by another process now" in n for n in free.verdict.notes)
        late = _crash(started_s_ago=7200, ended_s_ago=3600)
        config = _config(listening.port)
        assert await _decided(PortEvidence(config), late) == _without_evidence(late, config)

    async def test_dry_run_reports_the_halt(self, listening: Listening) -> None:
        """A dry-run unit: the same judgement, marked, nothing to stop."""
        hook = PortEvidence(_config(listening.port, dry_run=True))
        outcome = await _decided(hook, _crash(started_s_ago=0.1))
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
        # The boot's time to the tick, where known, over btime's whole second.
        booted = process_start(stat, "btime 1700000000\n", 100, booted=1699999999.25)
        assert booted == 1700000004.25

    def test_a_live_process_start_is_within_a_tick_of_its_fork(self) -> None:
        before = time.time()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            started = next(iter(_started_of(child.pid)))
        finally:
            child.kill()
            child.wait(timeout=10)
        assert before - 0.05 <= started <= time.time(), (before, started)

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
        ranges = parse_uid_map(text)
        assert ranges is None or all(n >= 0 for r in ranges for n in r)
        uid = uid_of_cgroup(text)
        assert uid is None or (uid >= 0 and "/user-" in text)

    @given(
        ranges=st.lists(
            st.tuples(st.integers(0, 70000), st.integers(0, 70000), st.integers(0, 3000)),
            max_size=4,
        ),
        seen=st.integers(0, 70000),
        overflow=st.sampled_from([OVERFLOW_UID, 65533]),
    )
    @example(ranges=[(0, 0, 1), (993, 993, 1)], seen=OVERFLOW_UID, overflow=OVERFLOW_UID)
    def test_only_the_unmapped_overflow_uid_is_hidden(
        self, ranges: list[tuple[int, int, int]], seen: int, overflow: int
    ) -> None:
        """A uid map as any text could give it: hidden means the overflow uid, unmapped."""
        text = "".join(f"{a} {b} {c}\n" for a, b, c in ranges)
        ids = IdMap(parse_uid_map(text) or HOST.ranges, overflow)
        inside = any(a <= seen < a + c for a, _, c in ids.ranges)
        assert ids.hides(seen) is (seen == overflow and not inside)


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
        ended = _read(dataclasses.replace(crash.invocation, **change))  # type: ignore[arg-type]
        hook = PortEvidence(_config(listening.port), machine_id="a" * 32)
        assert await _decided(hook, ended) == _without_evidence(ended, hook.config)

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
        ended, config = _read(inv), _config(listening.port)
        assert (await _decided(PortEvidence(config), ended)).decision == (
            _without_evidence(ended, config).decision
        )

    async def test_halt_inferred_off_makes_it_a_note(self, listening: Listening) -> None:
        """`halt_inferred = false`: the holder is named, the unit restarts."""
        config = Config(units=(UnitConfig(name=UNIT, port=listening.port, halt_inferred=False),))
        outcome = await _decided(PortEvidence(config), _crash(started_s_ago=0.1))
        assert outcome.decision.action is Action.ALLOW_RESTART
        assert any("there before this start" in n for n in outcome.verdict.notes)
