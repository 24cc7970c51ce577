"""Every command: one line per mistake, no traceback, no write from a read (issue 22 item 8).

Each command runs in this process through `cli.main(argv)`, with its config and directories
in temp dirs. A run as another user forks and drops to `nobody` in the child (the interpreter
lives under a root-only directory, so a fresh `python` could not even start as nobody). The
fake systemd is a dbus-fast service on a private dbus-daemon; this file has no
`from __future__ import annotations` because dbus-fast reads D-Bus signatures from the method
annotations.
"""

# ruff: noqa: F821 - the string annotations of FakeManager/FakeUnit are D-Bus signatures.

import contextlib
import io
import json
import os
import shutil
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface, method
from fake_systemd import FakeService, FakeUnit, private_bus, served_from_a_thread
from fakedaemon import FakeDaemon
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

# Everything a command imports lazily, imported here: a child that dropped to `nobody` cannot
# read the interpreter's own library under /root any more.
import vllm_supervisor.app
import vllm_supervisor.classify.table
import vllm_supervisor.commands.check_config
import vllm_supervisor.commands.gate
import vllm_supervisor.commands.history
import vllm_supervisor.commands.preflight
import vllm_supervisor.commands.release
import vllm_supervisor.commands.run
import vllm_supervisor.commands.setup
import vllm_supervisor.commands.signatures
import vllm_supervisor.commands.sigtest
import vllm_supervisor.commands.status
import vllm_supervisor.commands.triage
import vllm_supervisor.environment.probe  # noqa: F401 - see above
from vllm_supervisor import cli
from vllm_supervisor.actions.quarantine import Quarantine
from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands.triage import collect
from vllm_supervisor.config import Config
from vllm_supervisor.store import Checkpoint, Store

UNIT = "vllm.service"
SHIPPED_SIGNATURES = Path(cli.__file__).parent / "data" / "signatures"
ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b]52;c;cm0gLXJmIC8=\x07"
CRASH = f"RuntimeError: CUDA error: an illegal memory access {ESCAPES}was encountered"
NOBODY = 65534


def run(argv: list[str]) -> tuple[int, str, str]:
    """`vllm-supervisor ARGV` in this process: (exit code, stdout, stderr).

    An exception escaping `main` fails the test here, with its traceback."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def assert_one_line(code: int, err: str, *words: str) -> None:
    """Exit 2 and exactly one line `vllm-supervisor: ...` naming every word."""
    assert code == 2, err
    assert "Traceback" not in err
    assert err.count("\n") == 1, err
    assert err.startswith("vllm-supervisor: "), err
    for word in words:
        assert word in err, err


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No config, state or bus of the host reaches a command run by these tests."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("VLLM_SUPERVISOR_CONFIG", str(write_config(tmp_path)))
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path}/no-bus")
    for name in ("STATE_DIRECTORY", "RUNTIME_DIRECTORY", "VLLM_SUPERVISOR_SLACK_WEBHOOK_URL"):
        monkeypatch.delenv(name, raising=False)


def write_config(root: Path, *, metrics_port: int = 1) -> Path:
    path = root / "config.toml"
    path.write_text(write_config_text(root, metrics_port=metrics_port), encoding="utf-8")
    return path


def write_config_text(root: Path, *, metrics_port: int = 1, unit: str = UNIT) -> str:
    return (
        f"[state]\nstate_dir = {json.dumps(str(root / 'state'))}\n"
        f"runtime_dir = {json.dumps(str(root / 'run'))}\n"
        f'[metrics]\nlisten = "127.0.0.1:{metrics_port}"\n[systemd]\nenabled = false\n'
        f"[[unit]]\nname = {json.dumps(unit)}\n"
    )


# --- 1. status of a unit systemd does not know -------------------------------------------


class FakeManager(ServiceInterface):
    """LoadUnit as systemd answers it: a path for every name, loaded or not."""

    def __init__(self) -> None:
        super().__init__("org.freedesktop.systemd1.Manager")

    @method()
    def LoadUnit(self, name: "s") -> "o":
        return "/org/freedesktop/systemd1/unit/" + ("vllm_2eservice" if name == UNIT else "x")


@pytest.fixture
def systemd_bus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A private dbus-daemon with a fake systemd on it, served from a thread of this process
    (the command under test runs its own event loop in the main thread)."""
    with private_bus(tmp_path) as address, served_from_a_thread(lambda: _serve_systemd(address)):
        monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", address)
        yield address


async def _serve_systemd(address: str) -> MessageBus:
    bus = await MessageBus(bus_address=address).connect()
    bus.export("/org/freedesktop/systemd1", FakeManager())
    bus.export("/org/freedesktop/systemd1/unit/vllm_2eservice", FakeUnit())
    bus.export("/org/freedesktop/systemd1/unit/vllm_2eservice", FakeService(main_pid=4242))
    bus.export(
        "/org/freedesktop/systemd1/unit/x",
        FakeUnit(active="inactive", sub="dead", load_state="not-found"),
    )
    await bus.request_name("org.freedesktop.systemd1")
    return bus


def test_status_of_a_unit_systemd_does_not_know_says_so(
    systemd_bus: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was `● nosuch.service: ok`: systemd's LoadState=not-found is "no such unit", exit 3
    even with the daemon running and healthy."""
    with FakeDaemon(tmp_path / "state", pid=os.getpid()) as daemon:
        config = write_config(tmp_path, metrics_port=daemon.port)
        monkeypatch.setenv("VLLM_SUPERVISOR_CONFIG", str(config))
        assert run(["status", UNIT])[0] == 0
        code, out, err = run(["status", "nosuch.service"])
    assert code == 3, out + err
    assert "● nosuch.service: no such unit" in out
    assert ": ok" not in out
    code, out, _ = run(["status", "--format", "json", "nosuch.service", UNIT])
    units = {u["unit"]: u for u in json.loads(out)["units"]}
    assert units["nosuch.service"]["exists"] is False
    assert units[UNIT]["exists"] is True and units[UNIT]["systemd"]["active_state"] == "active"


def test_status_without_systemd_does_not_claim_ok() -> None:
    """No bus to ask: the unit is not called ok, and why is said."""
    _, out, _ = run(["status", "nosuch.service"])
    assert ": ok" not in out
    assert "● nosuch.service: not halted, systemd state unknown" in out
    assert "systemd not reachable" in out


# --- 2. one line instead of a traceback ----------------------------------------------------


@pytest.mark.parametrize("port", ["99999", "0", "-1", "http"])
def test_preflight_port_out_of_range_is_one_line(port: str) -> None:
    code, _, err = run(["preflight", UNIT, f"--port={port}"])
    assert_one_line(code, err, "--port", port)


def test_signatures_test_of_a_missing_file_is_one_line(tmp_path: Path) -> None:
    code, _, err = run(["signatures", "test", str(tmp_path / "missing.log")])
    assert_one_line(code, err, "missing.log", "No such file")


@pytest.mark.parametrize("path", ["/proc/self/mem", "/proc"])
def test_signatures_test_of_an_unreadable_file_is_one_line(path: str) -> None:
    code, _, err = run(["signatures", "test", path])
    assert_one_line(code, err, path)


def test_demo_into_a_directory_it_cannot_create_is_one_line() -> None:
    code, _, err = run(["demo", "--directory", "/proc/x"])
    assert_one_line(code, err, "/proc/x")


def run_as_nobody(tmp_path: Path, argv: list[str]) -> tuple[int, str, str]:
    """`cli.main(argv)` in a forked child running as uid/gid 65534 with no groups."""
    out, err = tmp_path / "nobody.out", tmp_path / "nobody.err"
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 99
        try:
            with out.open("w") as o, err.open("w") as e:
                os.setgroups([])
                os.setresgid(NOBODY, NOBODY, NOBODY)
                os.setresuid(NOBODY, NOBODY, NOBODY)
                with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
                    try:
                        code = cli.main(argv)
                    except BaseException:
                        e.write(traceback.format_exc())
                        code = 99
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.read_text(), err.read_text()


@pytest.fixture
def open_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory `nobody` may reach (pytest's tmp_path is under a root-only one), holding
    the config; removed after the test."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to nobody")
    root = Path(tempfile.mkdtemp(prefix="vllm-supervisor-test-"))
    root.chmod(0o755)
    config = write_config(root)
    # The shipped signature table, where `nobody` can read it: the checkout may not be (a
    # clone in /root, mode 0700).
    shutil.copytree(SHIPPED_SIGNATURES, root / "signatures")
    with config.open("a", encoding="utf-8") as text:
        text.write(f"[signatures]\npaths = [{json.dumps(str(root / 'signatures'))}]\n")
    monkeypatch.setenv("VLLM_SUPERVISOR_CONFIG", str(config))
    yield root
    shutil.rmtree(root)


@pytest.fixture
def root_only_state(open_root: Path) -> Path:
    """A daemon's directories as root leaves them: a database, a record, all mode 0700."""
    Store.in_directory(open_root / "state").close()
    Quarantine(open_root / "run" / "quarantine").write(UNIT, {"signature": "sig"})
    for directory in (open_root / "state", open_root / "run", open_root / "run" / "quarantine"):
        directory.chmod(0o700)
    return open_root


def test_status_as_another_user_is_one_line(root_only_state: Path) -> None:
    """Was a PermissionError traceback from the quarantine directory: now "can't tell", 3."""
    code, out, err = run_as_nobody(root_only_state, ["status"])
    assert "Traceback" not in err, err
    assert code == 3, out + err
    assert "Permission denied" in out
    assert ": ok" not in out


def test_preflight_as_another_user_is_no_traceback(root_only_state: Path) -> None:
    """Was a PermissionError traceback from the state directory (drift since the last good
    start): the database is extra information, so the checks run without it."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 that nobody can run")
    code, out, err = run_as_nobody(root_only_state, ["preflight", UNIT, "--python", python])
    assert "Traceback" not in err, err
    assert code == 1, out + err  # the unreadable quarantine fails the check, closed
    assert "preflight vllm.service: " in out


# --- 3. a read never writes ------------------------------------------------------------------


def test_history_of_a_missing_state_directory_creates_nothing(tmp_path: Path) -> None:
    """Was: created /typo/state.sqlite3 and said "no classified invocation", exit 0."""
    typo = tmp_path / "typo"
    code, _, err = run(["history", "--state-dir", str(typo)])
    assert_one_line(code, err, f"no state database at {typo / 'state.sqlite3'}")
    assert not typo.exists()


def test_history_reads_without_writing(open_root: Path) -> None:
    """A database the daemon left (closed) is read as it is: no -wal/-shm made, no mode or
    schema fixed, so a user who may read it but not write it reads it (was exit 2: "cannot
    create the state directory")."""
    record_crash(open_root / "state")
    (open_root / "state").chmod(0o755)  # readable by all, writable by root only
    (open_root / "state" / "state.sqlite3").chmod(0o644)
    before = {p.name: p.stat() for p in (open_root / "state").iterdir()}
    code, out, err = run_as_nobody(open_root, ["history"])
    assert code == 0, err
    assert "illegal memory access" in out
    after = {p.name: p.stat() for p in (open_root / "state").iterdir()}
    assert after.keys() == before.keys()
    for name, stat in before.items():
        assert (after[name].st_mode, after[name].st_mtime_ns) == (stat.st_mode, stat.st_mtime_ns)


def test_history_of_a_file_that_is_no_database_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.sqlite3").write_bytes(b"\x00garbage" * 64)
    code, _, err = run(["history"])
    assert_one_line(code, err, "state.sqlite3")


# --- 4. terminal escapes in a crash line are shown, not obeyed --------------------------------


def record_crash(state_dir: Path) -> None:
    """The state database with one classified crash whose root cause holds escapes."""
    log = state_dir.parent / "crash.log"
    log.write_text(f"INFO starting\n{CRASH}\n", encoding="utf-8")
    config = Config()
    outcomes = collect(str(log), config=config, table=load_table(config))
    store = Store.in_directory(state_dir)
    try:
        store.commit_batch(checkpoint=Checkpoint(), outcomes=outcomes)
    finally:
        store.close()


def assert_visible(text: str) -> None:
    assert "illegal memory access" in text
    assert not any((ord(c) < 0x20 and c not in "\n\t") or 0x7F <= ord(c) < 0xA0 for c in text)
    assert "\\x1b]0;pwned\\x07" in text


def test_triage_shows_escapes_of_a_crash_line(tmp_path: Path) -> None:
    log = tmp_path / "crash.log"
    log.write_text(f"INFO starting\n{CRASH}\n", encoding="utf-8")
    code, out, _ = run(["triage", str(log)])
    assert code == 0
    assert_visible(out)
    code, out, _ = run(["triage", str(log), "--format", "json"])
    assert "\x1b" not in out and "\\u001b]0;pwned" in out


def test_history_shows_escapes_of_a_crash_line(tmp_path: Path) -> None:
    record_crash(tmp_path / "state")
    code, out, _ = run(["history"])
    assert code == 0
    assert_visible(out)
    code, out, _ = run(["history", "--format", "json"])
    assert "\x1b" not in out and "\\u001b]0;pwned" in out


def test_status_shows_escapes_of_a_crash_line(tmp_path: Path) -> None:
    record_crash(tmp_path / "state")
    Quarantine(tmp_path / "run" / "quarantine").write(
        UNIT, {"signature": "cuda_illegal_memory_access", "root_cause": CRASH}
    )
    code, out, _ = run(["status"])
    assert code == 1
    assert_visible(out)
    code, out, _ = run(["status", "--format", "json"])
    assert "\x1b" not in out and "\\u001b]0;pwned" in out


def test_signatures_test_shows_escapes_of_a_crash_line(tmp_path: Path) -> None:
    log = tmp_path / "crash.log"
    log.write_text(f"INFO starting\n{CRASH}\n", encoding="utf-8")
    code, out, _ = run(["signatures", "test", str(log)])
    assert code == 0
    assert_visible(out)


# --- 5. every subcommand, on generated arguments, paths and configs ---------------------------

PATHS = (
    "missing",
    "dir",
    "garbage.bin",
    "crash.log",
    "bad-utf8.log",
    "empty",
    "config.toml",
    "state",
    "/proc",
    "/proc/self/status",
    "/proc/self/mem",
    "/proc/self/fd",
)
UNITS = st.sampled_from([UNIT, "nosuch.service", "vllm@.service", "", "-", ESCAPES, "a/b"])
WORDS = st.sampled_from(["--format", "json", "text", "--unit", "--bogus", "-", "--", "--help"])
FORMATS = st.lists(st.sampled_from(["--format=json", "--format=text", "--format=yaml"]), max_size=1)


def toml_value() -> st.SearchStrategy[str]:
    """A TOML literal of any of the types a key may (wrongly) get."""
    return st.one_of(
        st.integers(-(2**70), 2**70).map(str),
        st.floats(allow_nan=False).map(repr),
        st.booleans().map(lambda b: str(b).lower()),
        st.text(max_size=20).map(json.dumps),
        st.sampled_from(PATHS).map(json.dumps),
        st.lists(st.text(max_size=8).map(json.dumps), max_size=3).map(lambda v: f"[{','.join(v)}]"),
    )


SECTIONS = {
    "state": ["state_dir", "runtime_dir", "persistent_quarantine", "on_bad_cursor"],
    "metrics": ["enabled", "listen"],
    "journal": ["directory", "start_at", "reader", "machine_id"],
    "tracker": ["head_lines", "tail_lines", "max_line_chars", "settle_s"],
    "slack": ["webhook_url", "webhook_url_file", "timeout_s", "min_interval_s"],
    "gate": ["wait_s"],
    "drift": ["packages", "good_start_s"],
    "signatures": ["paths"],
    "systemd": ["enabled", "stop_timeout_s"],
    "alertmanager": ["url", "resend_s"],
}


@st.composite
def configs(draw: st.DrawFn) -> str:
    """TOML text: valid, structured (known and unknown keys, any value type) or garbage."""
    kind = draw(st.sampled_from(["valid", "valid", "valid", "structured", "structured", "garbage"]))
    if kind == "garbage":
        return draw(st.text(max_size=200))
    if kind == "valid":
        return write_config_text(Path(), unit=draw(st.sampled_from([UNIT, "nosuch.service"])))
    parts = []
    for section in draw(st.lists(st.sampled_from(sorted(SECTIONS)), unique=True, max_size=4)):
        keys = draw(st.lists(st.sampled_from(SECTIONS[section]) | st.text(max_size=6), max_size=3))
        body = "".join(f"{json.dumps(k)} = {draw(toml_value())}\n" for k in keys)
        parts.append(f"[{section}]\n{body}")
    for _ in range(draw(st.integers(0, 2))):
        keys = draw(st.lists(st.sampled_from(["name", "port", "python", "dry_run"]), max_size=3))
        body = "".join(f"{k} = {draw(toml_value())}\n" for k in keys)
        parts.append(f"[[unit]]\n{body}")
    return "".join(parts)


@st.composite
def argvs(draw: st.DrawFn) -> list[str]:
    """An argv of one subcommand; `run`, `demo` and `setup` only in forms that cannot act."""
    path = st.sampled_from(PATHS)
    dirs = ["--state-dir", draw(path), "--runtime-dir", draw(path)]
    extra = draw(st.lists(WORDS, max_size=2)) if draw(st.integers(0, 4)) == 0 else []
    command = draw(
        st.sampled_from(
            [
                "triage", "check-config", "signatures list", "signatures test", "history",
                "gate", "release", "recheck", "status", "preflight", "setup", "run", "demo", "",
            ]
        )
    )  # fmt: skip
    config = draw(
        st.one_of(
            st.just([]), st.just([]), st.just(["--config", "config.toml"]), path.map(_config_flag)
        )
    )
    match command:
        case "triage":
            return ["triage", draw(path | st.just("-")), *config, *draw(FORMATS), *extra]
        case "check-config":
            return ["check-config", *draw(st.lists(path, max_size=1)), *extra]
        case "signatures list":
            return ["signatures", *config, "list", *extra]
        case "signatures test":
            return ["signatures", *config, "test", draw(path | st.just("-")), *extra]
        case "history":
            return ["history", *config, *dirs[:2], *draw(FORMATS), *extra]
        case "gate" | "release" | "recheck":
            return [command, draw(UNITS), *config, *dirs, *extra]
        case "status":
            units = draw(st.lists(UNITS, max_size=2))
            return ["status", *units, *config, *dirs, *draw(FORMATS), *extra]
        case "preflight":
            port = draw(st.lists(st.integers(-5, 70000).map(str) | st.text(max_size=5), max_size=1))
            python = draw(st.lists(path, max_size=1))
            return [
                "preflight", draw(UNITS), *config, *dirs, *draw(FORMATS),
                *(f"--port={p}" for p in port), *(f"--python={p}" for p in python), *extra,
            ]  # fmt: skip
        case "setup":
            return ["setup", "--print", "--config", draw(path), *extra]
        case "run" | "demo":
            return [command, *extra, "--no-such-flag"]  # argparse refuses: it never runs
    return [*extra, *draw(st.lists(st.text(max_size=8), max_size=2))]


def _config_flag(path: str) -> list[str]:
    return ["--config", path]


def make_files(root: Path, config: str, garbage: bytes, state: str) -> None:
    """The paths PATHS names (relative ones under `root`, the working directory)."""
    (root / "dir").mkdir()
    (root / "dir" / "x.journal").write_bytes(garbage)
    (root / "garbage.bin").write_bytes(garbage)
    (root / "crash.log").write_text(f"INFO starting\n{CRASH}\n", encoding="utf-8")
    (root / "bad-utf8.log").write_bytes(b"RuntimeError: \xff\xfe\x1b[2J\n")
    (root / "empty").write_bytes(b"")
    (root / "config.toml").write_text(config, encoding="utf-8", errors="surrogateescape")
    (root / "state").mkdir()
    if state == "garbage database":
        (root / "state" / "state.sqlite3").write_bytes(garbage)
    elif state == "lock is a directory":
        (root / "state" / "daemon.lock").mkdir()
    elif state == "garbage record":
        (root / "state" / "quarantine").mkdir()
        (root / "state" / "quarantine" / f"{UNIT}.json").write_bytes(garbage)


@settings(
    max_examples=int(os.environ.get("CLI_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    argv=argvs(),
    config=configs(),
    garbage=st.binary(max_size=64),
    stdin=st.binary(max_size=64),
    state=st.sampled_from(["", "garbage database", "lock is a directory", "garbage record"]),
    config_from_env=st.booleans(),
)
def test_every_command_answers_in_one_line_never_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    config: str,
    garbage: bytes,
    stdin: bytes,
    state: str,
    config_from_env: bool,
) -> None:
    """No argv, path, file content or config makes a command raise or print a traceback; its
    exit status is one of the documented ones, and a 2 comes with `vllm-supervisor: ...`
    lines only, none of them the last net's "please report"."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_files(root, config, garbage, state)
        monkeypatch.chdir(root)
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin)))
        # Without --config a command reads $VLLM_SUPERVISOR_CONFIG: this example's generated
        # config, or a valid one in this example's directory (never the host's).
        base = write_config(root / "dir")
        monkeypatch.setenv(
            "VLLM_SUPERVISOR_CONFIG", str(root / "config.toml" if config_from_env else base)
        )
        code, _, err = run(argv)
    event(f"{argv[0] if argv else '(none)'} exit {code}")
    assert "Traceback" not in err
    assert cli.UNEXPECTED not in err, err
    assert code in (0, 1, 2, 3), (code, err)
    if code == 2:
        lines = err.splitlines()
        assert lines, "exit 2 without a word"
        assert all(line.startswith("vllm-supervisor:") for line in lines), err
