"""Slack faults against a real `vllm-supervisor run` child and a loopback Slack server.

Slack down while crashes happen, slow, behind an untrusted certificate, answering HTML, nothing
or megabytes, and a log line carrying Slack markup. In every case: the journal keeps being read
(a crash meanwhile is classified and halted at once), each message reaches Slack once (the one
documented exception: a request Slack took but answered after the client's timeout), and the
webhook URL never appears in the daemon's output.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from conftest import wait_for
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from slack_server import SECRET, WEBHOOK_PATH, Reply, SlackServer

from faults.conftest import SupervisorFactory
from faults.harness import (
    UNIT,
    Supervisor,
    classified,
    crash,
    db_rows,
    history_cli,
    write_config,
)
from vllm_supervisor.journal.writer import JournalWriter, crashed_invocation

QUARANTINE = Path("run") / "quarantine" / f"{UNIT}.json"
RETRIED = 'vllm_supervisor_notifications_total{outcome="retried",sink="slack"}'
HOSTILE = "ZeroDivisionError: <!channel> <@U123> <https://x|y> <!here> &amp; done"


def _ids(*serials: int) -> list[str]:
    return [f"{n:032x}" for n in serials]


def _notified(state: Path) -> list[str]:
    return [r[0] for r in db_rows(state, "SELECT invocation_id FROM history WHERE notified = 1")]


def _outbox(state: Path) -> list[tuple[str, int, str | None]]:
    return db_rows(state, "SELECT state, attempts, last_error FROM outbox ORDER BY id")


def _events(sup: Supervisor, name: str) -> list[dict[str, Any]]:
    return [e for e in sup.events() if e.get("event") == name]


def _assert_no_secret(sup: Supervisor) -> None:
    """The webhook's secret path appears nowhere in any run's stderr."""
    for log in sup.logs:
        text = log.read_text(errors="replace")
        assert SECRET not in text, f"webhook secret leaked into {log.name}"
        assert WEBHOOK_PATH not in text


def _metric(sup: Supervisor, sample: str) -> float:
    """One sample of the child's /metrics (its port is in the metrics_listening event)."""
    listening = _events(sup, "metrics_listening")
    if not listening:
        return 0.0
    url = f"http://127.0.0.1:{listening[-1]['port']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def _healthz(sup: Supervisor) -> tuple[int, dict[str, Any]]:
    """The child's /healthz: its status and JSON."""
    url = f"http://127.0.0.1:{_events(sup, 'metrics_listening')[-1]['port']}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _serial_in(request_text: str) -> int:
    """Which crash a message is about (the unknown crashes name "widget N")."""
    return int(request_text.split("widget ", 1)[1].split(" ", 1)[0])


class TestSlackDown:
    """Connection refused for a while, crashes meanwhile, then Slack comes back."""

    def test_outage_then_recovery_sends_each_once_in_order(
        self, tmp_path: Path, slack: SlackServer, make_supervisor: SupervisorFactory
    ) -> None:
        """Four crashes while Slack refuses connections: all classified, the fatal one halted
        within seconds, and after Slack returns four messages arrive once each, in order."""
        slack.stop()  # connection refused from now on, same port later
        sup = make_supervisor(slack_url=slack.url)
        state = tmp_path / "state"
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(crash("unknown", 1))
            sup.start()
            wait_for(lambda: len(classified(state)) == 1, what="the first crash classified")
            wait_for(lambda: _events(sup, "slack_delivery_failed"), what="a refused Slack delivery")
            written = time.monotonic()
            writer.write(crash("fatal", 2))
            writer.nudge()
            wait_for(lambda: (tmp_path / QUARANTINE).exists(), timeout=10, what="the halt")
            halted_after = time.monotonic() - written
            for serial in (3, 4):
                writer.write(crash("unknown", serial))
            writer.nudge()
            wait_for(lambda: len(classified(state)) == 4, what="every crash classified")
            # Several refused attempts pass (the backoff is capped at 0.5 s here).
            wait_for(lambda: _metric(sup, RETRIED) >= 4, what="several refused attempts")
            assert slack.count() == 0
            assert [row[0] for row in _outbox(state)] == ["pending"] * 4
            # The endpoint backs off, not the message: only the oldest was tried, and a refused
            # connection never counts against max_attempts (it never reached Slack).
            assert _outbox(state)[0] == ("pending", 0, "connect")
            assert len(_events(sup, "slack_delivery_failed")) == 1  # logged once
            assert _notified(state) == []
            slack.start()
            wait_for(lambda: len(_notified(state)) == 4, what="every message delivered")
        assert sup.terminate() == 0, sup.stderr_text()
        texts = [r.json()["text"] for r in slack.requests]
        assert len(texts) == 4, texts
        assert len(set(texts)) == 4
        assert "0.6.2" in texts[1]  # the fatal crash (serial 2) in its place
        assert [_serial_in(texts[i]) for i in (0, 2, 3)] == [1, 3, 4]
        assert [row[0] for row in _outbox(state)] == ["sent"] * 4
        assert halted_after < 5.0, f"halting took {halted_after:.1f}s during the outage"
        assert [h["invocation_id"] for h in history_cli(state)] == _ids(1, 2, 3, 4)
        refused = _events(sup, "slack_delivery_failed")
        assert "connect" in refused[0]["error"]
        assert _events(sup, "slack_delivery_recovered")
        _assert_no_secret(sup)


class TestSlowSlack:
    """Slack answering slower than the client's timeout, then merely slow."""

    def test_slow_answer_never_blocks_the_journal_and_costs_one_bounded_duplicate(
        self, tmp_path: Path, slack: SlackServer, make_supervisor: SupervisorFactory
    ) -> None:
        """A reply later than timeout_s (2 s) is retried with a doubled timeout: a slow Slack
        gets that message twice (it had taken the first request; a webhook has no idempotency
        key), the next slow-but-in-time reply is not repeated, and a fatal crash written
        during the wait is halted before Slack answers."""
        slack.reply(Reply(delay_s=2.6), Reply(delay_s=1.0))
        sup = make_supervisor(slack_url=slack.url)
        state = tmp_path / "state"
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(crash("unknown", 1))
            sup.start()
            wait_for(lambda: slack.count() == 1, what="the first (slow) request")
            writer.write(crash("fatal", 2))
            writer.nudge()
            wait_for(
                lambda: (tmp_path / QUARANTINE).exists() and len(classified(state)) == 2,
                timeout=10,
                what="the halt and its commit",
            )
            assert slack.count() == 1, "the journal waited for Slack"
            wait_for(lambda: len(_notified(state)) == 2, what="both messages delivered")
        assert sup.terminate() == 0, sup.stderr_text()
        texts = [r.json()["text"] for r in slack.requests]
        assert len(texts) == 3
        assert texts[0] == texts[1], "the timed-out request is the one repeated"
        assert _serial_in(texts[0]) == 1
        assert "0.6.2" in texts[2]
        assert _outbox(state) == [("sent", 2, None), ("sent", 1, None)]
        failed = _events(sup, "slack_delivery_failed")
        assert len(failed) == 1
        assert "timeout" in failed[0]["error"]
        _assert_no_secret(sup)


class TestKilledWhileSending:
    """The supervisor killed (-9) between Slack taking a message and recording that it did."""

    def test_the_message_sent_again_says_it_may_be_a_repeat(
        self, tmp_path: Path, slack: SlackServer, make_supervisor: SupervisorFactory
    ) -> None:
        """Was: a kill -9 10 ms after a fatal crash sent the same Slack message twice, the
        second with nothing to tell it from a new halt. Slack holds its answer here; the kill
        comes while the POST waits. The next run sends it again (at-least-once: a webhook has
        no idempotency key) marked as a possible repeat, once, and records it."""
        slack.reply(Reply(delay_s=30.0))
        sup = make_supervisor(slack_url=slack.url)
        state = tmp_path / "state"
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(crash("fatal", 1))
            sup.start()
            wait_for(lambda: slack.count() == 1, what="the POST Slack holds")
            sup.kill9()
            sup.start()
            wait_for(lambda: slack.count() == 2, what="the message sent again")
            wait_for(lambda: len(_notified(state)) == 1, what="the delivery recorded")
        assert sup.terminate() == 0, sup.stderr_text()
        first, again = (r.json() for r in slack.requests)
        assert again["text"] == f"(repeat) {first['text']}"
        assert "restarted while sending" in json.dumps(again["blocks"][0])
        assert again["blocks"][1:] == first["blocks"]
        assert [row[0] for row in _outbox(state)] == ["sent"]
        assert len(_events(sup, "slack_sending_interrupted")) == 1
        _assert_no_secret(sup)


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 that no trust store knows, and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake slack")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "slack.crt", directory / "slack.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


class TestTls:
    """An HTTPS endpoint whose certificate the daemon does not trust."""

    def test_untrusted_certificate_keeps_the_message_until_trusted(
        self, tmp_path: Path, make_supervisor: SupervisorFactory
    ) -> None:
        """The TLS error is reported clearly without the URL and the message waits in the
        outbox; restarted with the certificate trusted (SSL_CERT_FILE), it is sent once."""
        cert, key = _self_signed(tmp_path)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        server = SlackServer(tls=context)
        server.start()
        try:
            sup = make_supervisor(slack_url=server.url)
            state = tmp_path / "state"
            with JournalWriter(tmp_path / "journal") as writer:
                writer.write(crash("unknown", 1))
                sup.start()
                wait_for(lambda: _events(sup, "slack_delivery_failed"), what="the TLS failure")
                wait_for(lambda: len(classified(state)) == 1, what="the crash classified")
                error = _events(sup, "slack_delivery_failed")[0]["error"]
                assert error.startswith("slack: tls: ")
                assert "CERTIFICATE_VERIFY_FAILED" in error or "certificate verify" in error
                assert server.count() == 0  # no request was made over the untrusted channel
                assert _outbox(state) == [("pending", 0, "tls")]
                assert sup.terminate() == 0, sup.stderr_text()
                sup.env["SSL_CERT_FILE"] = str(cert)
                sup.start()
                wait_for(lambda: _notified(state) == _ids(1), what="delivery once trusted")
            assert sup.terminate() == 0, sup.stderr_text()
            assert server.count() == 1
            assert _serial_in(server.requests[0].json()["text"]) == 1
            _assert_no_secret(sup)
        finally:
            server.stop()


class TestOddReplies:
    """Error replies that are HTML, empty or huge, then a huge 200."""

    def test_html_empty_and_huge_replies_are_bounded_errors_then_sent_once(
        self, tmp_path: Path, slack: SlackServer, make_supervisor: SupervisorFactory
    ) -> None:
        """Each odd reply is logged once with its status and at most 200 characters of body;
        the daemon survives them and the message is delivered exactly once."""
        html = "<html><head><title>502 Bad Gateway</title></head><body>" + "x" * 5000
        slack.reply(
            Reply(502, html, {"Content-Type": "text/html"}),
            Reply(500, ""),
            Reply(503, "y" * 8_000_000),
            Reply(200, "z" * 8_000_000),
        )
        sup = make_supervisor(slack_url=slack.url)
        state = tmp_path / "state"
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(crash("unknown", 1))
            sup.start()
            wait_for(lambda: _notified(state) == _ids(1), what="delivery after odd replies")
            assert sup.alive()
        assert sup.terminate() == 0, sup.stderr_text()
        assert slack.count() == 4
        errors = [e["error"] for e in _events(sup, "slack_delivery_failed")]
        assert len(errors) == 3
        assert errors[0].startswith("slack: HTTP 502: <html><head><title>502 Bad Gateway")
        assert errors[1] == "slack: HTTP 500: "
        assert errors[2].startswith("slack: HTTP 503: yyyy")
        assert all(len(e) < 260 for e in errors), [len(e) for e in errors]
        assert _outbox(state) == [("sent", 4, None)]
        _assert_no_secret(sup)


class TestHostileMarkup:
    """A crash line built to ping the channel and forge a link."""

    def test_markup_from_the_journal_reaches_slack_escaped(
        self, tmp_path: Path, slack: SlackServer, make_supervisor: SupervisorFactory
    ) -> None:
        """`<!channel>`, `<@U123>` and `<https://x|y>` arrive as inert &lt;…&gt; text."""
        prefix = "(EngineCore_DP0 pid=6200) ERROR 11-30 11:00:09 [core.py:708]"
        lines = [
            f"{prefix} EngineCore failed to start.",
            f"{prefix} Traceback (most recent call last):",
            f'{prefix}   File "/opt/vllm/evil.py", line 1, in <module>',
            f"{prefix} {HOSTILE}",
        ]
        sup = make_supervisor(slack_url=slack.url)
        state = tmp_path / "state"
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(crashed_invocation(UNIT, lines, restarts=1, invocation_id=_ids(1)[0]))
            sup.start()
            wait_for(lambda: _notified(state) == _ids(1), what="the message delivered")
        assert sup.terminate() == 0, sup.stderr_text()
        payload = slack.requests[0].json()
        raw = json.dumps(payload, ensure_ascii=False)
        for markup in ("<!channel>", "<@U123>", "<https://x|y>", "<!here>"):
            assert markup not in raw
        escaped = "&lt;!channel&gt; &lt;@U123&gt; &lt;https://x|y&gt; &lt;!here&gt; &amp;amp; done"
        assert escaped in payload["text"]
        assert any(escaped in json.dumps(block, ensure_ascii=False) for block in payload["blocks"])
        # The history keeps the line as it was logged: escaping is Slack's concern only.
        assert HOSTILE in history_cli(state)[0]["verdict"]["root_cause"]
        _assert_no_secret(sup)


class TestPoisonUrl:
    """A webhook URL httpx cannot use (here a port past 65535, from the systemd credential)."""

    def test_a_bad_credential_turns_slack_off_and_the_daemon_runs_on(
        self, tmp_path: Path, slack: SlackServer, make_supervisor: SupervisorFactory
    ) -> None:
        """A message waits in the outbox from a run whose Slack was down; the next run reads
        an unusable URL from its credential. Before, the first send raised OverflowError (not
        an httpx.HTTPError) and the daemon died at every start. Now: one error line naming the
        credential (never the URL), Slack off, /healthz says why, crashes still handled."""
        slack.stop()
        sup = make_supervisor(slack_url=slack.url)
        state = tmp_path / "state"
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(crash("unknown", 1))
            sup.start()
            wait_for(lambda: _events(sup, "slack_delivery_failed"), what="a refused delivery")
            assert sup.terminate() == 0, sup.stderr_text()
            assert [row[0] for row in _outbox(state)] == ["pending"]
            credentials = tmp_path / "credentials"
            credentials.mkdir()
            (credentials / "slack-webhook").write_text(f"http://127.0.0.1:99999{WEBHOOK_PATH}\n")
            write_config(tmp_path)  # no [slack]: the credential is the URL
            sup.env["CREDENTIALS_DIRECTORY"] = str(credentials)
            sup.start()
            wait_for(lambda: _events(sup, "slack_webhook_invalid"), what="the URL refused")
            writer.write(crash("fatal", 2))
            writer.nudge()
            wait_for(lambda: (tmp_path / QUARANTINE).exists(), timeout=10, what="the halt")
            assert sup.alive(), sup.stderr_text()
            status, health = _healthz(sup)
            assert (status, health["slack"]) == (503, "invalid_url"), health
            assert "Slack is off" in " ".join(health["reasons"])
        assert sup.terminate() == 0, sup.stderr_text()
        invalid = _events(sup, "slack_webhook_invalid")
        assert len(invalid) == 1
        assert str(credentials / "slack-webhook") in invalid[0]["source"]
        assert [row[0] for row in _outbox(state)] == ["pending"]  # waits for a fixed URL
        _assert_no_secret(sup)
