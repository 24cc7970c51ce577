"""Whether the supervisor can see a served unit's interpreter, and which unit setting hides it.

The shipped unit runs the daemon with ProtectHome= and PrivateTmp=: a served venv under /home,
/root or /tmp is invisible to it, and drift would silently record nothing. `hidden_by` names
the setting, so the daemon can say so once per unit, and `vllm-supervisor setup` can bind the
venv read-only into the daemon's view (`BindReadOnlyPaths=`).
"""

from __future__ import annotations

import os
from pathlib import PurePosixPath

# The directories each sandbox setting of the daemon's unit hides (systemd.exec(5)).
HIDING: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ProtectHome=", ("/home", "/root", "/run/user")),
    ("PrivateTmp=", ("/tmp", "/var/tmp")),  # noqa: S108 - names them, never writes there
)


def hidden_by(path: str) -> str | None:
    """The unit setting of the shipped daemon unit that hides `path`, or None."""
    pure = PurePosixPath(os.path.normpath(path))
    for setting, roots in HIDING:
        if any(pure == PurePosixPath(r) or PurePosixPath(r) in pure.parents for r in roots):
            return setting
    return None


def environment_root(interpreter: str) -> str:
    """The directory to make visible for an interpreter: its venv (or prefix), bin/'s parent."""
    pure = PurePosixPath(os.path.normpath(interpreter))
    return str(pure.parent.parent) if pure.parent.name == "bin" else str(pure.parent)


def unreachable(path: str) -> str | None:
    """Why the supervisor cannot run `path` (None: it can), naming the setting that hides it."""
    if os.access(path, os.X_OK):
        return None
    setting = hidden_by(path)
    if setting is None:
        return f"{path} is not there or not executable for the supervisor's user"
    return (
        f"{path} is hidden by the supervisor unit's {setting}; `vllm-supervisor setup` binds "
        f"{environment_root(path)} read-only into its view (BindReadOnlyPaths=)"
    )
