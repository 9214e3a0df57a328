"""The bubble gate on a real GPU: side work queued ahead starts only once the training stream opens the gate.

The training stream spins (``torch.cuda._sleep``) for ~20 ms, then opens the
gate; a side stream had queued, before any of it, a wait on the gate and then a
kernel. CUDA events on both streams (one context, so ``elapsed_time`` between
them is exact) show the side kernel ran after the opening, not during the spin.
The same protocol on CPU, through a stand-in of the stream operations:
``tests/unit/test_bubble_gate.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from freeride.gpu.bubblegate import BubbleGate, GateWord, cuda_stream_ops, probe

pytestmark = pytest.mark.gpu


@pytest.fixture
def torch_cuda() -> Any:
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    return torch


@pytest.fixture
def gate(tmp_path: Path, torch_cuda: Any) -> Iterator[BubbleGate]:
    g = BubbleGate(GateWord.create(tmp_path / "gate"), cuda_stream_ops())
    yield g
    g.close()


def test_the_probe_passes(tmp_path: Path, torch_cuda: Any) -> None:
    assert probe(cuda_stream_ops(), torch_cuda.cuda.current_stream(), tmp_path) == ""


def test_side_work_starts_after_the_training_stream_opens_the_gate(torch_cuda: Any, gate: BubbleGate) -> None:
    torch = torch_cuda
    train = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    x = torch.zeros(1, device="cuda")
    side_done = torch.cuda.Event(enable_timing=True)
    spin_end = torch.cuda.Event(enable_timing=True)
    gate.wait_on(side)
    with torch.cuda.stream(side):
        x.add_(1)
    side_done.record(side)
    torch.cuda._sleep(40_000_000)  # ~20 ms at the idle clock
    spin_end.record(train)
    gate.open_on(train)
    assert not side_done.query()  # still behind the closed gate while the spin runs
    torch.cuda.synchronize()  # the gate is open: the side stream finishes too
    assert spin_end.elapsed_time(side_done) >= 0.0
    assert x.item() == 1.0
    assert gate.word.state().open and gate.word.state().seq == gate.seq


def test_a_closed_gate_holds_later_pieces_and_the_host_releases_them(torch_cuda: Any, gate: BubbleGate) -> None:
    torch = torch_cuda
    train = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    x = torch.zeros(1, device="cuda")
    gate.open_on(train)
    gate.close_on(train)
    torch.cuda.synchronize()
    assert not gate.word.state().open
    gate.wait_on(side)
    with torch.cuda.stream(side):
        x.add_(1)
    done = torch.cuda.Event()
    done.record(side)
    torch.cuda._sleep(20_000_000)  # the side stream has had time to pass a wait that did not hold
    train.synchronize()  # not the device's: that would wait for the side stream, which waits for the gate
    assert not done.query()
    gate.release()
    done.synchronize()
    assert x.item() == 1.0


def test_a_workers_step_queued_behind_its_slot_runs_once_the_training_stream_opens_it(
    tmp_path: Path, torch_cuda: Any
) -> None:
    """What a worker armed with a slot does (``freeride.worker.gated``), against a rank's opening of that slot:
    the step queued ahead runs after the training stream's spin, and its device time comes from its events."""
    from freeride.gpu.bubblegate import page_path
    from freeride.worker.gated import bind_gated_steps

    torch = torch_cuda
    path = page_path(tmp_path, "cuda:0")
    word = GateWord.create(path)
    side = torch.cuda.Stream()
    gated, state = bind_gated_steps(str(path), side)
    assert gated is not None and state == "ready"
    rank = BubbleGate(GateWord.attach(path), cuda_stream_ops())
    try:
        x = torch.zeros(1 << 20, device="cuda")
        queued = gated.queue(3, 0)
        with torch.cuda.stream(side):
            for _ in range(10):
                x.mul_(1.0001)  # the step's kernels, launched before the bubble
        spin_end = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(40_000_000)  # the training stream computes ~20 ms
        spin_end.record()
        rank.open_on(torch.cuda.current_stream(), 3)
        device_ns = gated.finish(queued)  # sleeps until the device has run the step
        assert spin_end.elapsed_time(queued.start) >= 0.0  # it started after the opening, not during the spin
        assert 0 < device_ns < 20_000_000
        assert word.state(3).open and not word.state(2).open  # slot 3 only
    finally:
        torch.cuda.synchronize()
        gated.close()
        rank.close()
        word.close()
