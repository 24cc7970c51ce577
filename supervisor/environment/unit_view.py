"""A path as a unit sees it: through its own mounts and with its own credentials.

A halt on a missing path (`FileNotFoundError: ... '/tmp/model/config.json'`) lifts once the
path exists. The check runs in the gate or the recheck, as root and in the host's mount
namespace (`ExecCondition=+...`): a file in the host's /tmp is not the file a `PrivateTmp=`
unit looks for, and a path under /root exists for root but not for the served user. Checked
there, the halt lifted on a file the unit cannot see (one more crash), and the gate answered
the served user whether root-only paths exist. Here the path is mapped through the unit's
`RootDirectory=`, `BindPaths=`, `PrivateTmp=`, `ProtectHome=`, `TemporaryFileSystem=` and
`InaccessiblePaths=` to the host path it names, and tested by a child running with the unit's
user and groups.
"""

from __future__ import annotations

import grp
import os
import posixpath
import pwd
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

NOBODY = 65534  # the credentials of a dynamic user that is not running: the least there are
_TEST = "/usr/bin/test"
_CHECK_TIMEOUT_S = 2.0
_PRIVATE_TMP = ("/tmp", "/var/tmp")  # noqa: S108 - the mounts PrivateTmp= replaces
_HOME = ("/home", "/root", "/run/user")


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitView:
    """What systemd runs a unit's processes as and in (its loaded settings)."""

    user: str = ""  # User=: a name or a uid; "" is root
    group: str = ""
    supplementary: tuple[str, ...] = ()
    dynamic_user: bool = False
    root_directory: str = ""
    private_tmp: bool = False
    protect_home: str = "no"  # "no", "yes", "read-only", "tmpfs"
    binds: tuple[tuple[str, str], ...] = ()  # (source on the host, destination in the unit)
    hidden: tuple[str, ...] = ()  # InaccessiblePaths=, TemporaryFileSystem= mount points


def host_path(view: UnitView, path: str) -> str | None:
    """The host path the unit sees at `path`, or None when its own namespace gives it a
    fresh or empty one there (a private /tmp, a tmpfs, an inaccessible path): nothing
    outside the unit can make such a path appear for its next start."""
    path = posixpath.normpath(path)
    bound = [(src, dst) for src, dst in view.binds if _under(path, dst)]
    if bound:
        source, destination = max(bound, key=lambda pair: len(pair[1]))
        return posixpath.join(source, posixpath.relpath(path, destination))
    hidden = list(view.hidden)
    if view.private_tmp:
        hidden += _PRIVATE_TMP
    if view.protect_home in ("yes", "tmpfs"):
        hidden += _HOME
    if any(_under(path, top) for top in hidden):
        return None
    if view.root_directory not in ("", "/"):
        return posixpath.join(view.root_directory, path.lstrip("/"))
    return path


def exists_for(view: UnitView, path: str) -> bool:
    """Does `path` exist for the unit: mapped through its mounts, looked up as its user (a
    directory it may not search hides what is under it)? False whenever that cannot be told."""
    seen = host_path(view, path)
    if seen is None:
        return False
    credentials = _credentials(view)
    if credentials is None:
        return False
    uid, gid, groups = credentials
    if uid == os.geteuid() and gid == os.getegid():
        return os.path.exists(seen)  # noqa: PTH110 - as the unit already
    if os.geteuid() != 0:
        return False  # only root can look as another user
    try:
        done = subprocess.run(
            [_TEST, "-e", seen],
            user=uid,
            group=gid,
            extra_groups=list(groups),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=_CHECK_TIMEOUT_S,
            check=False,
            env={},
        )
    except (OSError, subprocess.SubprocessError, ValueError):
        return False
    return done.returncode == 0


def _credentials(view: UnitView) -> tuple[int, int, tuple[int, ...]] | None:
    """(uid, gid, supplementary gids) the unit runs as; None for a user or group that does
    not resolve (the check then says nothing exists)."""
    # A dynamic user not running has no name to resolve ("" would be root): nobody then.
    user = _user(view.user) if view.user or not view.dynamic_user else None
    if user is None:
        return (NOBODY, NOBODY, ()) if view.dynamic_user else None
    uid, primary = user
    gid = _group(view.group) if view.group else primary
    groups = [_group(name) for name in view.supplementary]
    if gid is None or any(g is None for g in groups):
        return None
    return uid, gid, tuple(g for g in groups if g is not None)


def _user(name: str) -> tuple[int, int] | None:
    if not name:
        return 0, 0
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, OverflowError, ValueError):
        return (int(name), int(name)) if name.isdigit() and int(name) < 2**31 else None
    return entry.pw_uid, entry.pw_gid


def _group(name: str) -> int | None:
    try:
        return grp.getgrgid(int(name)).gr_gid if name.isdigit() else grp.getgrnam(name).gr_gid
    except (KeyError, OverflowError, ValueError):
        return int(name) if name.isdigit() and int(name) < 2**31 else None


def _under(path: str, top: str) -> bool:
    top = posixpath.normpath(top) if top else ""
    return bool(top) and (path == top or path.startswith(top.rstrip("/") + "/"))


def paths_of(entries: Sequence[str]) -> tuple[str, ...]:
    """InaccessiblePaths= as systemd lists them: a "-" (ignore if missing) or "+" (relative to
    the root directory) prefix is not part of the path."""
    return tuple(entry.lstrip("-+") for entry in entries if entry.lstrip("-+").startswith("/"))
