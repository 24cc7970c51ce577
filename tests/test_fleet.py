"""A fleet learns once: another host's halt of the same crash in the same environment, read from
a real Alertmanager (Debian's prometheus-alertmanager on loopback), halts this host at its first
crash; anything less (another environment, an old or released proof, a crash leaning transient,
Alertmanager unreachable or slow, a forged alert for another crash) leaves the local decision.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from alertmanager_server import Alertmanager, free_port
from conftest import wait_for
from corpus_judge import failed_invocation
from faults.harness import Supervisor, db_rows
from hypothesis import given
from hypothesis import strategies as st
from slack_server import SlackServer

from vllm_supervisor.actions.halt import quarantine_record
from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands.demo import make_venv
from vllm_supervisor.config import (
    AlertmanagerConfig,
    Config,
    FleetConfig,
    UnitConfig,
    load_config,
)
from vllm_supervisor.decide.fleet import FleetEvidence
from vllm_supervisor.environment.fingerprint import fleet_digest
from vllm_supervisor.errors import ConfigError
from vllm_supervisor.fleet import FLEET_ALERT, fleet_alert, proofs
from vllm_supervisor.journal.writer import EntryFactory, JournalWriter, crashed_invocation
from vllm_supervisor.model import (
    Action,
    Decision,
    Ended,
    Evidence,
    FleetProof,
    Outcome,
    Phase,
    Rule,
    Severity,
    Taken,
    Verdict,
)
from vllm_supervisor.notify.alertmanager import AlertmanagerSink
from vllm_supervisor.notify.decision import NotifyReason, telling
from vllm_supervisor.notify.sink import Incidents
from vllm_supervisor.pipeline import Pipeline

UNIT = "vllm.service"
UNIT_HALTED = "VllmSupervisorUnitHalted"
PREFIX = "(EngineCore_DP0 pid=6200) ERROR 11-30 11:00:09 [core.py:708]"
# An unknown crash with its cause named and no clue either way: halted by repetition alone.
UNKNOWN = [
    f"{PREFIX} EngineCore failed to start.",
    f"{PREFIX} RuntimeError: frobnicator kernel image missing for sm_90",
]
OTHER_CRASH = [
    f"{PREFIX} EngineCore failed to start.",
    f"{PREFIX} RuntimeError: widget shard table went sideways",
]
NCCL_AT_START = [
    "(Worker_TP1 pid=5301) [rank1]:[E1130 10:11:03.123456 5301 ProcessGroupNCCL.cpp:632]"
    " [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=52311,"
    " OpType=ALLREDUCE, NumelIn=4194304, NumelOut=4194304, Timeout(ms)=600000) ran for"
    " 600081 milliseconds before timing out.",
    "(Worker_TP1 pid=5301) terminate called after throwing an instance of 'c10::DistBackendError'",
]
HUB_OUTAGE = [
    "(APIServer pid=1) ERROR 11-30 11:00:09 [api_server.py:1] OSError: We couldn't connect to"
    " 'https://huggingface.co' to load this file, couldn't find it in the cached files and it"
    " looks like meta-llama/Llama-3.1-8B is not the path to a directory containing a file"
    " named config.json."
]
START = Phase(served=False, start_seen=True, ran_s=40.0)  # a start-up crash after 40 s
# What two hosts of one rollout run: the same venv contents at different paths and inodes.
ENVIRONMENT: dict[str, Any] = {
    "packages": {"/opt/venv/lib/python3.11/site-packages": {"vllm": "0.11.0", "torch": "2.9.0"}},
    "interpreter": {"path": "/opt/venv/bin/python", "identity": "/usr/bin/python3.11:12:6000:5"},
    "nvidia_driver": "570.133.20",
}
ON_ANOTHER_HOST: dict[str, Any] = {
    "packages": {"/srv/v/lib/python3.11/site-packages": {"torch": "2.9.0", "vllm": "0.11.0"}},
    "interpreter": {"path": "/srv/v/bin/python", "identity": "/usr/bin/python3.11:99:6000:77"},
    "nvidia_driver": "570.133.20",
}
UPGRADED: dict[str, Any] = {
    **ENVIRONMENT,
    "packages": {"/opt/venv/lib/python3.11/site-packages": {"vllm": "0.11.1", "torch": "2.9.0"}},
}


TABLE = load_table(Config())


def pipeline() -> Pipeline:
    """The daemon's pipeline for UNIT, with the shipped table and a fresh memory."""
    return Pipeline(Config(units=(UnitConfig(name=UNIT),)), TABLE)


@pytest.fixture(scope="module")
def classifier() -> Pipeline:
    return pipeline()


def ended(reader: Pipeline, lines: list[str], *, ago_s: float = 1.0) -> Ended:
    """A start-up crash of UNIT that ended `ago_s` ago, read as the daemon reads it."""
    now_us = int((time.time() - ago_s) * 1e6)
    inv = dataclasses.replace(
        failed_invocation(lines, started_us=now_us - 40_000_000, ended_us=now_us),
        boot_id="b" * 32,
    )
    return reader.examine(inv)


def config(url: str, *, host: str, peers: tuple[str, ...] = (), **fleet: Any) -> Config:
    return Config(
        alertmanager=AlertmanagerConfig(url=url, peers=peers, resend_s=60.0),
        fleet=FleetConfig(share=True, host=host, **fleet),
    )


def halt_record(
    crash: Ended, *, rule: Rule = Rule.UNKNOWN_REPEAT, when: datetime | None = None
) -> dict[str, Any]:
    """The quarantine record the proving host keeps for its halt of `crash`."""
    decision = Decision(action=Action.HALT, reason="repeated", rule=rule, crashes=2)
    outcome = Outcome(invocation=crash.invocation, verdict=crash.reading, decision=decision)
    record = {**quarantine_record(outcome), "environment": ENVIRONMENT}
    if when is not None:
        record["time"] = when.isoformat(timespec="seconds")
    return record


def publish(
    url: str,
    record: Mapping[str, Any],
    *,
    host: str,
    sent: Any = None,
    peers: tuple[str, ...] = (),
) -> Any:
    """What host's daemon posts for the open record (None: the unit released); the identity
    it sent open, for the next round."""
    sink = AlertmanagerSink(AlertmanagerConfig(url=url, peers=peers), host=host, share=True)

    async def once() -> Any:
        subject = Incidents(
            open={UNIT: record} if record else {},
            sent={UNIT: sent} if sent is not None else {},
            now=time.time(),
        )
        payload = sink.render(subject)
        result = await sink.send(payload, timeout_s=5)
        await sink.aclose()
        assert result.delivered, result
        return None if payload is None else payload.open.get(UNIT)

    return asyncio.run(once())


def rendered(record: Mapping[str, Any], *, host: str) -> list[dict[str, Any]]:
    """The alerts host's daemon would post for its halt of UNIT: its own and its fleet alert."""
    sink = AlertmanagerSink(AlertmanagerConfig(url="http://127.0.0.1:9"), host=host, share=True)
    payload = sink.render(Incidents(open={UNIT: record}, sent={}, now=time.time()))
    assert payload is not None
    return list(payload.body)


def read_proof(
    cfg: Config, crash: Ended, environment: dict[str, Any] | None = ENVIRONMENT
) -> tuple[Evidence, list[str], float]:
    """What FleetEvidence adds for `crash` on the host `cfg` names: the evidence, the lookup's
    result as counted, and how long it took."""
    counted: list[str] = []

    async def environment_of(_unit: str) -> dict[str, Any] | None:
        return environment

    async def once() -> Evidence:
        hook = FleetEvidence(cfg, environment=environment_of, counted=counted.append)
        try:
            return await hook.evidence(crash, Evidence(phase=START))
        finally:
            await hook.aclose()

    start = time.monotonic()
    found = asyncio.run(once())
    return found, counted, time.monotonic() - start


def decide(crash: Ended, evidence: Evidence) -> Decision:
    """The first crash's decision, as the daemon's pipeline makes it from the evidence."""
    return pipeline().decide(crash, evidence).decision


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[Alertmanager]:
    manager = Alertmanager(tmp_path / "am", free_port())
    manager.start()
    yield manager
    manager.stop()


class TestAgainstARealAlertmanager:
    def test_the_same_crash_and_environment_halts_at_the_first_crash(
        self, alertmanager: Alertmanager, classifier: Pipeline
    ) -> None:
        """gpu-12 halted after 2 crashes; gpu-13's first crash of the same kind halts, and its
        reason cites the proof: host, time and crashes."""
        proven = ended(classifier, UNKNOWN)
        publish(alertmanager.url, halt_record(proven), host="gpu-12")
        (shared,) = alertmanager.alerts(FLEET_ALERT)
        assert shared["labels"]["proof"] == "own"
        assert shared["labels"]["environment"] == fleet_digest(ENVIRONMENT)
        assert set(shared["labels"]) == {
            "alertname", "crash", "environment", "host", "unit", "proof", "severity",
        }  # fmt: skip
        here = ended(classifier, UNKNOWN)
        before = decide(here, Evidence(phase=START))
        assert before.action is Action.ALLOW_RESTART  # alone, the first crash restarts
        evidence, counted, _ = read_proof(
            config(alertmanager.url, host="gpu-13"), here, ON_ANOTHER_HOST
        )
        assert counted == ["proof"]
        assert evidence.fleet is not None and evidence.fleet.host == "gpu-12"
        decision = decide(here, evidence)
        assert decision.action is Action.HALT and decision.rule is Rule.FLEET_PROOF
        assert "the same crash with the same packages halted gpu-12 at" in decision.reason
        assert "after 2 crashes" in decision.reason

    def test_a_proof_from_another_environment_is_none(
        self, alertmanager: Alertmanager, classifier: Pipeline
    ) -> None:
        publish(alertmanager.url, halt_record(ended(classifier, UNKNOWN)), host="gpu-12")
        here = ended(classifier, UNKNOWN)
        evidence, counted, _ = read_proof(config(alertmanager.url, host="gpu-13"), here, UPGRADED)
        assert evidence.fleet is None and counted == ["none"]
        assert decide(here, evidence).action is Action.ALLOW_RESTART

    def test_an_old_proof_is_none(self, alertmanager: Alertmanager, classifier: Pipeline) -> None:
        old = datetime.now(UTC) - timedelta(hours=7)
        publish(alertmanager.url, halt_record(ended(classifier, UNKNOWN), when=old), host="gpu-12")
        assert alertmanager.alerts(FLEET_ALERT)  # still firing: only its age says no
        here = ended(classifier, UNKNOWN)
        evidence, counted, _ = read_proof(config(alertmanager.url, host="gpu-13"), here)
        assert evidence.fleet is None and counted == ["none"]

    def test_a_released_proof_is_none(
        self, alertmanager: Alertmanager, classifier: Pipeline
    ) -> None:
        """`release` on the proving host resolves its fleet alert with its halt's."""
        sent = publish(alertmanager.url, halt_record(ended(classifier, UNKNOWN)), host="gpu-12")
        publish(alertmanager.url, {}, host="gpu-12", sent=sent)
        wait_for(lambda: not alertmanager.alerts(FLEET_ALERT), timeout=10, what="resolved")
        here = ended(classifier, UNKNOWN)
        evidence, _, _ = read_proof(config(alertmanager.url, host="gpu-13"), here)
        assert evidence.fleet is None
        assert decide(here, evidence).action is Action.ALLOW_RESTART

    def test_a_halt_that_rested_on_a_proof_is_no_proof_and_a_hosts_own_is_not_read(
        self, alertmanager: Alertmanager, classifier: Pipeline
    ) -> None:
        """A fleet never keeps itself halted: a halt on a proof is published for the page
        (proof="fleet") but proves nothing; and a host does not read its own halt back."""
        crash = ended(classifier, UNKNOWN)
        publish(alertmanager.url, halt_record(crash, rule=Rule.FLEET_PROOF), host="gpu-12")
        publish(alertmanager.url, halt_record(crash), host="gpu-13")
        assert {a["labels"]["proof"] for a in alertmanager.alerts(FLEET_ALERT)} == {"own", "fleet"}
        evidence, _, _ = read_proof(config(alertmanager.url, host="gpu-13"), crash)
        assert evidence.fleet is None

    @pytest.mark.parametrize("lines", [NCCL_AT_START, HUB_OUTAGE], ids=["nccl", "hub"])
    def test_a_crash_leaning_transient_is_decided_locally(
        self, alertmanager: Alertmanager, classifier: Pipeline, lines: list[str]
    ) -> None:
        """A crash a signature calls transient is never looked up, even before serving where
        the policy reads NCCL's timeout as unknown; and no proof could halt a transient one."""
        crash = ended(classifier, lines)
        assert crash.reading.severity is Severity.TRANSIENT
        publish(alertmanager.url, halt_record(crash), host="gpu-12")  # forged or not
        evidence, counted, _ = read_proof(config(alertmanager.url, host="gpu-13"), crash)
        assert evidence.fleet is None and counted == []

    def test_no_proof_halts_a_crash_the_policy_reads_transient(self, classifier: Pipeline) -> None:
        crash = ended(classifier, HUB_OUTAGE)
        forced = Evidence(phase=START, fleet=_proof_for(crash))
        assert decide(crash, forced).action is Action.ALLOW_RESTART

    def test_a_forged_alert_cannot_halt_a_host_whose_crash_differs(
        self, alertmanager: Alertmanager, classifier: Pipeline
    ) -> None:
        """Anyone who can reach Alertmanager can post: a well-formed proof of another crash,
        malformed ones, and a proof naming this host's environment with a crash it does not
        have, none halts a host whose own crash differs."""
        theirs, mine = ended(classifier, OTHER_CRASH), ended(classifier, UNKNOWN)
        assert theirs.reading.fingerprint != mine.reading.fingerprint
        forged = fleet_alert(
            UNIT, halt_record(theirs), host="gpu-99", environment=fleet_digest(ENVIRONMENT)
        )
        assert forged is not None
        junk: dict[str, Any] = {"labels": {**forged["labels"], "crash": "not hex; drop table"}}
        alertmanager.post([forged, junk, {"labels": {"alertname": FLEET_ALERT}}])
        evidence, counted, _ = read_proof(config(alertmanager.url, host="gpu-13"), mine)
        assert evidence.fleet is None and counted == ["none"]
        assert decide(mine, evidence).action is Action.ALLOW_RESTART


def _proof_for(crash: Ended) -> FleetProof:
    assert crash.reading.fingerprint is not None
    return FleetProof(
        host="gpu-12",
        unit=UNIT,
        crash=crash.reading.fingerprint,
        environment="e" * 32,
        since_s=time.time() - 60,
        crashes=2,
    )


class TestAnHAPair:
    def test_alerts_go_to_each_peer_and_any_peer_answers(
        self, tmp_path: Path, classifier: Pipeline
    ) -> None:
        """Alertmanager's cluster gossips silences, not alerts: the sink posts to each peer,
        and with one peer down the other still holds the proof."""
        first = Alertmanager(tmp_path / "am1", free_port())
        second = Alertmanager(tmp_path / "am2", free_port())
        try:
            first.start()
            second.start()
            crash = ended(classifier, UNKNOWN)
            publish(first.url, halt_record(crash), host="gpu-12", peers=(second.url,))
            assert len(first.alerts(FLEET_ALERT)) == len(second.alerts(FLEET_ALERT)) == 1
            first.stop()
            cfg = config(first.url, host="gpu-13", peers=(second.url,))
            evidence, counted, _ = read_proof(cfg, crash)
            assert counted == ["proof"] and evidence.fleet is not None
        finally:
            first.stop()
            second.stop()

    def test_one_instance_down_still_delivers_and_a_release_resolves_on_the_other(
        self, alertmanager: Alertmanager, classifier: Pipeline
    ) -> None:
        """A round is delivered when one instance took it: what was sent is remembered, so a
        release still resolves the proof on the instance that is up."""
        down = f"http://127.0.0.1:{free_port()}"
        crash = ended(classifier, UNKNOWN)
        sent = publish(alertmanager.url, halt_record(crash), host="gpu-12", peers=(down,))
        assert sent is not None and alertmanager.alerts(FLEET_ALERT)
        publish(alertmanager.url, {}, host="gpu-12", sent=sent, peers=(down,))
        wait_for(lambda: not alertmanager.alerts(FLEET_ALERT), timeout=10, what="resolved")

    def test_peers_need_a_url_and_each_is_checked(self, tmp_path: Path) -> None:
        path = tmp_path / "c.toml"
        path.write_text('[alertmanager]\npeers = ["http://127.0.0.1:9093"]\n')
        with pytest.raises(ConfigError, match=r"alertmanager\.peers: set alertmanager\.url"):
            load_config(path)
        path.write_text('[alertmanager]\nurl = "http://127.0.0.1:9093"\npeers = ["ftp://x"]\n')
        with pytest.raises(ConfigError, match=r"alertmanager\.peers\[0\]"):
            load_config(path)


class TestWhenTheStoreFails:
    def test_unreachable_alertmanager_leaves_the_decision_local_and_fast(
        self, classifier: Pipeline
    ) -> None:
        crash = ended(classifier, UNKNOWN)
        url = f"http://127.0.0.1:{free_port()}"  # nobody listens
        evidence, counted, took = read_proof(config(url, host="gpu-13"), crash)
        assert evidence.fleet is None and counted == ["unreachable"]
        assert took < 2.0
        assert decide(crash, evidence).action is Action.ALLOW_RESTART

    def test_a_silent_alertmanager_costs_at_most_the_timeout(self, classifier: Pipeline) -> None:
        """A peer that accepts and never answers: the decision waits fleet.timeout_s, no more."""
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(8)
            url = f"http://127.0.0.1:{listener.getsockname()[1]}"
            crash = ended(classifier, UNKNOWN)
            evidence, counted, took = read_proof(config(url, host="gpu-13", timeout_s=0.3), crash)
        assert evidence.fleet is None and counted == ["unreachable"]
        assert 0.25 <= took < 1.5

    def test_a_reply_that_is_no_alert_list_is_none(self, classifier: Pipeline) -> None:
        """An HTTP 200 with HTML, or a huge body: nothing is believed, nothing raises."""
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Nonsense(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = b"<html>proxy says hi</html>"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Nonsense)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}"
            evidence, counted, _ = read_proof(
                config(url, host="gpu-13"), ended(classifier, UNKNOWN)
            )
        finally:
            server.shutdown()
            server.server_close()
        assert evidence.fleet is None and counted == ["unreachable"]


class TestThePolicy:
    def test_a_proof_of_a_crash_that_names_no_cause_never_halts(self, classifier: Pipeline) -> None:
        """A crash no line names (a guess): a forged proof with its fingerprint is not enough."""
        crash = ended(classifier, [f"{PREFIX} EngineCore failed to start."])
        if crash.reading.fingerprint is None:
            pytest.fail("the guess has a fingerprint to match")
        evidence = Evidence(phase=START, fleet=_proof_for(crash))
        assert decide(crash, evidence).action is Action.ALLOW_RESTART

    def test_a_unit_that_halts_on_nothing_inferred_is_not_halted_by_a_proof(
        self, classifier: Pipeline
    ) -> None:
        """`halt_inferred = false`: its operator wants its own repeats and signatures alone."""
        crash = ended(classifier, UNKNOWN)
        unit = UnitConfig(name=UNIT, halt_inferred=False)
        strict = Pipeline(Config(units=(unit,)), TABLE)
        evidence = Evidence(phase=START, fleet=_proof_for(crash))
        assert strict.decide(crash, evidence).decision.action is Action.ALLOW_RESTART

    def test_another_machines_crash_is_not_looked_up(
        self, alertmanager: Alertmanager, classifier: Pipeline
    ) -> None:
        """A journal directory of several hosts: this host's daemon reads its own units'
        environment, so another machine's crash asks nothing."""
        crash = ended(classifier, UNKNOWN)
        publish(alertmanager.url, halt_record(crash), host="gpu-12")
        theirs = dataclasses.replace(
            crash, invocation=dataclasses.replace(crash.invocation, host="f" * 32)
        )
        counted: list[str] = []

        async def environment_of(_unit: str) -> dict[str, Any] | None:
            return ENVIRONMENT

        async def once() -> Evidence:
            cfg = config(alertmanager.url, host="gpu-13")
            hook = FleetEvidence(
                cfg, environment=environment_of, counted=counted.append, machine_id="a" * 32
            )
            try:
                return await hook.evidence(theirs, Evidence(phase=START))
            finally:
                await hook.aclose()

        assert asyncio.run(once()).fleet is None and counted == []

    def test_a_proof_of_another_crash_never_halts(self, classifier: Pipeline) -> None:
        crash, other = ended(classifier, UNKNOWN), ended(classifier, OTHER_CRASH)
        evidence = Evidence(phase=START, fleet=_proof_for(other))
        assert decide(crash, evidence).action is Action.ALLOW_RESTART

    def test_a_halt_the_fleet_shares_is_told_by_its_group_not_per_host(
        self, classifier: Pipeline
    ) -> None:
        """With [fleet] share on, a halt on a proof and a halt on the host's own repeats are
        told by the fleet's Alertmanager group; off, as before; a port's halt always alone."""
        crash = ended(classifier, UNKNOWN)
        decision = decide(crash, Evidence(phase=START, fleet=_proof_for(crash)))
        outcome = Outcome(
            invocation=crash.invocation,
            verdict=crash.reading,
            decision=decision,
            taken=Taken.HALTED,
        )
        own = dataclasses.replace(
            outcome, decision=dataclasses.replace(decision, rule=Rule.UNKNOWN_REPEAT)
        )
        port = dataclasses.replace(
            outcome, decision=dataclasses.replace(decision, rule=Rule.PORT_HELD)
        )

        def told(outcome: Outcome, fleet_tells: bool = True) -> NotifyReason:
            return telling(outcome, endpoint=True, notify_transient=True, fleet_tells=fleet_tells)

        assert told(outcome) is told(own) is NotifyReason.FLEET
        assert told(outcome, fleet_tells=False) is told(port) is NotifyReason.ALONE
        failed = dataclasses.replace(outcome, taken=Taken.HALT_FAILED)
        assert told(failed) is NotifyReason.ALONE  # a halt that failed is news here


class TestHostLocalHalts:
    @pytest.mark.parametrize("kind", ["address_missing", "missing_path", "port_held", "gpu_xid"])
    def test_a_halt_on_the_hosts_own_state_is_not_published_and_goes_to_slack(
        self, classifier: Pipeline, kind: str
    ) -> None:
        """An inferred fatal that rests on an address, a path, a port or a GPU of this host
        (the record's evidence) is no proof for another host, and its own Slack tells it."""
        crash = ended(classifier, UNKNOWN)
        record = {**halt_record(crash, rule=Rule.INFERRED_FATAL), "evidence": {"kind": kind}}
        assert fleet_alert(UNIT, record, host="gpu-12", environment="e" * 32) is None

    def test_an_address_halt_is_told_by_slack_with_sharing_on(self) -> None:
        bind = [
            "(APIServer pid=1) ERROR 12-05 10:00:09 [api_server.py:1] OSError: [Errno 99] error"
            " while attempting to bind on address ('10.9.9.9', 8000): cannot assign requested"
            " address"
        ]
        crash = ended(pipeline(), bind)
        decision = Decision(action=Action.HALT, reason="address", rule=Rule.INFERRED_FATAL)
        verdict = dataclasses.replace(
            crash.reading, captures={"address": "10.9.9.9"}, root_cause=bind[0]
        )
        outcome = Outcome(
            invocation=crash.invocation, verdict=verdict, decision=decision, taken=Taken.HALTED
        )
        told = telling(outcome, endpoint=True, notify_transient=True, fleet_tells=True)
        assert told is NotifyReason.ALONE


class TestTheDigest:
    def test_the_hosts_of_a_rollout_share_it_and_a_version_changes_it(self) -> None:
        assert fleet_digest(ENVIRONMENT) == fleet_digest(ON_ANOTHER_HOST) is not None
        assert fleet_digest(UPGRADED) != fleet_digest(ENVIRONMENT)
        assert fleet_digest({"nvidia_driver": "570"}) is None  # too little to compare
        assert fleet_digest("not a fingerprint") is None

    def test_an_environment_file_counts_and_one_unread_keeps_the_unit_out(self) -> None:
        """`--model ${MODEL}` from a per-host EnvironmentFile=: different content, different
        digest; a file the daemon could not read cannot be compared: no digest."""
        a, b = "a" * 64, "b" * 64
        with_a = {**ENVIRONMENT, "environment_files": {"/etc/default/vllm": a}}
        with_b = {**ENVIRONMENT, "environment_files": {"/etc/default/vllm": b}}
        assert fleet_digest(with_a) != fleet_digest(with_b)
        assert fleet_digest({**ENVIRONMENT, "environment_files": {"/etc/x": "unread"}}) is None


def test_a_fleet_host_name_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[fleet]\nhost = "gpu 1; rm -rf"\n[[unit]]\nname = "vllm.service"\n')
    with pytest.raises(ConfigError, match=r"fleet\.host"):
        load_config(path)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=20,
)
LABELS = st.fixed_dictionaries(
    {
        "alertname": st.sampled_from([FLEET_ALERT, "Other"]),
        "crash": st.sampled_from(["a" * 16, "x", "0123456789abcdef"]),
        "environment": st.sampled_from(["e" * 32, ""]),
        "host": st.text(max_size=12),
        "unit": st.text(max_size=12),
        "proof": st.sampled_from(["own", "fleet", "yes"]),
    }
)
ALERTS = st.lists(
    st.fixed_dictionaries(
        {"labels": LABELS | JSON, "startsAt": st.text(max_size=40) | JSON}, optional={"x": JSON}
    )
    | JSON,
    max_size=6,
)


@given(body=ALERTS | JSON)
def test_no_reply_crashes_the_reader_and_only_a_whole_proof_counts(body: Any) -> None:
    found = proofs(
        body, crash="a" * 16, environment="e" * 32, not_host="gpu-13", now=2e9, window_s=2e9
    )
    for proof in found:
        assert proof.crash == "a" * 16 and proof.environment == "e" * 32
        assert proof.host != "gpu-13"


@given(record=st.dictionaries(st.text(max_size=12), JSON, max_size=8), host=st.text(max_size=20))
def test_any_record_makes_a_fleet_alert_of_string_labels_or_none(
    record: dict[str, Any], host: str
) -> None:
    made = fleet_alert(UNIT, record, host=host, environment="e" * 32)
    if made is not None:
        assert all(isinstance(v, str) for v in made["labels"].values())
        assert all(isinstance(v, str) for v in made["annotations"].values())


def test_an_alert_read_back_is_the_proof_it_was_written_as(classifier: Pipeline) -> None:
    crash = ended(classifier, UNKNOWN)
    made = fleet_alert(UNIT, halt_record(crash), host="gpu-12", environment="e" * 32)
    assert made is not None
    at = datetime(2026, 12, 5, 10, 2, 3, 123456, UTC).timestamp()
    reply = [
        {
            **made,
            "startsAt": "2026-12-05T10:02:03.123456789Z",
            "updatedAt": "2026-12-05T10:03:00.5Z",
        }
    ]
    asked = {"crash": crash.reading.fingerprint or "", "environment": "e" * 32, "not_host": "h"}
    (proof,) = proofs(reply, **asked, now=at + 120, window_s=3600)
    assert (proof.host, proof.unit, proof.crashes) == ("gpu-12", UNIT, 2)
    assert proof.since_s == at


def test_a_proof_posted_once_or_dated_ahead_proves_nothing(classifier: Pipeline) -> None:
    """Alertmanager's own `updatedAt` says when it last heard of the alert: a halted host's
    daemon re-sends it every resend_s, a proof posted once goes stale within FRESH_S; and a
    start later than now (past clock skew) is forged."""
    crash = ended(classifier, UNKNOWN)
    made = fleet_alert(UNIT, halt_record(crash), host="gpu-12", environment="e" * 32)
    assert made is not None
    now = datetime(2026, 12, 5, 12, 0, tzinfo=UTC).timestamp()
    asked = {"crash": crash.reading.fingerprint or "", "environment": "e" * 32, "not_host": "h"}

    def read(starts: str, updated: str) -> int:
        reply = [{**made, "startsAt": starts, "updatedAt": updated}]
        return len(proofs(reply, **asked, now=now, window_s=6 * 3600))

    assert read("2026-12-05T11:00:00Z", "2026-12-05T11:59:00Z") == 1  # a live halt
    assert read("2026-12-05T11:00:00Z", "2026-12-05T11:30:00Z") == 0  # posted once, stale
    assert read("2099-01-01T00:00:00Z", "2026-12-05T11:59:00Z") == 0  # dated ahead
    assert read("2026-12-05T11:00:00Z", "not a time") == 0


def test_the_crash_is_one_only_repetition_halts() -> None:
    """Guards the tests' own premise: the shipped table and the inference leave UNKNOWN
    unknown, restarted at its first crash and halted by repetition alone."""
    crash = ended(pipeline(), UNKNOWN)
    outcome = pipeline().decide(crash, Evidence(phase=START))
    verdict: Verdict = outcome.verdict
    assert verdict.severity is Severity.UNKNOWN and verdict.leaning is not Severity.TRANSIENT
    assert outcome.decision.rule is Rule.UNKNOWN_FIRST


class TestTwoDaemons:
    """Two real `vllm-supervisor run` daemons, each following its own host's journal directory
    (its own machine id and hostname), one real Alertmanager, one Slack stand-in."""

    def test_the_second_host_halts_at_its_first_crash_and_is_told_once(
        self, tmp_path: Path, alertmanager: Alertmanager
    ) -> None:
        slack = SlackServer()
        slack.start()
        python = make_venv(tmp_path / "venv", [("vllm", "0.11.0", ()), ("torch", "2.9.0", ())])
        daemons: list[Supervisor] = []
        try:
            first = _host(tmp_path / "gpu-1", "gpu-1", alertmanager.url, slack.url, python)
            second = _host(tmp_path / "gpu-2", "gpu-2", alertmanager.url, slack.url, python)
            daemons += [first.daemon, second.daemon]
            for host in (first, second):
                host.daemon.start()
                wait_for(host.daemon.following, timeout=60, what=f"{host.name} following")
            # gpu-1 learns alone: restarted at its first crash, halted at its second.
            first.crash(1)
            wait_for(lambda: len(first.history()) == 1, timeout=30, what="gpu-1's 1st crash")
            first.crash(2)
            wait_for(lambda: first.rules()[-1:] == ["unknown_repeat"], timeout=30, what="halt")
            wait_for(
                lambda: (
                    [a["labels"]["host"] for a in alertmanager.alerts(FLEET_ALERT)] == ["gpu-1"]
                ),
                timeout=30,
                what="gpu-1's proof",
            )
            # Its first crash goes to Slack; its halt, the fleet's, to Alertmanager's group.
            wait_for(lambda: first.notified() == [1, 1], timeout=30, what="gpu-1's crashes told")
            wait_for(lambda: slack.count() == 1, timeout=30, what="gpu-1's first crash")
            # gpu-2 is told by the fleet: halted at its first crash, citing gpu-1.
            second.crash(1)
            wait_for(lambda: second.rules() == ["fleet_proof"], timeout=30, what="gpu-2 halted")
            (row,) = second.history()
            assert "halted gpu-1 at" in row["decision"]["reason"]
            assert "after 2 crashes" in row["decision"]["reason"]
            assert (tmp_path / "gpu-2" / "run" / "quarantine").exists()
            wait_for(
                lambda: (
                    sorted(a["labels"]["proof"] for a in alertmanager.alerts(FLEET_ALERT))
                    == ["fleet", "own"]
                ),
                timeout=30,
                what="gpu-2's fleet alert",
            )
            wait_for(lambda: second.notified() == [1], timeout=30, what="gpu-2's crash told")
            assert slack.count() == 1  # both halts went to the fleet's group, not to Slack
            # A release on gpu-1 withdraws its proof (and its halt alert); gpu-2's stays.
            first.release()
            wait_for(
                lambda: (
                    [a["labels"]["host"] for a in alertmanager.alerts(FLEET_ALERT)] == ["gpu-2"]
                ),
                timeout=30,
                what="gpu-1's proof resolved",
            )
            assert [a["labels"]["host"] for a in alertmanager.alerts(UNIT_HALTED)] == ["gpu-2"]
            unreadable = [e for e in first.daemon.events() if e["event"] == "state_row_unreadable"]
            assert unreadable == []
        finally:
            for daemon in daemons:
                daemon.stop_quietly()
            slack.stop()


@dataclasses.dataclass
class _Host:
    name: str
    root: Path
    daemon: Supervisor
    writer_factory: EntryFactory

    def crash(self, serial: int) -> None:
        entries = crashed_invocation(
            UNIT, UNKNOWN, restarts=serial, invocation_id=f"{serial:032x}", pid=4000 + serial
        )
        with JournalWriter(self.root / "journal", factory=self.writer_factory) as writer:
            writer.write(entries)

    def history(self) -> list[dict[str, Any]]:
        rows = db_rows(self.root / "state", "SELECT outcome FROM history ORDER BY id")
        return [json.loads(row[0]) for row in rows]

    def rules(self) -> list[str]:
        return [str(row["decision"]["rule"]) for row in self.history()]

    def release(self) -> None:
        subprocess.run(
            [sys.executable, "-m", "vllm_supervisor", "release", UNIT, "--config",
             str(self.daemon.config)],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip

    def notified(self) -> list[int]:
        return [row[0] for row in db_rows(self.root / "state", "SELECT notified FROM history")]


def _host(root: Path, name: str, am_url: str, slack_url: str, python: Path) -> _Host:
    """One host: its journal directory, machine id and hostname, its daemon's config."""
    root.mkdir(parents=True)
    machine_id = uuid.uuid5(uuid.NAMESPACE_DNS, name).hex
    text = (
        "[systemd]\nenabled = false\n"
        f'[journal]\ndirectory = "{root / "journal"}"\nstart_at = "head"\n'
        f'machine_id = "{machine_id}"\nkernel = false\n'
        f'[state]\nstate_dir = "{root / "state"}"\nruntime_dir = "{root / "run"}"\n'
        '[metrics]\nlisten = "127.0.0.1:0"\n'
        f'[slack]\nwebhook_url = "{slack_url}"\nmin_interval_s = 0.01\nbackoff_max_s = 0.5\n'
        f'[alertmanager]\nurl = "{am_url}"\nresend_s = 1.0\nbackoff_max_s = 0.5\n'
        f'[fleet]\nshare = true\nhost = "{name}"\n'
        f'[[unit]]\nname = "{UNIT}"\npython = "{python}"\nunknown_repeat_limit = 2\n'
    )
    config = root / "config.toml"
    config.write_text(text, encoding="utf-8")
    daemon = Supervisor(root, config, env={"DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/no/bus"})
    return _Host(name, root, daemon, EntryFactory(machine_id=machine_id, hostname=name))


SHIPPED_ROUTE = (
    Path(__file__).resolve().parent.parent / "deploy" / "alertmanager" / "alertmanager.yml"
)


def shipped_config(receiver_url: str) -> str:
    """The shipped route and inhibit rule, its Slack receiver swapped for a loopback webhook
    and its 30 s group wait for 1 s (the test's only changes)."""
    text = SHIPPED_ROUTE.read_text(encoding="utf-8")
    head = text[: text.index("\nreceivers:")].replace("group_wait: 30s", "group_wait: 1s")
    return (
        f"{head}\nreceivers:\n  - name: vllm-supervisor\n    webhook_configs:\n"
        f"      - url: {receiver_url}\n        send_resolved: false\n"
    )


def test_the_shipped_route_tells_a_rollout_once(tmp_path: Path, classifier: Pipeline) -> None:
    """Five hosts halted on one crash (one on its own evidence, four on its proof), each
    pushing its halt and its fleet alert: the receiver gets one notification naming the five,
    and no host's own halt alert on top."""
    receiver = SlackServer()
    receiver.start()
    manager = Alertmanager(tmp_path / "am", free_port(), config=shipped_config(receiver.url))
    try:
        manager.start()
        crash = ended(classifier, UNKNOWN)
        bodies = rendered(halt_record(crash), host="gpu-1")
        for n in range(2, 6):
            bodies += rendered(halt_record(crash, rule=Rule.FLEET_PROOF), host=f"gpu-{n}")
        manager.post(bodies)  # at once: the group's wait must not end between two hosts
        wait_for(lambda: receiver.count() >= 1, timeout=30, what="the fleet's notification")
        wait_for(manager.settled, timeout=30, what="Alertmanager done notifying")
        (told,) = [request.json() for request in receiver.requests]
        assert told["groupLabels"]["alertname"] == FLEET_ALERT
        assert sorted(a["labels"]["host"] for a in told["alerts"]) == [
            f"gpu-{n}" for n in range(1, 6)
        ]
        halts = manager.alerts("VllmSupervisorUnitHalted")
        assert len(halts) == 5 and all(a["status"]["inhibitedBy"] for a in halts)
    finally:
        manager.stop()
        receiver.stop()


def test_the_shipped_alertmanager_config_checks() -> None:
    """amtool (Debian's prometheus-alertmanager) accepts the shipped route, rule and receiver."""
    checked = subprocess.run(
        ["amtool", "check-config", str(SHIPPED_ROUTE)],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "1 inhibit rules" in checked.stdout
