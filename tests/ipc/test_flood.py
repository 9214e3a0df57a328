"""Faults and attacks over the real sockets: the manager rejects, bounds, and keeps answering.

Each test sends what a hostile or broken sender could (well-formed frames
with values no rank sends, a Hello per made-up rank, a device name per event,
a frame over the size limit) and then asks for status, as an operator would.
Nothing here is timed: throughput under a flood is measured by
tools/bench/flood.py (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading

import msgspec
import zmq
from conftest import wait_until

from freeride import protocol as p
from freeride.serve.manager import Manager
from freeride.serve.ranks import MAX_DEVICES, MAX_RANKS
from freeride.transport import ControlClient

U64_MAX = 2**64 - 1


async def _status(manager: Manager) -> p.StatusReply:
    """Status over the control socket, as `freeride status` asks for it (the manager runs on this loop)."""

    def ask() -> p.ControlReply:
        with ControlClient(manager.config.endpoints.control, timeout_s=10) as client:
            return client.request(p.StatusRequest())

    reply = await asyncio.to_thread(ask)
    assert isinstance(reply, p.StatusReply), reply
    return reply


class _Sender:
    """A raw PUSH to the events socket: frames as any process could write them."""

    def __init__(self, manager: Manager) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.connect(manager.config.endpoints.events)

    def send(self, msg: dict[str, object] | msgspec.Struct) -> None:
        self.sock.send(msgspec.msgpack.encode(msg))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _hello(rank: int, device: str) -> p.Hello:
    return p.Hello(
        protocol_version=p.PROTOCOL_VERSION,
        rank=rank,
        stage=0,
        num_stages=1,
        device=device,
        framework="sim",
        pid=os.getpid(),
    )


def _ended(duration_ns: int) -> dict[str, object]:
    fields = {"rank": 0, "stage": 0, "device": "cpu:0", "step": 0, "index": 0, "t_ns": 1, "duration_ns": duration_ns}
    return {"type": "bubble_ended", **fields}


async def test_overflowing_values_are_rejected_and_counted_and_status_still_answers(manager: Manager) -> None:
    sender = _Sender(manager)
    try:
        sender.send(_hello(0, "cpu:0"))
        sender.send(_ended(U64_MAX))
        sender.send(_ended(U64_MAX))
        started = {"rank": 0, "stage": 0, "device": "cpu:0", "step": 0, "index": 0, "t_ns": 1, "expected_ns": U64_MAX}
        sender.send({"type": "bubble_started", **started})
        sender.send(_ended(5))
        await wait_until(lambda: manager.events == 5, 10, "five events")
        reply = await _status(manager)
        assert reply.rejected_frames == 3 and reply.events == 5
        (device,) = reply.devices
        assert device.device == "cpu:0" and device.bubble_ns == 5  # only the legitimate one counted
    finally:
        sender.close()


async def test_a_hello_flood_keeps_open_fds_bounded(manager: Manager) -> None:
    sender = _Sender(manager)
    fds_before = len(os.listdir("/proc/self/fd"))
    flood = MAX_RANKS + 300
    try:
        for rank in range(flood):
            sender.send(_hello(rank, f"cpu:{rank}"))
        await wait_until(lambda: manager.events == flood, 30, "every Hello handled")
        reply = await _status(manager)
        assert len(manager.live_backends()) == MAX_RANKS and manager.ranks.watched() == MAX_RANKS
        assert reply.rejected_frames == flood - MAX_RANKS
        assert len(os.listdir("/proc/self/fd")) - fds_before <= MAX_RANKS + 8  # a pidfd each, and sockets
    finally:
        sender.close()


async def test_a_new_device_name_per_event_keeps_the_tables_bounded(manager: Manager) -> None:
    sender = _Sender(manager)
    flood = MAX_DEVICES * 3
    try:
        for i in range(flood):
            fields = {"rank": 1, "stage": 0, "device": f"gpu-{i}", "step": 0, "index": i, "t_ns": 1, "expected_ns": 1}
            sender.send({"type": "bubble_started", **fields})
        await wait_until(lambda: manager.events == flood, 30, "every event handled")
        reply = await _status(manager)
        assert len(manager.devices) <= MAX_DEVICES and len(manager.schedulers) == len(manager.devices)
        assert f"gpu-{flood - 1}" in manager.devices and len(reply.devices) == len(manager.devices)
    finally:
        sender.close()


async def test_an_oversized_frame_is_refused_and_the_manager_goes_on(manager: Manager) -> None:
    sender = _Sender(manager)
    try:
        sender.sock.send(b"\x00" * (p.MAX_EVENT_FRAME + 1))  # libzmq drops the connection, not the manager
        huge = _hello(0, "cpu:0")
        sender.send(msgspec.structs.replace(huge, device="x" * 1000))  # small frame, string over its bound
        await wait_until(lambda: manager.rejected_frames >= 1, 10, "the long name rejected")
    finally:
        sender.close()
    again = _Sender(manager)
    try:
        again.send(_hello(1, "cpu:1"))
        await wait_until(lambda: "cpu:1" in manager.devices, 10, "a good Hello after the oversized frame")
        reply = await _status(manager)
        assert reply.rejected_frames == 1 and "x" * 1000 not in manager.devices
    finally:
        again.close()


async def test_an_oversized_control_request_does_not_cost_the_answer_to_others(manager: Manager) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(manager.config.endpoints.control)
    try:
        rogue.send(b"\x00" * (p.MAX_CONTROL_FRAME + 1))
        reply = await _status(manager)
        assert reply.rejected_frames == 0
    finally:
        rogue.close(0)
        ctx.term()


async def test_status_answers_while_a_flood_goes_on(manager: Manager) -> None:
    # A sender thread floods the events socket as fast as it can for as long as the
    # test asks for status; each status must come while the flood is being read (when
    # one loop served everything, status got no answer in 10 s at 30k events/s).
    stop = threading.Event()

    def flood() -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)  # as fast as the manager reads, without piling up here
        sock.connect(manager.config.endpoints.events)
        frames = [
            msgspec.msgpack.encode(
                p.BubbleStarted(rank=1000 + k, stage=0, device=f"flood:{k}", step=0, index=0, t_ns=1, expected_ns=1)
            )
            for k in range(8)
        ]
        try:
            while not stop.is_set():
                for frame in frames:
                    with contextlib.suppress(zmq.Again):
                        sock.send(frame, zmq.NOBLOCK)
        finally:
            sock.close()
            ctx.term()

    thread = threading.Thread(target=flood, name="flood", daemon=True)
    thread.start()
    try:
        await wait_until(lambda: manager.events > 10_000, 30, "the flood under way")
        for _ in range(5):
            before = manager.events
            reply = await _status(manager)
            assert manager.events > before, "the flood was read while status was asked for"
            assert reply.events >= before
    finally:
        stop.set()
        thread.join(30)
