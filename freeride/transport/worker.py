"""A side-task worker's sockets: its DEALER to the manager and its SUBs to a rank's bubble starts and ends."""

from __future__ import annotations

import asyncio
import logging
from typing import TypeVar, cast

import msgspec
import zmq
import zmq.asyncio

from freeride import protocol as p
from freeride.transport.frames import BUBBLE_END, BUBBLE_START, BadFrame, decode, encoder
from freeride.transport.owner import AsyncOwner

__all__ = ["BubbleListener", "WorkerLink", "wait_readable", "worker_identity"]

logger = logging.getLogger(__name__)

_E = TypeVar("_E", p.BubbleStarted, p.BubbleEnded)


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
        self._held: bytes | None = None
        """A message a cancelled :meth:`recv` had already taken off the socket: the next read returns it."""

    @property
    def holds_message(self) -> bool:
        """Whether a message taken off the socket by a cancelled :meth:`recv` waits to be read."""
        return self._held is not None

    async def recv(self) -> p.ManagerToWorker | BadFrame:
        """The next message; cancelling the wait never loses one.

        A wait cancelled just as its message came (the task's own input
        arrived at the same moment: :func:`~freeride.worker.waiting.race_link`)
        has taken the message off the socket already; it is kept for the next
        read. Lost, an Arm or a Revoke would leave the manager waiting for an
        answer that never comes.
        """
        if self._held is not None:
            frame, self._held = self._held, None
            return decode(self._decoder, frame)
        fut = cast("asyncio.Future[bytes]", self._live().recv())  # pyzmq's asyncio socket returns a Future
        try:
            frame = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._held = fut.result()
            raise
        return decode(self._decoder, frame)

    def recv_nowait(self) -> p.ManagerToWorker | BadFrame | None:
        """A message that has already arrived, or ``None`` (see ``_frame_nowait``)."""
        frame, self._held = self._held, None
        if frame is None:
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


class _Latest(AsyncOwner[_E]):
    """A SUB to one topic of a rank's :class:`BubblePublisher`, keeping only its latest message (conflated).

    One topic a socket: a conflated queue keeps one message of all it receives.
    """

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, topic: bytes, kind: type[_E]) -> None:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.CONFLATE, 1)  # before connect
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_EVENT_FRAME)
        sock.setsockopt(zmq.SUBSCRIBE, topic)
        sock.connect(endpoint)
        self._topic_bytes = len(topic)
        super().__init__(sock, msgspec.msgpack.Decoder(kind))

    def recv_nowait(self) -> _E | BadFrame | None:
        """The latest message not yet read, or ``None`` (see :meth:`WorkerLink.recv_nowait`)."""
        frame = self._frame_nowait()
        if frame is None:
            return None
        event: _E | BadFrame = decode(self._decoder, frame[self._topic_bytes :])
        return event


class BubbleListener(_Latest[p.BubbleStarted]):
    """An armed worker's SUBs to its rank's :class:`BubblePublisher`: the bubbles' starts, and their ends.

    Conflated: only the latest bubble start (and end) is kept, so a worker that
    has not read for a while finds the current bubble, not a queue of past ones.
    Only the starts' socket is waited on (:func:`wait_readable`): a worker
    between bubbles is woken by a start, never by an end. The ends are read
    between steps, so that a worker stops starting steps once its bubble ended,
    whenever the manager's revoke reaches it.
    """

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        if not endpoint.startswith("ipc://"):
            raise ValueError(f"bubble starts are followed over ipc only, got {endpoint!r}")
        self.endpoint = endpoint
        super().__init__(ctx, endpoint, BUBBLE_START, p.BubbleStarted)
        self._ends = _Latest(ctx, endpoint, BUBBLE_END, p.BubbleEnded)

    def close(self) -> None:
        self._ends.close()
        super().close()

    def recv_end_nowait(self) -> p.BubbleEnded | BadFrame | None:
        """The latest bubble end not yet read, or ``None``."""
        return self._ends.recv_nowait()


async def wait_readable(*owners: WorkerLink | BubbleListener) -> None:
    """Return once one of ``owners`` has a message queued (read it with its ``recv_nowait``).

    Polls through pyzmq's asyncio poller, which keeps each socket's edge-triggered
    wake-ups consistent with its owner's own awaits.
    """
    if any(isinstance(owner, WorkerLink) and owner.holds_message for owner in owners):
        return
    poller = zmq.asyncio.Poller()
    for owner in owners:
        poller.register(owner._live(), zmq.POLLIN)
    await poller.poll()
