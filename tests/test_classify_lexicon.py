"""The determinism lexicon (config/lexicon.toml): loaded and validated like the signature table,
and what it reads in a crash's words, class, numbers and raise site."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from vllm_supervisor.classify.lexicon import (
    _KEYS,
    DEFAULT_LEXICON_PATH,
    Lexicon,
    Reads,
    Strength,
    default_lexicon,
    frame_parts,
    load_lexicon,
    parse_lexicon,
)
from vllm_supervisor.errors import ConfigError

WORDING = """
[[wording]]
id = "not_supported"
reads = "deterministic"
patterns = ['not supported']
why = "a capability the host lacks"
examples = ["X is not supported"]
"""


@pytest.fixture(scope="module", name="lexicon")
def _lexicon() -> Lexicon:
    return default_lexicon()


def _parse(text: str) -> Lexicon:
    return parse_lexicon(text, Path("lexicon.toml"))


class TestLoading:
    def test_the_shipped_lexicon_loads(self) -> None:
        """The shipped file validates: every example reads as its entry says (checked at load)."""
        assert load_lexicon(DEFAULT_LEXICON_PATH).source == str(DEFAULT_LEXICON_PATH)

    @pytest.mark.parametrize(
        ("text", "message"),
        [
            (WORDING + "colour = 1\n", "wording 'not_supported': colour: unknown key"),
            (
                WORDING.replace("'not supported'", "'(unclosed'"),
                "wording 'not_supported': patterns[0]: invalid regex",
            ),
            (
                WORDING.replace('reads = "deterministic"', 'reads = "sometimes"'),
                "wording 'not_supported': reads: must be one of deterministic, indeterminate",
            ),
            (
                WORDING.replace('"X is not supported"', '"X works"'),
                "wording 'not_supported': examples[0]: not matched by its patterns: 'X works'",
            ),
            (
                WORDING + 'counter_examples = ["it is not supported"]\n',
                "wording 'not_supported': counter_examples[0]: matched",
            ),
            (WORDING + WORDING, "wording 'not_supported': id: duplicate in this file"),
            (WORDING.replace('why = "a capability the host lacks"\n', ""), "why: missing"),
            (
                WORDING.replace(
                    'reads = "deterministic"', 'reads = "deterministic"\nstrength = "huge"'
                ),
                "strength: must be one of weak, strong, decisive",
            ),
            (
                '[[exception]]\nid = "x"\nreads = "pointer"\nnames = ["ValueError"]\nwhy = "w"\n',
                "exception 'x': reads: must be one of deterministic, indeterminate",
            ),
            (
                '[[exception]]\nid = "x"\nreads = "deterministic"\nnames = ["valueerror"]\n'
                'why = "w"\n',
                "exception 'x': names[0]: must be a class name",
            ),
            (
                "[[capacity]]\nid = \"m\"\npattern = '(?P<free>\\\\d+)/(?P<total>\\\\d+)'\n"
                'why = "w"\n',
                "capacity 'm': pattern: needs a named group (?P<wanted>...)",
            ),
            (
                '[[site]]\nid = "s"\nreads = "deterministic"\npaths = [\'/argparse\\\\.py$\']\n'
                'why = "w"\nexamples = [\'File "/x/y.py", line 1, in f\']\n',
                "site 's': examples[0]: not a frame this site reads",
            ),
            ('[[site]]\nid = "s"\nreads = "deterministic"\nwhy = "w"\n', "a site needs paths"),
            ('[[request]]\nid = "r"\nnames = []\nwhy = "w"\n', "request 'r': names: must name"),
            ('[[request]]\nid = "r"\nnames = ["x y"]\nwhy = "w"\n', "names[0]: must be a class"),
            ('[[request]]\nid = "r"\nnames = ["ValueError"]\n', "why: missing"),
            ("[[signature]]\n", "unknown top-level key(s) ['signature']"),
            ("wording = 3\n", "'wording' must be an array of tables"),
            ("[[wording\n", "invalid TOML"),
        ],
    )
    def test_a_bad_file_names_the_entry_and_field(self, text: str, message: str) -> None:
        """Every fault is one line naming the file, the entry and the field."""
        with pytest.raises(ConfigError) as caught:
            _parse(text)
        assert str(caught.value).startswith("lexicon.toml: ")
        assert message in str(caught.value)
        assert "\n" not in str(caught.value)

    def test_an_unreadable_file_is_one_line(self, tmp_path: Path) -> None:
        """A missing file is a ConfigError naming it, not a traceback."""
        with pytest.raises(ConfigError, match="cannot read the lexicon"):
            load_lexicon(tmp_path / "absent.toml")


class TestWords:
    @pytest.mark.parametrize(
        ("text", "reads"),
        [
            # Deterministic: what a restart with the same inputs cannot change.
            ("RuntimeError: The FlashInfer backend is not available on this build", "det"),
            ("RuntimeError: quantized weights of this kind cannot load into FooModel", "det"),
            ("ValueError: Cannot load the quantized weights for this model", "det"),
            ("RuntimeError: Requested workspace exceeds the accelerator's memory budget", "det"),
            ("RuntimeError: CUDA error: out of memory", "det"),
            ("Environment variable VLLM_PORT='80a' is not a valid integer", "det"),
            ("ValueError: 28 attention heads is not divisible by tensor parallel size 3", "det"),
            ("Model architecture FooForCausalLM has no vLLM implementation", "det"),
            # Other engines' own words (llama.cpp, Ollama, Triton), written before any of
            # their recorded logs was read: an allocator, a corrupt file, a parser, a driver.
            ("llama_init_from_model: failed to allocate buffer for kv cache", "det"),
            ("cudaMalloc failed: out of memory", "det"),
            ("gguf: model is corrupted or incomplete", "det"),
            ("main: exiting due to model loading error", "det"),
            ('error while handling argument "--n-gpu-layers": stoi', "det"),
            ("RuntimeError: Found no NVIDIA driver on your system.", "det"),
            ("Error while deserializing header: HeaderTooLarge", "det"),
            # Indeterminate: the next start may not meet it.
            ("couldn't bind HTTP server socket, hostname: 0.0.0.0, port: 8080", "ind"),
            ("HfHubHTTPError: 429 Client Error: Too Many Requests for url: https://hf.co/x", "ind"),
            ("503 Server Error: Service Unavailable for url: https://huggingface.co/x", "ind"),
            ("ConnectionResetError: [Errno 104] Connection reset by peer", "ind"),
            ("RuntimeError: Rate limit exceeded, please retry later", "ind"),
            ("TimeoutError: the store timed out after 1800 s", "ind"),
            # Both: a conflict the model leaves unknown.
            ("OSError: cannot find the files; check your internet connection", "both"),
            # Neither.
            ("RuntimeError: CUDA kernel failed : 1", "none"),
        ],
    )
    def test_what_the_words_read(self, lexicon: Lexicon, text: str, reads: str) -> None:
        """The wording of a cause reads one way, the other, both or neither."""
        found = {clue.reads for clue in lexicon.words(text)}
        expected = {
            "det": {Reads.DETERMINISTIC},
            "ind": {Reads.INDETERMINATE},
            "both": {Reads.DETERMINISTIC, Reads.INDETERMINATE},
            "none": set(),
        }[reads]
        assert expected == found

    def test_a_phrase_inside_a_longer_one_gives_way(self, lexicon: Lexicon) -> None:
        """'exceeded' is a limit, but 'rate limit exceeded' and 'deadline exceeded' are not."""
        for text in ("Rate limit exceeded", "grpc: Deadline exceeded"):
            assert {Reads.INDETERMINATE} == {c.reads for c in lexicon.words(text)}

    def test_possibilities_are_not_evidence(self, lexicon: Lexicon) -> None:
        """What follows 'This can happen when' lists possibilities: the OOM it names is not
        what happened; the words before it still count."""
        text = (
            "node 10.0.0.5 has missed its heartbeats. This can happen when (1) raylet crashes "
            "unexpectedly (OOM, preempted node, etc.)"
        )
        assert [(c.entry, c.reads) for c in lexicon.words(text)] == [
            ("network", Reads.INDETERMINATE)
        ]

    @pytest.mark.parametrize(
        ("text", "kind"),
        [
            ("RuntimeError: Engine core initialization failed. See root cause above.", "pointer"),
            (
                "Received sigquit from a child process. It usually means the child failed.",
                "pointer",
            ),
            ("collect2: error: ld returned 1 exit status", "pointer"),
            ("Error retrieving safetensors: not found, retrying 1 of 2", "handled"),
            ("Flash attention is not supported here; falling back to SDPA", "handled"),
            ("max_total_tokens=1 is larger than the profiled value. Use it instead.", "handled"),
            ("ValueError: dtype must be float16", "deterministic"),
            ("Loading safetensors checkpoint shards: 100% Completed", None),
        ],
    )
    def test_line_kinds(self, lexicon: Lexicon, text: str, kind: str | None) -> None:
        """A pointer or a coped report first, whatever else the line says; then a cause."""
        got = lexicon.line_kind(text)
        assert kind == (got.value if got is not None else None)

    @given(text=st.text(max_size=300))
    def test_any_text_reads_without_error(self, text: str) -> None:
        """Arbitrary text never breaks the reading, and every clue quotes the text."""
        lexicon = default_lexicon()
        for clue in lexicon.words(text):
            assert clue.said in text
            assert clue.reads in (Reads.DETERMINISTIC, Reads.INDETERMINATE)
        lexicon.line_kind(text)
        lexicon.capacity(text)


class TestNumbersClassesSites:
    @pytest.mark.parametrize(
        ("text", "reads"),
        [
            # Asks for more than the device has at all: it can never fit.
            (
                "ValueError: Available memory on node 0 (21.96/23.54 GiB) on kv cache "
                "allocation is less than requested memory for kv (64.0 GiB).",
                Reads.DETERMINISTIC,
            ),
            # Fits the device but not what is free: another process holds the rest.
            (
                "ValueError: Free memory on device cuda:0 (1.54/22.05 GiB) on startup is less "
                "than desired GPU memory utilization (0.9, 19.84 GiB).",
                Reads.INDETERMINATE,
            ),
        ],
    )
    def test_a_memory_checks_numbers(self, lexicon: Lexicon, text: str, reads: Reads) -> None:
        """The numbers decide, whatever the message advises ('or reduce memory used by other
        processes' is printed either way)."""
        clue = lexicon.capacity(text)
        assert clue is not None
        assert (reads, Strength.DECISIVE) == (clue.reads, clue.strength)

    @given(
        free=st.floats(0.1, 500.0),
        total=st.floats(0.1, 500.0),
        wanted=st.floats(0.1, 1000.0),
    )
    def test_numbers_never_contradict_arithmetic(
        self, free: float, total: float, wanted: float
    ) -> None:
        """More than in all is deterministic, more than free is not, enough says nothing."""
        text = (
            f"Free memory on device cuda:0 ({free:.2f}/{total:.2f} GiB) on startup is less "
            f"than desired GPU memory utilization (0.9, {wanted:.2f} GiB)."
        )
        clue = default_lexicon().capacity(text)
        f, t, w = (round(x, 2) for x in (free, total, wanted))
        if w > t:
            assert clue is not None and clue.reads is Reads.DETERMINISTIC
        elif w > f:
            assert clue is not None and clue.reads is Reads.INDETERMINATE
        else:
            assert clue is None

    def test_a_requests_own_error_classes(self, lexicon: Lexicon) -> None:
        """[[request]]: the classes a request's input raises, whatever their module."""
        assert lexicon.request_error("ValueError")
        assert lexicon.request_error("jinja2.exceptions.TemplateError")
        assert not lexicon.request_error("ModuleNotFoundError")
        assert not lexicon.request_error("RuntimeError")
        assert not lexicon.request_error(None)

    @pytest.mark.parametrize(
        ("name", "reads"),
        [
            ("ModuleNotFoundError", Reads.DETERMINISTIC),
            ("pydantic_core._pydantic_core.ValidationError", Reads.DETERMINISTIC),
            ("requests.exceptions.ConnectionError", Reads.INDETERMINATE),
            ("RuntimeError", None),
            ("Exception", None),
            (None, None),
        ],
    )
    def test_exception_classes(self, lexicon: Lexicon, name: str | None, reads: Reads) -> None:
        """A class says what it says by its unqualified name; the catch-alls say nothing."""
        clue = lexicon.exception(name)
        assert reads == (clue.reads if clue is not None else None)

    @pytest.mark.parametrize(
        ("frame", "entry"),
        [
            (
                '  File "/v/site-packages/vllm/model_executor/layers/linear.py", line 3, in f',
                "model_and_weight_loading",
            ),
            (
                '  File "/v/dist-packages/vllm/worker/worker.py", line 231, in _check_dtype',
                "validation",
            ),
            ('File "/x/vllm/entrypoints/cli/main.py", line 7, in <module>', "import"),
            (
                '  File "/v/site-packages/torch/distributed/c10d.py", line 9, in barrier',
                "distributed_and_network",
            ),
            # The standard library's `check_returncode` checks a subprocess's result.
            ('  File "/usr/lib/python3.12/subprocess.py", line 502, in check_returncode', None),
            ("not a frame", None),
        ],
    )
    def test_raise_sites_are_weak(self, lexicon: Lexicon, frame: str, entry: str | None) -> None:
        """The innermost frame's module or function is a weak clue, never more."""
        clue = lexicon.site(frame)
        assert entry == (clue.entry if clue is not None else None)
        if clue is not None:
            assert clue.strength is Strength.WEAK

    @given(
        frames=st.lists(
            st.one_of(
                st.text(max_size=80),
                st.builds(
                    lambda lib, name, function: f'  File "{lib}/{name}.py", line 1, in {function}',
                    st.sampled_from(
                        ["/usr/lib/python3.12", "/v/site-packages/vllm/model_executor/models"]
                    ),
                    st.sampled_from(["subprocess", "socket", "registry", "x"]),
                    st.sampled_from(["check_returncode", "_check_x", "<module>", "f"]),
                ),
            ),
            max_size=6,
        )
    )
    def test_a_site_is_the_innermost_outside_the_standard_library(
        self, lexicon: Lexicon, frames: list[str]
    ) -> None:
        """Any frames: the clue is the innermost frame's own, or, when that is a standard
        library helper with none, the innermost caller's outside that library."""
        frame, callers = (frames[-1], frames[:-1]) if frames else (None, [])
        clue = lexicon.site(frame, callers)
        own = lexicon.site(frame)
        if own is not None or frame is None or "/usr/lib/python3.12/" not in frame:
            assert clue == own
        else:
            library = [
                (p := frame_parts(c)) is not None and "/lib/python3.12/" in p[0] for c in callers
            ]
            outside = [c for c, inside in zip(callers, library, strict=True) if not inside]
            assert clue == (lexicon.site(outside[-1]) if outside else None)

    def test_frame_parts(self) -> None:
        """Python's and faulthandler's frame lines give their file and function."""
        assert frame_parts('  File "/x/y.py", line 3, in f') == ("/x/y.py", "f")
        assert frame_parts('  File "/x/y.py", line 3 in f') == ("/x/y.py", "f")
        assert frame_parts("ValueError: x") is None


_LEXICON_STRINGS = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        [
            "deterministic",
            "indeterminate",
            "weak",
            "strong",
            "decisive",
            "ValueError",
            "x_1",
            r"(?P<free>\S+)/(?P<total>\S+) (?P<wanted>\S+)",
            r"(?P<free>.*)",
            "(unclosed",
            "a/b c",
            "1e999/nan inf",
            'File "/x/site-packages/vllm/a.py", line 1, in f',
        ]
    ),
)
_LEXICON_VALUES = st.one_of(
    _LEXICON_STRINGS,
    st.lists(_LEXICON_STRINGS, max_size=3),
    st.integers(),
    st.booleans(),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@st.composite
def _lexicon_documents(draw: st.DrawFn) -> dict[str, object]:
    """A parsed lexicon file: its tables, each entry of known (and some unknown) keys."""
    document: dict[str, object] = {}
    for table in draw(st.lists(st.sampled_from(sorted(_KEYS)), unique=True, max_size=2)):
        keys = st.sampled_from(sorted(_KEYS[table])) | st.text(max_size=3)
        entries = st.dictionaries(keys, _LEXICON_VALUES, max_size=6)
        document[table] = draw(st.lists(entries, max_size=2) | _LEXICON_VALUES)
    return document


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str | int):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    assert isinstance(value, dict)
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"


def _toml(document: dict[str, object]) -> str:
    """The TOML text of a document (arrays of tables as [[table]] blocks)."""
    parts = []
    for table, entries in document.items():
        if isinstance(entries, list) and entries and all(isinstance(e, dict) for e in entries):
            for entry in entries:
                assert isinstance(entry, dict)
                body = "".join(f"{json.dumps(k)} = {_toml_value(v)}\n" for k, v in entry.items())
                parts.append(f"[[{table}]]\n{body}")
        else:
            parts.insert(0, f"{table} = {_toml_value(entries)}\n")
    return "".join(parts)


@given(document=_lexicon_documents())
@example(
    document={
        "capacity": [
            {
                "id": "c",
                "why": "w",
                "pattern": r"(?P<free>\S+)/(?P<total>\S+) (?P<unit>\S+) (?P<wanted>\S+)"
                r" (?P<wanted_unit>\S+)",
                "examples": ["a/b GiB c GiB"],
            }
        ]
    }
)
@example(
    document={
        "capacity": [
            {
                "id": "c",
                "why": "w",
                "pattern": r"(?:(?P<free>\d+) free )?(?P<total>\d+) (?P<unit>\w+) (?P<wanted>\d+)"
                r" (?P<wanted_unit>\w+)",
                "examples": ["8 GiB 9 GiB"],  # an optional group that took no part: None
            }
        ]
    }
)
def test_any_lexicon_document_loads_or_is_one_line(document: dict[str, object]) -> None:
    """Whatever the file holds: a Lexicon, or one ConfigError line naming the file."""
    try:
        parse_lexicon(_toml(document), Path("lexicon.toml"))
    except ConfigError as exc:
        assert str(exc).startswith("lexicon.toml: "), exc
        assert "\n" not in str(exc), exc


def test_a_lexicon_nested_too_deeply_is_one_line() -> None:
    """tomllib raises RecursionError on arrays nested thousands deep: one ConfigError line."""
    with pytest.raises(ConfigError) as caught:
        parse_lexicon("x = " + "[" * 3000 + "]" * 3000 + "\n", Path("lexicon.toml"))
    assert str(caught.value).startswith("lexicon.toml: invalid TOML")
