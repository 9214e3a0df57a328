"""A side-task worker's sockets: its DEALER to the manager and its SUB to a rank's bubble starts."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import zmq
import zmq.asyncio

from freeride import protocol as p
from freeride.transport.frames import BUBBLE_START, BadFrame, decode, encoder
from freeride.transport.owner import AsyncOwner

__all__ = ["BubbleListener", "WorkerLink", "wait_readable", "worker_identity"]

logger = logging.getLogger(__name__)


def worker_identity(task_id: int) -> bytes:
    return f"task-{task_id}".encode()


class WorkerLink(AsyncOwner[p.ManagerToWorker]):
    """A side-task worker's DEALER to the manager."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, task_id: int) -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, worker_identity(task_id))
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(endpoint)
        super().__init__(sock, msgspec.msgpack.Decoder(p.ManagerToWorker))

    async def recv(self) -> p.ManagerToWorker | BadFrame:
        frame = await self._live().recv()
        return decode(self._decoder, frame)

    def recv_nowait(self) -> p.ManagerToWorker | BadFrame | None:
        """A message that has already arrived, or ``None`` (see ``_frame_nowait``)."""
        frame = self._frame_nowait()
        if frame is None:
            return None
        msg: p.ManagerToWorker | BadFrame = decode(self._decoder, frame)
        return msg

    def send_nowait(self, msg: p.WorkerToManager) -> None:
        """Queue ``msg`` for the manager (a DEALER queues while the manager is away)."""
        fut = self._live().send(encoder.encode(msg), zmq.NOBLOCK)
        exc = fut.exception() if isinstance(fut, asyncio.Future) and fut.done() else None
        if exc is not None:
            logger.warning("[send] to the manager failed: %s", exc)


class BubbleListener(AsyncOwner[p.BubbleStarted]):
    """An armed worker's SUB to its rank's :class:`BubblePublisher`.

    Conflated: only the latest bubble start is kept, so a worker that has not
    read for a while finds the current bubble, not a queue of past ones.
    """

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        if not endpoint.startswith("ipc://"):
            raise ValueError(f"bubble starts are followed over ipc only, got {endpoint!r}")
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.CONFLATE, 1)  # before connect
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_EVENT_FRAME)
        sock.setsockopt(zmq.SUBSCRIBE, BUBBLE_START)  # starts only: a conflated queue must not keep an end
        sock.connect(endpoint)
        self.endpoint = endpoint
        super().__init__(sock, msgspec.msgpack.Decoder(p.BubbleStarted))

    def recv_nowait(self) -> p.BubbleStarted | BadFrame | None:
        """The latest bubble start not yet read, or ``None`` (see :meth:`WorkerLink.recv_nowait`)."""
        frame = self._frame_nowait()
        if frame is None:
            return None
        event: p.BubbleStarted | BadFrame = decode(self._decoder, frame[len(BUBBLE_START) :])
        return event


async def wait_readable(*owners: WorkerLink | BubbleListener) -> None:
    """Return once one of ``owners`` has a message queued (read it with its ``recv_nowait``).

    Polls through pyzmq's asyncio poller, which keeps each socket's edge-triggered
    wake-ups consistent with its owner's own awaits.
    """
    poller = zmq.asyncio.Poller()
    for owner in owners:
        poller.register(owner._live(), zmq.POLLIN)
    await poller.poll()
