"""The trust tests reuse the fault tests' fixtures: a loopback Slack and supervisor children."""

from __future__ import annotations

from faults.conftest import _make_supervisor, _slack, _supervisors

__all__ = ["_make_supervisor", "_slack", "_supervisors"]
