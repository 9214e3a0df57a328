"""Waiting for a task's own input while still answering the manager.

A task that awaits its own I/O between steps (a spool directory, a queue) is
not in a step and holds no bubble, but it must still hear a ``Stop`` (to be
checkpointed rather than killed) and give back any grant that arrives. The
gate does this by racing the task's awaitable against its link.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from freeride import protocol as p
from freeride.transport import BadFrame

__all__ = ["GateLink", "race_link"]

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
