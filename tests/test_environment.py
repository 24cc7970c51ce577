"""Environment snapshots of real venvs, their diff, the environment log and ExecStart parsing."""

from __future__ import annotations

import platform
import shlex
from pathlib import Path

import pytest
from fakevenv import Venvs, session_venvs

from vllm_supervisor.environment.execstart import interpreter_from_exec_start
from vllm_supervisor.environment.log import EnvironmentLog
from vllm_supervisor.environment.probe import ProbeError, read_nvidia_driver
from vllm_supervisor.environment.serving import is_serving_line
from vllm_supervisor.environment.snapshot import (
    Change,
    ChangeKind,
    EnvSnapshot,
    diff,
    render_changes,
    snapshot,
)
from vllm_supervisor.store import Store

FLASHINFER = ("flashinfer-python", "Flashinfer_Cubin", "ray")


@pytest.fixture(scope="session")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> Venvs:
    return session_venvs(tmp_path_factory)


def snap(python: str = "3.11.7", driver: str | None = None, **packages: str) -> EnvSnapshot:
    """A hand-made snapshot; keyword names use `_` for `-`."""
    named = {k.replace("_", "-"): v for k, v in packages.items()}
    return EnvSnapshot(
        python=python, packages=named, checked=tuple(sorted(named)), nvidia_driver=driver
    )


class TestSnapshot:
    def test_reads_installed_versions_of_a_real_venv(self, venvs: Venvs, tmp_path: Path) -> None:
        """A snapshot has the venv's versions under PEP 503 names, and only installed ones."""
        result = snapshot(venvs["good"], FLASHINFER, nvidia_version_path=tmp_path / "none")
        assert dict(result.packages) == {"flashinfer-cubin": "0.6.3", "flashinfer-python": "0.6.3"}
        assert result.checked == ("flashinfer-cubin", "flashinfer-python", "ray")
        assert result.python == platform.python_version()
        assert result.nvidia_driver is None

    def test_unrunnable_interpreter_raises_probe_error(self, tmp_path: Path) -> None:
        """A missing interpreter is a ProbeError naming it, not an OSError."""
        with pytest.raises(ProbeError, match="missing/python"):
            snapshot(tmp_path / "missing" / "python", FLASHINFER)

    def test_json_round_trip(self) -> None:
        """from_json(to_json()) gives the same snapshot."""
        original = EnvSnapshot(
            python="3.12.1",
            packages={"torch": "2.9.0"},
            checked=("ray", "torch"),
            nvidia_driver="570.86.15",
            executable="/opt/venv/bin/python",
        )
        again = EnvSnapshot.from_json(original.to_json())
        assert again.to_json() == original.to_json()
        assert dict(again.packages) == {"torch": "2.9.0"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # The proprietary module's line.
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 2024\n"
            "GCC version:  gcc version 12.2.0\n",
            "550.54.15",
        ),
        # The open kernel module names its architecture with "for".
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build\n",
            "570.86.15",
        ),
        # No NVRM line: not a driver version file.
        ("GCC version: 12.2.0\n", None),
    ],
)
def test_nvidia_driver_version(tmp_path: Path, text: str, expected: str | None) -> None:
    """The driver version comes from the NVRM line of the version file."""
    path = tmp_path / "version"
    path.write_text(text, encoding="utf-8")
    assert read_nvidia_driver(path) == expected


class TestDiff:
    def test_names_the_upgrade_between_two_real_venvs(self, venvs: Venvs, tmp_path: Path) -> None:
        """flashinfer-python 0.6.3 → 0.6.4 is the only change; cubin is unchanged."""
        no_driver = tmp_path / "none"
        before = snapshot(venvs["good"], FLASHINFER, nvidia_version_path=no_driver)
        after = snapshot(venvs["upgraded"], FLASHINFER, nvidia_version_path=no_driver)
        changes = diff(before, after)
        assert changes == [Change(name="flashinfer-python", before="0.6.3", after="0.6.4")]
        assert render_changes(changes) == "flashinfer-python 0.6.3 → 0.6.4"

    @pytest.mark.parametrize(
        ("before", "after", "expected"),
        [
            # Same environment: nothing to report.
            (snap(torch="2.9.0"), snap(torch="2.9.0"), "no changes"),
            # A package appeared and one disappeared, in name order.
            (
                EnvSnapshot(python="3.11.7", packages={"ray": "2.40.0"}, checked=("ray", "triton")),
                EnvSnapshot(
                    python="3.11.7", packages={"triton": "3.4.0"}, checked=("ray", "triton")
                ),
                "ray removed (was 2.40.0); triton added 3.4.0",
            ),
            # The interpreter and the driver are changes too, listed first.
            (
                snap(python="3.11.7", driver="550.54.15", torch="2.9.0"),
                snap(python="3.12.1", driver="570.86.15", torch="2.9.0"),
                "python 3.11.7 → 3.12.1; nvidia-driver 550.54.15 → 570.86.15",
            ),
        ],
    )
    def test_renders_each_kind(
        self, before: EnvSnapshot, after: EnvSnapshot, expected: str
    ) -> None:
        """Each kind of difference renders on one line."""
        assert render_changes(diff(before, after)) == expected

    def test_kinds(self) -> None:
        """A change knows whether it added, removed or changed a version."""
        kinds = [
            Change(name="a", before=None, after="1").kind,
            Change(name="a", before="1", after=None).kind,
            Change(name="a", before="1", after="2").kind,
        ]
        assert kinds == [ChangeKind.ADDED, ChangeKind.REMOVED, ChangeKind.CHANGED]

    def test_a_name_checked_only_later_is_not_an_addition(self) -> None:
        """Adding a package to the configured list does not report it as newly installed."""
        before = EnvSnapshot(python="3.11.7", packages={}, checked=("torch",))
        after = EnvSnapshot(python="3.11.7", packages={"ray": "2.40.0"}, checked=("ray", "torch"))
        assert diff(before, after) == []


@pytest.fixture
def log(tmp_path: Path) -> EnvironmentLog:
    return EnvironmentLog(Store.in_directory(tmp_path))


class TestEnvironmentLog:
    def test_round_trip_of_one_start(self, log: EnvironmentLog) -> None:
        """The snapshot recorded for an invocation is read back unchanged."""
        log.record_start("vllm.service", "inv1", snap(torch="2.9.0"), 100.0)
        found = log.for_invocation("vllm.service", "inv1")
        assert found is not None
        assert dict(found.packages) == {"torch": "2.9.0"}
        assert log.for_invocation("vllm.service", "other") is None

    def test_last_good_is_the_newest_marked_start(self, log: EnvironmentLog) -> None:
        """Unmarked starts never count; the newest good one wins; units are separate."""
        log.record_start("vllm.service", "inv1", snap(torch="2.8.0"), 100.0)
        assert log.last_good("vllm.service") is None
        log.mark_good("vllm.service", "inv1")
        log.record_start("vllm.service", "inv2", snap(torch="2.9.0"), 200.0)
        log.mark_good("vllm.service", "inv2")
        log.record_start("vllm.service", "inv3", snap(torch="2.10.0"), 300.0)
        good = log.last_good("vllm.service")
        assert good is not None
        assert good.packages["torch"] == "2.9.0"
        assert log.last_good("sglang.service") is None

    def test_changes_since_last_good(
        self, log: EnvironmentLog, venvs: Venvs, tmp_path: Path
    ) -> None:
        """A crashing start reports what changed since the good one before it."""
        no_driver = tmp_path / "none"
        good = snapshot(venvs["good"], FLASHINFER, nvidia_version_path=no_driver)
        bad = snapshot(venvs["upgraded"], FLASHINFER, nvidia_version_path=no_driver)
        log.record_start("vllm.service", "inv1", good, 100.0)
        log.mark_good("vllm.service", "inv1")
        log.record_start("vllm.service", "inv2", bad, 200.0)
        changes = log.changes_since_last_good("vllm.service", "inv2")
        assert render_changes(changes) == "flashinfer-python 0.6.3 → 0.6.4"
        assert log.changes_since_last_good("vllm.service", "inv1") == []

    def test_no_baseline_means_no_changes(self, log: EnvironmentLog) -> None:
        """Without a good start there is nothing to compare with."""
        log.record_start("vllm.service", "inv1", snap(torch="2.9.0"), 100.0)
        assert log.changes_since_last_good("vllm.service", "inv1") == []
        assert log.changes_since_last_good("vllm.service", "unknown") == []

    def test_a_replayed_start_keeps_the_first_snapshot(self, log: EnvironmentLog) -> None:
        """Recording the same invocation again (a journal replay) does not overwrite it."""
        log.record_start("vllm.service", "inv1", snap(torch="2.8.0"), 100.0)
        log.record_start("vllm.service", "inv1", snap(torch="2.9.0"), 500.0)
        found = log.for_invocation("vllm.service", "inv1")
        assert found is not None
        assert found.packages["torch"] == "2.8.0"

    def test_pruning_keeps_the_baseline(self, tmp_path: Path) -> None:
        """Old starts are dropped past `keep`, but never the newest good one."""
        log = EnvironmentLog(Store.in_directory(tmp_path), keep=2)
        log.record_start("vllm.service", "good", snap(torch="2.9.0"), 1.0)
        log.mark_good("vllm.service", "good")
        for index in range(5):
            log.record_start("vllm.service", f"bad{index}", snap(torch="2.10.0"), 10.0 + index)
        assert log.for_invocation("vllm.service", "bad0") is None
        assert log.for_invocation("vllm.service", "bad4") is not None
        good = log.last_good("vllm.service")
        assert good is not None
        assert good.packages["torch"] == "2.9.0"

    def test_survives_reopening_the_database(self, tmp_path: Path) -> None:
        """The table lives in the state database, so a restarted daemon still has its baseline."""
        first = Store.in_directory(tmp_path)
        EnvironmentLog(first).record_start("vllm.service", "inv1", snap(torch="2.9.0"), 1.0)
        EnvironmentLog(first).mark_good("vllm.service", "inv1")
        first.close()
        assert EnvironmentLog(Store.in_directory(tmp_path)).last_good("vllm.service") is not None


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A venv-like tree: an interpreter, console scripts with each shebang style, a binary."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (tmp_path / "usrbin").mkdir()
    scripts = {
        bin_dir / "python": "",
        bin_dir / "vllm": f"#!{bin_dir}/python\nimport sys\n",
        bin_dir / "sglang-serve": "#!/usr/bin/env python3\n",
        bin_dir / "long": f"#!/bin/sh\n'''exec' \"{bin_dir}/python\" \"$0\" \"$@\"\n' '''\n",
        bin_dir / "tool": "#!/bin/bash\necho hi\n",
        tmp_path / "usrbin" / "python3": "",
    }
    for path, text in scripts.items():
        path.write_text(text, encoding="utf-8")
        path.chmod(0o755)
    (bin_dir / "text-generation-launcher").write_bytes(b"\x7fELF\x02\x01\x01\x00")
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # A venv's python running vLLM's module.
        ("{bin}/python -m vllm.entrypoints.openai.api_server --port 8000", "{bin}/python"),
        # SGLang's launcher module, with systemd's "-" prefix (ignore the exit status).
        ("-{bin}/python -m sglang.launch_server --port 30000", "{bin}/python"),
        # A console script names its python in the shebang.
        ("{bin}/vllm serve /models/llama --port 8000", "{bin}/python"),
        # pip's two-line trampoline for a long or spaced interpreter path.
        ("{bin}/long serve", "{bin}/python"),
        # `#!/usr/bin/env python3` is found on the unit's search path.
        ("{bin}/sglang-serve", "{usrbin}/python3"),
        # `env` with assignments and options before the command.
        ("/usr/bin/env -u HOME CUDA_VISIBLE_DEVICES=0,1 {bin}/vllm serve m", "{bin}/python"),
        # `env -S` splits its one argument.
        ("/usr/bin/env -S '{bin}/python -m vllm.entrypoints.openai.api_server'", "{bin}/python"),
        # A shell wrapper that execs the server.
        ("/bin/sh -c 'exec {bin}/vllm serve m --port 8000'", "{bin}/python"),
        # A CPU-pinning wrapper and its options.
        (
            "/usr/bin/taskset -c 0-7 {bin}/python -m vllm.entrypoints.openai.api_server",
            "{bin}/python",
        ),
        # systemd's "@": the second word is argv[0], not a program.
        ("@{bin}/python vllm-server -m vllm.entrypoints.openai.api_server", "{bin}/python"),
        # A bare python name is found on systemd's search path.
        ("python3 -m vllm.entrypoints.openai.api_server", "{usrbin}/python3"),
        # TGI's launcher is a Rust binary: no python.
        ("{bin}/text-generation-launcher --model-id m --port 3000", None),
        # A shell script that runs no python.
        ("{bin}/tool", None),
        # A program that does not exist.
        ("{bin}/missing serve", None),
        # Nothing at all.
        ("", None),
    ],
)
def test_interpreter_from_exec_start(tree: Path, argv: str, expected: str | None) -> None:
    """The interpreter of an ExecStart= line is found through wrappers and shebangs."""
    names = {"bin": str(tree / "venv" / "bin"), "usrbin": str(tree / "usrbin")}
    words = shlex.split(argv.format(**names))
    found = interpreter_from_exec_start(words, search_path=names["usrbin"])
    assert found == (None if expected is None else Path(expected.format(**names)))


@pytest.mark.parametrize(
    ("line", "serving"),
    [
        # uvicorn, as vLLM and SGLang log it.
        ("INFO:     Application startup complete.", True),
        (
            "(APIServer pid=1) INFO 01-01 12:00:00 [launcher.py:46] Uvicorn running on http://0.0.0.0:8000",
            True,
        ),
        # SGLang's own ready line.
        ("[2025-01-01 12:00:00] The server is fired up and ready to roll!", True),
        # TGI's router, with its ANSI colours as journald keeps them.
        (
            "\x1b[2m2025-01-01T12:00:00Z\x1b[0m \x1b[32m INFO\x1b[0m "
            "text_generation_router::server: router/src/server.rs:1851: Connected",
            True,
        ),
        # Loading progress and NCCL's "connected" are not serving.
        ("INFO Loading safetensors checkpoint shards: 50% Completed", False),
        ("NCCL INFO Connected all rings", False),
        ("INFO text_generation_launcher: Shard ready in 8.3s", False),
    ],
)
def test_is_serving_line(line: str, serving: bool) -> None:
    """Only the lines that mean 'answering requests' count as serving."""
    assert is_serving_line(line) is serving
