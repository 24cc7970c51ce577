"""Whatever a journal entry's fields hold, the pipeline decides and every renderer renders.

journald stores the fields a process sends as it sends them: a `__REALTIME_TIMESTAMP` from a
journal file written on a machine with a broken clock (or by hand with systemd-journal-remote),
an `EXIT_STATUS` or `N_RESTARTS` of twenty digits, a `_PID` that is not a number, bytes that are
not UTF-8. The daemon turns them into an outcome, a history row, a Slack message, an alert and
a line of `triage`; none of them may raise on such a value.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands.triage import render_text
from vllm_supervisor.config import Config
from vllm_supervisor.journal.export import decode_all
from vllm_supervisor.journal.writer import crashed_invocation
from vllm_supervisor.notify.alertmanager import alert
from vllm_supervisor.notify.message import build_payload
from vllm_supervisor.pipeline import Pipeline
from vllm_supervisor.records import outcome_record, pending_from_record
from vllm_supervisor.state.tables import dump

UNIT = "vllm.service"
CRASH = "RuntimeError: CUDA error: an illegal memory access was encountered"
TABLE = load_table(Config())

FIELDS = [
    "__REALTIME_TIMESTAMP",
    "__MONOTONIC_TIMESTAMP",
    "_PID",
    "PRIORITY",
    "EXIT_CODE",
    "EXIT_STATUS",
    "N_RESTARTS",
    "UNIT_RESULT",
    "JOB_RESULT",
    "JOB_TYPE",
    "INVOCATION_ID",
    "_SYSTEMD_INVOCATION_ID",
    "_BOOT_ID",
    "_MACHINE_ID",
    "_HOSTNAME",
    "MESSAGE",
]
VALUES = st.one_of(
    st.sampled_from(
        [
            b"9" * 19,
            b"9" * 20,
            b"9" * 400,
            b"18446744073709551615",
            b"-1",
            b"0",
            b"",
            b"nan",
            b"1e308",
            b"\xff\xfe",
            b"\xd9\xa3",  # an Arabic-Indic digit: str.isdigit() is true, int() is not ASCII
        ]
    ),
    st.integers(-(2**70), 2**70).map(lambda n: str(n).encode()),
    st.binary(max_size=12),
    st.text(max_size=12).map(str.encode),
)


def _raw_entries(changes: list[tuple[int, str, bytes]]) -> list[dict[bytes, bytes]]:
    """A crashed invocation (with a restart) as journal fields, some of them replaced."""
    entries = [
        {b"__CURSOR": b"c%d" % i, b"__REALTIME_TIMESTAMP": b"%d" % (1_700_000_000_000_000 + i)}
        | {k.encode(): str(v).encode() for k, v in fields.items()}
        for i, fields in enumerate(crashed_invocation(UNIT, ["INFO starting", CRASH], restarts=2))
    ]
    for index, name, value in changes:
        entries[index % len(entries)][name.encode()] = value
    return entries


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    changes=st.lists(
        st.tuples(st.integers(0, 63), st.sampled_from(FIELDS), VALUES), min_size=1, max_size=6
    )
)
@example(changes=[(i, "__REALTIME_TIMESTAMP", b"9" * 19) for i in range(8)])
@example(changes=[(i, "__REALTIME_TIMESTAMP", b"9" * 400) for i in range(8)])
def test_any_field_values_are_decided_and_rendered(changes: list[tuple[int, str, bytes]]) -> None:
    """Outcome, history JSON, pending record, Slack message, alert and triage text."""
    pipeline = Pipeline(Config(), TABLE)
    ended = pipeline.feed(decode_all(_raw_entries(changes))) + pipeline.finish()
    outcomes = pipeline.decide_all(ended)
    assert outcomes, "the crash was not decided"
    for outcome in outcomes:
        json.loads(dump(outcome.to_json()))
        assert pending_from_record(json.loads(dump(outcome_record(outcome)))) is not None
        json.dumps(build_payload(outcome, host="gpu-7"))
        record = {**outcome.to_json()["verdict"], "time": "x", "unit": UNIT}
        json.dumps(alert(UNIT, record, host="gpu-7"))
    assert isinstance(render_text(outcomes), str)
