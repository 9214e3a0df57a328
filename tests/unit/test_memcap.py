"""plan_memory_cap: RLIMIT_AS only on CPU devices, MPS or the PyTorch fraction on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

from freeride.gpu.memcap import DEFAULT_AS_OVERHEAD, plan_memory_cap
from freeride.gpu.mps import torch_memory_fraction

GIB = 1 << 30


def test_cpu_device_gets_rlimit_as_with_overhead() -> None:
    cap = plan_memory_cap("cpu:1", 2 * GIB)
    assert (cap.mechanism, cap.rlimit_as, cap.env) == ("rlimit_as", 2 * GIB + DEFAULT_AS_OVERHEAD, {})
    assert plan_memory_cap("cpu:0", GIB, address_space_overhead=0).rlimit_as == GIB


def test_cuda_device_never_gets_rlimit_as(tmp_path: Path) -> None:
    for pipe in (tmp_path, None):
        for total in (80 * GIB, -1):
            assert plan_memory_cap("cuda:0", 4 * GIB, mps_pipe_dir=pipe, total_bytes=total).rlimit_as == -1


def test_cuda_with_mps_is_a_low_priority_capped_client(tmp_path: Path) -> None:
    cap = plan_memory_cap("cuda:3", 4 * GIB, mps_pipe_dir=tmp_path, total_bytes=80 * GIB)
    assert cap.mechanism == "mps"
    assert cap.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "3=4096M"
    assert cap.env["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert cap.env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path)
    uuid = plan_memory_cap("cuda:3", GIB, mps_pipe_dir=tmp_path, mps_device="GPU-9")
    assert uuid.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "GPU-9=1024M"


def test_cuda_without_mps_falls_back_to_the_torch_fraction() -> None:
    cap = plan_memory_cap("cuda:0", 4 * GIB, total_bytes=80 * GIB)
    assert cap.mechanism == "torch_fraction"
    assert float(cap.env["FREERIDE_TORCH_MEMORY_FRACTION"]) == pytest.approx(
        torch_memory_fraction(4 * GIB, 80 * GIB), abs=1e-6
    )
    assert plan_memory_cap("cuda:0", 4 * GIB).mechanism == "none"


def test_unknown_limit_means_no_cap() -> None:
    assert plan_memory_cap("cpu:0", -1).mechanism == "none"
    assert plan_memory_cap("cpu:0", -1).rlimit_as == -1


@pytest.mark.parametrize("device", ["gpu:0", "cuda:x", "", "cpu:-1"])
def test_bad_device_names_are_rejected(device: str) -> None:
    with pytest.raises(ValueError, match="device"):
        plan_memory_cap(device, GIB)
