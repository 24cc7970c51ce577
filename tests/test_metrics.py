"""Metrics and the HTTP endpoint: series, values and lint, scraped over real loopback HTTP."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from notify_fakes import T0, make_outcome

from vllm_supervisor import __version__
from vllm_supervisor.classify.signatures import load_signature_table
from vllm_supervisor.model import Action, Rule, Severity
from vllm_supervisor.telemetry.http import MetricsServer, combine_health, following_check
from vllm_supervisor.telemetry.metrics import Metrics, new_registry

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The samples of a Prometheus text exposition, keyed by (name, labels)."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        assert match, line
        labels = frozenset(LABEL.findall(match.group(2) or ""))
        samples[match.group(1), labels] = float(match.group(3))
    return samples


def value(samples: dict, name: str, **labels: str) -> float | None:
    """One sample's value, or None when the series is absent."""
    return samples.get((name, frozenset(labels.items())))


@pytest.fixture(name="metrics")
def _metrics() -> Metrics:
    metrics = Metrics(new_registry(), now=lambda: T0)
    metrics.register_units(["vllm.service", "sglang.service"])
    for unit in ("vllm.service", "sglang.service"):
        metrics.unit_loaded(unit, True)
    metrics.signature_table(
        ["flashinfer_cubin_mismatch", "nccl_timeout"],
        True,
        severities={"flashinfer_cubin_mismatch": "fatal", "nccl_timeout": "transient"},
    )
    return metrics


@pytest.fixture(name="health_state")
def _health_state() -> dict[str, Any]:
    return {"ok": True, "details": {"reasons": []}}


@pytest.fixture(name="server")
async def _server(metrics: Metrics, health_state: dict[str, Any]) -> AsyncIterator[MetricsServer]:
    def outbox_health() -> tuple[bool, dict[str, Any]]:
        return health_state["ok"], dict(health_state["details"])

    server = MetricsServer(metrics, combine_health(following_check(metrics), outbox_health))
    await server.start("127.0.0.1", 0)
    yield server
    await server.close()


async def _get(server: MetricsServer, path: str, method: str = "GET") -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.request(method, f"http://127.0.0.1:{server.port}{path}")


def _feed(metrics: Metrics) -> None:
    """A fatal crash loop that is halted, plus one transient and one unknown crash."""
    metrics.entries_read(1200)
    metrics.journal_lag(0.25)
    metrics.following(True)
    for n in range(3):
        metrics.outcome(make_outcome(invocation_id=f"f{n}", restarts=n + 1), 0.002)
    metrics.outcome(
        make_outcome(
            signature="nccl_timeout", severity=Severity.TRANSIENT, action=Action.ALLOW_RESTART
        ),
        0.001,
    )
    metrics.outcome(
        make_outcome(unit="sglang.service", signature=None, severity=Severity.UNKNOWN), 0.003
    )
    metrics.halt("vllm.service", Rule.FATAL_SIGNATURE, 1.5)
    metrics.notification("sent")
    metrics.outbox_depth(2)
    metrics.source_restart("exited")
    metrics.entry_invalid("invalid_json")
    metrics.state_error("write")


class TestScrape:
    """/metrics over real HTTP after feeding outcomes."""

    async def test_expected_series_and_values(
        self, server: MetricsServer, metrics: Metrics
    ) -> None:
        """Each daemon call shows up as the documented series with the right value."""
        _feed(metrics)
        response = await _get(server, "/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        s = parse(response.text)
        p = "vllm_supervisor_"
        crash = {"unit": "vllm.service", "signature": "flashinfer_cubin_mismatch"}
        assert value(s, p + "build_info", version=__version__) == 1
        assert value(s, p + "journal_entries_total") == 1200
        assert value(s, p + "journal_lag_seconds") == 0.25
        assert value(s, p + "journal_following") == 1
        assert value(s, p + "crashes_total", **crash, severity="fatal") == 3
        assert (
            value(
                s,
                p + "crashes_total",
                unit="vllm.service",
                signature="nccl_timeout",
                severity="transient",
            )
            == 1
        )
        assert (
            value(
                s,
                p + "crashes_total",
                unit="sglang.service",
                signature="unknown",
                severity="unknown",
            )
            == 1
        )
        assert value(s, p + "unit_restarts", unit="vllm.service") == 3
        assert value(s, p + "last_crash_timestamp_seconds", unit="vllm.service") == T0
        assert value(s, p + "decisions_total", **crash, action="halt", dry_run="false") == 3
        assert value(s, p + "halts_total", unit="vllm.service", reason="fatal_signature") == 1
        assert value(s, p + "unit_halted", unit="vllm.service") == 1
        assert value(s, p + "unit_halted", unit="sglang.service") == 0
        assert value(s, p + "halt_latency_seconds_count") == 1
        assert value(s, p + "classify_duration_seconds_count") == 5
        assert value(s, p + "notifications_total", sink="slack", outcome="sent") == 1
        assert value(s, p + "outbox_depth", sink="slack") == 2
        assert value(s, p + "journal_source_restarts_total", reason="exited") == 1
        assert value(s, p + "journal_entries_invalid_total", reason="invalid_json") == 1
        assert value(s, p + "state_errors_total", reason="write") == 1
        assert value(s, p + "signature_table_loaded") == 1
        assert value(s, p + "signature_table_signatures") == 2
        assert value(s, "process_cpu_seconds_total") is not None

    async def test_series_exist_before_any_event(self, server: MetricsServer) -> None:
        """Per-unit and per-reason series are pre-initialised to 0 for rate() and alerts."""
        s = parse((await _get(server, "/metrics")).text)
        p = "vllm_supervisor_"
        assert value(s, p + "unit_halted", unit="sglang.service") == 0
        assert value(s, p + "halt_failures_total", unit="vllm.service", reason="timeout") == 0
        assert value(s, p + "notifications_total", sink="slack", outcome="failed") == 0
        assert (
            value(
                s, p + "crashes_total", unit="vllm.service", signature="unknown", severity="unknown"
            )
            == 0
        )
        assert (
            value(
                s,
                p + "crashes_total",
                unit="vllm.service",
                signature="flashinfer_cubin_mismatch",
                severity="fatal",
            )
            == 0
        )
        assert not any(name.endswith("_created") for name, _ in s)

    @pytest.mark.prometheus
    @pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool")
    async def test_promtool_check_metrics_is_clean(
        self, server: MetricsServer, metrics: Metrics
    ) -> None:
        """promtool finds nothing to complain about in a scrape."""
        _feed(metrics)
        body = (await _get(server, "/metrics")).content
        result = await asyncio.to_thread(
            subprocess.run,
            ["promtool", "check", "metrics"],
            input=body,
            capture_output=True,
            check=False,
        )
        assert (result.returncode, result.stdout, result.stderr) == (0, b"", b"")


class TestLabels:
    """Label values come from bounded sets, never raw text."""

    def test_unknown_values_are_folded(self, metrics: Metrics) -> None:
        """Unknown signatures, free-text reasons and bogus units become "other"/"unknown"."""
        metrics.outcome(make_outcome(signature="not_in_table"), 0.001)
        metrics.outcome(make_outcome(unit=None), 0.001)
        metrics.source_restart("journalctl died: Broken pipe at 0x7f")
        metrics.halt_failed("vllm.service", "D-Bus said: org.freedesktop.DBus.Error.NoReply")
        metrics.halt("bad unit name with spaces", Rule.FATAL_SIGNATURE, 0.1)
        metrics.notification("exploded")
        s = parse(metrics.exposition()[0].decode())
        p = "vllm_supervisor_"
        assert (
            value(s, p + "crashes_total", unit="vllm.service", signature="other", severity="fatal")
            == 1
        )
        assert (
            value(
                s,
                p + "crashes_total",
                unit="unknown",
                signature="flashinfer_cubin_mismatch",
                severity="fatal",
            )
            == 1
        )
        assert value(s, p + "journal_source_restarts_total", reason="other") == 1
        assert value(s, p + "halt_failures_total", unit="vllm.service", reason="other") == 1
        assert value(s, p + "halts_total", unit="other", reason="fatal_signature") == 1
        assert value(s, p + "notifications_total", sink="slack", outcome="other") == 1

    def test_dry_run_decisions_are_labelled(self, metrics: Metrics) -> None:
        """A dry-run halt decision is counted with dry_run="true" and sets no halted gauge."""
        metrics.outcome(make_outcome(dry_run=True), 0.001)
        s = parse(metrics.exposition()[0].decode())
        assert (
            value(
                s,
                "vllm_supervisor_decisions_total",
                unit="vllm.service",
                signature="flashinfer_cubin_mismatch",
                action="halt",
                dry_run="true",
            )
            == 1
        )
        assert value(s, "vllm_supervisor_unit_halted", unit="vllm.service") == 0


class TestUnitsSeries:
    """A supervised unit's series exist once systemd has it, or could not say, or it reports."""

    @staticmethod
    def _of(metrics: Metrics, unit: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        samples = parse(metrics.exposition()[0].decode())
        return {key: v for key, v in samples.items() if ("unit", unit) in key[1]}

    def test_a_unit_systemd_has_no_file_for_exports_only_its_absence(self) -> None:
        """LoadState=not-found: `unit_present 0` is the unit's one series."""
        metrics = Metrics(new_registry(process=False))
        metrics.register_units(["vllm.service", "tgi.service"])
        metrics.unit_loaded("tgi.service", False)
        assert self._of(metrics, "tgi.service") == {
            ("vllm_supervisor_unit_present", frozenset({("unit", "tgi.service")})): 0.0
        }

    def test_a_unit_not_asked_about_yet_exports_nothing(self) -> None:
        """Registered only: nothing is said of the unit until systemd or the journal does."""
        metrics = Metrics(new_registry(process=False))
        metrics.register_units(["vllm.service"])
        assert self._of(metrics, "vllm.service") == {}

    @pytest.mark.parametrize("loaded", [True, None])
    def test_a_unit_that_exists_or_may_gets_every_series_at_zero(self, loaded: bool | None) -> None:
        """Loaded, or systemd could not be asked: every per-unit series at 0 (for increase())."""
        metrics = Metrics(new_registry(process=False))
        metrics.register_units(["vllm.service"])
        metrics.unit_loaded("vllm.service", loaded)
        s = parse(metrics.exposition()[0].decode())
        p = "vllm_supervisor_"
        assert value(s, p + "halt_failures_total", unit="vllm.service", reason="timeout") == 0
        assert value(s, p + "unit_halted", unit="vllm.service") == 0
        present = value(s, p + "unit_present", unit="vllm.service")
        assert present == (1.0 if loaded else None)

    def test_an_absent_unit_that_reports_gets_its_series(self) -> None:
        """A crash of a unit systemd said it lacked (installed since, another host's journal)
        is counted like any other."""
        metrics = Metrics(new_registry(process=False))
        metrics.register_units(["vllm.service"])
        metrics.unit_loaded("vllm.service", False)
        metrics.outcome(make_outcome(), 0.001)
        s = parse(metrics.exposition()[0].decode())
        crash = {"unit": "vllm.service", "signature": "flashinfer_cubin_mismatch"}
        assert value(s, "vllm_supervisor_crashes_total", **crash, severity="fatal") == 1
        assert value(s, "vllm_supervisor_unit_halted", unit="vllm.service") == 0

    def test_every_supervised_unit_has_its_own_label_past_the_cap(self) -> None:
        """500 configured units: the 500th's crash is counted under its own name. The cap on
        unit labels bounds names seen in the journal, not the configured ones (before: units
        past the 64th were counted as "other")."""
        metrics = Metrics(new_registry(process=False))
        units = [f"serve-{n:04d}.service" for n in range(1, 501)]
        metrics.register_units(units)
        for unit in units:
            metrics.unit_loaded(unit, True)
        metrics.outcome(make_outcome(unit=units[-1]), 0.001)
        s = parse(metrics.exposition()[0].decode())
        crash = {"unit": units[-1], "signature": "flashinfer_cubin_mismatch", "severity": "fatal"}
        assert value(s, "vllm_supervisor_crashes_total", **crash) == 1
        assert value(s, "vllm_supervisor_unit_halted", unit=units[-1]) == 0

    def test_zero_series_per_signature_are_bounded_whatever_the_units(self) -> None:
        """500 units of the shipped table: the per-signature series made at 0 stay within
        their bound (before: 150k series, a 17.7 MB scrape), the first units keep them, and a
        crash of the last unit is still counted under its own name."""
        metrics = Metrics(new_registry(process=False))
        table = load_signature_table()
        metrics.signature_table(
            [s.id for s in table.signatures],
            True,
            severities={s.id: s.severity.value for s in table.signatures},
        )
        units = [f"serve-{n:04d}.service" for n in range(1, 501)]
        metrics.register_units(units)
        for unit in units:
            metrics.unit_loaded(unit, True)
        metrics.outcome(make_outcome(unit=units[-1]), 0.001)
        s = parse(metrics.exposition()[0].decode())
        crashes = [
            labels
            for name, labels in s
            if name == "vllm_supervisor_crashes_total" and ("signature", "unknown") not in labels
        ]
        assert len(crashes) <= 10_000 + 1  # the unit's own crash past the bound
        crash = {"signature": "flashinfer_cubin_mismatch", "severity": "fatal"}
        assert value(s, "vllm_supervisor_crashes_total", unit=units[0], **crash) == 0
        assert value(s, "vllm_supervisor_crashes_total", unit=units[-1], **crash) == 1
        halt = {"signature": "flashinfer_cubin_mismatch", "action": "halt", "dry_run": "false"}
        assert value(s, "vllm_supervisor_decisions_total", unit=units[0], **halt) == 0

    def test_journal_units_that_are_not_configured_are_still_capped(self) -> None:
        """Names the journal brings (never configured) get labels up to the cap, then "other",
        however many units are configured."""
        metrics = Metrics(new_registry(process=False))
        metrics.register_units([f"serve-{n:04d}.service" for n in range(1, 101)])
        for n in range(80):
            metrics.outcome(make_outcome(unit=f"stray-{n}.service"), 0.001)
        s = parse(metrics.exposition()[0].decode())
        crash = {"signature": "flashinfer_cubin_mismatch", "severity": "fatal"}
        assert value(s, "vllm_supervisor_crashes_total", unit="other", **crash) == 80 - 63

    def test_only_supervised_units_are_said_to_be_present_or_absent(self) -> None:
        """The label's values are the configured units, never another name."""
        metrics = Metrics(new_registry(process=False))
        metrics.register_units(["vllm.service"])
        metrics.unit_loaded("evil.service", False)
        metrics.unit_loaded("evil.service", True)
        assert self._of(metrics, "evil.service") == {}


class TestReaderMemory:
    """The reader child's resident memory, read when scraped."""

    def test_read_at_each_scrape_and_zero_without_a_child(self) -> None:
        """The gauge is whatever the reader says at the scrape; 0 while no child runs."""
        metrics = Metrics(new_registry(process=False))
        answers: list[int | None] = [3_145_728, None]
        metrics.reader_memory(lambda: answers[0])
        gauge = "vllm_supervisor_journal_reader_memory_bytes"
        assert value(parse(metrics.exposition()[0].decode()), gauge) == 3_145_728
        answers[0] = None
        assert value(parse(metrics.exposition()[0].decode()), gauge) == 0


class TestDocumented:
    """deploy/README.md lists every metric the supervisor exports."""

    def test_every_exported_family_is_in_the_deploy_readme(self) -> None:
        """A new metric comes with a line in the operators' list (and a stale line goes)."""
        metrics = Metrics(new_registry(process=False))
        exported = {
            line.split(" ")[2]
            for line in metrics.exposition()[0].decode().splitlines()
            if line.startswith("# TYPE")
        }
        readme = (Path(__file__).resolve().parents[1] / "deploy" / "README.md").read_text()
        listed = set(re.findall(r"^\| `(vllm_supervisor_[a-z_]+)`", readme, re.MULTILINE))
        assert sorted(exported - listed) == []
        assert sorted(listed - exported) == []


class TestHealth:
    """/healthz: 200 while following and the outbox is healthy, else 503 with why."""

    async def test_healthy(self, server: MetricsServer, metrics: Metrics) -> None:
        """Following the journal with a healthy outbox answers 200 JSON."""
        metrics.following(True)
        response = await _get(server, "/healthz")
        assert response.status_code == 200
        assert response.json() == {"healthy": True, "following": True, "reasons": []}

    async def test_not_following(self, server: MetricsServer, metrics: Metrics) -> None:
        """Not following the journal answers 503 naming the reason."""
        metrics.following(False)
        response = await _get(server, "/healthz")
        assert response.status_code == 503
        assert response.json()["reasons"] == ["not following the journal"]

    async def test_outbox_unhealthy(
        self, server: MetricsServer, metrics: Metrics, health_state: dict[str, Any]
    ) -> None:
        """An unhealthy outbox answers 503 with its reasons and details."""
        metrics.following(True)
        health_state.update(
            ok=False, details={"outbox_depth": 500, "reasons": ["outbox backlog: 500 messages"]}
        )
        response = await _get(server, "/healthz")
        assert response.status_code == 503
        assert response.json()["outbox_depth"] == 500
        assert response.json()["reasons"] == ["outbox backlog: 500 messages"]

    async def test_other_paths_and_methods(self, server: MetricsServer) -> None:
        """Unknown paths are 404, other methods 405, HEAD has headers but no body."""
        assert (await _get(server, "/nope")).status_code == 404
        assert (await _get(server, "/metrics", "POST")).status_code == 405
        head = await _get(server, "/metrics", "HEAD")
        assert (head.status_code, head.content) == (200, b"")

    async def test_garbage_request_gets_400(self, server: MetricsServer) -> None:
        """A request line that is not HTTP/1.x gets 400 and the server keeps serving."""
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"HELLO\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 400 ")
        assert (await _get(server, "/healthz")).status_code in (200, 503)
