"""Classifying a crash: log lines, the signature table, fingerprints, the classifier and
the determinism model.

`__all__` is what the commands (`supervisor/commands/`) may use of this stage; the rest is
its own (tests/test_import_graph.py checks it).
"""

from typing import TYPE_CHECKING

from ..util.lazy import exports

if TYPE_CHECKING:
    from .classifier import Classifier
    from .logline import parse_line
    from .signatures import SignatureTable
    from .table import load_table

__all__ = [
    "Classifier",
    "SignatureTable",
    "load_table",
    "parse_line",
]

__getattr__ = exports(
    __name__,
    {
        "Classifier": "classifier",
        "SignatureTable": "signatures",
        "load_table": "table",
        "parse_line": "logline",
    },
)
