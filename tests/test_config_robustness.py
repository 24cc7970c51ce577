"""Whatever a config file holds, it loads into a config the daemon can run with, or is refused
with one `ConfigError` line naming the file and the key.

A value that passes the loader reaches the pipeline, the gate and the daemon's timers: a NaN,
an infinity or a float that overflows once turned into microseconds must not get that far, nor
may a path with a NUL byte, which every system call refuses with a ValueError.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vllm_supervisor import cli
from vllm_supervisor.classify.table import load_table
from vllm_supervisor.config import Config, load_config
from vllm_supervisor.errors import ConfigError
from vllm_supervisor.journal.export import decode_all
from vllm_supervisor.journal.writer import crashed_invocation
from vllm_supervisor.pipeline import Now, Pipeline

UNIT = "vllm.service"
# Every [section] of the config file: the Config fields that are tables of their own.
SECTIONS = {
    field.name: [f.name for f in dataclasses.fields(section)]
    for field in dataclasses.fields(Config)
    if dataclasses.is_dataclass(section := getattr(Config(), field.name))
}
UNIT_KEYS = [f.name for f in dataclasses.fields(Config().unit(UNIT))]
CRASH = "RuntimeError: CUDA error: an illegal memory access was encountered"
DEEP = "[" * 3000 + "]" * 3000  # past tomllib's recursion limit: RecursionError, not its error


def toml_scalar() -> st.SearchStrategy[str]:
    """A TOML literal of any type a key may (wrongly) get, extremes included."""
    return st.one_of(
        st.integers().map(str),
        st.sampled_from([str(2**63), str(-(2**63)), "9" * 400, "0", "-1"]),
        st.floats().map(_toml_float),
        st.sampled_from(["nan", "inf", "-inf", "1e308", "1e-320", "-0.0"]),
        st.booleans().map(lambda b: str(b).lower()),
        st.text(max_size=20).map(json.dumps),
        st.sampled_from(["/tmp/x\\u0000y", "http://127.0.0.1:8000/\\u0000", "127.0.0.1:9464"]).map(
            lambda s: f'"{s}"'
        ),
        st.sampled_from(["1979-05-27T07:32:00Z", "1979-05-27", "07:32:00"]),
        st.just(DEEP),
    )


def toml_value() -> st.SearchStrategy[str]:
    """A scalar, an array of scalars, or an inline table."""
    return st.one_of(
        toml_scalar(),
        st.lists(toml_scalar(), max_size=3).map(lambda v: f"[{', '.join(v)}]"),
        st.dictionaries(st.sampled_from(["a", "name", "wait_s"]), toml_scalar(), max_size=2).map(
            lambda d: "{" + ", ".join(f"{k} = {v}" for k, v in d.items()) + "}"
        ),
    )


def _toml_float(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


@st.composite
def config_texts(draw: st.DrawFn) -> str:
    """A config of known sections and keys (and a few unknown ones), any value in each."""
    parts = []
    for section in draw(st.lists(st.sampled_from(sorted(SECTIONS)), unique=True, max_size=3)):
        keys = draw(st.lists(st.sampled_from(SECTIONS[section]) | st.text(max_size=4), max_size=3))
        body = "".join(f"{json.dumps(k)} = {draw(toml_value())}\n" for k in dict.fromkeys(keys))
        parts.append(f"[{section}]\n{body}")
    for _ in range(draw(st.integers(0, 2))):
        keys = draw(st.lists(st.sampled_from(UNIT_KEYS), max_size=3, unique=True))
        body = "".join(f"{k} = {draw(toml_value())}\n" for k in keys)
        parts.append(f'[[unit]]\nname = "{UNIT}"\n{body}')
    return "".join(parts)


def _config_file(root: Path, text: str) -> Path:
    path = root / "supervisor.toml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    return path


def _runs_a_crash(config: Config) -> None:
    """The pipeline with this config's settings reads a crash and decides about it."""
    pipeline = Pipeline(config, load_table(config))
    raw = [
        {b"__CURSOR": b"c%d" % i, b"__REALTIME_TIMESTAMP": b"%d" % (i + 1)}
        | {k.encode(): str(v).encode() for k, v in fields.items()}
        for i, fields in enumerate(crashed_invocation(UNIT, [CRASH]))
    ]
    ended = pipeline.feed(decode_all(raw)) + pipeline.due(Now(journal_us=1 << 62))
    assert len(pipeline.decide_all(ended)) == 1


def _gate(root: Path, path: Path) -> tuple[int, str]:
    err = io.StringIO()
    argv = ["gate", "--config", str(path), "--runtime-dir", str(root / "run"), UNIT]
    argv[-1:-1] = ["--state-dir", str(root / "state")]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        code = cli.main(argv)
    return code, err.getvalue()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=config_texts())
@example(text="[tracker]\nsettle_s = inf\n")
@example(text="[tracker]\ndrain_max_s = 1e308\n")
@example(text="[gate]\nwait_s = nan\n")
@example(text=f"[tracker]\nsettle_s = {'9' * 400}\n")
@example(text='[state]\nstate_dir = "/tmp/x\\u0000y"\n')
@example(text=f"[gate]\nwait_s = {DEEP}\n")
def test_any_config_loads_into_a_usable_one_or_is_one_line(text: str) -> None:
    """A ConfigError of one line that names the file, or a config whose values the pipeline
    runs with (no overflow, no NaN, no NUL reaching a system call)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = _config_file(Path(tmp), text)
        try:
            config = load_config(path)
        except ConfigError as exc:
            assert str(exc).startswith(f"{path}: "), exc
            assert "\n" not in str(exc), exc
            return
        _runs_a_crash(config)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=config_texts())
@example(text='[state]\nstate_dir = "/tmp/x\\u0000y"\n')
@example(text='[state]\nruntime_dir = "/tmp/x\\u0000y"\n')
@example(text="[gate]\nwait_s = inf\n")
@example(text=f"x = {DEEP}\n")
def test_the_gate_lets_the_start_through_whatever_the_config(text: str) -> None:
    """With no quarantine record, the gate's answer is 0 for any config, never a fault."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        code, output = _gate(root, _config_file(root, text))
    assert code == 0, output
    assert "the gate failed" not in output, output
    assert cli.UNEXPECTED not in output, output


@given(data=st.binary(max_size=200))
def test_any_bytes_load_or_are_one_line(data: bytes) -> None:
    """Arbitrary bytes (non-UTF-8 included): a config or one ConfigError line naming the file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "supervisor.toml"
        path.write_bytes(data)
        try:
            load_config(path)
        except ConfigError as exc:
            assert str(exc).startswith(f"{path}: "), exc
            assert "\n" not in str(exc), exc


def test_a_webhook_url_of_the_wrong_type_is_not_shown(tmp_path: Path) -> None:
    """A URL put in a list (or a table) is refused without echoing it: it is a secret."""
    url = "https://hooks.slack.com/services/T000/B000/XXXXXXXXXXXXXXXXXXXXXXXX"
    path = _config_file(tmp_path, f'[slack]\nwebhook_url = ["{url}"]\n')
    try:
        load_config(path)
    except ConfigError as exc:
        assert "slack.webhook_url: expected str" in str(exc)
        assert "XXXXXXXX" not in str(exc)
    else:
        raise AssertionError("a list was taken for a webhook URL")


def test_a_webhook_url_file_that_is_not_text_is_one_line(tmp_path: Path) -> None:
    """`check-config` reads the webhook file as the daemon will: bytes that are not UTF-8 are
    one line naming the key and the file."""
    hook = tmp_path / "slack-webhook"
    hook.write_bytes(b"\xff\xfehttps://hooks.slack.com/services/T/B/X")
    path = _config_file(tmp_path, f'[slack]\nwebhook_url_file = "{hook}"\n')
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["check-config", str(path)])
    assert code == 2, err.getvalue()
    assert cli.UNEXPECTED not in err.getvalue(), err.getvalue()
    assert "slack.webhook_url_file" in err.getvalue() and str(hook) in err.getvalue()
