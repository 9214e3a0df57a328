"""GPU-only paths on a real device: NVML readings, MPS memory caps, the PyTorch memory fraction."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from freeride.gpu.memcap import plan_memory_cap
from freeride.gpu.mps import MpsDaemon
from freeride.gpu.nvml import NvmlMonitor

pytestmark = pytest.mark.gpu

ALLOC = """
import os, sys, torch
frac = os.environ.get("FREERIDE_TORCH_MEMORY_FRACTION")
if frac:
    torch.cuda.set_per_process_memory_fraction(float(frac), 0)
try:
    x = torch.empty(int(sys.argv[1]) << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print("ok")
except torch.cuda.OutOfMemoryError:
    print("oom")
"""


def test_nvml_agrees_with_cuda() -> None:
    import torch

    monitor = NvmlMonitor.open()
    assert monitor is not None
    try:
        devices = monitor.devices()
        assert len(devices) == torch.cuda.device_count()
        _, total = torch.cuda.mem_get_info(0)
        # cudaMemGetInfo leaves out what the driver keeps for itself (616 MiB of 143,771 on an H200)
        assert total <= devices[0].total < total * 1.01
        assert devices[0].free > 0 and devices[0].used >= 0
    finally:
        monitor.close()


def test_torch_fraction_caps_allocations() -> None:
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    cap = plan_memory_cap("cuda:0", 1 << 30, total_bytes=total)
    run = lambda mb: subprocess.run(  # noqa: E731
        [sys.executable, "-c", ALLOC, str(mb)],
        env={**__import__("os").environ, **cap.env},
        capture_output=True,
        text=True,
    )
    assert run(256).stdout.strip() == "ok"
    assert run(2048).stdout.strip() == "oom"


def test_mps_pinned_memory_limit_is_enforced() -> None:
    """Needs nvidia-cuda-mps-control; the daemon runs on a private pipe directory."""

    async def scenario() -> tuple[str, str]:
        with tempfile.TemporaryDirectory(prefix="frmps-", dir="/tmp") as tmp:
            async with MpsDaemon(Path(tmp) / "p", Path(tmp) / "l") as mps:
                env = {**os.environ, **mps.client_env(0, 1 << 30)}
                env.pop("FREERIDE_TORCH_MEMORY_FRACTION", None)  # test the MPS cap alone
                small = await asyncio.to_thread(
                    subprocess.run, [sys.executable, "-c", ALLOC, "256"], env=env, capture_output=True, text=True
                )
                big = await asyncio.to_thread(
                    subprocess.run, [sys.executable, "-c", ALLOC, "2048"], env=env, capture_output=True, text=True
                )
                return small.stdout.strip(), big.stdout.strip()

    assert asyncio.run(scenario()) == ("ok", "oom")
