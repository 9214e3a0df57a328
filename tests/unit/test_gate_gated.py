"""The worker's steps queued ahead behind its slot of the device's bubble gate.

No CUDA exists on CPU machines: the side stream and the rank's compute stream
are the threads of ``tests/standins/fake_stream_ops.py``, and the step's
timing events are recorded on them (:class:`StreamEvent`); the gate page is
the real shared page. What a test thread does stands for the device and the
rank: it opens the slot on the compute stream and announces the bubble, while
the worker sleeps in the step's end, as it does on a GPU.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from _files import load
from test_gate_armed import ENDPOINT, MARGIN, MS, STEP, Wires, make_gate, started

from freeride import protocol as p
from freeride.clock import ManualClock
from freeride.gpu.bubblegate import BubbleGate, GateWord, page_path
from freeride.worker.gated import GatedSteps, bind_gated_steps, fits_gate

FakeStreamOps: Any = load("tests/standins/fake_stream_ops.py", "fake_stream_ops").FakeStreamOps


class StreamEvent:
    """A timing event on a stand-in stream: done, with the host's time, when the stream's thread gets to it."""

    def __init__(self, ops: Any) -> None:
        self._ops = ops
        self.at_ns = 0
        self._done = threading.Event()

    def record(self, stream: Any = None) -> None:
        self._done.clear()
        self._ops.launch(stream, self._reach)

    def _reach(self) -> None:
        self.at_ns = time.monotonic_ns()
        self._done.set()

    def synchronize(self) -> None:
        assert self._done.wait(10), "the stream never got to the event"

    def elapsed_time(self, end_event: Any) -> float:
        return float(end_event.at_ns - self.at_ns) / 1e6


class Device:
    """The page, the side stream the worker queues on, and the rank's compute stream."""

    def __init__(self, tmp_path: Path, ops: Any) -> None:
        self.ops = ops
        self.word = GateWord.create(page_path(tmp_path, "cuda:0"))
        self.rank = BubbleGate(GateWord.attach(self.word.path), ops)
        self.side, self.compute = ops.stream(), ops.stream()
        self.ran: list[str] = []
        self.gated = GatedSteps(BubbleGate(GateWord.attach(self.word.path), ops), self.side, lambda: StreamEvent(ops))

    def kernel(self, name: str, ms: float) -> Callable[[], None]:
        def run() -> None:
            self.ran.append(name)
            time.sleep(ms / 1e3)

        return run

    def later(self, action: Callable[[], None], delay_s: float = 0.05) -> threading.Timer:
        """Do ``action`` from another thread while the worker sleeps in its step's end."""
        timer = threading.Timer(delay_s, action)
        timer.start()
        return timer

    def close(self) -> None:
        self.gated.close()
        self.rank.close()
        self.word.close()


@pytest.fixture
def device(tmp_path: Path) -> Iterator[Device]:
    ops = FakeStreamOps()
    d = Device(tmp_path, ops)
    yield d
    d.close()
    ops.close()


def _arm(slot: int = 1, open_ns: int = 3 * STEP) -> p.Arm:
    return p.Arm(grant_id=5, endpoint=ENDPOINT, after_ns=0, margin_ns=MARGIN, gate_slot=slot, gate_open_ns=open_ns)


async def _gated_step(gate: Any, device: Device) -> None:
    async with asyncio.timeout(10), gate.step():
        device.ops.launch(device.side, device.kernel("side step", 2))  # what the task's body launches


async def test_an_armed_step_is_queued_ahead_and_runs_when_the_ranks_stream_opens_its_slot(
    tmp_path: Path, device: Device
) -> None:
    clock, wires = ManualClock(), Wires()
    gate = make_gate(tmp_path, clock, wires, gated=device.gated)
    wires.push(_arm())
    queued_at = clock.now_ns()
    bubble = msgspec.structs.replace(started(clock, 3 * STEP), t_ns=queued_at + MS)

    before: list[list[str]] = []

    def the_device_reaches_the_bubble() -> None:
        before.append(list(device.ran))
        device.ops.launch(device.compute, device.kernel("forward", 1))
        device.rank.open_on(device.compute, 1)  # the rank's write, right before its wait
        wires.events.append(bubble)  # and the rank's announcement, a moment later

    timer = device.later(the_device_reaches_the_bubble)
    await _gated_step(gate, device)  # returns once the device has run the step
    timer.join()
    assert before == [[]]  # queued 50 ms before, and waiting behind the shut slot
    assert device.ran == ["forward", "side step"]
    assert gate.steps == 1
    gate.finish("finished")
    [done] = wires.done()
    assert (done.grant_id, done.steps, done.armed, done.reason) == (5, 1, True, "finished")
    assert done.first_step_delay_ns == 0  # queued before the bubble: it starts where the device gets there
    assert 2 * MS <= done.busy_ns < 1000 * MS  # the step's time on the (stand-in) device, between its events
    assert gate.estimates.estimate_ns("") > 0


async def test_a_step_released_by_the_host_with_no_bubble_is_counted_outside_any_grant(
    tmp_path: Path, device: Device
) -> None:
    """The manager opens the slot from the host when the task must stop or the rank is gone: the step runs, and
    the worker, having heard of no bubble, counts it in no grant."""
    clock, wires = ManualClock(), Wires()
    gate = make_gate(tmp_path, clock, wires, gated=device.gated)
    wires.push(_arm())
    timer = device.later(lambda: device.word.release(1))
    await _gated_step(gate, device)
    timer.join()
    assert device.ran == ["side step"] and gate.steps == 1
    gate.finish("finished")
    assert wires.done() == []


async def test_a_step_that_may_not_fit_a_bubble_the_slot_opens_at_waits_on_the_host(
    tmp_path: Path, device: Device
) -> None:
    clock, wires = ManualClock(), Wires()
    gate = make_gate(tmp_path, clock, wires, gated=device.gated)
    wires.push(_arm(open_ns=STEP + MARGIN - 1))  # the shortest bubble it opens at: a nanosecond short
    stepping = asyncio.create_task(_gated_step(gate, device))
    await wires.parked()
    assert device.ops.busy(device.side) == 0  # nothing queued: it waits for the bubble's start, on the host
    wires.publish(started(clock, 3 * STEP))
    await stepping
    device.ops.synchronize(device.side)
    assert device.ran == ["side step"] and gate.steps == 1


def test_what_may_be_queued_behind_a_slot() -> None:
    arm = _arm(open_ns=20 * MS)
    assert fits_gate(arm, 19 * MS, MS) and not fits_gate(arm, 19 * MS + 1, MS)
    assert not fits_gate(arm, -1, 0)  # a kind not measured yet: a probe, on the host's path
    assert not fits_gate(_arm(slot=0), MS, 0)
    half = msgspec.structs.replace(arm, prediction_factor=0.5)
    assert fits_gate(half, 9 * MS, MS) and not fits_gate(half, 10 * MS, MS)  # deadlines as the guard sets them


def test_a_worker_binds_the_gate_only_where_it_works(tmp_path: Path) -> None:
    ops = FakeStreamOps()
    try:
        assert bind_gated_steps("", None) == (None, "")  # the manager runs no device gate
        path = page_path(tmp_path, "cuda:0")
        assert bind_gated_steps(str(path), None, ops=lambda: ops) == (None, "not a CUDA device")
        gated, state = bind_gated_steps(str(path), ops.stream(), ops=lambda: ops, event=lambda: StreamEvent(ops))
        assert gated is None and "cannot open the bubble gate" in state  # no page: the manager has none
        word = GateWord.create(path)
        gated, state = bind_gated_steps(str(path), ops.stream(), ops=lambda: ops, event=lambda: StreamEvent(ops))
        assert gated is not None and state == "ready"
        gated.close()
        word.close()

        broken = FakeStreamOps()
        broken.write = lambda *_: None  # a stream write that never reaches the host
        try:
            gated, state = bind_gated_steps(
                str(path), broken.stream(), ops=lambda: broken, event=lambda: StreamEvent(broken)
            )
        finally:
            broken.close()
        assert gated is None and state == "a stream's write to mapped host memory did not reach the host"
    finally:
        ops.close()
