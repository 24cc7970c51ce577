"""The trust tests reuse the fault tests' supervisor children (Slack: tests/conftest.py)."""

from __future__ import annotations

from faults.conftest import _make_supervisor, _supervisors

__all__ = ["_make_supervisor", "_supervisors"]
