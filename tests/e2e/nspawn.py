"""A real systemd in systemd-nspawn, for end-to-end tests (the recipe checked in docs/DESIGN.md §2).

`booted_container()` puts the spawner into fresh cgroups (one per v1 hierarchy, plus the
unified one, under the test process's own cgroups), boots the host's own OS tree volatile
(`-D / --volatile=yes`: a tmpfs root with the host's /usr read-only) with the given read-only
binds, waits by polling until the container's systemd reports `running` or `degraded`, and on
exit powers it off with SIGTERM to the nspawn process it started, then removes its cgroups.

Never start systemd outside such a container: on the bare machine it takes over the host.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
CGROUP_ROOT = Path("/sys/fs/cgroup")
BOOT_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0
_counter = itertools.count()


class NspawnError(RuntimeError):
    """The container could not be started, reached or stopped."""


def wait_for(
    probe: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.05
) -> T:
    """Poll `probe` until it returns a value other than None/False; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)  # A poll interval, not synchronisation: the probe decides.


def preflight() -> str | None:
    """Why nspawn cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("systemd-nspawn", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is missing (Debian packages systemd-container, util-linux)"
    if not (CGROUP_ROOT / "cgroup.procs").exists() and not (CGROUP_ROOT / "systemd").is_dir():
        return f"no usable cgroup hierarchy under {CGROUP_ROOT}"
    if Path("/proc/1/comm").read_text().strip() == "systemd":
        return "PID 1 is already systemd: use a VM or the host's systemd instead"
    return None


@dataclass
class Cgroups:
    """Fresh cgroups, one per hierarchy this process is in, created under its current ones."""

    name: str
    dirs: list[Path] = field(default_factory=list)

    def create(self) -> None:
        """Make the cgroup directories (cpuset needs its cpus/mems copied from the parent)."""
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            mount = _hierarchy_mount(controllers)
            if mount is None:
                continue
            parent = mount / path.lstrip("/")
            target = parent / self.name
            target.mkdir()
            self.dirs.append(target)
            if (parent / "cpuset.cpus").exists():
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    (target / knob).write_text((parent / knob).read_text())

    def procs_files(self) -> list[str]:
        """The cgroup.procs files a process writes its PID into to join these cgroups."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def remove(self, timeout: float = 10.0) -> None:
        """Remove the cgroups depth first once their processes are gone."""
        for top in self.dirs:
            wait_for(lambda top=top: _rmtree_cgroup(top), timeout=timeout, what=f"rmdir {top}")


def _hierarchy_mount(controllers: str) -> Path | None:
    if controllers == "":
        unified = CGROUP_ROOT / "unified"
        if unified.is_dir():
            return unified
        return CGROUP_ROOT if (CGROUP_ROOT / "cgroup.procs").exists() else None
    name = controllers.removeprefix("name=")
    mount = CGROUP_ROOT / name
    return mount if mount.is_dir() else None


def _rmtree_cgroup(top: Path) -> bool:
    if not top.exists():
        return True
    for dirpath, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
        with contextlib.suppress(FileNotFoundError, OSError):
            Path(dirpath).rmdir()
    return not top.exists()


@dataclass
class Container:
    """A booted container: run commands in it through nsenter."""

    nspawn_pid: int
    leader: int  # the container's PID 1, as seen from the host
    console_log: Path

    def run(
        self, *argv: str, check: bool = True, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside every namespace of the container."""
        cmd = ["nsenter", "-t", str(self.leader), "-a", *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise NspawnError(
                f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}"
                f" {proc.stdout.strip()}"
            )
        return proc

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`systemctl ARGS` inside the container."""
        return self.run("systemctl", *args, check=check)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """Unit properties as a dict (`systemctl show -p ...`)."""
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, *args: str) -> list[dict[str, str]]:
        """Journal entries as dicts (`journalctl -o json ARGS`), oldest first."""
        out = self.run("journalctl", "--no-pager", "-o", "json", "--all", *args).stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def write_file(self, path: str, text: str, mode: str = "0644") -> None:
        """Create a file inside the container (its /etc and /run are tmpfs)."""
        cmd = [
            "nsenter",
            "-t",
            str(self.leader),
            "-a",
            "sh",
            "-c",
            'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod "$2" "$1"',
            "sh",
            path,
            mode,
        ]
        subprocess.run(cmd, input=text, text=True, check=True, timeout=30, capture_output=True)

    def system_state(self) -> str | None:
        """`systemctl is-system-running`, or None while the manager cannot be reached."""
        proc = self.run("systemctl", "is-system-running", check=False, timeout=10)
        state = proc.stdout.strip()
        return state or None


@contextlib.contextmanager
def booted_container(
    binds: Sequence[tuple[str | Path, str]],
    *,
    workdir: Path,
    kernel_args: Sequence[str] = (),
    writable: Sequence[tuple[str | Path, str]] = (),
) -> Iterator[Container]:
    """Boot a container with read-only `binds` (host path, container path) and `writable`
    ones; tear it down after."""
    reason = preflight()
    if reason is not None:
        raise NspawnError(f"cannot run systemd-nspawn here: {reason}")
    cgroups = Cgroups(name=f"vsup-e2e-{os.getpid()}-{next(_counter)}")
    cgroups.create()
    console = workdir / "console.log"
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = _spawn(cgroups, binds, kernel_args, console, writable)
        container = _await_boot(proc, console)
        yield container
    finally:
        if proc is not None:
            _power_off(proc)
        cgroups.remove()


def _spawn(
    cgroups: Cgroups,
    binds: Sequence[tuple[str | Path, str]],
    kernel_args: Sequence[str],
    console: Path,
    writable: Sequence[tuple[str | Path, str]] = (),
) -> subprocess.Popen[bytes]:
    nspawn = [
        "systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "-D", "/",
        "--volatile=yes", "--console=pipe",
        *(f"--bind-ro={host}:{inside}" for host, inside in binds),
        *(f"--bind={host}:{inside}" for host, inside in writable),
        "-b", "systemd.firstboot=off", "systemd.unit=multi-user.target", *kernel_args,
    ]  # fmt: skip
    with console.open("wb") as log:
        return subprocess.Popen(
            _spawn_argv(nspawn, cgroups),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _spawn_argv(nspawn: list[str], cgroups: Cgroups) -> list[str]:
    """A shell that joins the fresh cgroups with its own PID, then becomes nspawn (same PID).

    So nothing of the container ever runs in the test's own cgroups.
    """
    files = cgroups.procs_files()
    # "$@" first holds the cgroup.procs files, then nspawn's argv; the loop stops at the split.
    script = (
        f'i=0; for f in "$@"; do [ $i -ge {len(files)} ] && break; '
        f'echo $$ > "$f" || exit 97; i=$((i+1)); done; shift {len(files)}; exec "$@"'
    )
    return ["sh", "-c", script, "sh", *files, *nspawn]


def _await_boot(proc: subprocess.Popen[bytes], console: Path) -> Container:
    def leader() -> int | None:
        # nspawn forks helpers before the container's init; PID 1 is the child running systemd.
        if proc.poll() is not None:
            raise NspawnError(f"systemd-nspawn exited {proc.returncode}: {_tail(console)}")
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        with contextlib.suppress(OSError):
            for pid in children.read_text().split():
                if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                    return int(pid)
        return None

    pid1 = wait_for(leader, timeout=BOOT_TIMEOUT_S, what="the container's PID 1")
    container = Container(nspawn_pid=proc.pid, leader=pid1, console_log=console)

    def booted() -> bool:
        if proc.poll() is not None:
            raise NspawnError(f"systemd-nspawn exited {proc.returncode}: {_tail(console)}")
        return container.system_state() in ("running", "degraded")

    wait_for(
        booted,
        timeout=BOOT_TIMEOUT_S,
        what="the container's systemd to finish booting",
        interval=0.2,
    )
    return container


def _power_off(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        # SIGTERM makes nspawn ask the container's systemd for a clean power-off.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()  # Only the nspawn process this harness started.
            proc.wait(timeout=STOP_TIMEOUT_S)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no console output)"
