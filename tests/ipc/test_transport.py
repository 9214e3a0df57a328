"""The backend emitter and the manager's receiver over real ipc:// sockets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import msgspec
import zmq

from freeride import protocol as p
from freeride.transport import BadFrame, ControlServer, EventEmitter, EventReceiver, ZapHandler, new_async_context


def beat(rank: int) -> p.Heartbeat:
    return p.Heartbeat(rank=rank, t_ns=time.monotonic_ns())


async def test_events_arrive_in_order_and_garbage_is_reported(runtime_dir: Path) -> None:
    endpoint = f"ipc://{runtime_dir}/events"
    ctx = new_async_context()
    receiver = EventReceiver(ctx, endpoint)
    emitter = EventEmitter(endpoint)
    raw_ctx = zmq.Context()
    raw = raw_ctx.socket(zmq.PUSH)
    raw.connect(endpoint)
    try:
        while not emitter.emit(beat(0)):  # IMMEDIATE: nothing goes out before the connection is up
            time.sleep(0.001)
        first = await receiver.recv()
        assert isinstance(first, p.Heartbeat) and first.rank == 0
        for i in range(1, 100):
            assert emitter.emit(beat(i))
        got = [await receiver.recv() for _ in range(99)]
        assert [e.rank for e in got if isinstance(e, p.Heartbeat)] == list(range(1, 100))

        raw.send(b"\x00garbage")
        raw.send(msgspec.msgpack.encode({"type": "no_such_event"}))
        raw.send_multipart([b"a", msgspec.msgpack.encode(beat(7))])  # each frame is read on its own
        raw.send(msgspec.msgpack.encode(beat(8)))
        bad = [await receiver.recv() for _ in range(3)]
        assert all(isinstance(b, BadFrame) for b in bad)
        assert "no_such_event" in bad[1].reason  # type: ignore[union-attr]
        after = [await receiver.recv() for _ in range(2)]
        assert [e.rank for e in after if isinstance(e, p.Heartbeat)] == [7, 8]
    finally:
        raw.close(0)
        raw_ctx.term()
        emitter.close()
        receiver.close()
        ctx.term()


def test_emitter_without_manager_never_blocks(runtime_dir: Path) -> None:
    emitter = EventEmitter(f"ipc://{runtime_dir}/nobody-listens")
    worst = 0
    t0 = time.perf_counter_ns()
    for i in range(10_000):
        a = time.perf_counter_ns()
        emitter.emit(beat(i))
        worst = max(worst, time.perf_counter_ns() - a)
    total = time.perf_counter_ns() - t0
    emitter.close(p.Goodbye(rank=0, t_ns=0))
    assert emitter.dropped >= 10_000 and emitter.sent == 0
    # 10k sends cost ~10 ms here; the bound only catches blocking, not speed
    assert total < 2_000_000_000 and worst < 200_000_000, (total, worst)


def test_emitter_goes_silent_in_a_forked_child(runtime_dir: Path) -> None:
    emitter = EventEmitter(f"ipc://{runtime_dir}/events")
    pid = os.fork()
    if pid == 0:  # child: must not touch the parent's socket
        ok = emitter.emit(beat(1)) is False and emitter.dropped == 1
        emitter.close()
        os._exit(0 if ok else 1)
    _, code = os.waitpid(pid, 0)
    emitter.close()
    assert os.waitstatus_to_exitcode(code) == 0


def test_close_is_idempotent(runtime_dir: Path) -> None:
    emitter = EventEmitter(f"ipc://{runtime_dir}/events")
    emitter.close()
    emitter.close()
    assert emitter.emit(beat(0)) is False


async def test_emitter_backs_off_without_a_manager_and_recovers_when_one_comes(runtime_dir: Path) -> None:
    endpoint = f"ipc://{runtime_dir}/late"
    emitter = EventEmitter(endpoint)
    for i in range(1000):
        assert not emitter.emit(beat(i))
    assert emitter.dropped == 1000
    ctx = new_async_context()
    receiver = EventReceiver(ctx, endpoint)
    try:
        deadline = time.monotonic() + 5
        while not emitter.emit(beat(7)):  # the pause between tries is at most 128 ms
            assert time.monotonic() < deadline, "the emitter never tried again"
            time.sleep(0.001)
        got = await receiver.recv()
        assert isinstance(got, p.Heartbeat) and got.rank == 7
        assert emitter.emit(beat(8))  # back to sending every event
    finally:
        emitter.close()
        receiver.close()
        ctx.term()


async def test_a_ranks_first_message_waits_for_the_connection_and_is_not_dropped(runtime_dir: Path) -> None:
    endpoint = f"ipc://{runtime_dir}/events"
    ctx = new_async_context()
    receiver = EventReceiver(ctx, endpoint)
    emitter = EventEmitter(endpoint)
    try:
        assert emitter.wait_connected(2000)
        assert emitter.emit(beat(7))  # the first send, at once
        first = await receiver.recv()
        assert isinstance(first, p.Heartbeat) and first.rank == 7 and emitter.dropped == 0
    finally:
        emitter.close()
        receiver.close()
        ctx.term()


def test_without_a_manager_socket_nothing_is_waited_for(runtime_dir: Path) -> None:
    emitter = EventEmitter(f"ipc://{runtime_dir}/events")
    try:
        start = time.monotonic()
        assert not emitter.wait_connected(2000)
        assert time.monotonic() - start < 0.5
    finally:
        emitter.close()


async def test_a_router_waiting_to_read_misses_no_message_while_it_sends(runtime_dir: Path) -> None:
    """The manager's ROUTERs send on the plain socket, which may take the descriptor's signal of a message
    that came meanwhile: the owner looks again after each send, so a read waiting on the descriptor wakes."""
    endpoint = f"ipc://{runtime_dir}/control"
    ctx = new_async_context()
    zap = ZapHandler(ctx, uid=os.getuid())
    server = ControlServer(ctx, endpoint)
    raw_ctx = zmq.Context()
    client = raw_ctx.socket(zmq.DEALER)
    client.connect(endpoint)
    request = msgspec.msgpack.encode(p.StatusRequest())
    try:
        async with asyncio.TaskGroup() as tg:
            served = tg.create_task(zap.serve(), name="test-zap")
            client.send(request)
            ident, _ = await asyncio.wait_for(server.recv(), 10)
            for i in range(300):
                reading = asyncio.ensure_future(server.recv_batch(8))
                await asyncio.sleep(0)  # the read is now parked on the descriptor
                client.send(request)
                for _ in range(40):  # replies sent while the request comes in: a send may take its signal
                    assert server.reply_nowait(ident, p.Rejected(reason=str(i)))
                    time.sleep(0.00002)
                got = await asyncio.wait_for(reading, 5)
                assert [type(m) for _, m in got] == [p.StatusRequest], got
                while client.poll(0):
                    client.recv()
            served.cancel()
    finally:
        client.close(0)
        raw_ctx.term()
        server.close()
        zap.close()
        ctx.term()


async def test_a_worker_link_wait_cancelled_as_its_message_comes_keeps_the_message(runtime_dir: Path) -> None:
    """A worker waiting for its own input and for the manager at once cancels one wait when the other ends
    (``race_link``). Cancelled just as the manager's message came, the wait had taken it off the socket
    already: lost, an Arm or a Revoke left the manager waiting for an answer that never came (the task was
    then frozen as a hung step). The cancel is made to land exactly then: from the receive's own completion,
    ahead of the waiting task's wake-up."""
    from freeride.transport import WorkerHub, WorkerLink, wait_readable

    ctx = new_async_context()
    endpoint = f"ipc://{runtime_dir}/workers"
    hub = WorkerHub(ctx, endpoint)
    link = WorkerLink(ctx, endpoint, task_id=7)
    try:
        link.send_nowait(p.WorkerReady(protocol_version=p.PROTOCOL_VERSION, task_id=7, pid=os.getpid()))
        ident, _ = await asyncio.wait_for(hub.recv(), 10)
        sock = link._live()
        plain_recv = sock.recv
        waiting: list[asyncio.Task[object]] = []

        def recv_cancelled_on_arrival(*args: object, **kwargs: object) -> object:
            fut = plain_recv(*args, **kwargs)  # type: ignore[arg-type]
            fut.add_done_callback(lambda _: waiting[0].cancel())  # type: ignore[union-attr]
            return fut

        sock.recv = recv_cancelled_on_arrival  # type: ignore[method-assign]
        waiting.append(asyncio.ensure_future(link.recv()))
        await asyncio.sleep(0.05)  # the receive is posted
        assert hub.send_nowait(ident, p.Revoke(grant_id=5))
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(waiting[0], 10)
        sock.recv = plain_recv  # type: ignore[method-assign]
        assert link.holds_message
        await asyncio.wait_for(wait_readable(link), 1)  # a poll says so at once
        assert link.recv_nowait() == p.Revoke(grant_id=5)
        assert not link.holds_message and link.recv_nowait() is None
    finally:
        link.close()
        hub.close()
        ctx.term()
