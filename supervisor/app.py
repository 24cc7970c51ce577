"""Wires the live daemon from a config: store, metrics, HTTP endpoint, systemd, Slack, watchdog.

`compose_daemon` is the composition root of the loop (structlog's `configure(processors=[...])`
is the model): the journal source, the pipeline, the replay, the checkpointer, the units' lanes,
the settler, the gates and the reloader are built here and handed to `Daemon`, which builds
none of its parts; a test hands in a source of its own (no journal) or any other part.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import structlog

from .actions.actor import Actor
from .actions.evidence import environment_of
from .actions.gatekeeper import GateServer, socket_path
from .actions.halt import Halter
from .actions.holds import Holds, hold_dir
from .actions.installed import InstalledUnits
from .actions.lanes import Lanes
from .actions.quarantine import (
    Quarantine,
    quarantine_dir,
    quarantine_records,
)
from .actions.sdnotify import Notifier, watchdog_interval
from .actions.systemd import SystemdClient
from .actions.unitnames import RealNames
from .actions.unitsettings import unit_gpus_of
from .actions.unitwatch import UnitWatch
from .classify.signatures import SignatureTable
from .classify.table import load_table
from .classify.xid import load_xid_catalog
from .config import DEFAULT_RUNTIME_DIR, Config, parse_listen
from .daemon import SHUTDOWN_GRACE_S, Daemon, Parts, supervised_machine_id
from .decide.address_evidence import AddressEvidence
from .decide.fleet import FleetEvidence
from .decide.hang import HangWatcher
from .decide.port_evidence import PortEvidence
from .decide.xid_evidence import XidEvidence
from .engines.profiles import install as install_engines
from .engines.profiles import load_engines
from .environment.drift import DriftRecorder
from .environment.log import EnvironmentLog
from .journal.kernel import KernelSource, read_driver_lines
from .journal.reader import JournalctlReader, ReaderSettings
from .loop.acting import Job
from .loop.checkpoint import Checkpointer, Position
from .loop.gates import GateService
from .loop.reload import PartReload, Reloader
from .loop.replay import Replay
from .loop.serving_again import ServingAgain
from .loop.settle import Settler
from .notify.fanout import Notifications, build_notifications
from .notify.slack import SlackSink
from .notify.webhook_reload import SlackReload, credential_source
from .pipeline import Pipeline
from .seams import (
    BatchHook,
    JournalSource,
    Notifying,
    OutcomeSource,
    StatusReporter,
    Task,
)
from .store import Checkpoint, Store
from .telemetry.http import (
    HealthCheck,
    MetricsServer,
    combine_health,
    following_check,
    sinks_check,
)
from .telemetry.metrics import Metrics
from .util.daemon_lock import DaemonLock, HostLock
from .util.files import make_dirs

log = structlog.get_logger(__name__)

# Where the host-wide lock is taken (the default runtime directory, whatever the config says):
# a test's own place, so a test daemon on the system journal never meets the host's.
HOST_LOCK_DIR_ENV = "VLLM_SUPERVISOR_HOST_LOCK_DIR"

CLOSE_BUDGET_S = 3.0  # sockets, the bus and the Slack client, closed together after the daemon


async def run_daemon(
    config: Config,
    stop: asyncio.Event,
    reload: asyncio.Event,
    *,
    reload_config: Callable[[], Config] | None = None,
) -> None:
    """Build every component, run the daemon until `stop`, and close everything in bounds.

    `reload_config` (SIGHUP) reads the config again; without it only the signature table is
    reloaded.
    """
    with DaemonLock(config.state.state_dir), _host_lock(config) as host:
        if host is not None and host.not_taken is not None:
            log.warning(
                "host_lock_not_taken",
                reason=host.not_taken,
                action="a second daemon on this host would not be refused",
            )
        await _run(config, stop, reload, reload_config or (lambda: config))


def _host_lock(config: Config) -> contextlib.AbstractContextManager[HostLock | None]:
    """The host-wide lock of a daemon on the system journal (none for a journal directory:
    several daemons may read one, each for its own host)."""
    if config.journal.directory is not None:
        return contextlib.nullcontext()
    return HostLock(Path(os.environ.get(HOST_LOCK_DIR_ENV) or DEFAULT_RUNTIME_DIR))


async def _run(
    config: Config, stop: asyncio.Event, reload: asyncio.Event, reload_config: Callable[[], Config]
) -> None:
    table = load_table(config, cached=True)
    xid_catalog = load_xid_catalog()  # read again at each reload (XidEvidence.reload)
    install_engines(load_engines())  # at each reload too, with the table (loop/reload.py)
    # Opening may upgrade the schema: in a thread, as every write.
    store, corrupt = await asyncio.to_thread(Store.recover_in_directory, config.state.state_dir)
    if corrupt is not None:
        log.error("state_database_corrupt", moved_to=str(corrupt), action="started afresh")
    metrics = Metrics()
    systemd = SystemdClient(timeout_s=config.systemd.stop_timeout_s)
    if config.systemd.enabled:
        try:
            await systemd.connect()
        except Exception as exc:
            log.error("systemd_unavailable", error=str(exc))
    control = systemd if config.systemd.enabled else None
    # A configured alias is supervised under the unit's real name, the one the journal carries;
    # a journal directory may hold another host's units: its names are kept as configured.
    names = RealNames(control if config.journal.directory is None else None)
    config = await names.resolve(config)
    notifier = Notifier()
    # Every sink (notify.fanout), one notifier; Slack's webhook at each reload is the one its
    # source names then (notify.webhook_reload).
    notify = build_notifications(
        config, store=store, metrics=metrics, quarantined=lambda: quarantine_records(config)
    )
    slack = _slack_reload(notify, config, control)
    halter = Halter(
        Quarantine(quarantine_dir(config)),
        control,
        attempts=config.systemd.stop_attempts,
        timeout_s=config.systemd.stop_timeout_s,
        # The interpreter the config names for a unit whose ExecStart= does not show it:
        # the halt's environment fingerprint reads that venv's packages.
        python_of=lambda unit: daemon.config.unit(unit).python,
    )
    gates: GateServer | None = None
    holds = Holds(hold_dir(config.state.runtime_dir))
    actor = Actor(
        halter,
        control,
        metrics,
        gate_waiting=lambda unit: gates is not None and gates.is_waiting(unit),
        holds=holds,
    )
    hangs = HangWatcher(config, systemd=control)
    # Per-unit metric series only for the units systemd has (see actions.installed).
    installed = InstalledUnits(
        control, units=lambda: [u.name for u in daemon.config.units], report=metrics.unit_loaded
    )

    def unit_changed(unit: str) -> None:
        daemon.unit_changed(unit)
        installed.changed(unit)

    watches: list[UnitWatch] = []
    if control is not None:
        # A state change of a supervised unit: read the journal now (see actions.unitwatch).
        watches.append(
            UnitWatch(
                control, units=lambda: [u.name for u in daemon.config.units], changed=unit_changed
            )
        )
    recorder = DriftRecorder(
        config,
        EnvironmentLog(store),
        exec_start=control.exec_start if control else None,
        on_snapshot=metrics.environment_snapshot,
    )
    machine_id = supervised_machine_id(config)
    ports = PortEvidence(
        config,
        machine_id=machine_id,
        unit_uid=control.unit_uid if control is not None else None,
    )
    journal = config.journal
    xids = XidEvidence(
        xid_catalog,
        counted=metrics.gpu_xid,
        gpus_of=lambda unit, pci: unit_gpus_of(control, unit, pci),
        machine_id=machine_id,
        lookup=None
        if not journal.kernel
        else lambda since, until: read_driver_lines(
            journal.journalctl, directory=journal.directory, since_s=since, until_s=until
        ),
    )
    # The fleet's proof at a first crash (supervisor.decide.fleet): this unit's environment is
    # read as a halt reads it, so two hosts' digests compare.
    fleet = FleetEvidence(
        config,
        environment=lambda unit: environment_of(
            unit, control, python=daemon.config.unit(unit).python
        ),
        counted=metrics.fleet_lookup,
        machine_id=machine_id,
    )
    kernel = KernelSource(xids.note, journalctl=journal.journalctl, directory=journal.directory)
    reader = journal_reader(config, store.load_checkpoint(), metrics)
    daemon = compose_daemon(
        config,
        table,
        reader=reader,
        store=store,
        metrics=metrics,
        actor=actor,
        notifier=notify,
        reporter=notifier,
        load_config=reload_config,
        hooks=[
            hangs,
            recorder,
            ports,
            AddressEvidence(config, machine_id=machine_id),
            xids,
            fleet,  # after the host's own evidence: a port, an address or an Xid decides alone
        ],
        tasks=[
            recorder.run,
            *([kernel.run] if journal.kernel else []),
            _watchdog(notifier),
            *(w.run for w in watches),
            installed.run,
        ],
        wakers=[notify.wake],
        sources=[hangs],
        names=names,
        reloaders=[xids.reload, *([slack.reload] if slack is not None else [])],
    )
    gates = GateServer(
        socket_path(config.state.runtime_dir),
        ready=daemon.gate_answer,
        released=daemon.released,
        wait_s=config.gate.wait_s,
    )

    def refresh_halted() -> None:
        records = quarantine_records(config)
        metrics.halted_units(set(records))
        metrics.halted_crashes(records)
        standing = holds.all()
        metrics.held_units({unit: hold.until for unit, hold in standing.items()}, time.time())

    def before_scrape() -> None:
        installed.wake()  # units configured by a reload are asked about
        refresh_halted()
        tracker = daemon.pipeline.tracker
        metrics.running_starts(tracker.running_starts(daemon.machine_id))
        metrics.start_phases(tracker.running_phases(daemon.machine_id))

    refresh_halted()
    metrics.reader_memory(reader.memory_bytes)
    metrics.reader_failures(lambda: reader.failures)

    server = MetricsServer(
        metrics,
        combine_health(
            following_check(metrics),
            _state_health(daemon),
            notify.health,
            sinks_check(notify.states()),
        ),
        before_scrape=before_scrape,
    )
    try:
        await _listen(config, server, gates)
        await daemon.run(stop, reload)
    finally:
        notifier.stopping()
        closing = [gates.close(), server.close(), systemd.close(), notify.aclose(), fleet.aclose()]
        await close_within(CLOSE_BUDGET_S, closing)
        await asyncio.to_thread(store.close)  # the writes still queued are finished first


def compose_daemon(
    config: Config,
    table: SignatureTable,
    *,
    store: Store,
    metrics: Metrics,
    reader: JournalSource | None = None,
    actor: Actor | None = None,
    notifier: Notifying | None = None,
    reporter: StatusReporter | None = None,
    load_config: Callable[[], Config] | None = None,
    hooks: Sequence[BatchHook] = (),
    tasks: Sequence[Task] = (),
    sources: Sequence[OutcomeSource] = (),
    wakers: Sequence[Callable[[], None]] = (),
    names: RealNames | None = None,
    reloaders: Sequence[PartReload] = (),
    shutdown_grace_s: float = SHUTDOWN_GRACE_S,
) -> Daemon:
    """The live daemon for `config`, its parts built around the `reader` given (by default the
    system journal's, or `journal.directory`, from the saved checkpoint)."""
    checkpoint = store.load_checkpoint()
    pipeline = Pipeline(
        config,
        table,
        policy_state=store.load_unit_states(),
        observer=metrics.outcome,
        on_skip=lambda: metrics.entry_invalid("pipeline_error"),
    )
    reader = reader or journal_reader(config, checkpoint, metrics)
    names = names or RealNames(None)
    lanes: Lanes[Job] = Lanes()
    parts = Parts(
        reader=reader,
        pipeline=pipeline,
        replay=Replay(checkpoint, pipeline),
        checkpointer=Checkpointer(
            store,
            metrics,
            notifier=notifier,
            interval_s=config.state.checkpoint_interval_s,
            retry_max_s=config.state.commit_retry_max_s,
            position=Position(checkpoint=checkpoint, memory=pipeline.memory()),
        ),
        lanes=lanes,
        # Ended invocations of this host are decided once journald has written their
        # processes' last lines and the reader has read them, not after the whole settle
        # window: only the system journal's own journald can be asked.
        settler=Settler(
            pipeline,
            reader,
            machine_id=supervised_machine_id(config),
            early=config.journal.directory is None,
        ),
        gates=GateService(pipeline, reader, lanes, names),
        reloader=Reloader(load_config, names=names, parts=reloaders, metrics=metrics),
    )
    metrics.register_units(u.name for u in config.units)
    metrics.signature_table(list(table.ids), True)
    return Daemon(
        config,
        parts,
        store=store,
        metrics=metrics,
        actor=actor,
        notifier=notifier,
        reporter=reporter,
        hooks=hooks,
        tasks=tasks,
        sources=sources,
        wakers=wakers,
        shutdown_grace_s=shutdown_grace_s,
        # Only a daemon that acts holds starts: its paced units' serving again ends the hold.
        serving_again=ServingAgain(Holds(hold_dir(config.state.runtime_dir)))
        if actor is not None
        else None,
    )


def journal_reader(config: Config, checkpoint: Checkpoint, metrics: Metrics) -> JournalctlReader:
    """The daemon's reader of the system journal (or `journal.directory`), from `checkpoint`."""
    return JournalctlReader(
        reader_settings(config),
        cursor=checkpoint.replay_from or checkpoint.cursor,
        inclusive=checkpoint.replay_from is not None,
        on_restart=metrics.source_restart,
        on_invalid=lambda n: metrics.entry_invalid("unparsable_entry"),
        on_following=metrics.following,
        on_gap=metrics.cursor_gap,
    )


def reader_settings(config: Config) -> ReaderSettings:
    """How the daemon reads the journal: following the configured units from where it left."""
    journal = config.journal
    start = journal.start_at
    if start == "auto":
        start = "head" if journal.directory is not None else "tail"
    return ReaderSettings(
        units=tuple(u.name for u in config.units),
        directory=journal.directory,
        journalctl=journal.journalctl,
        source=journal.reader,
        follow=True,
        start_at=start,
        on_bad_cursor=config.state.on_bad_cursor,
        backoff_s=journal.restart_backoff_s,
        backoff_max_s=journal.restart_backoff_max_s,
        max_line_chars=config.tracker.max_line_chars,
    )


async def close_within(budget_s: float, closing: list[Coroutine[Any, Any, None]]) -> None:
    """Close everything at once, for at most `budget_s` together (uvicorn's shutdown: wait with
    a budget, then cancel with a message); a close that fails or hangs never blocks the rest."""
    tasks = [asyncio.ensure_future(c) for c in closing]
    _, late = await asyncio.wait(tasks, timeout=budget_s)
    for task in late:
        task.cancel("shutdown: close took too long")
    if late:
        log.warning("close_timed_out", count=len(late), budget_s=budget_s)
    await asyncio.gather(*tasks, return_exceptions=True)


async def _listen(config: Config, server: MetricsServer, gates: GateServer) -> None:
    """Open the metrics port and the gates' socket; supervision goes on without either."""
    if config.metrics.enabled:
        host, port = parse_listen(config.metrics.listen, key="metrics.listen")
        try:
            await server.start(host, port)
        except OSError as exc:
            log.error(
                "metrics_unavailable",
                listen=config.metrics.listen,
                error=exc.strerror or str(exc),
                action="supervising without /metrics and /healthz; free the port or change "
                "metrics.listen, then restart",
            )
        else:
            log.info("metrics_listening", host=host, port=server.port)
    try:
        make_dirs(config.state.runtime_dir)
        await gates.start()
    except OSError as exc:
        log.error(
            "gate_socket_unavailable",
            path=str(gates.path),
            error=exc.strerror or str(exc),
            action="gates fall back to the quarantine records alone (a short RestartSec= "
            "may let one start through before a halt)",
        )


def _slack_reload(
    notify: Notifications, config: Config, control: SystemdClient | None
) -> SlackReload | None:
    """What applies a rewritten webhook URL at a reload, to the Slack sink and its lane."""
    lane = notify.edge("slack")
    if lane is None or not isinstance(lane.sink, SlackSink):
        return None
    return SlackReload(
        lane.sink,
        changed=lane.reset,
        timeout_s=config.slack.timeout_s,
        credential_source=credential_source(control) if control else None,
    )


def _state_health(daemon: Daemon) -> HealthCheck:
    """Healthy while every handled batch has reached the state database."""

    def check() -> tuple[bool, dict[str, Any]]:
        checkpointer = daemon.checkpointer
        pending = len(checkpointer.pending) + len(checkpointer.decisions)
        pending += len(checkpointer.undecided)
        error = checkpointer.commit_error
        reasons = [f"{pending} classified invocations not yet committed"] if pending else []
        if error is not None:
            reasons.append(f"state database not writable: {error}")
        return not reasons, {
            "state_errors": checkpointer.state_errors,
            "pending_commits": pending,
            "actions_under_way": daemon.lanes.pending(),  # decided, being carried out
            "last_verdict": daemon.state.last_verdict,
            "not_reloaded": daemon.state.not_reloaded,  # what waits for a restart
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
