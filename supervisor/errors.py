"""The supervisor's exceptions, one tree, translated from library errors at the boundary.

SupervisorError
├── ConfigError                a config file or flag is wrong; the message names the key and fix
│   ├── SignatureTableError    the signature table does not load (bad regex, duplicate id, ...)
│   └── EngineFileError        an engine file does not load (config/engines/<engine>.toml)
├── JournalError               the journal cannot be read (journalctl missing, bad directory)
├── StateError                 the state database cannot be opened or written
├── ProbeError                 a served interpreter could not be probed (environment.probe)
├── SetupError                 `setup` cannot go on: not root, a foreign file (commands.setup)
└── ActionError                an action (systemd stop, Slack) failed; see `retryable`, `reason`
    ├── SystemdError           a D-Bus call to systemd failed
    └── NotifyError            a notification could not be delivered
        └── SlackRateLimited   Slack answered 429, with its Retry-After (notify.webhook)

`tests/test_systemd_errors.py` checks this drawing against the classes.
"""

from __future__ import annotations


class SupervisorError(Exception):
    """Base of every error the supervisor raises on purpose."""


class ConfigError(SupervisorError):
    """A configuration value is wrong; the message names the key, the value and the fix."""


class SignatureTableError(ConfigError):
    """The signature table cannot be loaded; the message names the file, the id and the field."""


class EngineFileError(ConfigError):
    """An engine file cannot be loaded; the message names the file and the key."""


class JournalError(SupervisorError):
    """The journal cannot be read."""


class StateError(SupervisorError):
    """The state database cannot be opened or written."""


class ActionError(SupervisorError):
    """An action failed. `reason` is a short, bounded label used as a metric label value."""

    def __init__(self, message: str, *, reason: str, retryable: bool) -> None:
        super().__init__(message)
        self.reason = reason
        self.retryable = retryable


class SystemdError(ActionError):
    """A call to systemd's D-Bus API failed."""


class NotifyError(ActionError):
    """A notification could not be delivered."""
