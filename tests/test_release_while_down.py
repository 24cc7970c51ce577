"""`release` while the daemon is stopped: the next crash counts afresh, as with it running.

Seen under systemd 252: the same unknown crash halted on its 3rd repeat; with the daemon
stopped a person ran `release`, started the daemon and the unit, and the very next crash was
halted at once (the old streak, saved, came back), where a running daemon forgets it at the
release and halts only on the 3rd again. A real daemon (a child of the test) follows a real
journal written by systemd-journal-remote.
"""

from __future__ import annotations

import io
from pathlib import Path

from conftest import wait_for
from faults.harness import UNIT, Supervisor, write_config

from vllm_supervisor.actions.quarantine import Quarantine
from vllm_supervisor.commands.gate import release_main
from vllm_supervisor.journal.writer import JournalWriter, crashed_invocation

PREFIX = "(EngineCore_DP0 pid=6200) ERROR 11-30 11:00:09 [core.py:708]"
SAME_CRASH = [
    f"{PREFIX} EngineCore failed to start.",
    f"{PREFIX} Traceback (most recent call last):",
    f'{PREFIX}   File "/opt/vllm/frob.py", line 7, in frobnicate',
    f"{PREFIX}     raise RuntimeError(widget)",
    f"{PREFIX} RuntimeError: the widget fell over",
]


def _crash(serial: int) -> list[dict[str, object]]:
    return crashed_invocation(  # type: ignore[return-value]
        UNIT, SAME_CRASH, restarts=serial, invocation_id=f"{serial:032x}", pid=4000 + serial
    )


def _decided(sup: Supervisor, serial: int) -> dict[str, object] | None:
    for event in sup.events():
        if event.get("event") == "invocation_ended" and event.get("invocation_id") == (
            f"{serial:032x}"
        ):
            return event
    return None


def test_a_release_while_the_daemon_is_down_starts_the_count_afresh(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    sup = Supervisor(tmp_path, config, env={"DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/no/bus"})
    quarantine = Quarantine(tmp_path / "run" / "quarantine")
    sup.start()
    try:
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(_crash(1) + _crash(2) + _crash(3))

            def halted() -> bool:
                writer.nudge()
                return quarantine.read(UNIT) is not None and _decided(sup, 3) is not None

            wait_for(halted, timeout=60, what="the 3rd identical crash halted")
            assert (_decided(sup, 3) or {}).get("rule") == "unknown_repeat"
            sup.terminate()

            said = io.StringIO()
            assert release_main(UNIT, tmp_path / "run", tmp_path / "state", out=said) == 0
            assert quarantine.read(UNIT) is None
            assert (tmp_path / "run" / f"released.{UNIT}.json").exists()

            sup.start()
            writer.write(_crash(4))

            def decided() -> bool:
                writer.nudge()
                return _decided(sup, 4) is not None

            wait_for(decided, timeout=60, what="the next crash decided")
            fourth = _decided(sup, 4) or {}
            assert fourth.get("action") != "halt", fourth  # before: halted at once
            assert fourth.get("rule") == "unknown_first", fourth
            assert not (tmp_path / "run" / f"released.{UNIT}.json").exists()
        assert sup.alive(), sup.stderr_text()
    finally:
        sup.stop_quietly()
