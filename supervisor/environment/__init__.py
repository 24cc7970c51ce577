"""The served environment: interpreter probes, snapshots and their drift, ExecStart,
the serving line, who holds a port.

`__all__` is what the commands (`supervisor/commands/`) may use of this stage; the rest is
its own (tests/test_import_graph.py checks it).
"""

from typing import TYPE_CHECKING

from ..util.lazy import exports

if TYPE_CHECKING:
    from .drift import RecordedDrift
    from .execstart import interpreter_from_exec_start, serving_port, shebang_words
    from .log import EnvironmentLog
    from .ports import PROC, Holder, holders
    from .reach import HIDING, environment_root, hidden_by

__all__ = [
    "HIDING",
    "PROC",
    "EnvironmentLog",
    "Holder",
    "RecordedDrift",
    "environment_root",
    "hidden_by",
    "holders",
    "interpreter_from_exec_start",
    "serving_port",
    "shebang_words",
]

__getattr__ = exports(
    __name__,
    {
        "EnvironmentLog": "log",
        "HIDING": "reach",
        "Holder": "ports",
        "PROC": "ports",
        "RecordedDrift": "drift",
        "environment_root": "reach",
        "hidden_by": "reach",
        "holders": "ports",
        "interpreter_from_exec_start": "execstart",
        "serving_port": "execstart",
        "shebang_words": "execstart",
    },
)
