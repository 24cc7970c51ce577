"""The unit watch's object paths: systemd's own escaping of unit names (bus_label_escape)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.actions.unitwatch import UNIT_PATHS, unit_path


@pytest.mark.parametrize(
    ("unit", "path"),
    [
        # The first four as `busctl call ... Manager LoadUnit` answers on systemd 252.
        ("vllm.service", "vllm_2eservice"),
        ("systemd-journald.service", "systemd_2djournald_2eservice"),
        ("getty@tty1.service", "getty_40tty1_2eservice"),
        ("2fast.service", "_32fast_2eservice"),  # a leading digit is escaped too
        ("\u00e9.service", "_c3_a9_2eservice"),  # UTF-8 byte by byte
    ],
)
def test_paths_are_escaped_as_systemd_does(unit: str, path: str) -> None:
    assert unit_path(unit) == f"{UNIT_PATHS}/{path}"


@given(st.text(min_size=1, max_size=40))
def test_any_name_gives_a_valid_object_path(unit: str) -> None:
    """Whatever the configured name, the match never carries an invalid D-Bus path."""
    element = unit_path(unit).removeprefix(UNIT_PATHS + "/")
    assert re.fullmatch(r"[A-Za-z0-9_]+", element)
