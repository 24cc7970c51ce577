"""Tracking: journal entries grouped into invocations of each unit, and how each ended.

The commands (`supervisor/commands/`) use nothing of this stage: its `__all__` is empty
(tests/test_import_graph.py checks it).
"""

__all__: list[str] = []
