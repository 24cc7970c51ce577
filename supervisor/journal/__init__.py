"""Reading the journal: the export-format parser and the journalctl follower.

`__all__` is what the commands (`supervisor/commands/`) may use of this stage; the rest is
its own (tests/test_import_graph.py checks it).
"""

from typing import TYPE_CHECKING

from ..util.lazy import exports

if TYPE_CHECKING:
    from .kernel import read_driver_lines
    from .reader import ReaderSettings, read_all
    from .saved import (
        JOURNAL_FILE_MAGIC,
        decode_export,
        decode_json,
        plain_text_invocation,
        read_file,
        sniff,
    )
    from .writer import FieldValue, JournalWriter, crashed_invocation, lifecycle, service_lines

__all__ = [
    "JOURNAL_FILE_MAGIC",
    "FieldValue",
    "JournalWriter",
    "ReaderSettings",
    "crashed_invocation",
    "decode_export",
    "decode_json",
    "lifecycle",
    "plain_text_invocation",
    "read_all",
    "read_driver_lines",
    "read_file",
    "service_lines",
    "sniff",
]

__getattr__ = exports(
    __name__,
    {
        "FieldValue": "writer",
        "JOURNAL_FILE_MAGIC": "saved",
        "JournalWriter": "writer",
        "ReaderSettings": "reader",
        "crashed_invocation": "writer",
        "decode_export": "saved",
        "decode_json": "saved",
        "lifecycle": "writer",
        "plain_text_invocation": "saved",
        "read_all": "reader",
        "read_driver_lines": "kernel",
        "read_file": "saved",
        "service_lines": "writer",
        "sniff": "saved",
    },
)
