"""The CPU shim that lets megatron-core's schedules run without a GPU (tests and CPU demos only)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from freeride.backends.megatron import cpu_shim

schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
NAMES = ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving")


@pytest.fixture
def shim() -> Iterator[None]:
    if torch.cuda.is_available():
        pytest.skip("the shim refuses to run where CUDA is available")
    cpu_shim.activate()
    try:
        yield
    finally:
        cpu_shim.deactivate()


def test_refuses_where_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = torch.cuda.current_device, {n: getattr(schedules, n) for n in NAMES}
    with pytest.raises(cpu_shim.ShimRefused, match="is_available"):
        cpu_shim.activate()
    assert not cpu_shim.active()
    assert (torch.cuda.current_device, {n: getattr(schedules, n) for n in NAMES}) == before


def test_cuda_factory_calls_land_on_cpu_under_the_mode() -> None:
    with cpu_shim.CudaToCpuMode():
        assert torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
        assert torch.empty((3,), device=0, dtype=torch.int64).device.type == "cpu"
        assert torch.empty(2, device=torch.device("cuda", 0), requires_grad=True).requires_grad
        assert torch.ones(2, device="cpu").device.type == "cpu"
        assert torch.ones(2).sum().item() == 2.0


def test_activate_patches_and_deactivate_restores(shim: None) -> None:
    assert cpu_shim.active()
    assert str(torch.cuda.current_device()) == "cpu"
    torch.cuda.synchronize()  # a no-op, where torch without CUDA would raise
    for name in NAMES:
        assert getattr(getattr(schedules, name), "__freeride_cpu_shim__", False)
    cpu_shim.activate()  # idempotent: wrapped once
    wrapped = schedules.forward_backward_no_pipelining
    assert not getattr(wrapped.__wrapped__, "__freeride_cpu_shim__", False)


def test_deactivate_restores_everything() -> None:
    if torch.cuda.is_available():
        pytest.skip("the shim refuses to run where CUDA is available")
    before = torch.cuda.current_device, torch.cuda.synchronize, {n: getattr(schedules, n) for n in NAMES}
    with cpu_shim.cpu_shim():
        assert str(torch.cuda.current_device()) == "cpu"
    assert (torch.cuda.current_device, torch.cuda.synchronize, {n: getattr(schedules, n) for n in NAMES}) == before
    cpu_shim.deactivate()  # idempotent


def test_wrapped_schedule_runs_its_body_under_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("the shim refuses to run where CUDA is available")
    devices: list[str] = []

    def body(**kwargs: object) -> None:
        devices.append(torch.zeros([], device="cuda").device.type)

    monkeypatch.setattr(schedules, "forward_backward_no_pipelining", body)
    with cpu_shim.cpu_shim():
        schedules.forward_backward_no_pipelining()
    assert devices == ["cpu"]
    assert schedules.forward_backward_no_pipelining is body
