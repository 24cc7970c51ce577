"""`status` when the daemon's journal reader cannot start: an error with its count, not silence.

A real daemon (a child process of the test) is configured with a journal directory that is a
file: its reader child fails at every start and is restarted with backoff. `status` reads the
restarts from /metrics (`vllm_supervisor_journal_source_restarts_total`) and says why nothing is
read or decided; the daemon's own log has the child's complaint as an error.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from conftest import wait_for
from faults.harness import Supervisor, write_config
from hypothesis import given
from hypothesis import strategies as st
from test_status import free_port

from vllm_supervisor.commands.status import EXIT_DAEMON_DOWN, reader_restarts_in
from vllm_supervisor.telemetry.metrics import Metrics, new_registry


def status(config: Path, *args: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "vllm_supervisor", "status", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stdout


def test_a_reader_that_keeps_failing_is_an_error_in_status(tmp_path: Path) -> None:
    """Exit 3; the restarts counted from /metrics in JSON and in a problem line; the failed
    starts in a row a gauge of /metrics; the child's own message logged as an error by the
    daemon."""
    config = write_config(tmp_path)
    port = free_port()
    config.write_text(config.read_text().replace("127.0.0.1:0", f"127.0.0.1:{port}"))
    (tmp_path / "journal").write_text("not a directory\n")
    sup = Supervisor(tmp_path, config, env={"DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/no/bus"})
    sup.start()
    report: dict[str, Any] = {}
    try:

        def failing() -> bool:
            _, out = status(config, "--format", "json")
            report.update(json.loads(out) if out.strip() else {})
            return (report.get("daemon", {}).get("reader_restarts") or 0) >= 3

        wait_for(failing, timeout=60, what="three reader restarts")
        said: list[tuple[int, str]] = []

        def down() -> bool:
            # Each restart announces "following" from its spawn until the child exits: a
            # status read in those milliseconds sees a healthy daemon (the next one does not).
            said.append(status(config))
            return said[-1][0] == EXIT_DAEMON_DOWN

        wait_for(down, timeout=30, what="status saying the daemon is down")
        code, text = said[-1]
        exposition = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    finally:
        sup.stop_quietly()
    assert report["daemon"]["health"]["following"] is False
    assert code == EXIT_DAEMON_DOWN
    assert "problem:   the journal reader keeps failing: restarted" in text
    assert "vllm_supervisor_journal_source_restarts_total" in text
    # A gauge an alert can use: how many starts in a row failed (0 once entries come).
    failures = [
        float(line.split()[-1])
        for line in exposition.decode().splitlines()
        if line.startswith("vllm_supervisor_journal_reader_failures ")
    ]
    assert failures and failures[0] >= 3
    log = "".join(path.read_text() for path in sup.logs)
    errors = [
        json.loads(line)
        for line in log.splitlines()
        if line.startswith("{") and "journal_reader_failing" in line
    ]
    assert errors and errors[0]["level"] == "error"
    assert "Not a directory" in errors[0]["error"]


def test_the_restarts_are_summed_over_every_reason_of_the_real_exposition() -> None:
    """The daemon's own /metrics text: each reason's restarts count, other metrics do not."""
    metrics = Metrics(new_registry(process=False))
    for reason in ("exited", "exited", "no_output", "error"):
        metrics.source_restart(reason)
    metrics.entries_read(7)
    assert reader_restarts_in(metrics.exposition()[0].decode()) == 4


@given(st.text(max_size=300))
def test_any_answer_on_the_metrics_port_gives_a_count(text: str) -> None:
    """Whatever answers on the port (a stranger, a half-written body): a count >= 0, never an
    exception."""
    assert reader_restarts_in(text) >= 0
    line = f'vllm_supervisor_journal_source_restarts_total{{reason="x"}} {text[:20]}'
    assert reader_restarts_in(line) >= 0
