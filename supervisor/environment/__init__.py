"""The served environment: interpreter probes, snapshots and their drift, ExecStart,
the serving line, who holds a port.

`__all__` is what the commands (`supervisor/commands/`) may use of this stage; the rest is
its own (tests/test_import_graph.py checks it).
"""

from .drift import (
    RecordedDrift,
)
from .execstart import (
    interpreter_from_exec_start,
    serving_port,
    shebang_words,
)
from .log import (
    EnvironmentLog,
)
from .ports import (
    PROC,
    Holder,
    holders,
)
from .reach import (
    HIDING,
    environment_root,
    hidden_by,
)

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
