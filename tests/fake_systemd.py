"""A real, private dbus-daemon, and the parts of systemd's D-Bus API a test puts on it.

Only systemd itself is faked: the bus, its policy and the D-Bus protocol are real. The unit and
service objects hold the properties the supervisor reads; each test sets the values it needs.
No `from __future__ import annotations`: dbus-fast reads the D-Bus signatures from the
property annotations at class creation.
"""

# ruff: noqa: F821 - the string annotations are D-Bus signatures, not Python names.

import asyncio
import contextlib
import shutil
import subprocess
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from dbus_fast.aio import MessageBus
from dbus_fast.service import PropertyAccess, ServiceInterface, dbus_property

# Anyone may own any name and call anything, unless `deny` (policy rules) says otherwise.
BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>{deny}
  </policy>
</busconfig>
"""


@contextlib.contextmanager
def private_bus(directory: Path, *, deny: str = "") -> Iterator[str]:
    """A dbus-daemon listening on a socket in `directory`; its address, until it is stopped."""
    daemon = shutil.which("dbus-daemon")
    assert daemon, "dbus-daemon is missing: install the Debian package dbus-daemon"
    config = directory / "bus.conf"
    config.write_text(BUS_CONFIG.format(socket=directory / "bus", deny=deny))
    proc = subprocess.Popen(
        [daemon, f"--config-file={config}", "--nofork", "--print-address"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()  # printed once the socket listens
        assert address.startswith("unix:"), f"dbus-daemon did not start: {address!r}"
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextlib.contextmanager
def served_from_a_thread(serve: Callable[[], Awaitable[MessageBus]]) -> Iterator[None]:
    """Run `serve` (which connects and exports a fake) on an event loop of its own thread, for
    a synchronous command under test that runs its own event loop in the main thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        bus = asyncio.run_coroutine_threadsafe(serve(), loop).result(timeout=10)
        yield
        loop.call_soon_threadsafe(bus.disconnect)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


class FakeUnit(ServiceInterface):
    """org.freedesktop.systemd1.Unit properties; a test may change them as it goes."""

    def __init__(
        self,
        *,
        active: str = "active",
        sub: str = "running",
        load_state: str = "loaded",
        invocation_id: bytes = b"",
        job: tuple[int, str] = (0, "/"),
        active_exit_us: int = 0,
    ) -> None:
        super().__init__("org.freedesktop.systemd1.Unit")
        self.active, self.sub, self.load_state = active, sub, load_state
        self.invocation_id = invocation_id
        self.job = job  # (id, path); (0, "/") when no job is pending
        self.active_exit_us = active_exit_us  # CLOCK_MONOTONIC; 0: never left "active"

    @dbus_property(access=PropertyAccess.READ)
    def ActiveState(self) -> "s":
        return self.active

    @dbus_property(access=PropertyAccess.READ)
    def SubState(self) -> "s":
        return self.sub

    @dbus_property(access=PropertyAccess.READ)
    def LoadState(self) -> "s":
        return self.load_state

    @dbus_property(access=PropertyAccess.READ)
    def InvocationID(self) -> "ay":
        return self.invocation_id

    @dbus_property(access=PropertyAccess.READ)
    def Job(self) -> "(uo)":
        return list(self.job)

    @dbus_property(access=PropertyAccess.READ)
    def ActiveExitTimestampMonotonic(self) -> "t":
        return self.active_exit_us


class FakeJob(ServiceInterface):
    """org.freedesktop.systemd1.Job: the type of a pending job."""

    def __init__(self, job_type: str) -> None:
        super().__init__("org.freedesktop.systemd1.Job")
        self.job_type = job_type

    @dbus_property(access=PropertyAccess.READ)
    def JobType(self) -> "s":
        return self.job_type


class FakeService(ServiceInterface):
    """org.freedesktop.systemd1.Service properties."""

    def __init__(
        self,
        *,
        n_restarts: int = 0,
        result: str = "success",
        main_pid: int = 0,
        exec_start: Sequence[list[Any]] = (),
        exec_condition: Sequence[list[Any]] = (),
    ) -> None:
        super().__init__("org.freedesktop.systemd1.Service")
        self.n_restarts, self.result, self.main_pid = n_restarts, result, main_pid
        self.exec_start = list(exec_start)
        self.exec_condition = list(exec_condition)

    @dbus_property(access=PropertyAccess.READ)
    def NRestarts(self) -> "u":
        return self.n_restarts

    @dbus_property(access=PropertyAccess.READ)
    def Result(self) -> "s":
        return self.result

    @dbus_property(access=PropertyAccess.READ)
    def MainPID(self) -> "u":
        return self.main_pid

    @dbus_property(access=PropertyAccess.READ)
    def ExecStart(self) -> "a(sasbttttuii)":
        return self.exec_start

    @dbus_property(access=PropertyAccess.READ)
    def ExecCondition(self) -> "a(sasbttttuii)":
        return self.exec_condition
