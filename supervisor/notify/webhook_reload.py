"""A reload applies a new Slack webhook URL, or names it for `not_reloaded` when it cannot.

At a SIGHUP the URL is resolved again from where it came (the config, `slack.webhook_url_file`,
the systemd credential `slack-webhook`); a URL that changed replaces the Slack sink's webhook at
once (Slack turns on, off, or moves; its outbox lane forgets the old one's failures), logged by
where it came from, never by the URL.

systemd hands a `LoadCredential=` source over as a copy in $CREDENTIALS_DIRECTORY. For the
shipped unit (a private, read-only credential mount) systemd 252 writes the copy again for the
reload's `ExecReload=` commands, so the new URL is read (checked in nspawn); for a unit whose
credentials are a plain directory it keeps the copy made at the start, and the copy read again
is the old one. That case is told by times, never by contents: the copy is written when systemd
makes it, the source's mtime is when it was last written, and the daemon may stat the source
(root's, 0600) though not read it. The source's path is the unit's own `LoadCredential=`, asked
from systemd; a source newer than the copy is named in `not_reloaded`, as is a credential whose
source cannot be asked for. Names carry paths only.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import structlog

from ..actions.systemd import SERVICE_IFACE, SystemdClient
from ..config import (
    WEBHOOK_CREDENTIAL,
    Config,
    Secret,
    SlackConfig,
    resolve_webhook,
    webhook_source,
)
from ..errors import ConfigError
from .slack import SlackSink
from .webhook import SlackWebhook

# The source file of a unit's credential: (unit, credential id) -> its path, or None when the
# unit loads no such credential; raises when systemd cannot be asked.
CredentialSource = Callable[[str, str], Awaitable[str | None]]

RESTART_TO_APPLY = "systemd hands this credential over at start only"

log = structlog.get_logger(__name__)


def _digest(url: Secret | None) -> str:
    """A fingerprint of the URL to compare by, instead of a second copy of the secret."""
    return hashlib.sha256(url.value.encode()).hexdigest() if url else ""


class SlackReload:
    """Keeps the Slack sink's webhook the one the config and its sources name now."""

    def __init__(
        self,
        sink: SlackSink,
        *,
        changed: Callable[[], None] = lambda: None,
        timeout_s: float,
        credential_source: CredentialSource | None = None,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        self._sink = sink
        self._changed = changed  # told after the webhook changed (the outbox lane's reset)
        self._running = _digest(sink.webhook.url if sink.webhook else None)
        self._timeout_s = timeout_s  # slack.timeout_s is applied by a restart, like [slack]
        self._credential_source = credential_source
        self._environ = environ

    @property
    def webhook(self) -> SlackWebhook | None:
        """The webhook the sink posts to now."""
        return self._sink.webhook

    async def reload(self, config: Config) -> list[str]:
        """Apply the URL `config` gives now; the names of what only a restart applies."""
        slack = config.slack
        source = webhook_source(slack, self._environ)
        try:
            url = await asyncio.to_thread(resolve_webhook, slack, self._environ)
        except ConfigError as exc:  # the file is gone or unreadable: keep the running one
            return [f"slack webhook ({exc})"]
        if _digest(url) != self._running:
            await self._use(url, source)
            return []
        credential = self._credential(slack)
        return [] if credential is None else await self._stale_credential(credential)

    async def _use(self, url: Secret | None, source: str) -> None:
        old = self.webhook
        self._sink.use(SlackWebhook(url, timeout_s=self._timeout_s) if url else None)
        self._running = _digest(url)
        self._changed()
        log.info("slack_webhook_reloaded", source=source, slack="on" if url else "off")
        if old is not None:
            await old.aclose()

    def _credential(self, slack: SlackConfig) -> Path | None:
        """The credential copy the URL is read from, when it is read from one."""
        directory = self._environ.get("CREDENTIALS_DIRECTORY")
        if not directory or not webhook_source(slack, self._environ).startswith("credential "):
            return None
        copy = Path(directory) / WEBHOOK_CREDENTIAL
        return copy if copy.exists() else None

    async def _stale_credential(self, copy: Path) -> list[str]:
        """The credential, named, when its source was written after systemd copied it."""
        unit = copy.parent.name  # systemd names the directory after the unit
        try:
            if self._credential_source is None:
                raise LookupError("systemd is not asked")
            source = await self._credential_source(unit, WEBHOOK_CREDENTIAL)
            if source is None:
                return []
            if not await asyncio.to_thread(_written_after, Path(source), copy):
                return []
        except Exception as exc:  # a reload goes on without the answer
            return [f"slack webhook (credential {copy}: {RESTART_TO_APPLY}; not checked: {exc})"]
        return [f"slack webhook (credential {copy}: {source} changed; {RESTART_TO_APPLY})"]


def _written_after(source: Path, copy: Path) -> bool:
    """True when `source` was written after systemd made `copy` of it."""
    return source.stat().st_mtime_ns > copy.stat().st_mtime_ns


def credential_source(client: SystemdClient) -> CredentialSource:
    """A unit's credential source, from its `LoadCredential=` setting as systemd has it."""

    async def source(unit: str, credential: str) -> str | None:
        props = await client.properties(unit, [(SERVICE_IFACE, "LoadCredential")])
        for name, path in props["LoadCredential"] or ():  # a(ss): (id, source path)
            if name == credential:
                return str(path)
        return None

    return source
