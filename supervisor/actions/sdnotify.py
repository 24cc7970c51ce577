"""sd_notify(3) messages to systemd (READY=1, STATUS=, WATCHDOG=1, STOPPING=1).

The unit runs as `Type=notify` with `WatchdogSec=`: systemd considers the daemon started only
after READY=1 and restarts it when WATCHDOG=1 pings stop, which catches a wedged event loop.
Everything here is a no-op when NOTIFY_SOCKET is unset (a shell, the tests, `triage`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Protocol

import sdnotify


class _Sender(Protocol):
    def notify(self, state: str) -> None: ...


class Notifier:
    """Sends sd_notify messages when systemd asked for them, else does nothing."""

    def __init__(
        self, environ: Mapping[str, str] = os.environ, sender: _Sender | None = None
    ) -> None:
        self.enabled = bool(environ.get("NOTIFY_SOCKET"))
        self._sender: _Sender | None = sender
        if self._sender is None and self.enabled:
            # sdnotify reads NOTIFY_SOCKET itself and never raises unless debug=True, so a
            # vanished socket cannot take the daemon down.
            self._sender = sdnotify.SystemdNotifier()

    def ready(self, status: str | None = None) -> None:
        """Tell systemd the daemon is up (and optionally what it is doing)."""
        self._send("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def status(self, text: str) -> None:
        """Set the one-line status `systemctl status` shows."""
        self._send(f"STATUS={text}")

    def watchdog(self) -> None:
        """Ping the watchdog; call it every `watchdog_interval()` seconds."""
        self._send("WATCHDOG=1")

    def stopping(self) -> None:
        """Tell systemd a clean shutdown has begun."""
        self._send("STOPPING=1")

    def _send(self, state: str) -> None:
        if self._sender is not None:
            self._sender.notify(state)


def watchdog_interval(
    environ: Mapping[str, str] = os.environ, pid: int | None = None
) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec=), or None when no watchdog is set.

    Per sd_watchdog_enabled(3), WATCHDOG_PID, when set, names the process the watchdog is meant
    for; a child that inherited the environment must not ping.
    """
    usec = environ.get("WATCHDOG_USEC", "")
    if not (usec.isascii() and usec.isdigit()) or int(usec) == 0:
        return None
    watchdog_pid = environ.get("WATCHDOG_PID")
    if watchdog_pid and watchdog_pid != str(os.getpid() if pid is None else pid):
        return None
    return int(usec) / 1_000_000 / 2
