"""Another host's proof at this host's first crash, read from the fleet's shared Alertmanager.

A rollout of one image to many hosts crashes them all the same way. The first host proves an
unknown crash fatal the slow way (its own repeats) and halts; its daemon publishes the halt as
an alert (supervisor.fleet, written by the Alertmanager sink every daemon already pushes to).
`FleetEvidence` is the hook that reads it back: at a crash the policy would let restart (an
unknown crash, not leaning transient), it asks Alertmanager (API v2, `GET /api/v2/alerts` with
label matchers) for another host's own halt of the same crash fingerprint in the same
environment digest, begun within `fleet.window_s`, kept alive by its daemon and not resolved
(a `release` on that host resolves it; supervisor.fleet.proofs). The policy then halts at this
first crash (rule `fleet_proof`), citing the proof. Only this machine's crashes ask: the
environment read is this machine's units'.

Alertmanager is the store because the fleet runs it already; no new server, no gossip of our
own. Its API is readable by any daemon and its alerts carry labels Alertmanager can filter on.

Safe by construction: nothing read here can halt a host whose own crash differs (the
fingerprints are this host's own, and the proof must name both); the store unreachable, slow
or answering nonsense leaves the local decision as it was, within `fleet.timeout_s`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog

from ..config import Config
from ..environment.fingerprint import fleet_digest
from ..fleet import filters, proofs
from ..model import Basis, Ended, Evidence, FleetProof, JournalEntry, Severity
from ..util.http import one_line, read_bounded
from ..util.jsontext import loads
from ..util.urls import redact_all
from .policy import names_no_cause
from .port_evidence import crash_here_now

if TYPE_CHECKING:
    import httpx

log = structlog.get_logger(__name__)

# A reply of this many alerts is plenty (a rollout's hosts); a larger one is cut, not parsed.
MAX_REPLY_BYTES = 4 << 20

# What the unit ran with, as supervisor.environment.fingerprint.take reads it (None: unread).
EnvironmentOf = Callable[[str], Awaitable[dict[str, Any] | None]]


class FleetEvidence:
    """The daemon's hook: another host's halt of this crash, when the fleet has one."""

    def __init__(
        self,
        config: Config,
        *,
        environment: EnvironmentOf,
        counted: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.time,
        transport: httpx.AsyncBaseTransport | None = None,
        machine_id: str | None = None,
    ) -> None:
        self._environment = environment
        self._machine_id = machine_id  # this host's: its units' environment is read here
        self._counted = counted or (lambda _result: None)
        self._clock = clock
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self.reconfigure(config)

    @property
    def on(self) -> bool:
        """Whether crashes ask the fleet at all."""
        return self._urls != ()

    def entries(self, batch: list[JournalEntry]) -> list[JournalEntry]:
        return batch

    def reconfigure(self, config: Config) -> None:
        fleet = config.fleet
        urls = config.alertmanager.urls()
        self._urls = tuple(url.rstrip("/") for url in urls) if fleet.share else ()
        self._host = host_name(config)
        self._window_s = fleet.window_s
        self._timeout_s = fleet.timeout_s
        self._config = config

    async def evidence(self, ended: Ended, evidence: Evidence) -> Evidence:
        """`evidence` with the fleet's proof for this crash, when one applies; unchanged when
        none does, the crash is not one a proof could decide, or the fleet does not answer.
        The unit's environment is read within half of `fleet.timeout_s`, Alertmanager asked
        within what is left."""
        inv, crash = ended.invocation, ended.reading.fingerprint
        if not self.on or crash is None or not self._worth_asking(ended, evidence):
            return evidence
        started = time.monotonic()
        try:
            async with asyncio.timeout(self._timeout_s / 2):
                digest = fleet_digest(await self._environment(inv.unit or ""))
        except Exception:  # a timeout or a fault of our own: nothing to compare
            digest = None
        if digest is None:
            self._counted("no_environment")
            return evidence
        left = max(0.05, self._timeout_s - (time.monotonic() - started))
        try:
            async with asyncio.timeout(left):
                found = await self._proofs(crash, digest)
        except TimeoutError:
            self._unanswered(inv.unit, f"no answer within {self._timeout_s:g} s")
            return evidence
        except Exception as exc:  # the store's fault is never the daemon's
            self._unanswered(inv.unit, self._redact(f"{type(exc).__name__}: {exc}"))
            return evidence
        self._counted("proof" if found else "none")
        if not found:
            return evidence
        log.info("fleet_proof", unit=inv.unit, crash=crash, host=found[0].host)
        return dataclasses.replace(evidence, fleet=found[0])

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self._client is not None:
            await self._client.aclose()

    def _worth_asking(self, ended: Ended, evidence: Evidence) -> bool:
        """Only a present crash the policy would let restart, with a cause to fingerprint: a
        known fatal halts anyway, a transient one never may, a host's own port or GPU
        decides on its own evidence."""
        inv, reading = ended.invocation, ended.reading
        if not (inv.failed or reading.crashed):
            return False
        if evidence.xid is not None or evidence.port is not None or evidence.address is not None:
            return False
        if Severity.TRANSIENT in (reading.severity, reading.leaning):
            return False
        if reading.severity is Severity.FATAL and reading.basis is Basis.SIGNATURE:
            return False
        if names_no_cause(inv, reading):
            return False  # no line names its cause: the policy never halts on it
        # This machine's unit, its crash just now: its environment is read here, now.
        return crash_here_now(inv, self._clock(), self._config, self._machine_id)

    async def _proofs(self, crash: str, digest: str) -> list[FleetProof]:
        """The proofs the Alertmanagers of the cluster hold, asked at once (one hanging costs
        nothing): the first reply that holds one; [] when every one answered without; raises
        when none answered (an instance that just restarted empty answers, and is not all)."""
        params = {"filter": filters(crash, digest), "active": "true"}
        asked = [asyncio.ensure_future(self._get(f"{u}/api/v2/alerts", params)) for u in self._urls]
        failed: BaseException | None = None
        answered = False
        try:
            for answer in asyncio.as_completed(asked):
                try:
                    body = await answer
                except Exception as exc:  # another instance may answer
                    failed = exc
                    continue
                answered = True
                found = proofs(
                    body,
                    crash=crash,
                    environment=digest,
                    not_host=self._host,
                    now=self._clock(),
                    window_s=self._window_s,
                )
                if found:
                    return found
            if answered or failed is None:
                return []
            raise failed
        finally:
            for task in asked:
                task.cancel()

    async def _get(self, endpoint: str, params: dict[str, Any]) -> object:
        client = self._connection()
        async with client.stream("GET", endpoint, params=params) as reply:
            body = await read_bounded(reply, MAX_REPLY_BYTES)
            if not reply.is_success:
                text = one_line(body[:200].decode("utf-8", "replace"))
                raise RuntimeError(f"HTTP {reply.status_code}: {text}")
        if len(body) >= MAX_REPLY_BYTES:
            raise RuntimeError(f"a reply of more than {MAX_REPLY_BYTES} bytes")
        return loads(body)

    def _connection(self) -> httpx.AsyncClient:
        import httpx  # where it is used (see supervisor.util.http on why)

        if self._client is None:
            self._client = httpx.AsyncClient(trust_env=False, transport=self._transport)
        return self._client

    def _unanswered(self, unit: str | None, why: str) -> None:
        self._counted("unreachable")
        log.warning(
            "fleet_unanswered", unit=unit, error=why[:300], action="decided on local evidence"
        )

    def _redact(self, text: str) -> str:
        return redact_all(text, self._urls)


def host_name(config: Config) -> str:
    """This host's name in the fleet's alerts: `fleet.host`, else the machine's hostname."""
    return config.fleet.host or socket.gethostname()
