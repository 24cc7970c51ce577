"""One host, one voice: a second daemon on the host's system journal is refused, whatever its
state directory (real daemon children).

Seen before: an operator debugging started a second daemon with a state directory of its own;
it halted the same crash again, and every message went out twice. A daemon that follows the
system journal now holds a host-wide lock; one that follows a journal directory does not (the
fleet's daemons read one directory, each for its own host).
"""

from __future__ import annotations

from pathlib import Path

from conftest import wait_for
from faults.harness import Supervisor

from vllm_supervisor.util.daemon_lock import HOST_LOCK_NAME, lock_holder


def _config(root: Path, *, directory: Path | None = None) -> Path:
    journal = f'[journal]\ndirectory = "{directory}"\n' if directory else ""
    text = (
        f"[systemd]\nenabled = false\n{journal}"
        f'[state]\nstate_dir = "{root / "state"}"\nruntime_dir = "{root / "run"}"\n'
        '[metrics]\nlisten = "127.0.0.1:0"\n[[unit]]\nname = "vllm.service"\n'
    )
    path = root / "config.toml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_a_second_daemon_on_the_system_journal_is_refused(tmp_path: Path) -> None:
    env = {
        "VLLM_SUPERVISOR_HOST_LOCK_DIR": str(tmp_path / "host"),
        "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/no/bus",
    }
    first = Supervisor(tmp_path / "a", _config(tmp_path / "a"), env=env)
    second = Supervisor(tmp_path / "b", _config(tmp_path / "b"), env=env)
    first.start()
    try:
        wait_for(
            lambda: lock_holder(tmp_path / "host" / HOST_LOCK_NAME)[0] is True,
            timeout=30,
            what="the first daemon to hold the host's lock",
        )
        second.start()
        assert second.process is not None
        assert second.process.wait(timeout=30) == 2
        said = second.stderr_text()
        assert "already follows this host's journal" in said, said
        assert said.count("\n") <= 2, said  # one line
        assert first.alive(), first.stderr_text()
    finally:
        first.stop_quietly()
        second.stop_quietly()


def test_daemons_on_journal_directories_each_run(tmp_path: Path) -> None:
    """Each host's daemon of a fleet on this machine reads a directory: none is refused."""
    env = {"VLLM_SUPERVISOR_HOST_LOCK_DIR": str(tmp_path / "host")}
    (tmp_path / "journal").mkdir()
    daemons = [
        Supervisor(tmp_path / n, _config(tmp_path / n, directory=tmp_path / "journal"), env=env)
        for n in "ab"
    ]
    try:
        for daemon in daemons:
            daemon.start()
        wait_for(lambda: all(d.following() for d in daemons), timeout=30, what="both following")
        assert all(d.alive() for d in daemons)
    finally:
        for daemon in daemons:
            daemon.stop_quietly()
