"""Quarantine and state files are never world-writable (the database not even world-readable),
whatever umask the daemon inherits."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from conftest import wait_for
from faults.harness import Supervisor, classified, crash, write_config

from vllm_supervisor.actions.quarantine import Quarantine
from vllm_supervisor.journal.writer import JournalWriter
from vllm_supervisor.store import DATABASE_NAME, Store


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _not_world_writable(*paths: Path) -> None:
    for path in paths:
        assert not _mode(path) & stat.S_IWOTH, f"{path} is world-writable: {_mode(path):o}"


def _private(*paths: Path) -> None:
    for path in paths:
        assert not _mode(path) & stat.S_IRWXO, f"{path} is open to others: {_mode(path):o}"


class TestDaemonFiles:
    """A real `vllm-supervisor run` child started with umask 000."""

    def test_state_and_quarantine_are_private_under_umask_000(self, tmp_path: Path) -> None:
        """Database, WAL, SHM, the quarantine record and every directory created for them
        give others no access at all."""
        (tmp_path / "journal").mkdir()
        sup = Supervisor(tmp_path, write_config(tmp_path))
        state, run = tmp_path / "state", tmp_path / "run"
        try:
            with JournalWriter(tmp_path / "journal") as writer:
                writer.write(crash("fatal", 1))
                old = os.umask(0)
                try:
                    sup.start()
                finally:
                    os.umask(old)
                record = run / "quarantine" / "vllm.service.json"
                wait_for(lambda: record.exists() and classified(state), what="halt and commit")
                db = state / DATABASE_NAME
                wal, shm = Path(f"{db}-wal"), Path(f"{db}-shm")
                assert wal.exists()
                assert shm.exists()
                _private(state, db, wal, shm, run, run / "quarantine", record)
                _not_world_writable(state, db, wal, shm, run, run / "quarantine", record)
            assert sup.terminate() == 0, sup.stderr_text()
        finally:
            sup.stop_quietly()


class TestExistingFiles:
    """Files left open by an older version or by hand are tightened when opened."""

    def test_world_access_is_stripped_from_an_existing_database(self, tmp_path: Path) -> None:
        """A 0666 database loses the world bits (its WAL inherits its mode); group bits stay."""
        Store.in_directory(tmp_path).close()
        db = tmp_path / DATABASE_NAME
        db.chmod(0o666)
        store = Store.in_directory(tmp_path)
        try:
            assert _mode(db) == 0o660
            assert _mode(Path(f"{db}-wal")) == 0o660
        finally:
            store.close()

    def test_quarantine_directory_is_tightened(self, tmp_path: Path) -> None:
        """A world-writable quarantine directory is made 0750 before a record is written."""
        directory = tmp_path / "q"
        directory.mkdir()
        directory.chmod(0o777)
        Quarantine(directory).write("vllm.service", {"reason": "test"})
        assert _mode(directory) == 0o750
        assert _mode(directory / "vllm.service.json") == 0o640
