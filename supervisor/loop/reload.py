"""Reloading (SIGHUP): the config, signature table and engine files read again, applied where they
can be.

The files are read off the event loop; a config or table that does not load changes nothing
(one error line, the table's health metric says so). Each part with settings of its own (the
Slack webhook's source) is handed the new config and names what only a restart applies; the
daemon then applies the rest (`Apply`) and names the restart-only keys.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import structlog

from ..actions.unitnames import RealNames
from ..classify.signatures import SignatureTable
from ..classify.table import load_table
from ..config import Config
from ..engines.profiles import Engines, load_engines
from ..engines.profiles import install as install_engines
from ..errors import SupervisorError
from ..telemetry.metrics import Metrics
from ..util.aio import first_of, name_of

log = structlog.get_logger(__name__)

# Handed the new config at each reload: applies what it can of it to its part (a webhook URL
# rewritten in its file or credential) and names what only a restart applies.
PartReload = Callable[[Config], Awaitable[list[str]]]
# Applies a loaded config and table to the daemon; the third argument names what the parts
# could not apply.
Apply = Callable[[Config, SignatureTable, list[str]], None]


class Reloader:
    """Reads the config and table again at each reload and hands them on."""

    def __init__(
        self,
        load_config: Callable[[], Config] | None,
        *,
        names: RealNames,
        parts: Sequence[PartReload] = (),
        metrics: Metrics,
    ) -> None:
        self._load_config = load_config
        self._names = names
        self._parts = tuple(parts)
        self._metrics = metrics

    async def run(
        self,
        stop: asyncio.Event,
        reload: asyncio.Event,
        apply: Apply,
        table: Callable[[], SignatureTable],
    ) -> None:
        """At each `reload`, until `stop`: load, hand to the parts, `apply`; `table` is the one
        in use (its health is reported as failing while a new one does not load)."""
        while not stop.is_set():
            await first_of(reload.wait(), stop.wait())
            if not reload.is_set():
                continue
            reload.clear()
            loaded = await asyncio.to_thread(self._load, table)  # file reads, off the loop
            if loaded is not None:
                config = await self._names.resolve(loaded[0])  # asks systemd
                pending = await self._reload_parts(config)
                install_engines(loaded[2])  # with `apply`, in one step of the loop
                apply(config, loaded[1], pending)

    async def _reload_parts(self, config: Config) -> list[str]:
        """Hand `config` to the parts; what they say only a restart applies (a part that
        fails is named itself: a reload never ends the daemon)."""
        pending: list[str] = []
        for part in self._parts:
            try:
                pending += await part(config)
            except Exception as exc:
                pending.append(f"{name_of(part)} (failed: {type(exc).__name__}: {exc})")
        return pending

    def _load(
        self, table: Callable[[], SignatureTable]
    ) -> tuple[Config, SignatureTable, Engines] | None:
        """The config, table and engine files on disk now; None (logged) when one does not
        load: then the running ones all stay in force."""
        if self._load_config is None:
            return None
        try:
            config = self._load_config()
            return config, load_table(config, cached=True), load_engines()
        except Exception as exc:  # a reload may refuse a config, never end the daemon
            error = str(exc) if isinstance(exc, SupervisorError) else repr(exc)
            self._metrics.signature_table(list(table().ids), False)
            log.error("config_reload_failed", error=error, action="kept the running config")
            return None
