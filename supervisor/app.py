"""Wires the live daemon from a config: store, metrics, HTTP endpoint, systemd, Slack, watchdog."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import structlog

from supervisor import drift, hang
from supervisor.config import Config, parse_listen, resolve_webhook
from supervisor.daemon import Daemon
from supervisor.environment import EnvironmentLog
from supervisor.errors import ConfigError, SupervisorError
from supervisor.gatecmd import QUARANTINE_SUBDIR
from supervisor.halt import Halter
from supervisor.httpserver import HealthCheck, MetricsServer, combine_health, following_check
from supervisor.metrics import Metrics
from supervisor.notify.outbox import Outbox
from supervisor.notify.slack import SlackWebhook
from supervisor.quarantine import Quarantine
from supervisor.sdnotify import Notifier, watchdog_interval
from supervisor.signatures import SignatureTable, load_signature_table
from supervisor.store import Store
from supervisor.systemd import SystemdClient

log = structlog.get_logger(__name__)


def load_table(config: Config) -> SignatureTable:
    """The signature table the config names (the shipped one by default).

    Every unit's `signature_sets` is checked here, at load, so a typo stops the daemon with
    one line instead of failing at the first crash it classifies.
    """
    table = load_signature_table(list(config.signatures.paths) or None)
    for index, unit in enumerate(config.units):
        if unit.signature_sets:
            try:
                table.subset(unit.signature_sets)
            except SupervisorError as exc:
                raise ConfigError(f"unit[{index}].signature_sets: {exc}") from exc
    return table


def quarantine_dir(config: Config) -> Path:
    """Where halts are recorded: runtime (cleared at boot) unless persistence is asked for."""
    base = (
        config.state.state_dir if config.state.persistent_quarantine else config.state.runtime_dir
    )
    return base / QUARANTINE_SUBDIR


async def run_daemon(config: Config, stop: asyncio.Event, reload: asyncio.Event) -> None:
    """Build every component, run the daemon until `stop`, and close everything in bounds."""
    table = load_table(config)
    store, corrupt = Store.recover_in_directory(config.state.state_dir)
    if corrupt is not None:
        log.error("state_database_corrupt", moved_to=str(corrupt), action="started afresh")
    metrics = Metrics()
    systemd = SystemdClient(timeout_s=config.systemd.stop_timeout_s)
    if config.systemd.enabled:
        try:
            await systemd.connect()
        except Exception as exc:
            log.error("systemd_unavailable", error=str(exc))
    notifier = Notifier()
    webhook_url = resolve_webhook(config.slack)
    webhook = SlackWebhook(webhook_url, timeout_s=config.slack.timeout_s) if webhook_url else None
    outbox = Outbox(store, webhook, metrics, config.slack, host=socket.gethostname())
    halter_quarantine = Quarantine(quarantine_dir(config))
    halter = Halter(
        halter_quarantine,
        systemd if config.systemd.enabled else None,
        attempts=config.systemd.stop_attempts,
        timeout_s=config.systemd.stop_timeout_s,
    )
    daemon = Daemon(
        config,
        table,
        store=store,
        metrics=metrics,
        halter=halter,
        notifier=outbox,
        reporter=notifier,
        load_table=lambda: load_table(config),
        extra_tasks=[_watchdog(notifier)],
    )
    control = systemd if config.systemd.enabled else None
    hang.install(daemon, systemd=control, restarter=halter if control else None)
    drift.install(daemon, EnvironmentLog(store), exec_start=control.exec_start if control else None)
    for unit in halter_quarantine.list():
        metrics.units_halted(unit, True)
    server = MetricsServer(
        metrics, combine_health(following_check(metrics), _state_health(daemon), outbox.health)
    )
    try:
        if config.metrics.enabled:
            host, port = parse_listen(config.metrics.listen, key="metrics.listen")
            await server.start(host, port)
            log.info("metrics_listening", host=host, port=server.port)
        await daemon.run(stop, reload)
    finally:
        notifier.stopping()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.close(), 2)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(systemd.close(), 2)
        if webhook is not None:
            with contextlib.suppress(Exception):
                await webhook.aclose()
        store.close()


def _state_health(daemon: Daemon) -> HealthCheck:
    """Healthy while every handled batch has reached the state database."""

    def check() -> tuple[bool, dict[str, Any]]:
        pending, error = len(daemon.state.pending), daemon.state.commit_error
        reasons = [f"{pending} classified invocations not yet committed"] if pending else []
        if error is not None:
            reasons.append(f"state database not writable: {error}")
        return not reasons, {
            "state_errors": daemon.state.state_errors,
            "pending_commits": pending,
            "reasons": reasons,
        }

    return check


def _watchdog(notifier: Notifier) -> Callable[[asyncio.Event], Coroutine[None, None, None]]:
    async def ping(stop: asyncio.Event) -> None:
        interval = watchdog_interval(os.environ)
        if interval is None:
            return
        # Pinging from the event loop proves the loop itself is alive, not only the process.
        while not stop.is_set():
            notifier.watchdog()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    return ping
