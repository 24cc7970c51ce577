"""A crash read again after a restart is no "last run" when newer runs were read with it.

Seen under systemd 252: a daemon restarted while its state disk was full read the batch it
could not commit again. Its crashes that systemd had restarted were recorded as "down": the
unit, halted since, was inactive with no InvocationID, and the daemon asked the journal only for
a newer invocation still running; the newer ones had ended too (they are in the same batch).
Now the newest invocation read counts, ended or not.
"""

from __future__ import annotations

from vllm_supervisor.actions.presence import Here, Presence, judge
from vllm_supervisor.classify.table import load_table
from vllm_supervisor.config import Config, UnitConfig
from vllm_supervisor.journal.saved import decode_export
from vllm_supervisor.journal.writer import crashed_invocation, export_entry
from vllm_supervisor.model import UnitState
from vllm_supervisor.pipeline import Pipeline

UNIT = "vllm.service"
FIRST, SECOND = "1" * 32, "2" * 32
HALTED = UnitState(
    active_state="inactive", sub_state="dead", n_restarts=0, result="success",
    invocation_id="", main_pid=0,
)  # fmt: skip


def _read(*invocations: str) -> tuple[Pipeline, list]:  # type: ignore[type-arg]
    config = Config(units=(UnitConfig(name=UNIT),))
    pipeline = Pipeline(config, load_table(config))
    data = b"".join(
        export_entry(e)
        for n, inv in enumerate(invocations)
        for e in crashed_invocation(UNIT, ["RuntimeError: boom"], invocation_id=inv, restarts=n + 1)
    )
    ended = pipeline.feed(list(decode_export(data))) + pipeline.finish()
    return pipeline, ended


def test_the_newest_invocation_read_is_known_when_it_ended_too() -> None:
    pipeline, ended = _read(FIRST, SECOND)
    assert [e.invocation.invocation_id for e in ended] == [FIRST, SECOND]
    assert pipeline.open_invocation(UNIT) is None
    assert pipeline.newest_invocation_id(UNIT) == SECOND


def test_a_restarted_crash_read_again_is_history_not_down() -> None:
    pipeline, ended = _read(FIRST, SECOND)
    here = Here(machine_id="", boot_id="", now_us=0, act_window_s=60.0,
                newer_id=pipeline.newest_invocation_id(UNIT))  # fmt: skip
    first, second = (e.invocation for e in ended)
    assert judge(first, HALTED, here).presence is Presence.LATE
    # The newest one is the unit's last run: down, as before.
    assert judge(second, HALTED, here).presence is Presence.DOWN
