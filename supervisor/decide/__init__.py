"""Deciding what to do about an ended invocation: the policy, hung engines, port evidence.

The commands (`supervisor/commands/`) use nothing of this stage: its `__all__` is empty
(tests/test_import_graph.py checks it).
"""

__all__: list[str] = []
