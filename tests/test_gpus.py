"""A unit's own GPUs, from its CUDA_VISIBLE_DEVICES and the driver's table: an Xid of another
unit's GPU next to this unit's crash is not its cause; where the GPUs cannot be known for sure,
every Xid of the host joins as before."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

from corpus_judge import failed_invocation
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.classify.table import load_table
from vllm_supervisor.classify.xid import load_xid_catalog
from vllm_supervisor.config import Config, UnitConfig
from vllm_supervisor.decide.xid_evidence import XidEvidence
from vllm_supervisor.environment.gpus import (
    device_key,
    driver_gpus,
    gpus_asked_about,
    unit_gpus,
)
from vllm_supervisor.journal.kernel import KernelLine
from vllm_supervisor.model import Evidence, Phase
from vllm_supervisor.pipeline import Pipeline

# The driver's `information` file, as 535-570 drivers print it.
INFORMATION = """Model: \t\t {model}
IRQ:   \t\t 231
GPU UUID: \t {uuid}
Video BIOS: \t 92.00.9e.00.03
Bus Type: \t PCIe
DMA Size: \t 47 bits
DMA Mask: \t 0x7fffffffffff
Bus Location: \t {pci}
Device Minor: \t {minor}
GPU Firmware: \t N/A
GPU Excluded:\t No
"""
H100 = "NVIDIA H100 80GB HBM3"
A10 = "NVIDIA A10"
PCIS = ("0000:18:00.0", "0000:3b:00.0", "0000:86:00.0", "0000:af:00.0")


def driver_table(root: Path, models: tuple[str, ...] = (H100,) * 4) -> Path:
    """A /proc/driver/nvidia/gpus tree of four GPUs, in the driver's own format."""
    for minor, (pci, model) in enumerate(zip(PCIS, models, strict=True)):
        gpu = root / pci
        gpu.mkdir(parents=True)
        uuid = f"GPU-{minor:08x}-aaaa-bbbb-cccc-{minor:012x}"
        (gpu / "information").write_text(
            INFORMATION.format(model=model, uuid=uuid, pci=pci, minor=minor)
        )
    return root


class TestWhichGpus:
    def test_uuids_map_for_sure(self, tmp_path: Path) -> None:
        gpus = driver_gpus(driver_table(tmp_path))
        env = ["CUDA_VISIBLE_DEVICES=GPU-00000002-aaaa-bbbb-cccc-000000000002"]
        assert unit_gpus(env, gpus) == {"0000:86:00"}

    def test_indexes_map_in_bus_order_on_a_host_of_one_model(self, tmp_path: Path) -> None:
        gpus = driver_gpus(driver_table(tmp_path))
        assert unit_gpus(["CUDA_VISIBLE_DEVICES=2,3"], gpus) == {"0000:86:00", "0000:af:00"}

    def test_a_mixed_host_needs_the_bus_order_said(self, tmp_path: Path) -> None:
        gpus = driver_gpus(driver_table(tmp_path, (H100, A10, H100, A10)))
        assert unit_gpus(["CUDA_VISIBLE_DEVICES=1"], gpus) is None  # fastest first: unknown
        said = ["CUDA_DEVICE_ORDER=PCI_BUS_ID", "CUDA_VISIBLE_DEVICES=1"]
        assert unit_gpus(said, gpus) == {"0000:3b:00"}

    def test_what_cannot_be_mapped_is_unknown(self, tmp_path: Path) -> None:
        gpus = driver_gpus(driver_table(tmp_path))
        for env in (
            [],
            ["CUDA_VISIBLE_DEVICES="],
            ["CUDA_VISIBLE_DEVICES=-1"],
            ["CUDA_VISIBLE_DEVICES=MIG-4f0e6d5b-xxxx"],
            ["CUDA_VISIBLE_DEVICES=7"],  # past the host's GPUs
            ["CUDA_VISIBLE_DEVICES=GPU-ffffffff-0000"],  # a GPU this host does not have
        ):
            assert unit_gpus(env, gpus) is None, env
        assert unit_gpus(["CUDA_VISIBLE_DEVICES=0"], {}) is None  # no driver table

    def test_the_last_assignment_wins_as_systemds(self, tmp_path: Path) -> None:
        gpus = driver_gpus(driver_table(tmp_path))
        env = ["CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES=1"]
        assert unit_gpus(env, gpus) == {"0000:3b:00"}

    def test_an_xid_address_and_the_tables_agree(self) -> None:
        assert device_key("0000:3B:00.0") == device_key("3b:00") == "0000:3b:00"

    def test_no_table_is_no_gpus(self, tmp_path: Path) -> None:
        assert driver_gpus(tmp_path / "absent") == {}

    def test_a_gpu_gone_from_the_table_leaves_the_mapping_unknown(self, tmp_path: Path) -> None:
        """A GPU that fell off the bus may leave the driver's table: the indexes after it
        would then name the wrong GPUs, so nothing is restricted (the Xid joins as before)."""
        gpus = driver_gpus(driver_table(tmp_path))
        env = ["CUDA_VISIBLE_DEVICES=2,3"]
        assert gpus_asked_about(env, gpus, "0000:86:00") == {"0000:86:00", "0000:af:00"}
        del gpus["0000:86:00"]
        assert gpus_asked_about(env, gpus, "0000:86:00") is None


@given(env=st.lists(st.text(max_size=40), max_size=6), pci=st.text(max_size=30))
def test_no_environment_and_no_address_crashes_the_mapping(env: list[str], pci: str) -> None:
    gpus = {"0000:18:00": {"Model": H100, "GPU UUID": "GPU-1"}}
    found = unit_gpus(env, gpus)
    assert found is None or found <= {"0000:18:00"}
    assert isinstance(device_key(pci), str)


_TABLE = load_table(Config())
LAUNCH_FAILURE = [
    "(EngineCore_DP0 pid=812) ERROR 12-05 10:05:02 [core.py:710] RuntimeError: CUDA error: "
    "unspecified launch failure",
]


def joined_xid(
    xid_pci: str, unit_gpus_known: frozenset[str] | None
) -> tuple[int | None, list[str]]:
    """The Xid code the hook joins to a launch failure when `xid_pci` logged Xid 79 2 s before,
    and the units it asked about."""
    pipeline = Pipeline(Config(units=(UnitConfig(name="vllm.service"),)), _TABLE)
    end_us = int(time.time() * 1e6)
    inv = dataclasses.replace(
        failed_invocation(LAUNCH_FAILURE, started_us=end_us - 60_000_000, ended_us=end_us),
        boot_id="b" * 32,
        host="m" * 32,
    )
    asked: list[str] = []

    async def gpus_of(unit: str, pci: str) -> frozenset[str] | None:
        asked.append(unit)
        return unit_gpus_known

    hook = XidEvidence(load_xid_catalog(), gpus_of=gpus_of)
    hook.note(
        KernelLine(
            realtime_us=end_us - 2_000_000,
            boot_id="b" * 32,
            host="m" * 32,
            hostname="gpu-7",
            text=f"NVRM: Xid (PCI:{xid_pci}): 79, pid=812, name=python3, GPU has fallen off "
            "the bus.",
        )
    )
    evidence = asyncio.run(hook.evidence(pipeline.examine(inv), Evidence(phase=Phase(served=True))))
    return (None if evidence.xid is None else evidence.xid.code), asked


class TestTheJoin:
    def test_an_xid_of_another_units_gpu_is_not_this_crashs_cause(self) -> None:
        code, asked = joined_xid("0000:86:00", frozenset({"0000:18:00", "0000:3b:00"}))
        assert code is None and asked == ["vllm.service"]

    def test_an_xid_of_the_units_own_gpu_is(self) -> None:
        assert joined_xid("0000:3b:00", frozenset({"0000:18:00", "0000:3b:00"}))[0] == 79

    def test_gpus_unknown_join_every_gpu_as_before(self) -> None:
        assert joined_xid("0000:86:00", None)[0] == 79
