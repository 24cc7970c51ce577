"""What a reload cannot apply of Slack's webhook URL, named for the reload's `not_reloaded`.

The daemon reads the webhook URL once, at start (supervisor.app), and keeps that Slack client
across a SIGHUP. A URL that changed since (the file `slack.webhook_url_file` names, rewritten)
is named, so the reload does not report `not_reloaded: []` while Slack stays as it was.

systemd credentials need more: systemd copies a `LoadCredential=` source into
$CREDENTIALS_DIRECTORY when the unit starts and never again, not at `systemctl reload` (checked
on systemd 252), so the copy the daemon could read again is still the old one. Whether the
source changed after the copy is told by their times, never by their contents: the copy is
written at the start, the source's mtime is when it was last written, and the daemon may stat
the source (root's, 0600) though not read it. The source's path is the unit's own
`LoadCredential=` setting, asked from systemd; where it cannot be asked, a credential is named
as one that a reload never applies. Names carry paths only, never the URL.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

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

# The source file of a unit's credential: (unit, credential id) -> its path, or None when the
# unit loads no such credential; raises when systemd cannot be asked.
CredentialSource = Callable[[str, str], Awaitable[str | None]]

RESTART_TO_APPLY = "systemd hands credentials over at start only"


def _digest(url: Secret | None) -> str:
    """A fingerprint of the URL to compare by, kept instead of a second copy of the secret."""
    return hashlib.sha256(url.value.encode()).hexdigest() if url else ""


class WebhookReload:
    """Tells a reload which webhook change only a restart applies."""

    def __init__(
        self,
        running: Secret | None,
        *,
        credential_source: CredentialSource | None = None,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        self._running = _digest(running)
        self._credential_source = credential_source
        self._environ = environ

    async def not_reloaded(self, config: Config) -> list[str]:
        """The webhook changes a restart would apply, each named by where the URL comes from."""
        slack = config.slack
        source = webhook_source(slack, self._environ)
        try:
            now = await asyncio.to_thread(resolve_webhook, slack, self._environ)
        except ConfigError as exc:  # e.g. the file is gone: a restart would refuse to start
            return [f"slack webhook ({exc})"]
        if _digest(now) != self._running:
            return [f"slack webhook ({source}, changed)"]
        credential = self._credential(slack)
        if credential is None:
            return []
        return await self._stale_credential(credential)

    def _credential(self, slack: SlackConfig) -> Path | None:
        """The credential copy the URL is read from, when it is read from one."""
        directory = self._environ.get("CREDENTIALS_DIRECTORY")
        if not directory or not webhook_source(slack, self._environ).startswith("credential "):
            return None
        copy = Path(directory) / WEBHOOK_CREDENTIAL
        return copy if copy.exists() else None

    async def _stale_credential(self, copy: Path) -> list[str]:
        unit = copy.parent.name  # systemd names the directory after the unit
        try:
            if self._credential_source is None:
                raise LookupError("systemd is not asked")
            source = await self._credential_source(unit, WEBHOOK_CREDENTIAL)
        except Exception as exc:  # a reload goes on without the answer
            return [f"slack webhook (credential {copy}: {RESTART_TO_APPLY}; not checked: {exc})"]
        if source is None:
            return []
        try:
            changed = await asyncio.to_thread(_written_after, Path(source), copy)
        except OSError as exc:
            return [f"slack webhook (credential {copy}: {RESTART_TO_APPLY}; not checked: {exc})"]
        if not changed:
            return []
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
