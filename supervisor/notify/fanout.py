"""Every sink behind the one `Notifying` the daemon knows (Alertmanager's FanoutStage).

The sinks are plug-ins: each module of this package that defines `build_sink(config) -> Sink`
is one (`discover`), built for every config (off when not configured, so /healthz and `status`
show it). An edge-triggered sink gets its own `Outbox` lane over the shared outbox table; a
level-triggered one its own `LevelLoop`. The daemon queues a crash for every edge sink in the
batch's transaction (`writer_for`), wakes them all after a commit or a release (`wake`), and
runs them side by side (`run`): one sink's failures never hold another's deliveries.
"""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
import socket
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from ..config import Config
from ..model import Outcome
from ..store import Store, Writer
from ..telemetry.http import SinkState
from ..telemetry.metrics import Metrics
from .level import LevelLoop, Quarantined
from .outbox import Outbox
from .sink import Mode, Sink
from .told import ToldLedger, told_path

SinkFactory = Callable[[Config], Sink[Any, Any]]


def discover() -> list[SinkFactory]:
    """The `build_sink` of every module of this package that has one, by module name."""
    package = importlib.import_module(__package__ or "")
    factories: list[SinkFactory] = []
    for name in sorted(info.name for info in pkgutil.iter_modules(package.__path__)):
        factory = getattr(importlib.import_module(f"{package.__name__}.{name}"), "build_sink", None)
        if callable(factory):
            factories.append(factory)
    return factories


class Lane(Protocol):
    """What drives one sink: an edge sink's `Outbox`, a level sink's `LevelLoop`."""

    @property
    def sink(self) -> Sink[Any, Any]: ...

    async def run(self, stop: asyncio.Event) -> None: ...

    def wake(self) -> None: ...

    def state(self) -> SinkState: ...


class Notifications:
    """The sinks as one notifier (supervisor.seams.Notifying)."""

    def __init__(self, edges: Sequence[Outbox] = (), levels: Sequence[LevelLoop] = ()) -> None:
        self.edges = tuple(edges)
        self.levels = tuple(levels)
        self.lanes: tuple[Lane, ...] = (*self.edges, *self.levels)

    def edge(self, name: str) -> Outbox | None:
        """The lane of the edge sink called `name`."""
        return next((lane for lane in self.edges if lane.sink.name == name), None)

    def writer_for(self, outcome: Outcome) -> Writer:
        """Queue the crash for every edge sink, inside the batch's transaction."""
        writers = [lane.writer_for(outcome) for lane in self.edges]

        def write(db: sqlite3.Connection) -> None:
            for each in writers:
                each(db)

        return write

    async def run(self, stop: asyncio.Event) -> None:
        """Run every lane and loop until `stop`."""
        async with asyncio.TaskGroup() as group:
            for part in self.lanes:
                group.create_task(part.run(stop), name=f"notify-{part.sink.name}")

    def wake(self) -> None:
        """Look again now: a commit queued messages, or a unit was halted or released."""
        for part in self.lanes:
            part.wake()

    def hold(self, outcome: Outcome) -> None:
        """A crash whose batch could not be committed: each edge sink announces it from memory."""
        for lane in self.edges:
            lane.hold(outcome)

    def states(self) -> dict[str, Callable[[], SinkState]]:
        """Each sink's state for /healthz, by name."""
        return {part.sink.name: part.state for part in self.lanes}

    def health(self) -> tuple[bool, dict[str, Any]]:
        """For /healthz: every edge lane's backlog and failures (one lane: its own details)."""
        checks = [lane.health() for lane in self.edges]
        if len(checks) == 1:
            return checks[0]
        details: dict[str, Any] = {"outbox_depth": 0, "reasons": []}
        for _, found in checks:
            details["outbox_depth"] += found.get("outbox_depth") or 0
            details["reasons"] += found.get("reasons", [])
        return all(ok for ok, _ in checks), details

    async def aclose(self) -> None:
        """Close every sink's connections."""
        await asyncio.gather(*(part.sink.aclose() for part in self.lanes), return_exceptions=True)


def build_notifications(
    config: Config,
    *,
    store: Store,
    metrics: Metrics,
    quarantined: Quarantined,
    host: str | None = None,
    factories: Iterable[SinkFactory] | None = None,
) -> Notifications:
    """A lane or a loop for every sink `factories` (by default every plug-in) build."""
    host = host or socket.gethostname()
    edges: list[Outbox] = []
    levels: list[LevelLoop] = []
    for factory in discover() if factories is None else factories:
        sink = factory(config)
        if sink.mode is Mode.EDGE:
            told = ToldLedger(told_path(config.state.runtime_dir, sink.name))
            fleet_tells = config.fleet.share and config.alertmanager.url is not None
            edges.append(
                Outbox(store, sink, metrics, host=host, told=told, fleet_tells=fleet_tells)
            )
        else:
            levels.append(LevelLoop(sink, store, quarantined, metrics=metrics))
    return Notifications(edges, levels)
