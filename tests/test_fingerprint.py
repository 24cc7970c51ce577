"""Fingerprints: the same crash on another day, host, pid or version is one fingerprint; two
different crashes are two."""

from __future__ import annotations

import pytest

from vllm_supervisor.classify.fingerprint import fingerprint, normalise

# Pairs of root-cause lines that are the same crash seen twice.
SAME = [
    pytest.param(
        "RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version (0.6.4).",
        "RuntimeError: flashinfer-cubin version (0.6.8.post1) does not match flashinfer version "
        "(0.6.10).",
        id="versions",
    ),
    pytest.param(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 50.00 MiB. GPU 0 has a "
        "total capacity of 23.56 GiB of which 21.75 MiB is free.",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.20 GiB. GPU 3 has a "
        "total capacity of 79.10 GiB of which 400.00 MiB is free.",
        id="sizes-gpu-index-exception-module",
    ),
    pytest.param(
        "RuntimeError('Engine process (pid 77) died.')",
        "RuntimeError('Engine process (pid 31337) died.')",
        id="pids",
    ),
    pytest.param(
        "2024-12-19 21:40:35 worker at 10.0.0.12:29500 lost connection",
        "2025-01-02 03:04:05 worker at 192.168.1.7:41000 lost connection",
        id="timestamps-and-ips",
    ),
    pytest.param(
        "ImportError: /home/a/venv/lib/python3.12/site-packages/vllm/_C.abi3.so: undefined symbol: "
        "_ZN3c10",
        "ImportError: /opt/conda/lib/python3.10/site-packages/vllm/_C.abi3.so: undefined symbol: "
        "_ZN3c10",
        id="paths",
    ),
    pytest.param(
        "NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001",
        "NVRM: Xid (PCI:0000:ba:00): 45, pid=1818989, name=python3, Ch 00000003",
        id="pci-and-channels",
    ),
    pytest.param(
        "Segfault at address 0x7f4d8c3212d0 in thread 0x7f4d00000000",
        "Segfault at address 0x55aa00001111 in thread 0x7fffffff0000",
        id="addresses",
    ),
    pytest.param("  RuntimeError: boom  ", "RuntimeError:   boom", id="whitespace"),
]

# Pairs of root-cause lines that are different crashes.
DIFFERENT = [
    pytest.param(
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "RuntimeError: CUDA error: misaligned address",
        id="cuda-errors",
    ),
    pytest.param(
        "ModuleNotFoundError: No module named 'vllm.benchmarks.serve'",
        "ModuleNotFoundError: No module named 'vllm.prompt_adapter'",
        id="missing-modules",
    ),
    pytest.param("KeyError: 'model'", "ValueError: 'model'", id="exception-class"),
    pytest.param(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 50.00 MiB.",
        "RuntimeError: CUDA driver error: out of memory",
        id="oom-kinds",
    ),
]


class TestFingerprint:
    @pytest.mark.parametrize(("first", "second"), SAME)
    def test_same_crash_same_fingerprint(self, first: str, second: str) -> None:
        """Variable parts are masked, so both lines share one fingerprint."""
        assert fingerprint(first) == fingerprint(second)

    @pytest.mark.parametrize(("first", "second"), DIFFERENT)
    def test_different_crashes_differ(self, first: str, second: str) -> None:
        """What stays after masking tells the crashes apart."""
        assert fingerprint(first) != fingerprint(second)

    def test_shape(self) -> None:
        """A fingerprint is 16 lowercase hex characters and stable across calls."""
        value = fingerprint("RuntimeError: boom")
        assert len(value) == 16
        assert int(value, 16) >= 0
        assert value == fingerprint("RuntimeError: boom")

    def test_normalised_text_is_readable(self) -> None:
        """The masked text keeps the wording and names what was masked."""
        text = normalise(
            "OSError: [Errno 98] error while attempting to bind on address ('0.0.0.0', 8000)"
        )
        assert "error while attempting to bind on address" in text
        assert "<ip>" in text
