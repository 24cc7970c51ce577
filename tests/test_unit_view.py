"""A missing path is looked for as the unit sees it (issue 37, 5).

Seen under systemd 252: a `PrivateTmp=` unit halted on `FileNotFoundError: '/tmp/m/config.json'`
was lifted by a file in the host's /tmp it cannot see (one more crash), and the gate, as root,
told the served user whether root-only paths exist ("/root/... exists now"). Now the path is
mapped through the unit's mounts and tested with its user and groups.
"""

from __future__ import annotations

import os
import posixpath
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.actions.evidence import cause_gone
from vllm_supervisor.environment.unit_view import UnitView, exists_for, host_path

UNIT = "vllm.service"


class TestMounts:
    def test_a_private_tmp_is_the_units_own(self) -> None:
        view = UnitView(private_tmp=True)
        assert host_path(view, "/tmp/m/config.json") is None
        assert host_path(view, "/var/tmp/x") is None
        assert host_path(view, "/tmpfoo/x") == "/tmpfoo/x"
        assert host_path(UnitView(), "/tmp/m/config.json") == "/tmp/m/config.json"

    def test_a_root_directory_prefixes_the_path(self) -> None:
        view = UnitView(root_directory="/srv/root")
        assert host_path(view, "/models/m") == "/srv/root/models/m"

    def test_a_bind_maps_its_destination_to_its_source_the_longest_first(self) -> None:
        view = UnitView(
            root_directory="/srv/root",
            private_tmp=True,
            binds=(("/data", "/models"), ("/fast/llama", "/models/llama"), ("/h", "/tmp/h")),
        )
        assert host_path(view, "/models/qwen/a") == "/data/qwen/a"
        assert host_path(view, "/models/llama/a") == "/fast/llama/a"
        assert host_path(view, "/tmp/h/x") == "/h/x"  # a bind over the private /tmp

    def test_hidden_homes_and_paths(self) -> None:
        assert host_path(UnitView(protect_home="yes"), "/root/m") is None
        assert host_path(UnitView(protect_home="tmpfs"), "/home/u/m") is None
        assert host_path(UnitView(protect_home="read-only"), "/home/u/m") == "/home/u/m"
        assert host_path(UnitView(hidden=("/secret",)), "/secret/k") is None


@pytest.fixture
def searchable() -> Iterator[Path]:
    """A directory every user may search (pytest's own tmp_path is root's alone)."""
    with tempfile.TemporaryDirectory(prefix="unit-view-") as made:
        Path(made).chmod(0o755)
        yield Path(made)


class TestCredentials:
    def test_a_path_root_alone_may_see_does_not_exist_for_another_user(
        self, searchable: Path
    ) -> None:
        if os.geteuid() != 0:
            pytest.fail("run as root (CI and the e2e do): the check looks as another user")
        private = searchable / "root-only"
        private.mkdir(mode=0o700)
        (private / "weights").write_text("x")
        assert exists_for(UnitView(), str(private / "weights"))  # root sees it
        assert not exists_for(UnitView(user="nobody"), str(private / "weights"))
        private.chmod(0o755)
        assert exists_for(UnitView(user="nobody"), str(private / "weights"))

    def test_a_user_or_group_that_does_not_resolve_sees_nothing(self, tmp_path: Path) -> None:
        assert not exists_for(UnitView(user="no-such-user-here"), str(tmp_path))
        assert not exists_for(UnitView(group="no-such-group-here"), str(tmp_path))

    def test_a_dynamic_user_not_running_looks_as_nobody(self, tmp_path: Path) -> None:
        private = tmp_path / "p"
        private.mkdir(mode=0o700)
        assert not exists_for(UnitView(user="vllm-dyn", dynamic_user=True), str(private))


class TestTheGatesAnswer:
    def test_a_file_in_the_hosts_tmp_does_not_lift_a_private_tmp_units_halt(
        self, tmp_path: Path
    ) -> None:
        record = {"evidence": {"kind": "missing_path", "path": str(tmp_path)}}
        assert cause_gone(record, unit=UNIT, view=lambda _: UnitView()) is not None
        private = lambda _: UnitView(private_tmp=True)  # noqa: E731
        assert cause_gone(record, unit=UNIT, view=private) is None

    def test_no_answer_from_systemd_keeps_the_halt_and_tells_nothing(self, tmp_path: Path) -> None:
        record = {"evidence": {"kind": "missing_path", "path": str(tmp_path)}}
        assert cause_gone(record, unit=UNIT, view=lambda _: None) is None
        assert cause_gone(record, view=lambda _: UnitView()) is None  # no unit to ask about


PATHS = st.lists(st.sampled_from(["a", "b", "..", ".", "tmp", "models", "", "x y"]), max_size=5)


@given(
    path=PATHS.map(lambda parts: "/" + "/".join(parts)),
    root=st.sampled_from(["", "/", "/srv/r"]),
    private_tmp=st.booleans(),
    home=st.sampled_from(["no", "yes", "read-only", "tmpfs"]),
    binds=st.lists(st.tuples(PATHS.map(lambda p: "/src/" + "/".join(p)),
                             PATHS.map(lambda p: "/" + "/".join(p))), max_size=3),
)  # fmt: skip
def test_any_settings_map_a_path_to_an_absolute_path_or_none(
    path: str, root: str, private_tmp: bool, home: str, binds: list[tuple[str, str]]
) -> None:
    view = UnitView(
        root_directory=root, private_tmp=private_tmp, protect_home=home, binds=tuple(binds)
    )
    seen = host_path(view, path)
    assert seen is None or posixpath.isabs(seen)
    if seen is not None and not binds and root in ("", "/"):
        assert seen == posixpath.normpath(path)
