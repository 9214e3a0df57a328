"""Waiting for a task's own input while still answering the manager.

A task that awaits its own I/O between steps (a spool directory, a queue) is
not in a step and holds no bubble, but it must still hear a ``Stop`` (to be
checkpointed rather than killed) and give back any grant that arrives. The
gate does this by racing the task's awaitable against its link.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from freeride import protocol as p
from freeride.transport import BadFrame

__all__ = ["GateLink", "IdleWaits", "race_link"]

_T = TypeVar("_T")


class GateLink(Protocol):
    """What the gate needs of its link to the manager (a :class:`~freeride.transport.WorkerLink`)."""

    def recv_nowait(self) -> p.ManagerToWorker | BadFrame | None:
        """The next message if one has arrived, else ``None``."""
        ...

    async def recv(self) -> p.ManagerToWorker | BadFrame:
        """Wait for the next message."""
        ...

    def send_nowait(self, msg: p.WorkerToManager) -> None:
        """Send a message without waiting."""
        ...


async def race_link(
    awaitable: Awaitable[_T],
    recv: Callable[[], Awaitable[p.ManagerToWorker | BadFrame]],
    on_message: Callable[[p.ManagerToWorker | BadFrame], None],
    *,
    tick: Callable[[], None],
    period_s: float,
) -> _T:
    """Await ``awaitable`` while handing every message ``recv`` yields to ``on_message``.

    ``on_message`` ends the wait by raising (the gate raises ``TaskStopped`` on
    a stop): the awaitable is then cancelled, so the task's own wait unwinds
    through its ``finally`` blocks. ``tick`` runs at least every ``period_s``
    (progress reports).
    """
    work: asyncio.Future[_T] = asyncio.ensure_future(awaitable)
    incoming: asyncio.Future[p.ManagerToWorker | BadFrame] | None = None
    try:
        while True:
            if incoming is None:
                incoming = asyncio.ensure_future(recv())
            pending: set[asyncio.Future[Any]] = {work, incoming}
            done, _ = await asyncio.wait(pending, timeout=period_s, return_when=asyncio.FIRST_COMPLETED)
            if incoming in done:
                msg, incoming = incoming.result(), None
                on_message(msg)
            if work in done:
                return work.result()
            tick()
    finally:
        for future in (incoming, work):
            if future is not None and not future.done():
                future.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await future


class IdleWaits:
    """The waits of a task for its own input between steps, as the gate runs them.

    Args:
        link: The worker's link to the manager.
        on_message: Handles a message that came meanwhile (gives back any grant; raises on a stop).
        waiting: Called once a real wait begins (after every grant is given back), with True, and with
            False once it ends.
        tick: Called at least every ``period_s`` while waiting (progress reports).
        period_s: See ``tick``.
    """

    def __init__(
        self,
        link: GateLink,
        *,
        on_message: Callable[[p.ManagerToWorker | BadFrame], None],
        waiting: Callable[[bool], None],
        tick: Callable[[], None],
        period_s: float,
    ) -> None:
        self._link = link
        self._on_message = on_message
        self._waiting = waiting
        self._tick = tick
        self._period_s = period_s

    async def wait_for(self, awaitable: Awaitable[_T]) -> _T:
        """Await ``awaitable``; what is there already is taken in one pass of the event loop, without a wait."""
        work: asyncio.Future[_T] = asyncio.ensure_future(awaitable)
        try:
            await asyncio.sleep(0)  # one pass: the awaitable runs up to its first real wait
        except BaseException:
            work.cancel()
            raise
        if work.done():
            return work.result()
        while (msg := self._link.recv_nowait()) is not None:
            self._on_message(msg)
        self._waiting(True)
        try:
            return await race_link(work, self._link.recv, self._on_message, tick=self._tick, period_s=self._period_s)
        finally:
            self._waiting(False)

    async def idle_until(self, source: AsyncIterable[_T]) -> AsyncIterator[_T]:
        """Iterate ``source``, waiting for each item as :meth:`wait_for` does."""
        items = aiter(source)
        while True:
            try:
                item = await self.wait_for(anext(items))
            except StopAsyncIteration:
                return
            yield item
