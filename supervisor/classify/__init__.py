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
    from .proposal import Proposal, Refused, propose
    from .signatures import DEFAULT_SIGNATURE_DIR, SignatureTable, load_signature_table
    from .table import load_table, table_paths

__all__ = [
    "DEFAULT_SIGNATURE_DIR",
    "Classifier",
    "Proposal",
    "Refused",
    "SignatureTable",
    "load_signature_table",
    "load_table",
    "parse_line",
    "propose",
    "table_paths",
]

__getattr__ = exports(
    __name__,
    {
        "Classifier": "classifier",
        "DEFAULT_SIGNATURE_DIR": "signatures",
        "Proposal": "proposal",
        "Refused": "proposal",
        "SignatureTable": "signatures",
        "load_signature_table": "signatures",
        "load_table": "table",
        "parse_line": "logline",
        "propose": "proposal",
        "table_paths": "table",
    },
)
