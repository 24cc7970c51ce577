"""The libsystemd reader program's command line (`journal_reader.c`, run as the reader child).

The daemon builds its argv (`reader.native_argv`); these check what the program does with any
other: a usage error with exit 2 that names the bad word, journalctl's wording and exit 1 when the
journal cannot be read, never a crash.
"""

from __future__ import annotations

import dataclasses
import select
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_supervisor.app import reader_settings
from vllm_supervisor.config import load_config
from vllm_supervisor.errors import ConfigError
from vllm_supervisor.journal.reader import NATIVE_READER, ReaderSettings, native_argv, native_input
from vllm_supervisor.journal.writer import JournalWriter, service_lines

UNIT = "vllm.service"


def run(
    *args: str, timeout: float = 10.0, stdin: bytes = b""
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [str(NATIVE_READER), *args], input=stdin, capture_output=True, timeout=timeout
    )


class TestCommandLine:
    def test_an_unknown_option_is_a_usage_error_naming_it(self) -> None:
        result = run("--no-such-option")
        assert result.returncode == 2
        assert b"unknown or incomplete option: --no-such-option" in result.stderr
        assert result.stderr.startswith(b"usage: vllm-supervisor-journal-reader")

    def test_a_linger_out_of_range_is_refused(self) -> None:
        result = run("--linger-ms=1001")
        assert result.returncode == 2
        assert b"--linger-ms must be within 0..1000: 1001" in result.stderr

    def test_an_unknown_start_is_refused(self) -> None:
        result = run("--start=middle")
        assert result.returncode == 2
        assert b"--start must be head, tail or last: middle" in result.stderr

    def test_a_stray_argument_is_refused(self) -> None:
        result = run("--lines", "vllm.service")
        assert result.returncode == 2
        assert b"unexpected argument: vllm.service" in result.stderr

    def test_a_short_option_is_named_as_given(self) -> None:
        result = run("--lines", "-xy")
        assert b"unknown or incomplete option: -x" in result.stderr

    def test_a_unit_name_too_long_on_stdin_is_a_usage_error(self, tmp_path: Path) -> None:
        result = subprocess.run(
            [str(NATIVE_READER), f"--directory={tmp_path}", "--units-from-stdin"],
            input=b"vllm.service\n" + b"x" * 5000 + b"\n\n",
            capture_output=True,
            timeout=10,
        )
        assert result.returncode == 2
        assert b"error: a unit name on stdin is too long: xxxx" in result.stderr

    def test_any_data_threshold_the_daemon_may_ask_is_taken(self, tmp_path: Path) -> None:
        """max_line_chars has no upper bound in the config: neither has the threshold."""
        result = run(f"--directory={tmp_path}", "--data-threshold=1099511627776")
        assert result.returncode == 0, result.stderr

    def test_a_reader_that_goes_away_ends_it_cleanly(self, tmp_path: Path) -> None:
        """Its stdout closed after a few bytes: exit 0 (EPIPE), not death by SIGPIPE."""
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(service_lines(UNIT, "a" * 32, [f"line {i}" * 20 for i in range(20000)]))
        settings = ReaderSettings(directory=tmp_path / "journal", follow=False)
        child = subprocess.Popen(native_argv(settings, None), stdout=subprocess.PIPE)
        assert child.stdout is not None
        assert child.stdout.read(100)
        child.stdout.close()
        assert child.wait(timeout=10) == 0

    def test_a_missing_file_fails_as_journalctl_does(self, tmp_path: Path) -> None:
        result = run(f"--file={tmp_path / 'gone.journal'}")
        assert result.returncode == 1
        assert result.stderr.startswith(b"Failed to open journal: ")

    def test_the_daemons_argv_reads_the_lines_of_its_unit(self, tmp_path: Path) -> None:
        """Read once with the argv the daemon builds: each message of the unit, in order."""
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(service_lines(UNIT, "a" * 32, ["first line", "second line"], pid=4000))
            writer.write(service_lines("other.service", "b" * 32, ["not ours"], pid=4001))
        settings = ReaderSettings(units=(UNIT,), directory=tmp_path / "journal", follow=False)
        argv = native_argv(settings, None)
        result = subprocess.run(
            argv, input=native_input(settings), capture_output=True, timeout=10, check=True
        )
        assert b"first line" in result.stdout
        assert result.stdout.index(b"first line") < result.stdout.index(b"second line")
        assert b"not ours" not in result.stdout


WORDS = st.sampled_from(
    [
        "--directory",
        "--file",
        "--unit",
        "--field",
        "--cursor",
        "--start",
        "--data-threshold",
        "--linger-ms",
        "--lines",
        "--start=tail",
        "--start=last",
        "--start=",
        "--linger-ms=-1",
        "--linger-ms=99999999999999999999",
        "--data-threshold=x",
        "--cursor=s=0;i=1",
        "--cursor=",
        "--field=MESSAGE",
        "--unit=vllm.service",
        "--units-from-stdin",
        "--",
        "-",
        "-x",
        "",
    ]
)


@settings(max_examples=60, deadline=None)
@given(words=st.lists(WORDS | st.text(max_size=12), max_size=8))
def test_no_command_line_crashes_it(words: list[str]) -> None:
    """Any argv (but --follow, which waits for changes) ends with 0, 1 or 2, never a signal;
    the empty directory given first keeps it off the host's journal."""
    empty = Path("/nonexistent-vllm-supervisor-test-journal")
    words = [w.replace("\0", "") for w in words]
    result = run(f"--directory={empty}", *words)
    assert result.returncode in (0, 1, 2), (words, result.returncode, result.stderr[-500:])
    if result.returncode == 2:
        assert b"vllm-supervisor-journal-reader: error: " in result.stderr


@settings(max_examples=60, deadline=None)
@given(
    names=st.lists(st.binary(max_size=40), max_size=20),
    rest=st.binary(max_size=60),
    follow=st.booleans(),
)
def test_no_unit_list_on_stdin_crashes_it(
    tmp_path_factory: pytest.TempPathFactory, names: list[bytes], rest: bytes, follow: bool
) -> None:
    """Any unit names (any bytes, empty, repeated) and anything after the list's end, read once
    or followed: it runs (exit 0 at the end, or once we close its stdout), never a signal."""
    empty = tmp_path_factory.mktemp("empty")
    stdin = b"".join(n.replace(b"\n", b"") + b"\n" for n in names) + b"\n" + rest
    args = [f"--directory={empty}", "--units-from-stdin", "--lines", "--field=MESSAGE"]
    if not follow:
        result = run(*args, stdin=stdin)
        assert result.returncode == 0, result.stderr[-500:]
        return
    child = subprocess.Popen(
        [str(NATIVE_READER), *args, "--follow", "--start=head"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert child.stdin is not None and child.stdout is not None
    # A sync request larger than any number `rest` may hold: its answer says the list was read.
    child.stdin.write(stdin + b"\n%d\n" % (2**63 - 1))
    child.stdin.flush()
    ready, _, _ = select.select([child.stdout], [], [], 10)
    answer = child.stdout.readline() if ready else b""
    child.stdout.close()
    child.stdin.close()
    assert child.wait(timeout=10) == 0
    assert answer == b"#%d\n" % (2**63 - 1)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(chars=st.integers(1, 2**70) | st.sampled_from([16384, 2**61, 2**62, 2**63]))
def test_a_line_length_the_config_accepts_is_one_the_reader_takes(
    tmp_path: Path, chars: int
) -> None:
    """`tracker.max_line_chars` becomes the child's --data-threshold: any value check-config
    lets through must be one the child takes, or the daemon starts blind, restarting it."""
    path = tmp_path / "supervisor.toml"
    path.write_text(f"[tracker]\nmax_line_chars = {chars}\n", encoding="utf-8")
    try:
        config = load_config(path)
    except ConfigError:
        return
    settings_ = dataclasses.replace(
        reader_settings(config), directory=tmp_path / "no-journal", follow=False, units=()
    )
    result = run(*native_argv(settings_, None)[1:])
    assert result.returncode != 2, result.stderr[-300:]
