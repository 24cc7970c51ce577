"""The signature table: the shipped files load, every signature has a vector that it (and no
other signature) wins, and a broken table is refused with a message naming file, id and field."""

from __future__ import annotations

import contextlib
import io
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vllm_supervisor import cli
from vllm_supervisor.classify.schema import WrittenFrom, parse_table_file
from vllm_supervisor.classify.signatures import (
    DEFAULT_SIGNATURE_DIR,
    ENV_SIGNATURE_DIR,
    SignatureTable,
    compile_pattern,
    load_signature_table,
)
from vllm_supervisor.errors import SignatureTableError
from vllm_supervisor.model import Severity

VECTORS_FILE = Path(__file__).parent / "data" / "signature_vectors.toml"
VECTORS: list[dict[str, Any]] = tomllib.loads(VECTORS_FILE.read_text(encoding="utf-8"))["vector"]


@pytest.fixture(scope="module", name="table")
def _table() -> SignatureTable:
    return load_signature_table()


def _write(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(body, encoding="utf-8")
    return path


GOOD = """
[[signature]]
id = "good_one"
title = "A good one"
severity = "fatal"
patterns = ['good (?P<what>\\w+)']
remediation = "fix {what}"
"""


class TestLazyCompile:
    """Each regex compiles at its first use; loading validates them all."""

    def test_a_loaded_table_has_compiled_none(self) -> None:
        table = load_signature_table()
        assert sum(s.compiled.built + s.compiled_frames.built for s in table.signatures) == 0

    def test_a_match_compiles_only_what_the_set_found(self) -> None:
        table = load_signature_table()
        line = (
            "RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version "
            "(0.6.4)"
        )
        match = table.match(line)
        assert match is not None and match.signature.id == "flashinfer_cubin_mismatch"
        built = sum(s.compiled.built for s in table.signatures)
        assert 1 <= built <= 3
        assert match.signature.compiled.built >= 1

    def test_an_invalid_pattern_is_still_refused_at_load(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "bad.toml", GOOD.replace("good (?P<what>\\w+)", "good (unclosed"))
        with pytest.raises(SignatureTableError, match=r"patterns\[0\]: invalid regex"):
            load_signature_table([path])


class TestShippedTable:
    def test_default_dir_loads(self, table: SignatureTable) -> None:
        """The shipped table loads and holds at least 40 cause signatures plus noise."""
        causes = [s for s in table.signatures if s.kind == "cause"]
        assert len(causes) >= 40
        assert any(s.kind == "noise" for s in table.signatures)
        assert any(s.kind == "wrapper" for s in table.signatures)

    def test_default_dir_is_the_repo_config(self) -> None:
        """Without an installed data dir or env override the repo's config/signatures is used."""
        assert DEFAULT_SIGNATURE_DIR.name == "signatures"
        assert (DEFAULT_SIGNATURE_DIR / "vllm.toml").is_file()

    def test_every_signature_has_a_vector(self, table: SignatureTable) -> None:
        """Every signature id appears in the vector file, and the file names no unknown id."""
        ids = {s.id for s in table.signatures}
        covered = {v["signature"] for v in VECTORS}
        assert ids - covered == set()
        assert covered - ids == set()

    @pytest.mark.parametrize("vector", VECTORS, ids=lambda v: v["signature"])
    def test_vector_best_match_is_its_signature(
        self, table: SignatureTable, vector: dict[str, Any]
    ) -> None:
        """Each vector is won by its own signature (no shadowing) with the stated captures."""
        match = table.match(vector["line"], frames=vector.get("frames", ()))
        assert match is not None, vector["line"]
        assert match.signature.id == vector["signature"]
        for name, value in vector.get("captures", {}).items():
            assert match.captures.get(name) == value

    def test_every_cause_has_source_and_remediation(self, table: SignatureTable) -> None:
        """Causes say where they were learnt and what to do; noise needs neither."""
        for signature in table.signatures:
            if signature.kind == "cause":
                assert signature.source, signature.id
                assert signature.remediation, signature.id
                assert signature.severity in (Severity.FATAL, Severity.TRANSIENT)

    def test_remediation_renders_captures(self, table: SignatureTable) -> None:
        """The remediation template is filled with the line's captured versions."""
        match = table.match(
            "RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version "
            "(0.6.4). Please install the same version of both packages."
        )
        assert match is not None
        text = match.signature.render_remediation(match.captures)
        assert text is not None
        assert "0.6.3" in text
        assert "0.6.4" in text

    def test_frames_gate_a_signature(self, table: SignatureTable) -> None:
        """A bare TimeoutError is a broadcast stall only when the traceback is in shm_broadcast."""
        assert table.match("TimeoutError") is None
        frame = (
            '  File "/v/vllm/distributed/device_communicators/shm_broadcast.py", line 460, '
            "in acquire_read"
        )
        match = table.match("TimeoutError", frames=[frame])
        assert match is not None
        assert match.signature.id == "shm_broadcast_read_timeout"

    def test_noise_beats_a_cause_on_the_same_line(self, table: SignatureTable) -> None:
        """The CPU-host libcuda warning is noise even though it also names a missing library."""
        match = table.match(
            "Failed to import from vllm._C with ImportError('libcuda.so.1: cannot open shared "
            "object file: No such file or directory')"
        )
        assert match is not None
        assert match.signature.kind == "noise"

    def test_line_length_is_bounded(self) -> None:
        """Only the first max_line_chars characters of a line are matched."""
        table = load_signature_table(max_line_chars=50)
        line = "x" * 60 + " CUDA error: no kernel image is available for execution on the device"
        assert table.match(line) is None
        assert load_signature_table().match(line) is not None

    def test_explain_reports_match_and_misses(self, table: SignatureTable) -> None:
        """explain lists the winner first and says why the others did not match."""
        result = table.explain("OSError: [Errno 98] Address already in use")
        assert result[0].matched
        assert result[0].signature.id == "port_in_use"
        assert len(result) == len(table.signatures)
        reasons = {e.signature.id: e.reason for e in result}
        assert reasons["flashinfer_cubin_mismatch"] == "no pattern matched"

    def test_explain_names_the_shadowing_signature(self, table: SignatureTable) -> None:
        """A signature that matched but lost says which one outranked it."""
        result = table.explain(
            "RuntimeError: The server socket has failed to listen on any local network address. "
            "useIpv6: 0, code: -98, name: EADDRINUSE, message: address already in use"
        )
        by_id = {e.signature.id: e for e in result}
        assert by_id["torch_distributed_port_in_use"].matched
        assert "outranked by 'torch_distributed_port_in_use'" in by_id["port_in_use"].reason

    def test_subset_keeps_only_the_domains(self, table: SignatureTable) -> None:
        """subset keeps the named domains' signatures and refuses an unknown domain."""
        sub = table.subset(["flashinfer", "noise"])
        assert {s.domain for s in sub.signatures} == {"flashinfer", "noise"}
        assert sub.match("OSError: [Errno 98] Address already in use") is None
        with pytest.raises(SignatureTableError, match="unknown signature domain"):
            table.subset(["nope"])

    def test_env_var_selects_the_directory(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """VLLM_SUPERVISOR_SIGNATURES points the default directory elsewhere."""
        import importlib

        import vllm_supervisor.classify.signatures as module

        _write(tmp_path, "custom.toml", GOOD)
        monkeypatch.setenv(ENV_SIGNATURE_DIR, str(tmp_path))
        assert module._default_signature_dir() == tmp_path
        monkeypatch.delenv(ENV_SIGNATURE_DIR)
        importlib.reload(module)


# Each case: a file body, then text the error message must contain.
BAD_TABLES = [
    pytest.param(
        GOOD.replace("good (?P<what>\\w+)", "good (?P<what>\\w+"),
        "signature 'good_one': patterns[0]: invalid regex",
        id="bad-regex",
    ),
    pytest.param(
        GOOD.replace("patterns = ['good (?P<what>\\w+)']", "patterns = ['a', '(?<=x)b']"),
        "signature 'good_one': patterns[1]: invalid regex",
        id="re2-unsupported-lookbehind",
    ),
    pytest.param(
        GOOD.replace("fix {what}", "fix {where}"),
        "signature 'good_one': remediation: names capture {where} that no pattern defines",
        id="unknown-capture",
    ),
    pytest.param(
        GOOD + 'colour = "red"\n',
        "signature 'good_one': colour: unknown key",
        id="unknown-key",
    ),
    pytest.param(
        GOOD.replace('severity = "fatal"', "severity = 3"),
        "signature 'good_one': severity: must be a str, got int",
        id="wrong-type",
    ),
    pytest.param(
        GOOD + "priority = true\n",
        "signature 'good_one': priority: must be a int, got bool",
        id="bool-is-not-int",
    ),
    pytest.param(
        GOOD.replace('severity = "fatal"', 'severity = "deadly"'),
        "severity: must be fatal or transient",
        id="bad-severity",
    ),
    pytest.param(
        GOOD.replace('severity = "fatal"\n', ""),
        "severity: missing (required)",
        id="cause-without-severity",
    ),
    pytest.param(
        GOOD + 'kind = "noise"\n',
        "a noise entry has no severity",
        id="noise-with-severity",
    ),
    pytest.param(
        GOOD.replace('id = "good_one"', 'id = "Good-One"'),
        "id: must be snake_case",
        id="id-not-snake-case",
    ),
    pytest.param(
        GOOD.replace("patterns = ['good (?P<what>\\w+)']", "patterns = []").replace(
            'remediation = "fix {what}"\n', ""
        ),
        "patterns: must hold at least one regex",
        id="no-patterns",
    ),
    pytest.param(GOOD + GOOD, "signature 'good_one': id: duplicate", id="duplicate-in-file"),
    pytest.param(
        GOOD + 'written_from = "01-a.log"\n',
        "signature 'good_one': written_from: must be a list, got str",
        id="written-from-not-a-list",
    ),
    pytest.param(
        GOOD + "written_from = []\n",
        "signature 'good_one': written_from: must name at least one source",
        id="written-from-empty",
    ),
    pytest.param(
        GOOD + 'written_from = ["01-a.log"]\n',
        "signature 'good_one': written_from[0]: must be a table { log = ... } or "
        "{ upstream = ... }, got str",
        id="written-from-item-not-a-table",
    ),
    pytest.param(
        GOOD + 'written_from = [{ invocation = "vllm.service 12ab" }]\n',
        "written_from[0].invocation: must be 'UNIT INVOCATION_ID' (32 hex digits)",
        id="written-from-bad-invocation",
    ),
    pytest.param(
        GOOD + 'written_from = [{ invocation = "vllm.service ' + "a" * 32 + '", log = "1.log" }]\n',
        "written_from[0]: an invocation source names nothing else",
        id="written-from-invocation-and-log",
    ),
    pytest.param(
        GOOD + "examples = [3]\n",
        "signature 'good_one': examples[0]: must be a str, got int",
        id="examples-not-text",
    ),
    pytest.param(
        GOOD + 'written_from = [{ log = "01-a.log" }, { file = "x" }]\n',
        "signature 'good_one': written_from[1]: unknown key 'file' "
        "(allowed: log, upstream, url, invocation)",
        id="written-from-unknown-key",
    ),
    pytest.param(
        GOOD + 'written_from = [{ log = "01-a.log", upstream = "https://x.org/1" }]\n',
        "signature 'good_one': written_from[0]: names log or upstream, not both",
        id="written-from-log-and-upstream",
    ),
    pytest.param(
        GOOD + 'written_from = [{ url = "https://x.org/1" }]\n',
        "signature 'good_one': written_from[0]: names neither log (a corpus log) nor upstream",
        id="written-from-neither",
    ),
    pytest.param(
        GOOD + 'written_from = [{ upstream = "https://x.org/1", url = "https://x.org/2" }]\n',
        "signature 'good_one': written_from[0].url: only a log entry has a url",
        id="written-from-upstream-with-url",
    ),
    pytest.param(
        GOOD + 'written_from = [{ log = "../corpus/01-a.log" }]\n',
        "signature 'good_one': written_from[0].log: must be a corpus log's file name",
        id="written-from-log-path",
    ),
    pytest.param(
        GOOD + "written_from = [{ log = 1 }]\n",
        "signature 'good_one': written_from[0].log: must be a str, got int",
        id="written-from-log-not-str",
    ),
    pytest.param(
        GOOD + 'written_from = [{ upstream = "github.com/x/y/issues/1" }]\n',
        "signature 'good_one': written_from[0].upstream: must be an http(s) URL",
        id="written-from-upstream-not-a-url",
    ),
    pytest.param(
        GOOD + 'written_from = [{ log = "01-a.log", url = "https://x.org/1 and more" }]\n',
        "signature 'good_one': written_from[0].url: must be an http(s) URL",
        id="written-from-url-with-space",
    ),
    pytest.param(
        GOOD + 'written_from = [{ log = "01-a.log" }, { log = "01-a.log" }]\n',
        "signature 'good_one': written_from[1]: the same source as written_from[0]",
        id="written-from-duplicate",
    ),
    pytest.param(
        GOOD + 'packages = ["flashinfer python"]\n',
        "signature 'good_one': packages: must be a list of distribution names",
        id="packages-not-a-name",
    ),
    pytest.param(
        GOOD + "packages = [1]\n",
        "signature 'good_one': packages: must be a list of distribution names",
        id="packages-not-text",
    ),
    pytest.param("[[signature]\n", "invalid TOML", id="bad-toml"),
    pytest.param("[meta]\nx = 1\n" + GOOD, "unknown top-level key", id="top-level-key"),
]


class TestValidation:
    @pytest.mark.parametrize(("body", "message"), BAD_TABLES)
    def test_bad_table_is_refused(self, tmp_path: Path, body: str, message: str) -> None:
        """A broken file raises SignatureTableError naming the file, id and field."""
        path = _write(tmp_path, "vllm.toml", body)
        with pytest.raises(SignatureTableError) as excinfo:
            load_signature_table([path])
        assert str(path) in str(excinfo.value)
        assert message in str(excinfo.value)

    def test_duplicate_id_across_files(self, tmp_path: Path) -> None:
        """The same id in two domain files is an error naming both files."""
        first = _write(tmp_path, "a.toml", GOOD)
        second = _write(tmp_path, "b.toml", GOOD)
        with pytest.raises(SignatureTableError) as excinfo:
            load_signature_table([tmp_path])
        message = str(excinfo.value)
        assert "signature 'good_one': id: duplicate" in message
        assert str(first) in message
        assert str(second) in message

    def test_missing_path(self, tmp_path: Path) -> None:
        """A path that does not exist is refused."""
        with pytest.raises(SignatureTableError, match="no such signature file"):
            load_signature_table([tmp_path / "absent.toml"])

    def test_good_file_loads_with_domain(self, tmp_path: Path) -> None:
        """A valid file loads; its stem is the signatures' domain."""
        table = load_signature_table([_write(tmp_path, "mine.toml", GOOD)])
        assert [s.id for s in table.signatures] == ["good_one"]
        assert table.signatures[0].domain == "mine"
        match = table.match("very good stuff")
        assert match is not None
        assert match.captures == {"what": "stuff"}

    @pytest.mark.parametrize(
        ("template", "rendered"),
        [
            ("fix {what!r}", "fix 'stuff'"),
            ("fix {what!s} now", "fix stuff now"),
            ("fix [{what:>7}]", "fix [  stuff]"),
            ("fix [{what:.3}]", "fix [stu]"),
        ],
    )
    def test_a_template_that_renders_any_text_loads(
        self, tmp_path: Path, template: str, rendered: str
    ) -> None:
        """A conversion or format spec that renders every text (captures are text) is a
        template an operator may write; only one that fails on text is refused."""
        body = GOOD.replace("fix {what}", template)
        table = load_signature_table([_write(tmp_path, "mine.toml", body)])
        match = table.match("very good stuff")
        assert match is not None
        assert rendered == match.signature.render_remediation(match.captures)
        assert match.signature.render_remediation({}) is not None  # "?" renders too

    def test_written_from_is_parsed(self, tmp_path: Path) -> None:
        """Corpus logs (with their URL, when public) and upstream URLs come out in order."""
        body = GOOD + (
            "written_from = [\n"
            '  { log = "02-oom.log", url = "https://github.com/o/r/issues/2" },\n'
            '  { log = "201-real.log" },\n'
            '  { upstream = "https://github.com/o/r/blob/main/x.py" },\n'
            "]\n"
        )
        [spec] = parse_table_file(_write(tmp_path, "mine.toml", body), compile_pattern)
        assert spec.written_from == (
            WrittenFrom(log="02-oom.log", url="https://github.com/o/r/issues/2"),
            WrittenFrom(log="201-real.log"),
            WrittenFrom(upstream="https://github.com/o/r/blob/main/x.py"),
        )
        assert [w.log for w in spec.written_from] == ["02-oom.log", "201-real.log", None]

    def test_written_from_is_optional(self, tmp_path: Path) -> None:
        """A table of one's own need not say where each signature came from."""
        [spec] = parse_table_file(_write(tmp_path, "mine.toml", GOOD), compile_pattern)
        assert spec.written_from == ()

    def test_wrapper_may_omit_severity(self, tmp_path: Path) -> None:
        """A wrapper without severity loads as UNKNOWN severity."""
        body = '[[signature]]\nid = "w"\ntitle = "W"\nwrapper = true\npatterns = ["wrapped"]\n'
        table = load_signature_table([_write(tmp_path, "w.toml", body)])
        assert table.signatures[0].kind == "wrapper"
        assert table.signatures[0].severity is Severity.UNKNOWN


_TOML_VALUES = st.recursive(
    st.one_of(st.text(max_size=30), st.integers(), st.booleans()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["log", "url", "upstream", "x"]), inner, max_size=3),
    ),
    max_leaves=8,
)


def _toml(value: Any) -> str:
    """A TOML inline value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):  # TOML takes JSON's escapes, but not its surrogate pairs
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=_TOML_VALUES)
def test_any_written_from_loads_or_is_one_line_naming_the_field(tmp_path: Path, value: Any) -> None:
    """Whatever `written_from` holds, the file loads with valid entries or is refused with one
    line that names the file, the signature and the field."""
    path = _write(tmp_path, "prop.toml", GOOD + f"written_from = {_toml(value)}\n")
    try:
        [spec] = parse_table_file(path, compile_pattern)
    except SignatureTableError as exc:
        message = str(exc)
        assert "\n" not in message
        assert message.startswith(f"{path}: signature 'good_one': written_from")
        return
    assert spec.written_from
    for entry in spec.written_from:
        assert (entry.log is None) != (entry.upstream is None)


_FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "patterns": st.lists(
        st.sampled_from(
            [r"boom (?P<what>\w+)", "boom", r"(?P<what>.*)", "(unclosed", "(?P<0>x)", "", "."]
        )
        | st.text(max_size=8),
        max_size=3,
    ),
    "remediation": st.sampled_from(
        [
            "fix {what}",
            "fix {what!r}",
            "fix {what!z}",
            "fix {what:d}",
            "fix {what:>{what}}",
            "fix {what.attr}",
            "fix {what[0]}",
            "fix {}",
            "fix {0}",
            "fix {",
            "fix }",
            "fix {{what}}",
        ]
    )
    | st.text(max_size=12),
    "severity": st.sampled_from(["fatal", "transient", "unknown", "FATAL", ""]),
    "startup_severity": st.sampled_from(["fatal", "transient", "unknown", "x"]),
    "serving_severity": st.sampled_from(["fatal", "transient", "unknown", "x"]),
    "kind": st.sampled_from(["cause", "noise", "wrapper", "x"]),
    "priority": st.integers() | st.sampled_from([2**63, -(2**63) - 1, 10**30]),
    "wrapper": st.booleans(),
    "frames": st.lists(
        st.sampled_from([r"a\.py", "(x", "", r".*"]) | st.text(max_size=6), max_size=2
    ),
}


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    fields=st.fixed_dictionaries(
        {
            "id": st.just("gen") | _TOML_VALUES,
            "title": st.just("Generated") | _TOML_VALUES,
        },
        optional={**_FIELD_VALUES, "other": _TOML_VALUES},
    )
)
@example(
    fields={
        "id": "gen",
        "title": "G",
        "patterns": [r"boom (?P<what>\w+)"],
        "remediation": "fix {what:d}",
        "severity": "fatal",
    }
)
@example(
    fields={
        "id": "gen",
        "title": "G",
        "patterns": [r"boom (?P<what>\w+)"],
        "remediation": "fix {what!z}",
        "severity": "fatal",
    }
)
def test_any_signature_file_loads_and_classifies_or_is_one_line(
    tmp_path: Path, fields: dict[str, Any]
) -> None:
    """Any [[signature]] entry: `triage` with it classifies a crash it matches, or the
    command names the file in one line; never the last net's error."""
    body = "[[signature]]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in fields.items())
    signatures = _write(tmp_path, "gen.toml", body)
    config = _write(
        tmp_path,
        "supervisor.toml",
        f'[signatures]\npaths = ["{signatures}"]\n[systemd]\nenabled = false\n',
    )
    log = _write(tmp_path, "crash.log", "INFO starting\nRuntimeError: boom alpha\n")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["triage", str(log), "--config", str(config), "--format", "json"])
    assert cli.UNEXPECTED not in err.getvalue(), err.getvalue()
    assert "classification_failed" not in err.getvalue(), err.getvalue()
    if code == 2:
        assert err.getvalue().count("\n") == 1, err.getvalue()
        assert str(signatures) in err.getvalue(), err.getvalue()
    else:
        assert code == 0, err.getvalue()
        assert json.loads(out.getvalue())["invocations"], "the crash was not classified"


def test_a_file_nested_too_deeply_is_one_line(tmp_path: Path) -> None:
    """tomllib raises RecursionError on arrays nested thousands deep: one line, not a crash."""
    path = _write(tmp_path, "deep.toml", "x = " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(SignatureTableError) as caught:
        parse_table_file(path, compile_pattern)
    assert str(caught.value).startswith(f"{path}: invalid TOML")
