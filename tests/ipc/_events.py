"""A stand-in manager's ears: every event the training ranks send, from both of the sockets they send on.

A rank sends its Hello, step reports and goodbye to the events socket and, once
it publishes its bubbles (decision D50), its bubble starts and ends to its own
publisher, which a manager follows. :class:`EventTap` binds the events socket
and follows every publisher a Hello names, as the manager would while it
learns a device's bubbles, and hands out what comes from both as one stream
(in arrival order per socket; the two interleave as they arrive).
"""

from __future__ import annotations

import asyncio

import zmq.asyncio

from freeride import protocol as p
from freeride.transport import BadFrame, BubbleFollower, EventReceiver

__all__ = ["EventTap"]


class EventTap:
    """Binds ``endpoint`` and follows the ranks' bubble publishers; :meth:`recv` the next event from either."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self._receiver = EventReceiver(ctx, endpoint)
        self._follower = BubbleFollower(ctx)
        self._queue: asyncio.Queue[p.BackendEvent | BadFrame] = asyncio.Queue()
        self._pumps: list[asyncio.Task[None]] = []

    async def _pump_events(self) -> None:
        while True:
            for event in await self._receiver.recv_batch(64):
                if isinstance(event, p.Hello) and event.bubbles_endpoint:
                    self._follower.follow(event.bubbles_endpoint)
                self._queue.put_nowait(event)

    async def _pump_bubbles(self) -> None:
        while True:
            for event in await self._follower.recv_batch(64):
                self._queue.put_nowait(event)

    async def recv(self) -> p.BackendEvent | BadFrame:
        if not self._pumps:
            self._pumps = [
                asyncio.create_task(self._pump_events(), name="tap-events"),
                asyncio.create_task(self._pump_bubbles(), name="tap-bubbles"),
            ]
        return await self._queue.get()

    def close(self) -> None:
        for pump in self._pumps:
            pump.cancel()
        self._pumps = []
        self._follower.close()
        self._receiver.close()
