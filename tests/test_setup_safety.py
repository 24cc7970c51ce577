"""`vllm-supervisor setup` installs only what root may trust and can run (issue 22, item 5).

setup runs as root and writes root's units: `ExecCondition=+PROGRAM` and the daemon's
`ExecStart=`. So it refuses a program (or its interpreter, its venv, any directory above them)
that another account could change, a program the daemon's sandbox hides, and a target
directory another account could write (planted temp-file symlinks); it checks everything
before it writes anything; and it warns about an inline webhook in a world-readable config and
about units systemd does not know.

The tests run setup as root into a fake / under the test's temp directory (the module's target
paths pointed there, systemd's commands recorded, not run); ownership is played with uid
65534 (nobody).
"""

from __future__ import annotations

import ctypes
import errno
import io
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from dbus_fast.aio import MessageBus
from fake_systemd import FakeService, FakeUnit, private_bus, served_from_a_thread
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_systemd_errors import UNIT_PATH, FakeManager

from vllm_supervisor.cli import main
from vllm_supervisor.commands import setup
from vllm_supervisor.config import load_config
from vllm_supervisor.errors import SupervisorError
from vllm_supervisor.util import safe_write

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plays file owners: needs root")

NOBODY = 65534
UNITS = ("vllm@0.service", "vllm@1.service")
TRUSTED_PROGRAM = Path("/usr/bin/true")  # root's, outside every directory the daemon cannot see
WEBHOOK = "https://hooks.slack.com/services/T000/B000/s3cr3t"
# Where the module's constants point; the daemon's unit and the credential live under /etc.
TARGETS = {
    "UNIT_DIR": "etc/systemd/system",
    "DAEMON_UNIT_FILE": "etc/systemd/system/vllm-supervisor.service",
    "ENVIRONMENTS_DROP_IN": "etc/systemd/system/vllm-supervisor.service.d/20-environments.conf",
    "SYSUSERS_FILE": "etc/sysusers.d/vllm-supervisor.conf",
    "POLKIT_FILE": "etc/polkit-1/rules.d/50-vllm-supervisor.rules",
    "CATALOG_FILE": "usr/local/lib/systemd/catalog/vllm-supervisor.catalog",
    "CREDENTIAL_FILE": "etc/vllm-supervisor/slack-webhook",
    "SHARE_DIR": "usr/local/share",  # the man page and the completions
}


@dataclass
class Host:
    """A fake / for setup to install into, and the systemd commands it ran."""

    top: Path  # the test's temp directory: root's, 0700; trust checks stop here
    root: Path
    config: Path
    runs: list[tuple[str, ...]] = field(default_factory=list)

    def run(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.runs.append(tuple(argv))
        return subprocess.CompletedProcess(list(argv), 0, "", "")

    def target(self, name: str) -> Path:
        return self.root / TARGETS[name]

    def planned(self) -> list[Path]:
        """Every file setup writes for UNITS (the served venvs need no bind: none)."""
        names = ("DAEMON_UNIT_FILE", "SYSUSERS_FILE", "POLKIT_FILE", "CATALOG_FILE")
        drop_ins = [self.target("UNIT_DIR") / f"{u}.d" / setup.DROP_IN for u in UNITS]
        docs = [self.target("SHARE_DIR") / name for name in setup.CLI_DOCS]
        return [*map(self.target, names), *drop_ins, *docs, self.target("CREDENTIAL_FILE")]

    def written(self) -> list[Path]:
        """Every file (not directory) under the fake /."""
        return sorted(p for p in self.root.rglob("*") if p.is_file() or p.is_symlink())

    def install(self, program: Path = TRUSTED_PROGRAM) -> str:
        out = io.StringIO()
        config = load_config(self.config)
        setup.install(config, config_path=self.config, program=str(program), out=out, run=self.run)
        return out.getvalue()


def write_config(path: Path, *, units: Sequence[str] = UNITS, extra: str = "") -> Path:
    path.parent.mkdir(mode=0o755, exist_ok=True)
    path.write_text("".join(f'[[unit]]\nname = "{u}"\n\n' for u in units) + extra)
    path.chmod(0o600)
    return path


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Host:
    tmp_path.chmod(0o700)
    root = tmp_path / "root"
    root.mkdir(mode=0o755)
    for name, relative in TARGETS.items():
        monkeypatch.setattr(setup, name, root / relative)
    monkeypatch.setattr(setup, "TRUST_TOP", tmp_path, raising=False)
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path}/no-bus")
    return Host(top=tmp_path, root=root, config=write_config(tmp_path / "conf" / "vs.toml"))


def make_dirs(path: Path, *, mode: int = 0o755) -> Path:
    for directory in [*reversed(path.parents), path]:
        if not directory.exists():
            directory.mkdir(mode=mode)
    return path


def make_venv(venv: Path) -> Path:
    """A venv's shape (pyvenv.cfg, bin/python, site-packages) with a console script; the
    program's path."""
    site = make_dirs(venv / "lib" / "python3.11" / "site-packages")
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\n")
    (site / "distutils-precedence.pth").write_text("import os\n")
    make_dirs(venv / "bin")
    python = venv / "bin" / "python"
    python.symlink_to("/usr/bin/python3")
    program = venv / "bin" / "vllm-supervisor"
    program.write_text(f"#!{python}\nfrom vllm_supervisor.cli import main\nmain()\n")
    program.chmod(0o755)
    return program


def chown_tree(path: Path, uid: int = NOBODY) -> None:
    os.lchown(path, uid, uid)
    for child in path.rglob("*"):
        os.lchown(child, uid, uid)


def refused(host: Host, program: Path = TRUSTED_PROGRAM) -> str:
    """setup's one-line refusal, after checking it wrote and ran nothing."""
    with pytest.raises(setup.SetupError) as info:
        host.install(program)
    message = str(info.value)
    assert "\n" not in message
    assert host.written() == [], "refused, yet setup wrote files"
    assert host.runs == [], "refused, yet setup ran systemd's commands"
    return message


# 1. A program (or its interpreter, its venv, a directory above) another account could change.


def venv_of_another_account(top: Path) -> tuple[Path, Path]:
    program = make_venv(top / "venv")
    chown_tree(top / "venv")
    return program, top / "venv"


def group_writable_bin(top: Path) -> tuple[Path, Path]:
    program = make_venv(top / "venv")
    os.chown(top / "venv" / "bin", 0, NOBODY)
    (top / "venv" / "bin").chmod(0o775)
    return program, top / "venv" / "bin"


def world_writable_parent(top: Path) -> tuple[Path, Path]:
    shared = make_dirs(top / "shared")
    shared.chmod(0o777)
    return make_venv(shared / "venv"), shared


def program_of_another_account(top: Path) -> tuple[Path, Path]:
    program = make_venv(top / "venv")
    os.chown(program, NOBODY, NOBODY)
    return program, program


def planted_pth(top: Path) -> tuple[Path, Path]:
    program = make_venv(top / "venv")
    pth = top / "venv" / "lib" / "python3.11" / "site-packages" / "zz-planted.pth"
    pth.write_text("import os; os.system('id > /tmp/owned')\n")
    os.chown(pth, NOBODY, NOBODY)
    return program, pth


def interpreter_in_a_venv_of_another_account(top: Path) -> tuple[Path, Path]:
    make_venv(top / "user-venv")
    chown_tree(top / "user-venv")
    program = make_dirs(top / "opt" / "bin") / "vllm-supervisor"
    program.write_text(f"#!{top}/user-venv/bin/python\nimport sys\n")
    program.chmod(0o755)
    return program, top / "user-venv"


def pip_trampoline_to_a_venv_of_another_account(top: Path) -> tuple[Path, Path]:
    make_venv(top / "user venv")
    chown_tree(top / "user venv")
    program = make_dirs(top / "opt" / "bin") / "vllm-supervisor"
    python = top / "user venv" / "bin" / "python"
    program.write_text(f"#!/bin/sh\n'''exec' \"{python}\" \"$0\" \"$@\"\n' '''\nimport sys\n")
    program.chmod(0o755)
    return program, top / "user venv"


@pytest.mark.parametrize(
    "situation",
    [
        venv_of_another_account,
        group_writable_bin,
        world_writable_parent,
        program_of_another_account,
        planted_pth,
        interpreter_in_a_venv_of_another_account,
        pip_trampoline_to_a_venv_of_another_account,
    ],
)
def test_setup_refuses_a_program_another_account_could_change(
    host: Host, situation: Callable[[Path], tuple[Path, Path]]
) -> None:
    """Root would run `ExecCondition=+PROGRAM`: code another account controls (a planted
    .pth runs at every interpreter start). Before: setup wrote the drop-ins anyway."""
    program, offending = situation(host.top)
    message = refused(host, program)
    assert f"{offending} " in message or message.startswith(f"{offending}:"), message
    assert "mode 0" in message and "owner" in message, message
    assert "/opt/vllm-supervisor" in message and "--program" in message, message


# 2. A target directory another account can write; planted temp-file symlinks.


def test_planted_temp_file_symlinks_do_not_redirect_roots_writes(host: Host) -> None:
    """A symlink at the temp name setup used to use (`.NAME.tmp-PID`) and at a few other names
    leaves its target untouched. Before: setup opened it with O_CREAT|O_TRUNC, truncating,
    chmodding and overwriting the target."""
    victim = host.top / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    for path in host.planned():
        make_dirs(path.parent)
        for name in (f".{path.name}.tmp-{os.getpid()}", f".{path.name}.tmp", f"{path.name}.tmp"):
            (path.parent / name).symlink_to(victim)
    host.install()
    assert victim.read_text() == "precious\n" and victim.stat().st_mode & 0o777 == 0o600
    for path in host.planned():
        assert path.is_file() and not path.is_symlink(), path
    assert host.target("CREDENTIAL_FILE").read_text() == ""


@pytest.mark.parametrize(
    ("directory", "owner", "mode"),
    [
        ("etc/vllm-supervisor", NOBODY, 0o755),
        ("etc/systemd/system", 0, 0o777),
        ("etc/polkit-1/rules.d", 0, 0o775),
        ("etc", NOBODY, 0o755),
    ],
)
def test_setup_refuses_a_target_directory_another_account_can_write(
    host: Host, directory: str, owner: int, mode: int
) -> None:
    """Another account could plant or swap files root then writes. Before: setup wrote there."""
    path = make_dirs(host.root / directory)
    os.chown(path, owner, NOBODY)
    path.chmod(mode)
    message = refused(host)
    assert str(path) in message and "chown root:root" in message, message


# 3. A program the daemon's sandbox hides: it would fail with status=203/EXEC.


def test_setup_refuses_a_program_under_tmp(host: Host) -> None:
    """PrivateTmp=yes gives the daemon its own /tmp. Before: setup installed it."""
    program = make_venv(host.top / "venv")
    message = refused(host, program)
    assert "PrivateTmp=" in message and "/opt/vllm-supervisor" in message, message


def test_setup_refuses_a_program_under_root(host: Host) -> None:
    """`python3 -m venv ~/vs` as root: ProtectHome=yes hides /root. Before: installed."""
    home = Path(tempfile.mkdtemp(prefix="vsup-test-", dir="/root"))
    try:
        message = refused(host, make_venv(home / "vs"))
    finally:
        shutil.rmtree(home)
    assert "ProtectHome=" in message and str(home) in message, message
    assert "/opt/vllm-supervisor" in message, message


# 4. Every check before the first write.


def test_a_target_directory_that_cannot_be_made_leaves_nothing_written(host: Host) -> None:
    """/etc/polkit-1 is a file: the rules directory cannot be made. Before: the unit and the
    sysusers entry were written, then an OSError's traceback."""
    blocker = make_dirs(host.root / "etc") / "polkit-1"
    blocker.write_text("")
    with pytest.raises(setup.SetupError, match="polkit-1"):
        host.install()
    assert host.written() == [blocker]
    assert host.runs == []


CLONE_NEWNS = 0x00020000


def in_private_mount_namespace(action: Callable[[], dict[str, object]], report: Path) -> None:
    """Run `action` in a forked child with its own mount namespace; its result in `report`."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNS) != 0:
                raise OSError(ctypes.get_errno(), "unshare")
            subprocess.run(["mount", "--make-rprivate", "/"], check=True)
            report.write_text(json.dumps(action()))
        except BaseException as exc:  # reported to the parent
            report.write_text(json.dumps({"child_failed": repr(exc)}))
            code = 1
        os._exit(code)
    os.waitpid(pid, 0)


def test_a_read_only_usr_leaves_nothing_written(host: Host) -> None:
    """The catalog goes under /usr: on a read-only /usr setup refuses before writing anything.
    Before: "setup on a read-only /usr leaves 3 of 7 files written" (and a traceback)."""
    usr = make_dirs(host.root / "usr")
    report = host.top / "report.json"

    def install_on_read_only_usr() -> dict[str, object]:
        subprocess.run(["mount", "--bind", usr, usr], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", usr], check=True)
        try:
            host.install()
        except Exception as exc:  # the parent judges it
            return {"error": type(exc).__name__, "message": str(exc)}
        return {"error": None}

    in_private_mount_namespace(install_on_read_only_usr, report)
    outcome = json.loads(report.read_text())
    if "child_failed" in outcome:
        pytest.skip(f"no private mount namespace here: {outcome['child_failed']}")
    assert outcome["error"] == "SetupError", outcome
    assert str(usr) in str(outcome["message"]) and "read-only" in str(outcome["message"])
    assert host.written() == []
    assert host.runs == []


# 5. Warnings: an inline webhook anyone can read; units systemd does not know.


def warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("vllm-supervisor: warning:")]


def test_an_inline_webhook_in_a_world_readable_config_is_warned_about(
    host: Host, capsys: pytest.CaptureFixture[str]
) -> None:
    """Anyone on the host could post to the channel. Before: not a word."""
    write_config(host.config, extra=f'[slack]\nwebhook_url = "{WEBHOOK}"\n')
    host.config.chmod(0o644)
    out = host.install()
    err = capsys.readouterr().err
    [line] = [w for w in warnings(err) if "webhook" in w]
    assert str(host.config) in line and str(host.target("CREDENTIAL_FILE")) in line, line
    assert WEBHOOK not in err + out and "s3cr3t" not in err + out
    host.config.chmod(0o640)
    host.install()
    assert not [w for w in warnings(capsys.readouterr().err) if "webhook" in w]


def test_systemd_that_cannot_be_asked_is_said_once(
    host: Host, capsys: pytest.CaptureFixture[str]
) -> None:
    """No system bus: setup says once that it could not check the units. Before: silence."""
    host.install()
    [line] = warnings(capsys.readouterr().err)
    assert "systemd" in line and "cannot" in line, line


@pytest.fixture
def systemd_bus(tmp_path: Path) -> Iterator[str]:
    """A fake systemd on a private bus, served from its own thread while setup (synchronous,
    its own event loop) asks it. Its LoadUnit answers NoSuchUnit for `missing.service`."""
    with private_bus(tmp_path) as address:

        async def serve() -> MessageBus:
            bus = await MessageBus(bus_address=address).connect()
            bus.export("/org/freedesktop/systemd1", FakeManager())
            bus.export(UNIT_PATH, FakeUnit())
            bus.export(UNIT_PATH, FakeService())
            await bus.request_name("org.freedesktop.systemd1")
            return bus

        with served_from_a_thread(serve):
            yield address


def test_a_unit_systemd_does_not_know_is_warned_about(
    host: Host, systemd_bus: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A typo in a unit name would gate nothing. Before: setup installed it silently."""
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", systemd_bus)
    write_config(host.config, units=("vllm.service", "missing.service"))
    host.install()
    [line] = warnings(capsys.readouterr().err)
    assert "missing.service" in line and "vllm.service" not in line, line


# Every refusal is one line on stderr and exit 2, no traceback.


def test_a_refusal_is_one_line_and_exit_2(
    host: Host, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    program, _ = venv_of_another_account(host.top)
    recorded = setup.install

    def install(*args: object, **kwargs: object) -> int:
        return recorded(*args, **{**kwargs, "run": host.run})  # type: ignore[arg-type]

    monkeypatch.setattr(setup, "install", install)
    code = main(["setup", "--config", str(host.config), "--program", str(program)])
    err = capsys.readouterr().err
    assert code == 2, err
    [line] = err.splitlines()
    assert line.startswith("vllm-supervisor: ") and "Traceback" not in err
    assert issubclass(setup.SetupError, SupervisorError)


# The parts, directly.


@given(
    st.text(
        alphabet=st.characters(blacklist_categories=["Cs", "Zs", "Cc"], blacklist_characters="\n"),
        min_size=1,
    ),
    st.text(alphabet=" \t-Eisu", max_size=8),
    st.text(max_size=40),
)
def test_the_shebang_command_is_the_first_word_of_the_first_line(
    command: str, options: str, rest: str
) -> None:
    head = f"#!{command}{' ' + options if options.strip() else ''}\n{rest}"
    assert setup.shebang_command(head) == command.split()[0]


@given(st.text(max_size=80))
def test_any_head_of_a_program_is_read_without_error(head: str) -> None:
    found = setup.shebang_command(head)
    assert found is None or (head.startswith("#!") and found in head.partition("\n")[0])


def test_env_and_pip_trampolines_name_the_python_behind_them(tmp_path: Path) -> None:
    program = tmp_path / "vllm-supervisor"
    program.write_text("#!/usr/bin/env python3\n")
    found = setup.program_interpreters(program)
    assert found[0] == Path("/usr/bin/env") and found[1].name == "python3", found
    program.write_text("#!/bin/sh\n'''exec' \"/opt/my venv/bin/python\" \"$0\" \"$@\"\n' '''\n")
    assert setup.program_interpreters(program) == [Path("/bin/sh"), Path("/opt/my venv/bin/python")]


HIDDEN = ("/home", "/root", "/run/user", "/tmp", "/var/tmp")
SEGMENT = st.text(alphabet="abcxyz0123456789._-", min_size=1, max_size=12).filter(
    lambda s: s not in (".", "..")
)


@given(st.sampled_from(HIDDEN), st.lists(SEGMENT, max_size=4))
def test_a_path_under_a_hidden_root_is_hidden_from_the_daemon(
    root: str, segments: list[str]
) -> None:
    said = setup.hidden_from_daemon(Path(root, *segments))
    assert said is not None and f"under {root}," in said, said


@given(
    st.sampled_from(("/opt", "/usr/local", "/srv", "/var/lib", "/homework", "/tmpfs", "/run")),
    st.lists(SEGMENT, max_size=4),
)
def test_a_path_elsewhere_is_seen_by_the_daemon(root: str, segments: list[str]) -> None:
    path = Path(root, *segments)
    assume(not any(path == Path(h) or Path(h) in path.parents for h in HIDDEN))
    assert setup.hidden_from_daemon(path) is None


@settings(max_examples=60, deadline=None)
@given(st.sampled_from((0, NOBODY)), st.sampled_from((0, NOBODY)), st.integers(0, 0o7777))
def test_only_root_and_no_group_or_world_write_is_trusted(uid: int, gid: int, mode: int) -> None:
    with tempfile.TemporaryDirectory() as base:
        path = Path(base) / "part"
        path.mkdir()
        os.chown(path, uid, gid)
        path.chmod(mode)
        found = safe_write.untrusted(path, top=path)
        changeable = uid != 0 or bool(mode & 0o002) or bool(mode & 0o020 and gid != 0)
        assert (found is not None) == changeable, (uid, gid, oct(mode), found)
        if found is not None:
            assert found.path == path and f"mode {mode & 0o7777:04o}" in str(found)


def test_a_write_failing_midway_leaves_nothing_written(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fills at the fourth file: every temp file and new directory is removed."""
    calls = []
    real = safe_write._write_all

    def fill_at_the_fourth(fd: int, data: bytes) -> None:
        calls.append(fd)
        if len(calls) == 4:
            raise OSError(errno.ENOSPC, "No space left on device", "the-fourth")
        real(fd, data)

    monkeypatch.setattr(safe_write, "_write_all", fill_at_the_fourth)
    with pytest.raises(setup.SetupError, match="nothing was changed"):
        host.install()
    assert list(host.root.rglob("*")) == [] and host.runs == []


def test_a_symlink_where_a_file_goes_is_refused_and_not_followed(host: Host) -> None:
    victim = host.top / "victim"
    victim.write_text("precious\n")
    make_dirs(host.target("POLKIT_FILE").parent)
    host.target("POLKIT_FILE").symlink_to(victim)
    with pytest.raises(setup.SetupError, match="not written by setup"):
        host.install()
    assert victim.read_text() == "precious\n"


def test_run_again_it_writes_nothing(host: Host) -> None:
    first = host.install()
    assert first.count("wrote") == len(host.planned()) - 1 and "created" in first
    again = host.install()
    assert "wrote" not in again and "0 file(s) changed" in again
    assert {p.stat().st_mode & 0o777 for p in host.planned()[:-1]} == {0o644}
    assert host.target("CREDENTIAL_FILE").stat().st_mode & 0o777 == 0o600
