"""The bubble gate's protocol: side work queued ahead runs only while the training stream holds the gate open.

The CUDA driver's stream memory operations are replaced by
``tests/standins/fake_stream_ops.py`` (threads that run each stream's queue in
order) because no CUDA exists on CPU machines; the gate word is the real shared
page. The same protocol on a real device: ``tests/gpu/test_bubble_gate_cuda.py``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _files import load

from freeride.gpu.bubblegate import (
    SLOTS,
    BubbleGate,
    GateUnavailable,
    GateWord,
    decode,
    encode,
    probe,
)


def _standin() -> Any:
    return load("tests/standins/fake_stream_ops.py", "fake_stream_ops")


FakeStreamOps: Any = _standin().FakeStreamOps


@pytest.fixture(name="ops")
def fixture_ops() -> Iterator[Any]:
    """The stand-in's streams (closed after the test)."""
    fake = FakeStreamOps()
    yield fake
    fake.close()


@pytest.fixture
def word(tmp_path: Path) -> Iterator[GateWord]:
    w = GateWord.create(tmp_path / "gate")
    yield w
    w.close()


class Log:
    """What ran, in order, from any stream's thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[str] = []

    def add(self, item: str) -> None:
        with self.lock:
            self.items.append(item)

    def kernel(self, item: str) -> object:
        return lambda: self.add(item)

    def before(self, a: str, b: str) -> bool:
        return self.items.index(a) < self.items.index(b)


def test_the_word_holds_a_sequence_number_and_two_flags() -> None:
    assert decode(encode(5, open=True)) == decode(encode(5, open=True, host=False))
    state = decode(encode(7, open=False, host=True))
    assert (state.seq, state.open, state.host) == (7, False, True)
    assert decode(encode((1 << 30) + 3, open=True)).seq == 3  # wraps within 30 bits


def test_a_new_gate_is_closed_and_private(tmp_path: Path, word: GateWord) -> None:
    assert not word.state().open
    assert (word.path.stat().st_mode & 0o777) == 0o600
    with pytest.raises(FileExistsError):
        GateWord.create(word.path)
    other = GateWord.attach(word.path)
    try:
        word.write(encode(3, open=True))
        assert other.state().open and other.state().seq == 3  # one page, seen by both mappings
    finally:
        other.close()


@pytest.mark.parametrize("plant", ["link", "mode", "size", "missing"])
def test_attach_refuses_a_gate_another_user_could_have_planted(tmp_path: Path, word: GateWord, plant: str) -> None:
    path = tmp_path / "planted"
    if plant == "link":
        path.symlink_to(word.path)
    elif plant == "mode":
        path.write_bytes(b"\0" * os.sysconf("SC_PAGE_SIZE"))
        path.chmod(0o666)
    elif plant == "size":
        path.write_bytes(b"\0" * 8)
        path.chmod(0o600)
    with pytest.raises(GateUnavailable, match=str(path)):
        GateWord.attach(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the file to another user")
def test_attach_refuses_a_gate_of_another_user(tmp_path: Path, word: GateWord) -> None:
    os.chown(word.path, 12345, 12345)
    with pytest.raises(GateUnavailable, match="owned by uid 12345"):
        GateWord.attach(word.path)


def test_side_work_queued_ahead_waits_for_the_training_stream_to_open_the_gate(word: GateWord, ops: Any) -> None:
    gate = BubbleGate(word, ops)
    train, side = ops.stream(), ops.stream()
    log, computing = Log(), threading.Event()
    gate.wait_on(side)
    ops.launch(side, log.kernel("side piece"))  # queued before the training stream got anywhere
    ops.launch(train, computing.wait)
    ops.launch(train, log.kernel("forward"))
    seq = gate.open_on(train)
    ops.launch(train, log.kernel("bubble"))
    computing.set()
    ops.synchronize(train)
    ops.synchronize(side)
    assert log.before("forward", "side piece")  # without the gate it would have run at once
    assert word.state().open and word.state().seq == seq == 1 and not word.state().host


def test_a_bubble_that_ends_early_leaves_the_next_pieces_for_the_next_bubble(word: GateWord, ops: Any) -> None:
    gate = BubbleGate(word, ops)
    train, side = ops.stream(), ops.stream()
    log = Log()
    first_running, first_may_end, first_ended = threading.Event(), threading.Event(), threading.Event()
    second_compute = threading.Event()

    def first_piece() -> None:
        log.add("piece 1 start")
        first_running.set()
        assert first_may_end.wait(10)
        log.add("piece 1 end")
        first_ended.set()

    for piece in (first_piece, log.kernel("piece 2"), log.kernel("piece 3")):
        gate.wait_on(side)
        ops.launch(side, piece)
    gate.open_on(train)
    assert first_running.wait(10)
    gate.close_on(train)  # the data came early: the bubble is over while piece 1 still runs
    ops.synchronize(train)
    first_may_end.set()
    assert first_ended.wait(10)  # the piece that started in the bubble runs to its end
    ops.launch(train, second_compute.wait)
    ops.launch(train, log.kernel("compute"))
    gate.open_on(train)
    second_compute.set()
    ops.synchronize(train)
    ops.synchronize(side)
    assert log.items[:2] == ["piece 1 start", "piece 1 end"]
    assert log.before("compute", "piece 2") and log.before("piece 2", "piece 3")
    assert gate.seq == 2


def test_the_host_releases_work_left_waiting(word: GateWord, ops: Any) -> None:
    gate = BubbleGate(word, ops)
    side = ops.stream()
    log = Log()
    gate.wait_on(side)
    ops.launch(side, log.kernel("piece"))
    assert ops.busy(side) == 2 and not log.items  # nothing opens the gate
    gate.release()
    ops.synchronize(side)
    assert log.items == ["piece"]
    state = word.state()
    assert state.open and state.host
    gate.shut()
    assert not word.state().open and word.state().host


def test_an_opening_releases_only_the_slot_it_opens(word: GateWord, ops: Any) -> None:
    """Each side task of a device waits on a slot of its own: the task a bubble is meant for runs, no other."""
    gate = BubbleGate(word, ops)
    train, mine, other = ops.stream(), ops.stream(), ops.stream()
    log = Log()
    for stream, slot, piece in ((mine, 2, "task of slot 2"), (other, 1, "task of slot 1")):
        gate.wait_on(stream, slot)
        ops.launch(stream, log.kernel(piece))
    assert gate.open_on(train, 2) == 1
    ops.synchronize(train)
    ops.synchronize(mine)
    assert log.items == ["task of slot 2"] and ops.busy(other) == 2
    assert word.state(2).open and not word.state(1).open and not word.state(0).open
    gate.close_on(train, 2)
    ops.synchronize(train)
    gate.release(1)  # as the manager does from the host at a Grant to the task of slot 1
    ops.synchronize(other)
    assert log.items == ["task of slot 2", "task of slot 1"]
    assert word.state(1).host and not word.state(2).open


def test_the_control_word_names_a_slot_and_the_shortest_bubble_worth_opening_for(
    tmp_path: Path, word: GateWord
) -> None:
    assert word.control() == (0, 0)  # a new page names no slot
    word.set_control(3, 2_500_000)
    other = GateWord.attach(word.path)  # what a rank of the device reads, in its own mapping
    try:
        assert other.control() == (3, 2_500_000)
        word.set_control(0)
        assert other.control() == (0, 0)
    finally:
        other.close()
    with pytest.raises(ValueError, match="gate slot"):
        word.set_control(SLOTS + 1)
    with pytest.raises(ValueError, match="gate slot"):
        word.write(1, slot=-1)
    assert SLOTS >= 64


def test_a_restarted_rank_continues_the_count_of_openings(word: GateWord, ops: Any) -> None:
    word.write(encode(41, open=False))
    gate = BubbleGate(word, ops)
    train = ops.stream()
    assert gate.open_on(train) == 42
    gate.close_on(train)
    ops.synchronize(train)
    assert decode(ops.writes[-1][1]).seq == 42 and not word.state().open


def test_close_unregisters_once(word: GateWord, ops: Any) -> None:
    gate = BubbleGate(word, ops)
    assert word.address in ops.mapped
    gate.close()
    gate.close()
    assert not ops.mapped


def test_probe_passes_where_the_calls_work(tmp_path: Path, ops: Any) -> None:
    assert probe(ops, ops.stream(), tmp_path) == ""
    assert not list(tmp_path.iterdir())  # the scratch page is gone


def test_probe_says_why_where_a_write_never_reaches_the_host(tmp_path: Path, ops: Any) -> None:
    class Lost(FakeStreamOps):  # type: ignore[misc]
        def write(self, stream: int, device_address: int, value: int) -> None:
            self.launch(stream, lambda: None)

    lost = Lost()
    try:
        assert "did not reach the host" in probe(lost, lost.stream(), tmp_path)
    finally:
        lost.close()
    assert "cannot make a scratch gate" in probe(ops, ops.stream(), tmp_path / "no such dir")
