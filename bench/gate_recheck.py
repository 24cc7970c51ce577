"""What the environment fingerprint costs: taken at a halt, taken again by the gate.

`python -m bench.gate_recheck [--runs N] [--packages P]` builds a real venv (`python -m venv
--without-pip`) holding P distributions (default 300, dist-info directories as pip leaves them),
a unit file, two drop-ins and an environment file, and times, N times each (interleaved, the
median and p90 reported):

- `take`: the halt's fingerprint of those files (systemd's answer given, not asked);
- `recheck`: the gate's comparison of a recorded fingerprint with now, nothing changed;
- `refusal` against `refusal_baseline`: the gate's whole check of the quarantine directory
  (`gate_main`, in process) with a record that has the fingerprint and with the same record
  without it, as before the fingerprint existed; the ratio is the one to read.

The gate also asks systemd for the unit's loaded settings (D-Bus). `--nspawn` runs the same
inside the end-to-end tests' container (systemd 252 in systemd-nspawn, tests/e2e/served.py), where
the fingerprint is of the real served unit, `refusal` includes that D-Bus round trip, and
`systemd_settings` times it alone. Without a system bus (`--nspawn` not given) the gate's ask
fails at once and `refusal` has no D-Bus part: read `--nspawn`'s figures for the gate's cost.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.exit_latency import E2E, unavailable
from vllm_supervisor.actions.evidence import GATE_SYSTEMD_TIMEOUT_S, changed
from vllm_supervisor.actions.quarantine import Quarantine
from vllm_supervisor.actions.unitsettings import ask_unit_settings
from vllm_supervisor.commands.demo import make_venv, site_packages, write_dist
from vllm_supervisor.commands.gate import EXIT_QUARANTINED, gate_main
from vllm_supervisor.environment.fingerprint import UnitSettings, take

UNIT = "vllm.service"
# The served unit's extra drop-in in the container: an environment file, as on a real host.
ENV_FILE = "/etc/default/vllm"
DROP_IN = f"/etc/systemd/system/{UNIT}.d/60-bench-env.conf"
IN_CONTAINER_PATH = "/run/bench-path"  # `vllm_supervisor` -> the bound checkout, for imports


def never_hidden(path: str) -> str | None:
    return None


def served_venv(root: Path, packages: int) -> Path:
    """A venv with `packages` distributions; its interpreter."""
    python = make_venv(root / "venv", (("flashinfer-cubin", "0.6.3", ()),))
    site = site_packages(root / "venv")
    for index in range(packages - 1):
        write_dist(site, f"package-{index:03d}", f"1.{index}.0")
    return python


def local_settings(root: Path) -> UnitSettings:
    """Unit files as real files, and what systemd would report for them (no systemd here)."""
    fragment = root / "vllm.service"
    drop_ins = [root / "vllm.service.d" / "10-vllm-supervisor.conf", root / "vllm.service.d" / "x"]
    env = root / "vllm.env"
    drop_ins[0].parent.mkdir()
    fragment.write_text("[Service]\nExecStart=/opt/venv/bin/vllm serve m --port 8000\n")
    for path in drop_ins:
        path.write_text("[Service]\nExecCondition=+/usr/local/bin/vllm-supervisor gate %n\n")
    env.write_text("VLLM_USE_FLASHINFER_SAMPLER=1\nHF_HOME=/srv/hf\n")
    return UnitSettings(
        exec_start=(("/opt/venv/bin/vllm", "/opt/venv/bin/vllm", "serve", "m"),),
        environment=("VLLM_LOGGING_LEVEL=INFO",),
        environment_files=(str(env),),
        unit_files=(str(fragment), *map(str, drop_ins)),
    )


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": round(statistics.median(ordered), 3),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 3),
        "min_ms": round(ordered[0], 3),
        "max_ms": round(ordered[-1], 3),
    }


def measure(runs: int, packages: int, *, unit_settings: UnitSettings | None) -> dict[str, Any]:
    """The figures on this machine; `unit_settings` None: ask systemd (inside the container)."""
    with tempfile.TemporaryDirectory(prefix="vllm-supervisor-gate-") as tmp:
        root = Path(tmp)
        python = served_venv(root, packages)
        asked = unit_settings is None
        settings = ask_unit_settings(UNIT, timeout_s=5.0) if asked else unit_settings
        if settings is None:
            raise SystemExit(f"systemd did not report {UNIT}'s settings")
        record = {
            "signature": "flashinfer_cubin_mismatch",
            "environment": take(interpreter=python, settings=settings, hidden=never_hidden),
        }
        bare = {key: value for key, value in record.items() if key != "environment"}
        with_fingerprint, without = root / "with", root / "without"
        Quarantine(with_fingerprint / "quarantine").write(UNIT, record)
        Quarantine(without / "quarantine").write(UNIT, bare)

        def refusal(base: Path) -> None:
            code = gate_main(UNIT, base, base / "state", wait_s=1.0, out=io.StringIO(), defaults=())
            assert code == EXIT_QUARANTINED, "the gate let the start through: nothing changed"

        def recheck() -> None:
            assert changed(record, unit=UNIT, settings=lambda unit: settings) is None

        cases: dict[str, Callable[[], object]] = {
            "take": lambda: take(interpreter=python, settings=settings, hidden=never_hidden),
            "recheck": recheck,
            "refusal": lambda: refusal(with_fingerprint),
            "refusal_baseline": lambda: refusal(without),
        }
        if asked:
            cases["systemd_settings"] = lambda: ask_unit_settings(
                UNIT, timeout_s=GATE_SYSTEMD_TIMEOUT_S
            )
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(runs):  # interleaved: a busy moment of the shared machine hits all alike
            for name, case in cases.items():
                samples[name].append(timed(case))
        found = {name: summary(values) for name, values in samples.items()}
        return {
            "packages": packages,
            "runs": runs,
            "systemd_asked": asked,
            "record_bytes": Quarantine(with_fingerprint / "quarantine").path(UNIT).stat().st_size,
            "record_bytes_baseline": Quarantine(without / "quarantine").path(UNIT).stat().st_size,
            **found,
            "refusal_ratio": round(
                found["refusal"]["median_ms"] / found["refusal_baseline"]["median_ms"], 2
            ),
        }


def measure_in_container(runs: int, packages: int) -> dict[str, Any]:
    """The same, inside the e2e container, with the real served unit and its systemd."""
    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"--nspawn: {reason}")
    from served import SEED_LOG, SITE, deployed_container, install_served_unit

    with (
        tempfile.TemporaryDirectory(prefix="vllm-supervisor-gate-") as tmp,
        deployed_container(Path(tmp)) as box,
    ):
        box.write_file(ENV_FILE, "VLLM_USE_FLASHINFER_SAMPLER=1\n")
        box.write_file(DROP_IN, f"[Service]\nEnvironmentFile=-{ENV_FILE}\n")
        install_served_unit(box, SEED_LOG, "30s")
        return _run_inside(box, runs, packages, SITE)


def _run_inside(box: Any, runs: int, packages: int, site: str) -> dict[str, Any]:
    box.run("mkdir", "-p", IN_CONTAINER_PATH)
    box.run("ln", "-sfn", "/opt/vsup/src/supervisor", f"{IN_CONTAINER_PATH}/vllm_supervisor")
    done = box.run(
        "env",
        "LD_LIBRARY_PATH=/opt/vsup/python/lib",
        f"PYTHONPATH={IN_CONTAINER_PATH}:/opt/vsup/src:/opt/vsup/e2e:{site}",
        "PYTHONDONTWRITEBYTECODE=1",
        "/opt/vsup/python/bin/python3",
        "-m",
        "bench.gate_recheck",
        "--inside",
        f"--runs={runs}",
        f"--packages={packages}",
        timeout=600,
    )
    return dict(json.loads(done.stdout))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gate_recheck", description=__doc__)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--packages", type=int, default=300)
    parser.add_argument("--nspawn", action="store_true", help="also inside systemd 252 (root)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        print(json.dumps(measure(args.runs, args.packages, unit_settings=None)))
        return 0
    if str(E2E) not in sys.path:
        sys.path.insert(0, str(E2E))
    with tempfile.TemporaryDirectory() as tmp:
        result: dict[str, Any] = {
            "here": measure(args.runs, args.packages, unit_settings=local_settings(Path(tmp)))
        }
    if args.nspawn:
        result["nspawn"] = measure_in_container(args.runs, args.packages)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
