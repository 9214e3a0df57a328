"""What every asyncio socket owner shares: one context per process, non-blocking reads, bounded batches."""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

__all__ = ["AsyncOwner", "new_async_context"]

_M = TypeVar("_M")


def new_async_context() -> zmq.asyncio.Context:
    """A fresh context for one process's async sockets (never the global instance)."""
    return zmq.asyncio.Context()


class AsyncOwner(Generic[_M]):
    """Owns one asyncio socket and the typed decoder of what it receives; :meth:`close` is idempotent."""

    def __init__(self, sock: zmq.asyncio.Socket, decoder: msgspec.msgpack.Decoder[_M]) -> None:
        self._sock: zmq.asyncio.Socket | None = sock
        self._decoder = decoder
        self._plain: zmq.Socket[bytes] | None = zmq.Socket.shadow(sock.underlying)
        """The same socket without asyncio, for non-blocking reads (it owns nothing: closing ``_sock`` closes it)."""

    def _live(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            raise RuntimeError("socket already closed")
        return self._sock

    def close(self) -> None:
        self._plain = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _frame_nowait(self) -> bytes | None:
        """The next single-frame message if one is already queued, without waiting.

        What pyzmq's asyncio socket itself does for a non-blocking receive (a
        plain receive on a shadow of the same socket), without the Future it
        wraps the answer in: a third of the cost, and the workers read their
        sockets this way between every two side-task steps. Reading
        ``ZMQ_EVENTS`` instead would swallow the edge-triggered wake-up of a
        later ``await recv()``; a receive does not, since every asyncio wait
        checks the socket's events before it parks.
        """
        plain = self._plain
        if plain is None:
            raise RuntimeError("socket already closed")
        try:
            return plain.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def _queued_nowait(self) -> list[bytes] | None:
        """The next message if one is already queued, without waiting (see :meth:`_frame_nowait`)."""
        plain = self._plain
        if plain is None:
            raise RuntimeError("socket already closed")
        try:
            return plain.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
