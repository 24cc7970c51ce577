"""Acting on decisions: the only place that stops, restarts or quarantines a unit.

`presence` judges whether an ended invocation is the present one (pure); `halt` quarantines and
stops a unit; `actor` carries out a decision after asking systemd, with dry-run honoured here
and nowhere else.

`__all__` is what the commands (`supervisor/commands/`) may use of this stage; the rest is
its own (tests/test_import_graph.py checks it).
"""

from typing import TYPE_CHECKING

from ..util.lazy import exports

if TYPE_CHECKING:
    from .comeback import SupervisorUnit, ask_about, coming_back
    from .evidence import cause_gone, changed, still_holds, waits_on_a_condition
    from .gatekeeper import Reply, ask, socket_path
    from .holds import (
        Hold,
        Holds,
        active_hold,
        arm_once,
        arm_recheck_once,
        disarm_once,
        hold_dirs,
        holds_of,
        start_once,
    )
    from .preflight import run_preflight
    from .quarantine import (
        DEFAULT_DIRS,
        Quarantine,
        quarantine_dir,
        quarantine_dirs,
        quarantine_records,
    )
    from .releases import note_release, take_releases
    from .systemd import SystemdClient, ask_once
    from .unitnames import real_name

__all__ = [
    "DEFAULT_DIRS",
    "Hold",
    "Holds",
    "Quarantine",
    "Reply",
    "SupervisorUnit",
    "SystemdClient",
    "active_hold",
    "arm_once",
    "arm_recheck_once",
    "ask",
    "ask_about",
    "ask_once",
    "cause_gone",
    "changed",
    "coming_back",
    "disarm_once",
    "hold_dirs",
    "holds_of",
    "note_release",
    "quarantine_dir",
    "quarantine_dirs",
    "quarantine_records",
    "real_name",
    "run_preflight",
    "socket_path",
    "start_once",
    "still_holds",
    "take_releases",
    "waits_on_a_condition",
]

__getattr__ = exports(
    __name__,
    {
        "DEFAULT_DIRS": "quarantine",
        "Hold": "holds",
        "Holds": "holds",
        "active_hold": "holds",
        "arm_once": "holds",
        "arm_recheck_once": "holds",
        "cause_gone": "evidence",
        "disarm_once": "holds",
        "hold_dirs": "holds",
        "note_release": "releases",
        "take_releases": "releases",
        "holds_of": "holds",
        "start_once": "holds",
        "Quarantine": "quarantine",
        "Reply": "gatekeeper",
        "SupervisorUnit": "comeback",
        "SystemdClient": "systemd",
        "ask": "gatekeeper",
        "ask_about": "comeback",
        "ask_once": "systemd",
        "changed": "evidence",
        "coming_back": "comeback",
        "quarantine_dir": "quarantine",
        "quarantine_dirs": "quarantine",
        "quarantine_records": "quarantine",
        "real_name": "unitnames",
        "run_preflight": "preflight",
        "socket_path": "gatekeeper",
        "still_holds": "evidence",
        "waits_on_a_condition": "evidence",
    },
)
