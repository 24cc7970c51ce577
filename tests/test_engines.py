"""Engine files: the shipped ones load and hold what the stages used to hard-code, a broken
one is refused in one line naming file and key, and whatever a file holds, loading it gives a
profile or that error, never another exception."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_supervisor.classify.logline import parse_line
from vllm_supervisor.decide import hang
from vllm_supervisor.decide.hang import HangDetector
from vllm_supervisor.decide.port_evidence import port_of
from vllm_supervisor.engines.profiles import (
    Engines,
    current,
    hints_of,
    install,
    load_engines,
)
from vllm_supervisor.engines.schema import EngineProfile, parse_engine, read_engine_file
from vllm_supervisor.environment.execstart import serving_port
from vllm_supervisor.environment.serving import is_serving_line
from vllm_supervisor.errors import EngineFileError
from vllm_supervisor.model import JournalEntry, LogLine

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "config" / "engines"


@pytest.fixture(name="engines_in_force")
def _engines_in_force() -> Iterator[Engines]:
    """The engines in force, put back after a test that installs others."""
    before = current()
    yield before
    install(before)


def _write(tmp_path: Path, body: str, name: str = "acme.toml") -> Path:
    path = tmp_path / name
    path.write_text(body, encoding="utf-8")
    return path


class TestShipped:
    def test_every_engine_loads_beside_its_signatures(self) -> None:
        """vLLM, SGLang and TGI (and any other) each have an engine file and a signature file
        of the same name."""
        engines = load_engines(SHIPPED)
        assert {"sglang", "tgi", "vllm"} <= set(engines.ids)
        for engine_id in engines.ids:
            assert (REPO / "config" / "signatures" / f"{engine_id}.toml").is_file()

    def test_the_package_reads_the_shipped_files(self) -> None:
        """Without $VLLM_SUPERVISOR_ENGINES the engines in force are the shipped files."""
        assert current() == load_engines(SHIPPED)

    @pytest.mark.parametrize(
        ("argv", "port"),
        [
            (["vllm", "serve", "m"], 8000),
            (["python", "-m", "sglang.launch_server"], 30000),
            (["/usr/bin/text-generation-launcher", "--model-id", "m"], 3000),
            (["python", "-m", "other.server"], None),
        ],
    )
    def test_each_engines_default_port(self, argv: list[str], port: int | None) -> None:
        """A command line without --port listens on its engine file's default_port."""
        assert serving_port(argv) == port

    @pytest.mark.parametrize(
        "rule",
        [*load_engines(SHIPPED).death, *load_engines(SHIPPED).serving],
        ids=lambda rule: rule.pattern[:30],
    )
    @settings(max_examples=30, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def test_every_line_a_rule_matches_holds_one_of_its_hints(
        self, rule: Any, data: st.DataObject
    ) -> None:
        """The hints only spare the regex: no line a pattern matches lacks all of them."""
        line = data.draw(st.from_regex(rule.pattern))
        assert any(hint in line for hint in rule.hints), line


class TestDataOnlyEngine:
    """What a new engine's file alone changes, once installed."""

    ACME = """\
name = "Acme"
packages = ["acme-serve"]
default_port = 7070
commands = [["acme-serve"]]
port_options = ["--listen-port"]
model_paths = ["/acme/models/"]
server_paths = ["/acme/"]
port_lines = ['acme port=(\\d+)']

[[serving]]
pattern = 'Acme is serving on \\S+'
hints = ["Acme is serving"]

[[death]]
pattern = 'Acme worker \\d+ is gone'
hints = ["is gone"]

[[prefix]]
position = "inner"
starts = "bracket"
pattern = '\\[acme:(?P<level>E|I)\\] <(?P<process>\\w+)> '
levels = { E = "ERROR", I = "INFO" }
"""

    @pytest.fixture(name="acme")
    def _acme(self, tmp_path: Path, engines_in_force: Engines) -> Engines:
        directory = tmp_path / "engines"
        directory.mkdir()
        for source in SHIPPED.glob("*.toml"):
            _write(directory, source.read_text(encoding="utf-8"), source.name)
        _write(directory, self.ACME)
        engines = load_engines(directory)
        install(engines)
        return engines

    def test_its_prefix_is_stripped(self, acme: Engines) -> None:
        """The prefix's level and process are read, after the generic outer ones."""
        parsed = parse_line(LogLine(text="(EngineCore pid=7) [acme:E] <rank3> boom", pid=None))
        assert (parsed.text, parsed.process, parsed.level) == ("boom", "rank3", "ERROR")

    def test_its_lines_ports_and_packages_are_known(self, acme: Engines) -> None:
        """Serving line, death line, default port, bind-error port, packages: all from data."""
        assert is_serving_line("Acme is serving on 0.0.0.0:7070")
        detector = HangDetector({"acme.service": 5.0}, clock=lambda: 0.0)
        assert "is gone" in hang.DEATH_HINTS
        line = "Acme worker 3 is gone"
        detector.observe(JournalEntry(cursor="c", realtime_us=1, unit="acme.service", message=line))
        assert detector.death("acme.service") is not None
        assert serving_port(["/opt/acme/bin/acme-serve"]) == 7070
        assert serving_port(["/opt/acme/bin/acme-serve", "--listen-port", "7072"]) == 7072
        assert serving_port(["/opt/acme/bin/acme-serve", "--listen-port=7073"]) == 7073
        assert port_of({}, "bind failed: acme port=7071", None) == 7071
        assert "acme-serve" in acme.packages

    def test_reinstalling_the_old_engines_forgets_it(self, acme: Engines) -> None:
        """Installing the shipped files again: the prefix is text again."""
        install(load_engines(SHIPPED))
        assert parse_line(LogLine(text="[acme:E] <rank3> boom")).text.startswith("[acme:E]")


# (file body, the key its one-line error names)
BROKEN = [
    ("name = ", "invalid TOML"),
    ("packages = []", "name: missing (required)"),
    ('name = "x"\ncolour = 1', "colour: unknown key"),
    ('name = "x"\npackages = ["a b"]', "packages[0]: not a package name"),
    ('name = "x"\ndefault_port = 0\ncommands = [["x"]]', "default_port: must be a TCP port"),
    ('name = "x"\ndefault_port = 80', "default_port: needs commands"),
    ('name = "x"\ndefault_port = true', "default_port: must be a int, got bool"),
    ('name = "x"\ncommands = [["x"]]', "commands: name default_port too"),
    ('name = "x"\ndefault_port = 80\ncommands = [["/bin/x"]]', "commands[0]: a word"),
    ('name = "x"\nstartup_frames = ["load("]', "startup_frames[0]: invalid regex"),
    ('name = "x"\nself_kill = ["kill("]', "self_kill[0]: invalid regex"),
    ('name = "x"\nport_options = ["port"]', "port_options[0]: not a command-line option"),
    (
        'name = "x"\nport_lines = ["port (\\\\d+) (\\\\d+)"]',
        "port_lines[0]: must hold exactly one group",
    ),
    ('name = "x"\n[[death]]\nhints = ["a"]', "death[0].pattern: missing"),
    ('name = "x"\n[[death]]\npattern = "a("\nhints = ["a"]', "death[0].pattern: invalid regex"),
    ('name = "x"\n[[serving]]\npattern = "a"', "serving[0].hints: missing"),
    ('name = "x"\n[[serving]]\npattern = "a"\nhints = [""]', "serving[0].hints[0]: must not"),
    ('name = "x"\n[[serving]]\npattern = "a"\nhints = ["a"]\nhint = "a"', "serving[0].hint:"),
    (
        'name = "x"\n[[prefix]]\nposition = "inner"\nstarts = "digit"\npattern = "1 "',
        "prefix[0].starts: an inner prefix starts with one of level, bracket, paren, dash, pipe",
    ),
    (
        'name = "x"\n[[prefix]]\nposition = "outer"\nstarts = "digit"\npattern = "(?P<x>1) "',
        "prefix[0].pattern: group 'x' is read by nothing",
    ),
    (
        'name = "x"\n[[prefix]]\nposition = "outer"\nstarts = "digit"\npattern = "1 "\n'
        'levels = { E = "ERROR" }',
        "prefix[0].levels: the pattern has no (?P<level>...) group",
    ),
    (
        'name = "x"\n[[prefix]]\nposition = "outer"\nstarts = "digit"\n'
        'pattern = "(?P<level>E) "\nlevels = { E = "BAD" }',
        "prefix[0].levels.E: must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL",
    ),
    (
        'name = "x"\n[[prefix]]\nposition = "outer"\nstarts = "digit"\n'
        'pattern = "(?P<level>E)(?P<level>F) "',
        "prefix[0].pattern: invalid regex",
    ),
]


@pytest.mark.parametrize(("body", "message"), BROKEN, ids=[m for _, m in BROKEN])
def test_a_broken_file_is_one_line_naming_file_and_key(
    tmp_path: Path, body: str, message: str
) -> None:
    """Each fault is an EngineFileError: the file, the key, the fix, on one line."""
    path = _write(tmp_path, body)
    with pytest.raises(EngineFileError) as caught:
        read_engine_file(path)
    text = str(caught.value)
    assert text.startswith(f"{path}: ")
    assert message in text
    assert "\n" not in text


def test_a_file_name_that_is_no_engine_id_is_refused(tmp_path: Path) -> None:
    """The stem is the engine's id (and its signatures' domain): snake_case."""
    with pytest.raises(EngineFileError, match="snake_case"):
        read_engine_file(_write(tmp_path, 'name = "x"', "Bad-Name.toml"))


def test_a_missing_directory_is_refused(tmp_path: Path) -> None:
    """A directory that is not there is an error, not an empty set of engines."""
    with pytest.raises(EngineFileError, match="no such engine directory"):
        load_engines(tmp_path / "absent")


KEYS = [
    "name",
    "packages",
    "default_port",
    "commands",
    "port_options",
    "server_paths",
    "model_paths",
    "startup_frames",
    "serving_frames",
    "request_frames",
    "request_lines",
    "port_lines",
    "self_kill",
    "serving",
    "death",
    "prefix",
    "pattern",
    "hints",
    "position",
    "starts",
    "levels",
]
_SCALARS = (
    st.text(max_size=12)
    | st.sampled_from(["(", "a|b", r"(?P<level>E) ", "outer", "inner", "digit", "level", "ERROR"])
    | st.integers(-10, 70000)
    | st.booleans()
    | st.floats(allow_nan=False)
)
VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), VALUES, max_size=8))
def test_whatever_a_file_holds_it_is_a_profile_or_one_error(raw: dict[str, Any]) -> None:
    """Any parsed TOML document: an EngineProfile, or an EngineFileError of one line."""
    try:
        profile = parse_engine(raw, Path("/x/acme.toml"))
    except EngineFileError as exc:
        assert str(exc).startswith("/x/acme.toml: ")
        assert "\n" not in str(exc)
    else:
        assert isinstance(profile, EngineProfile)
        for rule in profile.prefixes:
            re.compile(rule.grouped)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    raw=st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=6),
    junk=st.binary(max_size=40),
)
def test_whatever_bytes_a_file_holds_loading_gives_a_profile_or_one_error(
    tmp_path: Path, raw: dict[str, Any], junk: bytes
) -> None:
    """A file written as TOML (often valid, often not), with random bytes after it or not."""
    path = tmp_path / "acme.toml"
    body = "\n".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in raw.items()).encode()
    path.write_bytes(body + (b"\n" + junk if junk else b""))
    try:
        read_engine_file(path)
    except EngineFileError as exc:
        assert "\n" not in str(exc)


def test_hints_are_kept_once_in_file_order() -> None:
    """Two rules sharing a hint (vLLM's two `died unexpectedly` lines) test it once."""
    assert hints_of(load_engines(SHIPPED).death).count("died unexpectedly") == 1
