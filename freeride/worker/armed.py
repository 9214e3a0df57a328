"""Armed grants on the worker's side: a step starts on the rank's own bubble start.

The manager knows, once a bubble is given back, which task gets the next one.
It arms that task's worker (:class:`~freeride.protocol.Arm`); the worker follows
its rank's bubble starts directly (:class:`~freeride.transport.BubbleListener`)
and, when the next one arrives, takes it as the armed grant, with the deadline
the rank announced: one socket hop from bubble start to step start instead of
two. It reads the rank's bubble ends too, between steps: a grant whose bubble
ended starts no more steps, whenever the manager's Revoke comes.

The manager stays the authority: it sees the same events, counts the armed
task as the bubble's holder and revokes a grant still out at the end. Until the
worker has shown that it hears the rank (an armed report), the manager also
sends the Grant it would have sent anyway, which starts a worker that missed
the event and is ignored by one that took it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from freeride import protocol as p
from freeride.holdback import HoldbackSchedule, granted
from freeride.transport import BadFrame, BubbleListener, WorkerLink, wait_readable

__all__ = ["Arming", "BubbleFeed", "RankFeed"]

logger = logging.getLogger(__name__)


class BubbleFeed(Protocol):
    """The worker's view of its rank's bubble starts (a :class:`RankFeed`, or a test's fake)."""

    def follow(self, endpoint: str) -> None:
        """Listen to the rank publishing on ``endpoint`` (nothing to do if already)."""
        ...

    def recv_nowait(self) -> p.BubbleStarted | BadFrame | None:
        """The latest bubble start not yet read, else ``None``."""
        ...

    def recv_end_nowait(self) -> p.BubbleEnded | BadFrame | None:
        """The latest bubble end not yet read, else ``None``."""
        ...

    async def wait(self) -> None:
        """Return once the feed or the manager's link has something to read."""
        ...


class RankFeed:
    """A :class:`BubbleFeed` on a real socket; the listener is created at the first arm."""

    def __init__(self, link: WorkerLink, listen: Callable[[str], BubbleListener]) -> None:
        """Wait on ``link`` too; ``listen`` opens a listener on an endpoint (in the worker's context)."""
        self._link = link
        self._listen = listen
        self._listener: BubbleListener | None = None

    def follow(self, endpoint: str) -> None:
        if self._listener is not None and self._listener.endpoint == endpoint:
            return
        self.close()  # the rank on this device changed
        self._listener = self._listen(endpoint)
        logger.info("[worker] following bubble starts on %s", endpoint)

    def recv_nowait(self) -> p.BubbleStarted | BadFrame | None:
        return self._listener.recv_nowait() if self._listener is not None else None

    def recv_end_nowait(self) -> p.BubbleEnded | BadFrame | None:
        return self._listener.recv_end_nowait() if self._listener is not None else None

    async def wait(self) -> None:
        if self._listener is None:
            await wait_readable(self._link)
        else:
            await wait_readable(self._link, self._listener)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None


class Arming:
    """What the worker was armed with, and the latest bubble start it has seen: pure state."""

    def __init__(self) -> None:
        self.arm: p.Arm | None = None
        self._holdback: HoldbackSchedule | None = None
        """The held-back steps of the armed rank's job (the manager grants none of their bubbles)."""
        self._latest: p.BubbleStarted | None = None
        self.ended_ns = 0
        """When the rank's latest bubble end seen came (0: none): a grant of a bubble that started before it is over."""
        self._taken: p.Grant | None = None
        """The last armed grant taken from an event (kept after it is given back)."""

    def armed(self, arm: p.Arm) -> None:
        self.arm = arm
        if arm.holdback is None:
            self._holdback = None
        elif self._holdback is None or self._holdback.config != arm.holdback:
            self._holdback = HoldbackSchedule(arm.holdback)

    def disarmed(self, grant_id: int) -> bool:
        """Withdraw the arm ``grant_id``; whether it was still pending."""
        if self.arm is not None and self.arm.grant_id == grant_id:
            self.arm = None
            return True
        return False

    @property
    def rank_thread(self) -> int:
        """Native id of the rank's announcing thread, from its latest bubble start (0: none seen)."""
        return self._latest.thread if self._latest is not None else 0

    def seen(self, event: p.BubbleStarted) -> None:
        if self._latest is None or event.t_ns > self._latest.t_ns:
            self._latest = event

    def ended(self, event: p.BubbleEnded) -> None:
        self.ended_ns = max(self.ended_ns, event.t_ns)

    def over(self, grant: p.Grant) -> bool:
        """Whether ``grant``'s bubble has ended, as the rank announced (one rank's bubbles never overlap)."""
        return grant.bubble_t_ns < self.ended_ns

    def take(self) -> p.Grant | None:
        """The armed grant, if its bubble has started; the arm is spent then."""
        arm, ev = self.arm, self._latest
        if arm is None or ev is None or ev.t_ns <= arm.after_ns:
            return None
        expected = max(0, round(ev.expected_ns * arm.prediction_factor))  # as the manager's guard sets it
        if expected < arm.min_bubble_ns:
            return None  # too short for the guard: the manager grants it to no one, the arm waits for the next
        if self._holdback is not None and self._holdback.held(ev.step):
            return None  # held back to measure the job's cost: likewise granted to no one
        if not granted(arm.harvest_share, ev.step, ev.index):
            return None  # left out by the job's slowdown budget: likewise
        if ev.expected_ns < arm.gate_open_ns:
            return None  # shorter than the step queued behind the gate: the rank left the slot shut, the arm waits
        self.arm = None
        self._taken = p.Grant(
            grant_id=arm.grant_id,
            bubble_t_ns=ev.t_ns,
            deadline_ns=min(p.I64_MAX, ev.t_ns + expected),
            margin_ns=arm.margin_ns,
        )
        return self._taken

    def manager_grant(self, grant: p.Grant) -> bool:
        """Whether the manager's ``grant`` repeats the armed grant already taken (then ignore it).

        A Grant for the pending arm spends the arm: the worker starts from the
        manager's word. One for the grant taken from another bubble than the
        manager's (an event was lost on one of the two paths) is not a repeat.
        """
        if self.arm is not None and self.arm.grant_id == grant.grant_id:
            self.arm = None
            return False
        taken = self._taken
        return taken is not None and taken.grant_id == grant.grant_id and taken.bubble_t_ns == grant.bubble_t_ns

    def is_taken(self, grant_id: int) -> bool:
        return self._taken is not None and self._taken.grant_id == grant_id
