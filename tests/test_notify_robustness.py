"""No poison, no leak: every error a sink can raise is handled, and the URL never escapes.

A webhook URL with a control character or an out-of-range port makes httpx raise
`InvalidURL` or `OverflowError`, neither an `httpx.HTTPError`: such a message must be dropped
(once, counted) or Slack turned off, never retried into a crash loop of the daemon. A reply
that echoes the URL must be redacted before it is cut, so no piece of the token survives.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
from conftest import poll
from hypothesis import given, settings
from hypothesis import strategies as st
from notify_fakes import FakeClock, make_outcome, running, slack_outbox
from slack_server import SECRET, WEBHOOK_PATH, Reply, SlackServer

from vllm_supervisor import cli
from vllm_supervisor.config import (
    WEBHOOK_ENV,
    AlertmanagerConfig,
    Secret,
    SlackConfig,
    load_config,
)
from vllm_supervisor.errors import ConfigError, NotifyError
from vllm_supervisor.notify.alertmanager import AlertmanagerSink
from vllm_supervisor.notify.level import LevelLoop
from vllm_supervisor.notify.outbox import Outbox
from vllm_supervisor.notify.webhook import ERROR_TEXT_LIMIT, SlackWebhook, redact
from vllm_supervisor.store import Checkpoint, Store
from vllm_supervisor.telemetry.http import MetricsServer
from vllm_supervisor.telemetry.metrics import Metrics, new_registry

# URLs httpx cannot send to: each raised something other than httpx.HTTPError before the fix.
BAD_URLS = [
    f"https://hooks.slack.com/services/T0/B0/{SECRET}\x01",  # InvalidURL: control character
    f"http://127.0.0.1:99999/services/T0/B0/{SECRET}",  # OverflowError (in an ExceptionGroup)
    f"http://127.0.0.1:65536/services/T0/B0/{SECRET}",
    f"https://hooks.slack.com:port/services/T0/B0/{SECRET}",  # InvalidURL: port
]
DROPPED = "vllm_supervisor_notifications_dropped_total"


@pytest.fixture(autouse=True)
def _structlog_restored() -> Iterator[None]:
    """cli.main configures structlog onto capsys's stream; later tests must not log there."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def leaks(text: str, secret: str = WEBHOOK_PATH, n: int = 8) -> set[str]:
    """Every `n`-character piece of `secret` that appears in `text`."""
    return {secret[i : i + n] for i in range(len(secret) - n + 1) if secret[i : i + n] in text}


def _dropped(metrics: Metrics, sink: str, reason: str) -> float:
    labels = {"sink": sink, "reason": reason}
    return metrics.registry.get_sample_value(DROPPED, labels) or 0.0


def _outbox(
    tmp_path: Path, webhook: Any, clock: FakeClock, **config: Any
) -> tuple[Store, Outbox, Metrics]:
    store = Store(tmp_path / "state.db")
    metrics = Metrics(new_registry(process=False))
    outbox = slack_outbox(
        store,
        webhook,
        metrics,
        SlackConfig(**config),
        host="gpu-7",
        now=clock.now,
        sleep=clock.sleep,
    )
    return store, outbox, metrics


def _queue(store: Store, outbox: Outbox, invocation_id: str = "inv-1") -> None:
    outcome = make_outcome(invocation_id=invocation_id)
    store.commit_batch(
        checkpoint=Checkpoint(cursor=invocation_id),
        outcomes=[outcome],
        extra=[outbox.writer_for(outcome)],
    )


def _states(store: Store) -> list[tuple[str, int, str | None]]:
    rows = store.query("SELECT state, attempts, last_error FROM outbox ORDER BY id")
    return [tuple(r) for r in rows]


def _events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e.get("event") == name]


class _Raising:
    """A webhook stand-in whose every send raises `error` (counts the attempts)."""

    problem: str | None = None

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.sent = 0

    async def send(self, payload: Any, *, timeout_s: float | None = None) -> None:
        self.sent += 1
        raise self.error


# -- 1. poison: a URL httpx cannot use ------------------------------------------------------------


@pytest.mark.parametrize("url", BAD_URLS)
async def test_an_unusable_url_is_an_unrecoverable_notify_error(url: str) -> None:
    """send() raises NotifyError(invalid_url, not retryable), never InvalidURL/OverflowError."""
    async with SlackWebhook(Secret(url), timeout_s=2) as hook:
        with pytest.raises(NotifyError) as caught:
            await hook.send({"text": "hi"})
    assert (caught.value.reason, caught.value.retryable) == ("invalid_url", False)
    assert not leaks(str(caught.value), SECRET)


@pytest.mark.parametrize("url", BAD_URLS)
async def test_a_pending_message_and_a_bad_url_do_not_kill_the_outbox(
    tmp_path: Path, url: str
) -> None:
    """The poison message: queued, then the daemon restarts with an unusable URL. The outbox
    keeps running, says so once (URL not shown), Slack is off and /healthz tells why."""
    clock = FakeClock()
    store, before, _ = _outbox(tmp_path, SlackWebhook(Secret("https://hooks.slack.com/x")), clock)
    _queue(store, before)  # queued by the run before, whose URL was fine
    hook = SlackWebhook(Secret(url), timeout_s=2)
    with structlog.testing.capture_logs() as logs:
        metrics = Metrics(new_registry(process=False))
        outbox = slack_outbox(store, hook, metrics, SlackConfig(), host="h", now=clock.now)
        async with running(outbox):
            outbox.wake()
            await poll(lambda: _events(logs, "slack_webhook_invalid"))
    await hook.aclose()
    assert len(_events(logs, "slack_webhook_invalid")) == 1
    assert not leaks(repr(logs), SECRET)
    healthy, details = outbox.health()
    assert details["slack"] == "invalid_url"
    assert not healthy and "Slack is off" in " ".join(details["reasons"])
    assert _states(store) == [("pending", 0, None)]  # kept for when the URL is fixed


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (NotifyError("slack: bad URL", reason="invalid_url", retryable=False), "invalid_url"),
        (NotifyError("slack: HTTP 404", reason="no_service", retryable=False), "http_4xx"),
    ],
)
async def test_an_unrecoverable_error_drops_the_message_once(
    tmp_path: Path, error: NotifyError, reason: str
) -> None:
    """Dropped at the first attempt, counted with its reason, one log line, never retried."""
    clock = FakeClock()
    hook = _Raising(error)
    store, outbox, metrics = _outbox(tmp_path, hook, clock)
    _queue(store, outbox)
    with structlog.testing.capture_logs() as logs:
        async with running(outbox):
            await poll(lambda: _states(store)[0][0] == "failed")
    assert hook.sent == 1
    assert _dropped(metrics, "slack", reason) == 1
    assert len(_events(logs, "slack_message_dropped")) == 1


async def test_an_unexpected_exception_is_bounded_by_max_attempts(tmp_path: Path) -> None:
    """A bug or a library error we did not foresee: retried up to max_attempts, then dropped;
    the daemon goes on, and the exception's text (which may hold the URL) is not logged."""
    clock = FakeClock()
    hook = _Raising(RuntimeError(f"boom {WEBHOOK_PATH}"))
    store, outbox, metrics = _outbox(tmp_path, hook, clock, max_attempts=3)
    _queue(store, outbox)
    with structlog.testing.capture_logs() as logs:
        async with running(outbox):
            await poll(lambda: _states(store)[0][0] == "failed")
    assert hook.sent == 3
    assert _dropped(metrics, "slack", "attempts_exhausted") == 1
    assert not leaks(repr(logs))


async def test_a_message_that_cannot_be_rendered_is_dropped(
    tmp_path: Path, slack: SlackServer
) -> None:
    """A stored payload that is not JSON, or holds NaN (httpx refuses it): unrenderable."""
    clock = FakeClock()
    hook = SlackWebhook(Secret(slack.url), timeout_s=5)
    store, outbox, metrics = _outbox(tmp_path, hook, clock)
    _queue(store, outbox, "inv-1")
    _queue(store, outbox, "inv-2")

    def spoil(db: sqlite3.Connection) -> None:
        db.execute("UPDATE outbox SET payload = '{not json' WHERE id = 1")
        db.execute("""UPDATE outbox SET payload = '{"text": NaN}' WHERE id = 2""")

    store.write_blocking(spoil)
    with structlog.testing.capture_logs():
        async with running(outbox):
            await poll(lambda: [s[0] for s in _states(store)] == ["failed", "failed"])
    await hook.aclose()
    assert slack.count() == 0
    assert _dropped(metrics, "slack", "unrenderable") == 2


# -- 1b. the URL checked where it is configured --------------------------------------------------


@pytest.mark.parametrize("url", BAD_URLS)
def test_check_config_rejects_a_bad_url_from_the_environment(
    tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """check-config fails with one line naming the variable, never the URL."""
    config = tmp_path / "supervisor.toml"
    config.write_text('[[unit]]\nname = "vllm.service"\n', encoding="utf-8")
    monkeypatch.setenv(WEBHOOK_ENV, url)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    assert cli.main(["check-config", str(config)]) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert WEBHOOK_ENV in err and len(err.strip().splitlines()) == 1
    assert "config ok" not in out
    assert not leaks(out + err, SECRET)


def test_check_config_names_the_credential_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad systemd credential is named by its path."""
    config = tmp_path / "supervisor.toml"
    config.write_text('[[unit]]\nname = "vllm.service"\n', encoding="utf-8")
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "slack-webhook").write_text(BAD_URLS[1] + "\n", encoding="utf-8")
    monkeypatch.delenv(WEBHOOK_ENV, raising=False)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    assert cli.main(["check-config", str(config)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert str(credentials / "slack-webhook") in err
    assert not leaks(err, SECRET)


@pytest.mark.parametrize("url", [u for u in BAD_URLS if "\x01" not in u])
def test_a_bad_url_in_the_config_file_stops_at_load(tmp_path: Path, url: str) -> None:
    """The config key is named; the value is not shown."""
    config = tmp_path / "supervisor.toml"
    config.write_text(f'[slack]\nwebhook_url = "{url}"\n', encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    assert "slack.webhook_url" in str(caught.value)
    assert not leaks(str(caught.value), SECRET)


# -- 2. a reply that echoes the URL ---------------------------------------------------------------


def _echo_body(url: str) -> str:
    """A body whose 200-character cut falls inside the token when cut before redaction."""
    pad = ERROR_TEXT_LIMIT - 1 - 20 - (len(url) - len(SECRET))
    return "proxy error: " + "x" * (pad - len("proxy error: ")) + url + " (upstream 500)"


async def test_a_500_echoing_the_url_leaks_nothing(tmp_path: Path, slack: SlackServer) -> None:
    """Slack (or a proxy) answers 500 with the URL in its body: no 8-character piece of the
    secret path reaches a log line or /healthz (readable by any local user)."""
    slack.reply(*[Reply(500, _echo_body(slack.url)) for _ in range(4)])
    clock = FakeClock()
    hook = SlackWebhook(Secret(slack.url), timeout_s=5)
    store, outbox, metrics = _outbox(tmp_path, hook, clock)
    http = MetricsServer(metrics, outbox.health)
    _queue(store, outbox)
    try:
        with structlog.testing.capture_logs() as logs:
            await http.start("127.0.0.1", 0)
            async with running(outbox):
                await poll(lambda: not outbox.health()[0] and slack.count() >= 3)
                async with httpx.AsyncClient() as client:
                    healthz = (await client.get(f"http://127.0.0.1:{http.port}/healthz")).text
    finally:
        await http.close()
        await hook.aclose()
    assert "slack failing" in healthz
    assert "HTTP 500" in healthz
    assert not leaks(healthz)
    assert not leaks(repr(logs))
    assert not leaks(repr(_states(store)))


async def test_percent_encoded_and_partial_echoes_are_redacted(slack: SlackServer) -> None:
    """A proxy that quotes the URL percent-encoded, or only a piece of the path."""
    encoded = httpx.URL(slack.url).path.replace("/", "%2F")
    partial = WEBHOOK_PATH[5:40]
    slack.reply(Reply(400, f"bad {encoded}"), Reply(502, f"cut {partial}"))
    async with SlackWebhook(Secret(slack.url), timeout_s=5) as hook:
        for _ in range(2):
            with pytest.raises(NotifyError) as caught:
                await hook.send({"text": "hi"})
            assert not leaks(str(caught.value)), str(caught.value)


# -- Alertmanager: the same rules -----------------------------------------------------------------


def _sink(tmp_path: Path, url: str, **config: Any) -> tuple[LevelLoop, Metrics]:
    metrics = Metrics(new_registry(process=False))
    records = {"vllm.service": {"signature": "x", "severity": "fatal", "title": "t"}}
    sink = LevelLoop(
        AlertmanagerSink(AlertmanagerConfig(url=url, **config), host="gpu-7"),
        Store(tmp_path / "state.db"),
        lambda: records,
        metrics=metrics,
    )
    return sink, metrics


@pytest.mark.parametrize("url", [f"http://127.0.0.1:99999/{SECRET}", f"http://am/{SECRET}\x01"])
async def test_alertmanager_with_an_unusable_url_stops_quietly(tmp_path: Path, url: str) -> None:
    """The sink task ends its work with one error line and a count; it never raises."""
    sink, metrics = _sink(tmp_path, url)
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(sink.run(stop))
        await poll(lambda: _events(logs, "alertmanager_url_invalid") or task.done())
        assert not task.done()
        stop.set()
        await asyncio.wait_for(task, timeout=5)
    assert len(_events(logs, "alertmanager_url_invalid")) == 1
    assert _dropped(metrics, "alertmanager", "invalid_url") == 1
    assert not leaks(repr(logs), SECRET)


async def test_alertmanager_4xx_is_not_retried_and_5xx_is_redacted(
    tmp_path: Path, slack: SlackServer
) -> None:
    """A 400 drops the round (counted, logged once); a 500 echoing the URL leaks nothing."""
    base = f"http://user:{SECRET}@127.0.0.1:{slack.port}"
    sink, metrics = _sink(tmp_path, base)
    slack.reply(Reply(400, "bad alerts"), Reply(500, f"upstream {base}/api/v2/alerts"))
    with structlog.testing.capture_logs() as logs:
        assert await sink.reconcile() is True  # nothing to retry: dropped
        assert await sink.reconcile() is False  # retryable
        await sink.sink.aclose()
    assert _dropped(metrics, "alertmanager", "http_4xx") == 1
    assert not leaks(repr(logs), SECRET)
    assert "HTTP 500" in repr(logs)


# -- properties -----------------------------------------------------------------------------------

_SEGMENT = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=30
)
_FORMS = ["url", "path", "enc", "token", "lower"]
_TOKEN = st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789", min_size=8)


@st.composite
def _webhook_urls(draw: st.DrawFn) -> tuple[str, str]:
    """(a Slack-like URL, its token)."""
    token = draw(_TOKEN)
    host = draw(st.sampled_from(["hooks.slack.com", "127.0.0.1", "[::1]", "proxy.example"]))
    port = draw(st.one_of(st.just(""), st.integers(1, 65535).map(lambda p: f":{p}")))
    return f"https://{host}{port}/services/T{draw(_TOKEN)}/B1/{token}", token


_PREFIXES = st.sampled_from(["https://", "http://", "https://127.0.0.1:", "ftp://", "", "http://["])


@settings(max_examples=500)
@given(st.one_of(st.text(max_size=200), st.tuples(_PREFIXES, st.text(max_size=60)).map("".join)))
def test_the_validator_never_raises_and_accepts_only_what_httpx_can_send(text: str) -> None:
    """For any text: a problem, or a URL httpx builds a request for."""
    from vllm_supervisor.util.urls import url_problem

    problem = url_problem(text)
    if problem is None:
        request = httpx.Request("POST", text)
        assert request.url.scheme in ("http", "https") and request.url.host
        assert 0 < (request.url.port or 443) < 65536
    else:
        assert isinstance(problem, str)
        assert len(text) < 8 or text not in problem  # the value is never quoted


@given(_webhook_urls())
def test_the_validator_accepts_webhook_urls(url_token: tuple[str, str]) -> None:
    from vllm_supervisor.util.urls import url_problem

    assert url_problem(url_token[0]) is None


@settings(max_examples=200)
@given(_webhook_urls(), st.lists(st.one_of(_SEGMENT, st.sampled_from(_FORMS)), max_size=12))
def test_redaction_leaves_no_token(url_token: tuple[str, str], pieces: list[str]) -> None:
    """Any mix of text, the URL, its path, percent-encoded or lower-cased: no token segment
    (nor any 8-character piece of it) survives, whatever surrounds it."""
    url, token = url_token
    path = httpx.URL(url).path
    forms = {
        "url": url,
        "path": path,
        "enc": path.replace("/", "%2F"),
        "token": token,
        "lower": url.lower(),
    }
    text = "".join(forms.get(p, p) for p in pieces)
    out = redact(text, Secret(url))
    assert not leaks(out.lower(), token.lower())


@given(st.text(max_size=300), st.text(max_size=100))
def test_redaction_never_raises(text: str, url: str) -> None:
    """Whatever the URL (even an invalid one) and the text, redact returns a string."""
    assert isinstance(redact(text, Secret(url)), str)


def test_check_config_accepts_a_good_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "supervisor.toml"
    config.write_text('[[unit]]\nname = "vllm.service"\n', encoding="utf-8")
    monkeypatch.setenv(WEBHOOK_ENV, "https://hooks.slack.com/services/T0/B0/abcdefgh12345678")
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    assert cli.main(["check-config", str(config)]) == 0
    assert "config ok" in capsys.readouterr().out
