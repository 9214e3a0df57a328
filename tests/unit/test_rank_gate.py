"""A rank's side of the bubble gate: the slot the manager names opened right before an announced wait, closed after.

No CUDA exists on CPU machines: the stream memory operations are the stand-in
``tests/standins/fake_stream_ops.py`` (the gate page itself is the real shared
page) and the timeline's events that of ``tests/standins/fake_cuda.py``. On a
GPU, ``tests/gpu/test_bubble_gate_cuda.py`` and the check's section (f) run the
same operations on a device.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from _files import load
from test_bubble_gate import fixture_ops  # noqa: F401 - fixture
from test_cuda_timing import MS, Recorder

from freeride import protocol as p
from freeride.backends.cuda_timing import DeviceTimeline
from freeride.backends.rank_gate import RankGate, rank_gate_for
from freeride.backends.session import BackendConfig, BackendSession
from freeride.gpu.bubblegate import GateWord, decode, page_path
from freeride.transport import EventEmitter

fake_cuda: Any = load("tests/standins/fake_cuda.py", "fake_cuda")


@pytest.fixture
def page(tmp_path: Path) -> Iterator[GateWord]:
    """The device's page as the manager makes it."""
    word = GateWord.create(page_path(tmp_path, "cuda:0"))
    yield word
    word.close()


def _attached(page: GateWord, ops: Any) -> RankGate:
    gate = RankGate(page.path, ops=lambda: ops)
    gate.attach_due()
    assert gate.attached
    return gate


def _opened(ops: Any) -> list[tuple[int, bool]]:
    """(slot's seq, open) of every write queued, in order."""
    return [(decode(value).seq, decode(value).open) for _, value in ops.writes]


def test_the_slot_the_manager_names_is_opened_for_a_bubble_its_step_fits(page: GateWord, ops: Any) -> None:
    gate, stream = _attached(page, ops), ops.stream()
    never_held = lambda step: False  # noqa: E731
    assert gate.open_at(stream, 0, 10 * MS, never_held) == 0  # the manager names no slot yet
    page.set_control(3, 4 * MS)
    assert gate.open_at(stream, 1, 3 * MS, never_held) == 0  # shorter than the step the slot's task queued
    assert gate.open_at(stream, 2, 10 * MS, lambda step: step == 2) == 0  # held back to measure the job's cost
    assert ops.writes == []
    assert gate.open_at(stream, 3, 4 * MS, never_held) == 3
    gate.close_at(stream, 3)
    ops.synchronize(stream)
    assert _opened(ops) == [(1, True), (1, False)]
    assert not page.state(3).open and page.state(3).seq == 1 and gate.opened == 1


def test_a_gate_whose_calls_fail_is_given_up_and_training_goes_on(
    page: GateWord, ops: Any, caplog: pytest.LogCaptureFixture
) -> None:
    gate = _attached(page, ops)
    page.set_control(1, 0)

    def broken(*_: object) -> None:
        raise RuntimeError("cuStreamWriteValue32 failed: CUDA_ERROR_NOT_SUPPORTED")

    ops.write = broken
    with caplog.at_level(logging.WARNING, logger="freeride.backends.rank_gate"):
        assert gate.open_at(ops.stream(), 0, 10 * MS, lambda step: False) == 0
    assert not gate.attached and "uses it no more" in caplog.text
    gate.attach_due()
    assert not gate.attached  # not looked for again


def test_the_page_is_looked_for_until_the_manager_has_made_it(tmp_path: Path, ops: Any) -> None:
    now = [0]
    path = page_path(tmp_path, "cuda:0")
    gate = RankGate(path, ops=lambda: ops, clock=lambda: now[0])
    gate.attach_due()
    assert not gate.attached  # no manager with --device-gate (yet)
    word = GateWord.create(path)
    try:
        gate.attach_due()
        assert not gate.attached  # looked for a moment ago
        now[0] += 5_000_000_000
        gate.attach_due()
        assert gate.attached
    finally:
        gate.close()
        word.close()


def test_a_page_a_new_manager_made_is_attached_in_place_of_the_old_one(tmp_path: Path, ops: Any) -> None:
    """A manager started again makes a new page at the same path: the rank opens slots in it from then on, and keeps
    the old one registered (writes queued on its compute stream may still be on their way there)."""
    now = [0]
    path = page_path(tmp_path, "cuda:0")
    old = GateWord.create(path)
    gate = RankGate(path, ops=lambda: ops, clock=lambda: now[0])
    gate.attach_due()
    path.unlink()
    new = GateWord.create(path)  # what the new manager made
    try:
        new.set_control(1, 0)
        stream = ops.stream()
        assert gate.open_at(stream, 0, MS, lambda step: False) == 0  # still the old page: it names no slot
        now[0] += 5_000_000_000
        gate.attach_due()
        assert gate.open_at(stream, 1, MS, lambda step: False) == 1
        ops.synchronize(stream)
        assert new.state(1).open and not old.state(1).open
        assert len(ops.mapped) == 2  # the old page is not unregistered
    finally:
        gate.close()
        assert not ops.mapped
        old.close()
        new.close()


def test_a_planted_page_is_refused_for_good(tmp_path: Path, ops: Any) -> None:
    path = page_path(tmp_path, "cuda:0")
    path.write_bytes(b"\0" * 4096)
    path.chmod(0o666)
    gate = RankGate(path, ops=lambda: ops)
    gate.attach_due()
    assert not gate.attached and not ops.mapped


def test_the_gate_is_the_runtime_directorys_for_the_device() -> None:
    gate = rank_gate_for("ipc:///run/fr/events.sock", "cuda:1")
    assert gate is not None and gate.path == Path("/run/fr/gate-cuda-1")
    assert rank_gate_for("tcp://10.0.0.1:5555", "cuda:1") is None


def test_the_device_timeline_opens_the_slot_before_an_announced_wait_and_closes_it_after(
    page: GateWord, ops: Any
) -> None:
    """The page is attached on the timeline's helper thread after its first announcement (where CUDA is current);
    from then on each announced wait opens the slot the manager names, and the wait's end closes it."""
    gpu = fake_cuda.FakeGpu()
    gpu.compute.cuda_stream = ops.stream()  # the compute stream's handle, for the stream writes
    recorder = Recorder()
    config = BackendConfig(
        endpoint="ipc:///nonexistent", rank=0, stage=0, num_stages=2, device="cuda:0", framework="test"
    )
    session = BackendSession(config, emitter=cast(EventEmitter, recorder))
    gate = RankGate(page.path, ops=lambda: ops)
    timeline = DeviceTimeline(session, api=gpu.api(), clock=gpu.host_ns, gate=gate)
    page.set_control(2, 5 * MS)
    try:
        timeline.wait_began((0, 20 * MS, None))  # not attached yet: the helper thread attaches it at this bubble
        timeline.wait_finished(None)
        gpu.reach(1.0)
        gpu.reach(21.0)
        recorder.wait_for(p.BubbleEnded, 1)  # the helper thread attached the page when it announced the start
        assert gate.attached and ops.writes == []
        timeline.wait_began((1, 20 * MS, None))
        assert _opened(ops) == [(1, True)]  # queued on the host, before the wait's event: the device opens it
        timeline.wait_began((1, 20 * MS, None))  # a wait already open: nothing more
        timeline.wait_finished(None)
        assert _opened(ops) == [(1, True), (1, False)]
        timeline.wait_began(None)  # a wait not announced (too short): no slot opened
        timeline.wait_finished(None)
        timeline.wait_began((2, 4 * MS, None))  # announced, but shorter than the slot's step
        timeline.wait_finished(None)
        assert len(ops.writes) == 2
        for at in (22.0, 40.0, 41.0, 42.0, 43.0, 44.0):
            gpu.reach(at)
        ops.synchronize(gpu.compute.cuda_stream)
        assert not page.state(2).open and page.state(2).seq == 1
    finally:
        timeline.close()
        gate.close()
