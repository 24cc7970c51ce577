"""The kernel's Xid joined to the engine crash it caused (issue 35).

Real journal files (systemd-journal-remote writes them), the kernel's lines with journald's
own kernel transport, read by `triage` exactly as the daemon reads: a GPU that fell off the bus
(Xid 79) while serving is the root cause of the `unspecified launch failure` and halted at the
1st crash; a contained ECC error (Xid 94), where NVIDIA says restart the application, is named
and restarted; an illegal memory access with no Xid, or an Xid 79 of another boot an hour
before a start-up `ValueError`, names no Xid. The same lines written by the unit (stdout) or by
root through /dev/kmsg (a user facility) are never the kernel's.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from conftest import wait_for
from faults.harness import Supervisor, write_config
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.actions.evidence import cause_gone, current_boot_id, evidence_of
from vllm_supervisor.classify.table import load_table
from vllm_supervisor.classify.xid import load_xid_catalog, parse_xid
from vllm_supervisor.commands.triage import collect
from vllm_supervisor.config import Config, UnitConfig
from vllm_supervisor.errors import ConfigError
from vllm_supervisor.journal.writer import (
    FieldValue,
    JournalWriter,
    exit_entries,
    restart_entries,
    service_lines,
    start_entries,
)
from vllm_supervisor.model import Action, Outcome, Rule

UNIT = "vllm.service"
QUARANTINE = Path("run") / "quarantine" / "vllm.service.json"
CONFIG = Config(units=(UnitConfig(name=UNIT),))
# The journal writer's clock never goes back: the runs start an hour from now.
T0 = int(time.time() * 1e6) + 3_600_000_000
PCI = "0000:3b:00"
SERVING = [
    "INFO 12-05 10:00:00 [api_server.py:1885] vLLM API server version 0.11.0",
    "INFO:     Application startup complete.",
    "INFO:     Uvicorn running on http://0.0.0.0:8000 (Press CTRL+C to quit)",
]
LAUNCH_FAILURE = [
    "(EngineCore_DP0 pid=812) ERROR 12-05 10:05:02 [core.py:710] EngineCore encountered a fatal "
    "error.",
    "(EngineCore_DP0 pid=812) ERROR 12-05 10:05:02 [core.py:710] Traceback (most recent call "
    "last):",
    '(EngineCore_DP0 pid=812) ERROR 12-05 10:05:02 [core.py:710]   File "/opt/venv/lib/python3.12'
    '/site-packages/vllm/v1/worker/gpu_model_runner.py", line 1730, in execute_model',
    "(EngineCore_DP0 pid=812) ERROR 12-05 10:05:02 [core.py:710] RuntimeError: CUDA error: "
    "unspecified launch failure",
]
ECC = [*LAUNCH_FAILURE[:-1], LAUNCH_FAILURE[-1].replace(
    "unspecified launch failure", "uncorrectable ECC error encountered")]  # fmt: skip
ILLEGAL = [*LAUNCH_FAILURE[:-1], LAUNCH_FAILURE[-1].replace(
    "unspecified launch failure", "an illegal memory access was encountered")]  # fmt: skip
NO_DEVICE = [
    "INFO 12-05 10:06:00 [api_server.py:1885] vLLM API server version 0.11.0",
    "RuntimeError: No CUDA GPUs are available",
]
VALUE_ERROR = [
    "INFO 12-05 10:00:00 [api_server.py:1885] vLLM API server version 0.11.0",
    "ValueError: The model's max seq len (32768) is larger than the maximum number of tokens "
    "that can be stored in KV cache (16384).",
]


def xid_line(code: int, detail: str) -> str:
    return f"NVRM: Xid (PCI:{PCI}): {code}, pid=812, name=python3, {detail}"


def kernel(text: str, at_us: int, **fields: FieldValue) -> dict[str, FieldValue]:
    """A line as journald stores the kernel's: its own transport, the kern facility."""
    return {
        "_TRANSPORT": "kernel",
        "SYSLOG_FACILITY": 0,
        "SYSLOG_IDENTIFIER": "kernel",
        "PRIORITY": 4,
        "MESSAGE": text,
        "__REALTIME_TIMESTAMP": at_us,
        **fields,
    }


def run(lines: list[str], start_us: int, end_us: int, *, restarts: int = 0) -> list[dict]:  # type: ignore[type-arg]
    """One invocation of the unit: started at `start_us`, its lines, ended at `end_us`."""
    inv = uuid.uuid4().hex
    entries: list[dict[str, FieldValue]] = []
    for entry in start_entries(UNIT, inv):
        entries.append({**entry, "__REALTIME_TIMESTAMP": start_us})
    step = max(1, (end_us - start_us) // (len(lines) + 1))
    for n, entry in enumerate(service_lines(UNIT, inv, lines, pid=812)):
        entries.append({**entry, "__REALTIME_TIMESTAMP": start_us + step * (n + 1)})
    for entry in [*exit_entries(UNIT, inv, 1), *restart_entries(UNIT, inv, restarts + 1)]:
        entries.append({**entry, "__REALTIME_TIMESTAMP": end_us})
    return entries


def triaged(tmp_path: Path, entries: list[dict]) -> list[Outcome]:  # type: ignore[type-arg]
    with JournalWriter(tmp_path / "journal") as writer:
        writer.write(entries)
    return collect(str(tmp_path / "journal"), config=CONFIG, table=load_table(CONFIG))


def test_a_gpu_that_fell_off_the_bus_is_the_root_cause_and_halted(tmp_path: Path) -> None:
    fault = T0 + 300_000_000
    inv = run([*SERVING, *LAUNCH_FAILURE], T0, fault + 3_000_000)
    for n, entry in enumerate(inv[5:9]):  # the engine's error, 2 s after the fault
        entry["__REALTIME_TIMESTAMP"] = fault + 2_000_000 + n
    # The fault in the kernel's log, between the serving lines and the engine's error.
    entries = [*inv[:5], kernel(xid_line(79, "GPU has fallen off the bus."), fault),
               kernel(f"NVRM: GPU {PCI}.0: GPU has fallen off the bus.", fault + 1),
               *inv[5:]]  # fmt: skip
    later = run(NO_DEVICE, fault + 600_000_000, fault + 630_000_000, restarts=1)
    first, *rest = triaged(tmp_path, [*entries, *later])
    assert first.verdict.root_cause is not None and "Xid (PCI:0000:3b:00): 79" in (
        first.verdict.root_cause
    )
    assert first.verdict.captures["xid"] == "79" and first.verdict.captures["pci"] == PCI
    assert any("unspecified launch failure" in n for n in first.verdict.notes)
    assert (first.decision.action, first.decision.rule) == (Action.HALT, Rule.GPU_XID)
    assert "reboot the node" in (first.verdict.remediation or "")
    # A start 10 minutes on (a person's) that finds no device: outside the window, not joined.
    assert rest and all("Xid" not in (o.verdict.root_cause or "") for o in rest), [
        (o.verdict.root_cause, o.invocation.ended_us) for o in rest
    ]
    record = evidence_of(first)
    assert record is not None and record["kind"] == "gpu_xid" and record["xid"] == "79"


def test_a_contained_ecc_error_is_named_and_restarted(tmp_path: Path) -> None:
    fault = T0 + 300_000_000
    inv = run([*SERVING, *ECC], T0, fault + 3_000_000)
    for n, entry in enumerate(inv[5:9]):
        entry["__REALTIME_TIMESTAMP"] = fault + 2_000_000 + n
    line = xid_line(94, "Contained: SM (0x1). RST: No, D-RST: No")
    [outcome] = triaged(tmp_path, [*inv[:5], kernel(line, fault), *inv[5:]])
    assert "): 94" in (outcome.verdict.root_cause or "")
    assert (outcome.decision.action, outcome.decision.rule) == (Action.ALLOW_RESTART, Rule.GPU_XID)


def test_no_xid_anywhere_names_no_xid(tmp_path: Path) -> None:
    [outcome] = triaged(tmp_path, run([*SERVING, *ILLEGAL], T0, T0 + 300_000_000))
    assert "Xid" not in (outcome.verdict.root_cause or "")
    assert outcome.decision.rule is not Rule.GPU_XID


def test_an_xid_of_another_boot_an_hour_before_is_never_joined(tmp_path: Path) -> None:
    old_boot = "a" * 32
    fault = kernel(xid_line(79, "GPU has fallen off the bus."), T0, _BOOT_ID=old_boot)
    later = T0 + 3_600_000_000
    [outcome] = triaged(tmp_path, [fault, *run(VALUE_ERROR, later, later + 5_000_000)])
    assert "Xid" not in (outcome.verdict.root_cause or "")
    assert "max seq len" in (outcome.verdict.root_cause or "")


@pytest.mark.parametrize(
    "forged",
    [
        {"_TRANSPORT": "stdout"},  # the unit printed it
        {"SYSLOG_FACILITY": 1},  # root wrote it to /dev/kmsg (the kernel forces a user facility)
    ],
)
def test_an_xid_line_not_the_kernels_own_is_not_joined(
    tmp_path: Path, forged: dict[str, FieldValue]
) -> None:
    fault = T0 + 300_000_000
    inv = run([*SERVING, *LAUNCH_FAILURE], T0, fault + 3_000_000)
    for n, entry in enumerate(inv[5:9]):
        entry["__REALTIME_TIMESTAMP"] = fault + 2_000_000 + n
    line = {**kernel(xid_line(79, "GPU has fallen off the bus."), fault), **forged}
    [outcome] = triaged(tmp_path, [*inv[:5], line, *inv[5:]])
    assert outcome.decision.rule is not Rule.GPU_XID


# --- the catalog and the line ------------------------------------------------------------------


def test_the_shipped_catalog_lists_what_the_issue_names() -> None:
    catalog = load_xid_catalog()
    wanted = {13, 31, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109, 119, 120, 140,
              154}  # fmt: skip
    assert wanted <= set(catalog.codes())
    for code in catalog.codes():
        entry = catalog.get(code)
        assert entry is not None and entry.source.startswith("https://docs.nvidia.com/")
    assert not catalog.get(79).restart_helps  # type: ignore[union-attr]
    assert catalog.get(94).restart_helps  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[[xid]]\ncode = 79\nmeaning = "m"\naction = "explode"\nsource = "https://x"\n',
         "xid[0].action: must be one of"),
        ('[[xid]]\ncode = 79\nmeaning = "m"\naction = "reboot"\n', "xid[0].source: missing"),
        ('[[xid]]\ncode = "79"\nmeaning = "m"\naction = "reboot"\nsource = "https://x"\n',
         "xid[0].code: must be a int"),
        ("[[xid]]\ncode = 79\nmeaning = 'm'\naction = 'reboot'\nsource = 'https://x'\n" * 2,
         "xid[1].code: 79 listed twice"),
        ("[[signature]]\n", "unknown top-level key(s) ['signature']"),
        ("[[xid]\n", "invalid TOML"),
    ],
)  # fmt: skip
def test_a_bad_catalog_is_one_line_naming_the_file_and_key(
    tmp_path: Path, text: str, error: str
) -> None:
    path = tmp_path / "xid.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_xid_catalog(path)
    assert str(info.value).startswith(str(path)) and error in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "pci", "code"),
    [
        ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.",
         "0000:3b:00", 79),
        ("NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.", "0000:2b:00", 79),
        ("NVRM: Xid (0000:01:00): 13, Graphics SM Warp Exception on (GPC 0, TPC 1)",
         "0000:01:00", 13),
        ("[  269.5] NVRM: Xid (PCI:0000:CA:00): 94, pid='<unknown>', name=<unknown>, Contained",
         "0000:ca:00", 94),
        ("NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9).",
         "0000:01:00", 94),
    ],
)  # fmt: skip
def test_the_drivers_formats(text: str, pci: str, code: int) -> None:
    found = parse_xid(text)
    assert found is not None and (found.pci, found.code) == (pci, code)
    assert found.text.startswith("NVRM: Xid")


def test_the_drivers_probe_finding_a_gpu_gone_is_xid_79() -> None:
    """At load the driver says a GPU fell off the bus in one record of three lines, no Xid
    number: the same fault as Xid 79, on that GPU."""
    record = (
        "NVRM: The NVIDIA GPU 0000:b3:00.0\nNVRM: (PCI ID: 10de:26b5) installed in this system "
        "has\nNVRM: fallen off the bus and is not responding to commands."
    )
    found = parse_xid(record)
    assert found is not None and (found.pci, found.code) == ("0000:b3:00.0", 79)
    assert "\n" not in found.text and found.text.startswith("NVRM: The NVIDIA GPU")
    assert parse_xid("NVRM: The NVIDIA probe routine failed for 1 device(s).") is None


def test_xid_45_names_the_fault_it_follows() -> None:
    found = parse_xid(xid_line(45, "Ch 00000001 caused by previous Xid 149"))
    assert found is not None and (found.code, found.follows, found.cause) == (45, 149, 149)
    alone = parse_xid(xid_line(45, "Ch 00000001"))
    assert alone is not None and (alone.follows, alone.cause) == (None, 45)


@pytest.mark.parametrize(
    ("detail", "action"),
    [("Ch 00000001 caused by previous Xid 149", Action.HALT), ("Ch 00000001", None)],
)
def test_xid_45_is_decided_as_the_xid_it_follows(
    tmp_path: Path, detail: str, action: Action | None
) -> None:
    """Xid 45 is the driver cleaning up after a fault: after NVLink 5's Xid 149 the GPU needs
    a reset (halted at the 1st crash); on its own it says nothing a restart cannot fix."""
    fault = T0 + 300_000_000
    inv = run([*SERVING, *LAUNCH_FAILURE], T0, fault + 3_000_000)
    for n, entry in enumerate(inv[5:9]):
        entry["__REALTIME_TIMESTAMP"] = fault + 2_000_000 + n
    [outcome] = triaged(tmp_path, [*inv[:5], kernel(xid_line(45, detail), fault), *inv[5:]])
    assert "): 45" in (outcome.verdict.root_cause or "")
    assert outcome.decision.rule is Rule.GPU_XID
    if action is Action.HALT:
        assert outcome.decision.action is Action.HALT
        assert outcome.verdict.captures["xid"] == "149"
    else:
        assert outcome.decision.action is not Action.HALT


@given(st.text(max_size=300))
def test_any_kernel_line_parses_or_is_none(text: str) -> None:
    found = parse_xid(text)
    assert found is None or (0 <= found.code < 10000 and found.text.startswith("NVRM:"))


def test_a_reboot_lifts_the_gpu_halt() -> None:
    now = current_boot_id()
    assert now is not None
    record = {"evidence": {"kind": "gpu_xid", "xid": "79", "pci": PCI, "boot_id": now}}
    assert cause_gone(record) is None
    record["evidence"]["boot_id"] = "b" * 32  # recorded in an earlier boot
    assert "rebooted" in (cause_gone(record) or "")


# --- the daemon, live ----------------------------------------------------------------------------


def test_the_daemon_joins_the_kernels_xid_live_halts_and_counts_it(tmp_path: Path) -> None:
    """A `run` child following a journal directory: the Xid 79 the kernel logged just before
    the engine's launch failure is read (at once, for a crash that speaks of the GPU), the
    crash halted at the 1st, its record keeps the GPU and the boot, and the Xid is counted."""
    config = write_config(tmp_path)
    sup = Supervisor(tmp_path, config)
    sup.start()
    now = int(time.time() * 1e6)
    inv = run([*SERVING, *LAUNCH_FAILURE], now, now + 3_000_000)
    for n, entry in enumerate(inv[5:]):
        entry["__REALTIME_TIMESTAMP"] = now + 2_500_000 + n
    fault = kernel(xid_line(79, "GPU has fallen off the bus."), now + 2_000_000)
    try:
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write([*inv[:5], fault, *inv[5:]])
            wait_for(lambda: (tmp_path / QUARANTINE).exists(), what="the halt")
        record = json.loads((tmp_path / QUARANTINE).read_text())
        assert record["evidence"]["kind"] == "gpu_xid" and record["evidence"]["xid"] == "79"
        assert record["evidence"]["boot_id"] == current_boot_id()
        assert "Xid" in record["reason"] or "Xid" in json.dumps(record)

        def counted() -> bool:
            port = [e for e in sup.events() if e.get("event") == "metrics_listening"][-1]["port"]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
            return 'vllm_supervisor_gpu_xid_total{pci="0000:3b:00",xid="79"} 1.0' in text

        wait_for(counted, what="the Xid counted")
    finally:
        assert sup.terminate() == 0, sup.stderr_text()
