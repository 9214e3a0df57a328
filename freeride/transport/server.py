"""The manager's sockets: PULL for backend events, SUB to ranks' bubbles, ROUTERs for workers and clients."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar, cast

import msgspec
import zmq
import zmq.asyncio

from freeride import protocol as p
from freeride.auth import CurveServerKeys
from freeride.transport.frames import BUBBLE_END, BUBBLE_START, HELLO_ACK, BadFrame, decode, encoder
from freeride.transport.guard import guard_server
from freeride.transport.owner import AsyncOwner

__all__ = ["BubbleEvent", "BubbleFollower", "ControlServer", "EventReceiver", "HelloAcks", "WorkerHub"]

logger = logging.getLogger(__name__)

_M = TypeVar("_M")
_T = TypeVar("_T")


def _drain(read: Callable[[], _T | None], limit: int) -> list[_T]:
    """Up to ``limit`` of what ``read`` (a non-blocking receive) finds already queued, without waiting.

    Receives until one would block: a receive that finds the socket empty
    re-arms its descriptor, so the next message signals it (cheaper under a
    flood than asking ``ZMQ_EVENTS`` before each receive).
    """
    out: list[_T] = []
    while len(out) < limit:
        item = read()
        if item is None:
            break
        out.append(item)
    return out


class _DescriptorOwner(AsyncOwner[_M]):
    """Waits for its socket by watching the socket's descriptor itself (a reader on the event loop).

    It reads and sends with non-blocking calls on the plain socket, never
    through pyzmq's asyncio ones: messages mostly come and go one at a time,
    each a wake-up of the manager, and pyzmq's Future per call makes each cost
    more CPU, which on a machine without spare cores is taken from training
    (docs/benchmarks.md, "Where the simulated pipeline's slowdown goes"). Only
    this object uses the socket, so the descriptor's edge-triggered signal is
    never taken by anyone else; a send, which may take it, looks whether
    messages came meanwhile (:meth:`_sent`).
    """

    def __init__(self, sock: zmq.asyncio.Socket, decoder: msgspec.msgpack.Decoder[_M]) -> None:
        super().__init__(sock, decoder)
        self._reading: tuple[asyncio.AbstractEventLoop, int] | None = None
        """The loop and descriptor the reader is registered on (``None``: not yet)."""
        self._ready = asyncio.Event()

    def close(self) -> None:
        self.pause()
        super().close()

    async def _batch(self, read: Callable[[], _T | None], limit: int) -> list[_T]:
        """Up to ``limit`` of what ``read`` finds already queued, waiting until there is one."""
        batch = _drain(read, limit)
        while not batch:
            if self._reading is None:
                plain = self._plain
                if plain is None:
                    raise RuntimeError("socket already closed")
                loop, fd = asyncio.get_running_loop(), cast(int, plain.getsockopt(zmq.FD))
                loop.add_reader(fd, self._ready.set)
                self._reading = (loop, fd)
            self._ready.clear()
            # the descriptor signals a change, not a level: look again after clearing, then wait
            batch = _drain(read, limit)
            if not batch:
                await self._ready.wait()
                batch = _drain(read, limit)
        return batch

    def pause(self) -> None:
        """Stop watching the socket's descriptor until the next wait: messages queue without waking anyone."""
        if self._reading is not None:
            loop, fd = self._reading
            self._reading = None
            if not loop.is_closed():
                loop.remove_reader(fd)

    def _sent(self) -> None:
        """After a send: the send may have taken the descriptor's signal of a message come meanwhile."""
        plain = self._plain
        if plain is not None and cast(int, plain.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._ready.set()


class _DescriptorReader(_DescriptorOwner[_M]):
    """Reads one-frame messages (a PULL, a SUB) through :class:`_DescriptorOwner`.

    Each frame is read, and judged, on its own (a message of several is read as
    that many): asking whether more frames follow would cost another call into
    libzmq per event.
    """

    _topic_bytes = 0
    """Bytes before the message in each frame (a publisher's topic), skipped when decoding."""

    async def _frames(self, limit: int) -> list[bytes]:
        return await self._batch(self._frame_nowait, limit)

    async def recv_batch(self, limit: int) -> list[_M | BadFrame]:
        """The next message, and up to ``limit - 1`` more that are already queued."""
        return [self._event(frame) for frame in await self._frames(limit)]

    def drain_nowait(self, limit: int) -> list[_M | BadFrame]:
        """Up to ``limit`` messages already queued, without waiting (none: an empty list)."""
        return [self._event(frame) for frame in _drain(self._frame_nowait, limit)]

    def _event(self, frame: bytes) -> _M | BadFrame:
        return decode(self._decoder, frame[self._topic_bytes :])


class EventReceiver(_DescriptorReader[p.BackendEvent]):
    """The manager's PULL socket for backend events."""

    def __init__(
        self, ctx: zmq.asyncio.Context, endpoint: str, *, rcvhwm: int = 100_000, curve: CurveServerKeys | None = None
    ) -> None:
        sock = ctx.socket(zmq.PULL)
        guard_server(sock, endpoint, curve)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_EVENT_FRAME)
        sock.bind(endpoint)
        super().__init__(sock, msgspec.msgpack.Decoder(p.BackendEvent))

    async def recv(self) -> p.BackendEvent | BadFrame:
        return self._event((await self._frames(1))[0])


BubbleEvent = p.BubbleStarted | p.BubbleEnded
"""What a rank's bubble publisher sends."""


def _connect(sock: zmq.asyncio.Socket, connected: set[str], endpoint: str) -> None:
    """Connect ``sock`` to the rank's publisher on ``endpoint`` (ipc only), unless ``connected`` has it."""
    if endpoint in connected:
        return
    if not endpoint.startswith("ipc://"):
        raise ValueError(f"bubble publishers are reached over ipc only, got {endpoint!r}")
    sock.connect(endpoint)
    connected.add(endpoint)


def _disconnect(sock: zmq.asyncio.Socket, connected: set[str], endpoint: str) -> None:
    """Disconnect ``sock`` from ``endpoint`` if ``connected`` has it."""
    if endpoint not in connected:
        return
    connected.discard(endpoint)
    try:
        sock.disconnect(endpoint)
    except zmq.ZMQError as exc:  # never connected as far as libzmq knows: nothing left to undo
        logger.debug("[events] disconnecting %s: %s", endpoint, exc)


def _connect_exactly(sock: zmq.asyncio.Socket, connected: set[str], endpoints: set[str]) -> None:
    """Leave ``sock`` connected to ``endpoints`` and no other; ``connected`` is what it is connected to."""
    for endpoint in connected - endpoints:
        _disconnect(sock, connected, endpoint)
    for endpoint in endpoints - connected:
        _connect(sock, connected, endpoint)


class HelloAcks:
    """The manager's answer to the ranks' ``Hello``: a SUB to the bubble publisher of every rank it knows.

    It subscribes to :data:`HELLO_ACK`, on which nothing is published: it never
    receives, and costs a rank nothing per bubble. The subscription reaching a
    rank's publisher tells the rank its ``Hello`` was taken, so it stops
    repeating it at the fast pace. Like :class:`BubbleFollower` it connects only
    to endpoints the manager derived itself, inside its private runtime directory.
    """

    def __init__(self, ctx: zmq.asyncio.Context, *, topic: bytes = HELLO_ACK) -> None:
        """``topic``: :data:`HELLO_ACK`, or what :func:`~freeride.transport.frames.hello_ack_topic` makes of the
        manager's held-back steps (the ranks then publish no bubble of theirs)."""
        if not topic.startswith(HELLO_ACK):
            raise ValueError(f"an acknowledgement topic starts with {HELLO_ACK!r}, got {topic[:8]!r}")
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 1)  # nothing is published on the topic: nothing to keep
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 500)
        sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._sock: zmq.asyncio.Socket | None = sock
        self.connected: set[str] = set()
        """The endpoints connected now."""

    def answer_exactly(self, endpoints: set[str]) -> None:
        """Be connected to the publishers on ``endpoints`` (ipc only), and to no other."""
        if self._sock is not None:
            _connect_exactly(self._sock, self.connected, endpoints)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


class BubbleFollower(_DescriptorReader[BubbleEvent]):
    """The manager's SUB to the bubble publishers of the ranks whose devices may run side work.

    The manager follows a rank (:meth:`follow`) while side work is placed on its
    device or waits for one, and stops (:meth:`unfollow`) once none is: a rank
    nobody follows publishes into nothing and wakes no one (decision D50). Only
    endpoints inside the manager's private runtime directory are followed (the
    manager derives them itself); a socket file that is gone is retried now and
    then by libzmq until it is unfollowed.
    """

    _topic_bytes = len(BUBBLE_START)

    def __init__(self, ctx: zmq.asyncio.Context, *, rcvhwm: int = 100_000) -> None:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_EVENT_FRAME + 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 500)  # a rank that left: its file is retried twice a second, not ten times
        sock.setsockopt(zmq.SUBSCRIBE, BUBBLE_START)
        sock.setsockopt(zmq.SUBSCRIBE, BUBBLE_END)
        super().__init__(sock, msgspec.msgpack.Decoder(BubbleEvent))
        self.followed: set[str] = set()
        """The endpoints connected now."""

    def follow(self, endpoint: str) -> None:
        """Connect to the publisher on ``endpoint`` (ipc only; nothing to do if already)."""
        _connect(self._live(), self.followed, endpoint)

    def unfollow(self, endpoint: str) -> None:
        """Disconnect from ``endpoint`` (nothing to do if not followed)."""
        _disconnect(self._live(), self.followed, endpoint)

    def follow_exactly(self, endpoints: set[str]) -> None:
        """Follow the publishers on ``endpoints`` (ipc only), and no other."""
        _connect_exactly(self._live(), self.followed, endpoints)


class _RouterOwner(_DescriptorOwner[_M]):
    async def recv(self) -> tuple[bytes, _M | BadFrame]:
        return self._message((await self._batch(self._queued_nowait, 1))[0])

    async def recv_batch(self, limit: int) -> list[tuple[bytes, _M | BadFrame]]:
        """The next message, and up to ``limit - 1`` more that are already queued."""
        return [self._message(frames) for frames in await self._batch(self._queued_nowait, limit)]

    def _message(self, frames: list[bytes]) -> tuple[bytes, _M | BadFrame]:
        if len(frames) != 2:
            ident = frames[0] if frames else b""
            return ident, BadFrame(reason=f"expected 2 frames, got {len(frames)}", size=sum(map(len, frames)))
        return frames[0], decode(self._decoder, frames[1])

    def _send_nowait(self, ident: bytes, msg: msgspec.Struct) -> bool:
        plain = self._plain
        if plain is None:
            raise RuntimeError("socket already closed")
        try:
            plain.send_multipart([ident, encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or its queue full
            logger.warning("[send] to %r failed: %s", ident, exc)
            return False
        finally:
            self._sent()
        return True


class WorkerHub(_RouterOwner[p.WorkerToManager]):
    """The manager's ROUTER for side-task workers; identities are task ids."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        sock = ctx.socket(zmq.ROUTER)
        guard_server(sock, endpoint, None)  # always ipc: the peer-uid check
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_WORKER_FRAME)
        sock.bind(endpoint)
        super().__init__(sock, msgspec.msgpack.Decoder(p.WorkerToManager))

    def send_nowait(self, ident: bytes, msg: p.ManagerToWorker) -> bool:
        return self._send_nowait(ident, msg)


class ControlServer(_RouterOwner[p.ControlRequest]):
    """The manager's ROUTER for control clients."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, *, curve: CurveServerKeys | None = None) -> None:
        sock = ctx.socket(zmq.ROUTER)
        guard_server(sock, endpoint, curve)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_CONTROL_FRAME)
        sock.bind(endpoint)
        super().__init__(sock, msgspec.msgpack.Decoder(p.ControlRequest))

    def reply_nowait(self, ident: bytes, msg: p.ControlReply) -> bool:
        return self._send_nowait(ident, msg)
