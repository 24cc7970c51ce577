"""A listen address this host does not have (yet): a hold until it exists, never a halt for good
(supervisor.environment.addresses, supervisor.decide.address_evidence).

Seen under systemd 252 before: a server started before its address existed at boot was an
unknown crash, halted after 3 crashes 45 s after boot; the address came, and the unit stayed
down until a person ran `release`.
"""

from __future__ import annotations

import dataclasses
import time

from corpus_judge import GOOD_START_S, invocation_of, label_of
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.actions.evidence import cause_gone, evidence_of, waits_on_a_condition
from vllm_supervisor.classify.classifier import Classifier
from vllm_supervisor.classify.signatures import load_signature_table
from vllm_supervisor.config import Config, DriftConfig, UnitConfig
from vllm_supervisor.decide.address_evidence import AddressEvidence
from vllm_supervisor.environment.addresses import (
    bind_address,
    could_not_bind,
    is_local,
    listen_address,
    not_assigned,
)
from vllm_supervisor.model import Action, Ended, Outcome, Rule
from vllm_supervisor.pipeline import Pipeline

UNIT = "vllm.service"
ABSENT = "10.255.255.1"  # the recorded log's --host: an address no interface of this host has
CONFIG = Config(units=(UnitConfig(name=UNIT),), drift=DriftConfig(good_start_s=GOOD_START_S))


VLLM_ADDRESS_MISSING = "235-real-vllm-host-address-not-local.log"
LLAMACPP_ADDRESS_MISSING = "353-real-llamacpp-host-address-not-local.log"  # no errno: its words
LLAMACPP_PORT_IN_USE = "345-real-llamacpp-port-in-use.log"  # the same words, of 127.0.0.1


def _crash(
    *, ended_s_ago: float = 0.5, host: str | None = None, log: str = VLLM_ADDRESS_MISSING
) -> Ended:
    """A real crash of the corpus, by default vLLM 0.32's on `--host 10.255.255.1` (235), just
    ended."""
    now_us = int(time.time() * 1e6)
    inv = dataclasses.replace(
        invocation_of(label_of(log)),
        started_us=now_us - 11_000_000,
        ended_us=now_us - int(ended_s_ago * 1e6),
        host=host,
    )
    reading, facts = Classifier(load_signature_table()).examine(inv)
    return Ended(invocation=inv, reading=reading, facts=facts)


async def _decided(ended: Ended, machine_id: str | None = None) -> Outcome:
    pipeline = Pipeline(CONFIG, load_signature_table())
    hook = AddressEvidence(CONFIG, machine_id=machine_id)
    return pipeline.decide(ended, await hook.evidence(ended, pipeline.evidence(ended)))


class TestAddresses:
    def test_the_listen_address_from_vllms_arguments_or_a_command_line(self) -> None:
        assert listen_address(["non-default args: {'host': '10.0.0.5', 'port': 8000}"]) == (
            "10.0.0.5"
        )
        assert listen_address(["vllm serve m --host fd00::5 --port 1"]) == "fd00::5"
        assert listen_address(["--host=0.0.0.0", "{'host': 'gpu-1.lan'}"]) is None

    def test_which_addresses_this_host_has(self) -> None:
        assert is_local("127.0.0.1") is True
        assert is_local("192.0.2.7") is False  # TEST-NET-1: on no interface here
        assert is_local("not an address") is None

    def test_errno_99_is_not_assigned(self) -> None:
        assert not_assigned("OSError: [Errno 99] Cannot assign requested address")
        assert not not_assigned("OSError: [Errno 98] Address already in use")
        assert not not_assigned(None)

    def test_a_bind_failure_names_its_address_in_its_own_words_first(self) -> None:
        llamacpp = "couldn't bind HTTP server socket, hostname: 10.255.255.1, port: 18115"
        assert could_not_bind(llamacpp)
        assert could_not_bind("OSError: [Errno 99] Cannot assign requested address")
        assert not could_not_bind("ValueError: max_model_len (500) is larger than 256")
        assert bind_address(llamacpp, ["--host 10.0.0.5"]) == "10.255.255.1"
        assert bind_address("error: failed to bind [fd00::5]:8080", []) == "fd00::5"
        assert bind_address("failed to bind 0.0.0.0:8000", ["--host 10.0.0.5"]) == "10.0.0.5"
        assert bind_address("failed to bind at 12:00:01.5", []) is None  # a time, no address

    @given(st.text(max_size=300), st.lists(st.text(max_size=200), max_size=3))
    def test_no_cause_line_makes_the_bind_address_fail(self, cause: str, texts: list[str]) -> None:
        found = bind_address(cause, texts)
        assert found is None or is_local(found) is not None

    @given(st.lists(st.text(max_size=200), max_size=5))
    def test_no_line_makes_the_reading_fail(self, texts: list[str]) -> None:
        found = listen_address(texts)
        assert found is None or is_local(found) is not None or ":" in found or "." in found


class TestTheHold:
    async def test_a_missing_address_halts_the_first_crash_until_it_exists(self) -> None:
        outcome = await _decided(_crash())
        assert (outcome.decision.action, outcome.decision.rule) == (
            Action.HALT,
            Rule.INFERRED_FATAL,
        )
        assert f"listen address {ABSENT} is not on this host" in outcome.decision.reason
        record = {"evidence": evidence_of(outcome)}
        assert record["evidence"] == {"kind": "address_missing", "address": ABSENT}
        assert waits_on_a_condition(record)
        assert cause_gone(record) is None
        assert cause_gone({"evidence": {"kind": "address_missing", "address": "127.0.0.1"}}) == (
            "127.0.0.1 is an address of this host now"
        )

    async def test_a_bind_failure_in_other_words_names_the_address_it_could_not_bind(
        self,
    ) -> None:
        """llama.cpp says "couldn't bind HTTP server socket, hostname: H, port: P" for a port in
        use and an address this host lacks alike: the address in its words tells them apart."""
        outcome = await _decided(_crash(log=LLAMACPP_ADDRESS_MISSING))
        assert (outcome.decision.action, outcome.decision.rule) == (
            Action.HALT,
            Rule.INFERRED_FATAL,
        )
        assert evidence_of(outcome) == {"kind": "address_missing", "address": ABSENT}
        in_use = await _decided(_crash(log=LLAMACPP_PORT_IN_USE))  # 127.0.0.1 is here
        assert in_use.decision.action is Action.ALLOW_RESTART, in_use.decision
        assert evidence_of(in_use) is None

    async def test_without_the_evidence_it_is_decided_as_before(self) -> None:
        """An old crash, or another host's: this host's addresses say nothing of it."""
        for ended in (_crash(ended_s_ago=3600), _crash(host="another-machine")):
            outcome = await _decided(ended, machine_id="this-machine")
            assert outcome.decision.rule is Rule.UNKNOWN_FIRST, outcome.decision
            assert evidence_of(outcome) is None
