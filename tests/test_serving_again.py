"""A paced loop's story ends when the unit serves again: its hold is removed and that is told
once (supervisor.loop.serving_again).

A real daemon (a child of the test) follows a real journal written by systemd-journal-remote
and posts to a Slack stand-in on loopback: two crashes in a row hold the next start (one
message when pacing begins), the next run serves (one message: it serves again, the hold gone),
and a crash of that run is still told as its own.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from conftest import wait_for
from faults.harness import UNIT, Supervisor, crash, write_config
from slack_server import SlackServer

from vllm_supervisor.actions.holds import Hold, Holds, hold_dir
from vllm_supervisor.journal.writer import JournalWriter, service_lines, start_entries
from vllm_supervisor.loop.serving_again import serving_again
from vllm_supervisor.model import (
    Action,
    Decision,
    Invocation,
    Outcome,
    Pace,
    Rule,
    Severity,
    Taken,
    Verdict,
)
from vllm_supervisor.notify.decision import NotifyReason, telling

SERVING_LINE = "(APIServer pid=5150) INFO:     Application startup complete."


def _texts(slack: SlackServer) -> list[str]:
    return [json.dumps(request.json()) for request in slack.requests]


def test_a_paced_unit_that_serves_again_ends_its_hold_and_is_told_once(
    tmp_path: Path, slack: SlackServer
) -> None:
    config = write_config(tmp_path, slack_url=slack.url)
    sup = Supervisor(tmp_path, config, env={"DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/no/bus"})
    holds = Holds(hold_dir(tmp_path / "run"))
    sup.start()
    try:
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(crash("unknown", 1) + crash("unknown", 2))

            def held() -> bool:
                writer.nudge()
                return holds.read(UNIT) is not None and slack.count() >= 2

            wait_for(held, timeout=60, what="the second crash to hold the next start, told")
            assert "paced" in _texts(slack)[1].lower(), _texts(slack)[1]

            run = uuid.uuid4().hex
            writer.write(start_entries(UNIT, run) + list(service_lines(UNIT, run, [SERVING_LINE])))

            def served_again() -> bool:
                writer.nudge()
                return holds.read(UNIT) is None and slack.count() >= 3

            wait_for(served_again, timeout=60, what="the hold to end, told")
            said = _texts(slack)[2]
            assert f"{UNIT} serves again" in said
            assert "after 2 crashes in a row" in said

            writer.write(crash("unknown", 3, invocation_id=run)[len(start_entries(UNIT, run)) :])

            def told_again() -> bool:
                writer.nudge()
                return slack.count() >= 4

            wait_for(told_again, timeout=60, what="the served run's crash, told on its own")
            assert "widget 3 fell over" in _texts(slack)[3]
            assert sum(f"{UNIT} serves again" in text for text in _texts(slack)) == 1
        assert sup.alive(), sup.stderr_text()
    finally:
        sup.stop_quietly()


def _held(crashes: int, begins: bool | None) -> Outcome:
    invocation = Invocation(unit=UNIT, invocation_id="i", lines=(), exit_code="exited",
                            exit_status=1, result="exit-code")  # fmt: skip
    verdict = Verdict(signature=None, severity=Severity.UNKNOWN, title="t", root_cause=None,
                      crashed=True)  # fmt: skip
    pace = Pace(delay_s=60.0, crashes=crashes, begins=begins)
    decision = Decision(action=Action.HOLD, reason="r", rule=Rule.UNKNOWN_NO_CAUSE, pace=pace)
    return Outcome(invocation=invocation, verdict=verdict, decision=decision, taken=Taken.HELD)


def test_a_hold_is_told_when_it_begins_pacing_whatever_the_count() -> None:
    """The hold after a unit served again begins a new story, at any count; one while a hold
    stood is folded into the story, at any count."""

    def told(outcome: Outcome) -> NotifyReason:
        return telling(outcome, endpoint=True, notify_transient=False)

    assert told(_held(7, begins=True)) is NotifyReason.ALONE
    assert told(_held(2, begins=False)) is NotifyReason.PACED
    assert told(_held(2, begins=None)) is NotifyReason.ALONE  # a record of an earlier version
    hold = Hold(unit=UNIT, until=2.0, since=1.0, crashes=2, reason="r", rule="transient")
    run = Invocation(unit=UNIT, invocation_id="r", lines=(), served_us=3_000_000)
    again = serving_again(run, hold)
    assert told(again) is NotifyReason.ALONE
    assert again.invocation.invocation_id != run.invocation_id  # the run's crash is its own
