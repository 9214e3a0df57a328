"""The grant a worker holds and what its task did inside it: the one place a worker builds a GrantDone.

Pure bookkeeping on the times the gate reads: which grant is held (and
whether it was revoked), the steps, busy time, first-step delay, overrun and
CPU clock seen inside it, how much room it has left for work of a given
length (:mod:`freeride.admission`), and the :class:`~freeride.protocol.GrantDone`
that gives it back.
"""

from __future__ import annotations

from dataclasses import dataclass

from freeride import protocol as p
from freeride.admission import fits, room_ns

__all__ = ["GrantLedger"]


@dataclass(slots=True)
class _Tally:
    """What the work inside one grant came to; a fresh tally is a grant in which nothing ran."""

    steps: int = 0
    busy_ns: int = 0
    """Time spent in steps and checkpoints inside the grant."""
    first_ns: int = -1
    """Bubble start to first step start (-1: no step yet)."""
    overrun_ns: int = 0
    last_end_ns: int = 0
    cpu_ns: int = -1
    """The process's CPU clock when the last piece of work ended (-1: none ended)."""
    armed: bool = False
    cpu_at_start_ns: int = -1
    """The process's CPU clock when it took an armed grant (-1: not armed)."""
    last_start_ns: int = 0
    cpu_at_last_start_ns: int = -1
    """The process's CPU clock when the last piece of work started (-1: unknown)."""


class GrantLedger:
    """The grant held and its tally.

    Args:
        assign: What the manager assigned: the task's id, and the margin used
            where a grant carries none.
    """

    def __init__(self, assign: p.Assign) -> None:
        self.assign = assign
        self.grant: p.Grant | None = None
        self.revoked = False
        self._tally = _Tally()

    @property
    def steps(self) -> int:
        """Steps run inside the grant held."""
        return self._tally.steps

    @property
    def open(self) -> p.Grant | None:
        """The grant held unless it was revoked: the one work may start in."""
        return None if self.revoked else self.grant

    def holds(self, grant_id: int) -> bool:
        return self.grant is not None and self.grant.grant_id == grant_id

    def take(self, grant: p.Grant) -> None:
        self.grant, self.revoked = grant, False

    def take_armed(self, grant: p.Grant, cpu_ns: int) -> None:
        """Take the armed grant, with the process's CPU clock read as it was taken."""
        self.take(grant)
        self._tally.armed, self._tally.cpu_at_start_ns = True, cpu_ns

    def margin(self, grant: p.Grant) -> int:
        """The grant's margin (its device's guard adapts it), else the one assigned at the start."""
        return grant.margin_ns if grant.margin_ns >= 0 else self.assign.margin_ns

    def room_ns(self, grant: p.Grant, now: int) -> int:
        """Time left at ``now`` before ``grant``'s deadline minus its margin."""
        return room_ns(now, grant.deadline_ns, self.margin(grant))

    def fits(self, now: int, need_ns: int) -> bool:
        """Whether work expected to take ``need_ns`` (-1: unknown) may start now in the grant held."""
        grant = self.open
        if grant is None:
            return False
        if need_ns < 0 or grant.probe:  # unknown or stale: one step, at the start of a grant still open
            return self._tally.steps == 0 and self.room_ns(grant, now) > 0
        return fits(now, need_ns, grant.deadline_ns, self.margin(grant))

    def at_start(self, now: int) -> bool:
        """Whether a grant is open, with room left, and no step ran in it yet."""
        grant = self.open
        return grant is not None and self._tally.steps == 0 and self.room_ns(grant, now) > 0

    def started(self, t0: int) -> None:
        """Note a step starting at ``t0``: the grant's first one sets the delay from its bubble's start."""
        if self._tally.steps == 0 and self.grant is not None:
            self._tally.first_ns = t0 - self.grant.bubble_t_ns

    def stepped(self, t0: int, t1: int, cpu_ns: int, *, cpu_at_start_ns: int = -1) -> None:
        """Note a step that ran from ``t0`` to ``t1``, and the CPU clock at its end (and start; -1 unread)."""
        self._tally.steps += 1
        self._ran(t0, t1, cpu_ns, cpu_at_start_ns)

    def checkpointed(self, t0: int, t1: int, cpu_ns: int, *, cpu_at_start_ns: int = -1) -> None:
        """Note a checkpoint that ran from ``t0`` to ``t1``, and the CPU clock at its end (and start; -1 unread)."""
        self._ran(t0, t1, cpu_ns, cpu_at_start_ns)

    def _ran(self, t0: int, t1: int, cpu_ns: int, cpu_at_start_ns: int) -> None:
        tally = self._tally
        tally.busy_ns += t1 - t0
        tally.last_end_ns, tally.cpu_ns = t1, cpu_ns
        tally.last_start_ns, tally.cpu_at_last_start_ns = t0, cpu_at_start_ns
        grant = self.grant
        if grant is not None and t1 > grant.deadline_ns:
            tally.overrun_ns = t1 - grant.deadline_ns

    def overrun_text(self, kind: str, t0: int, t1: int, waited: int, expected: int, *, at_least_ns: int) -> str:
        """What to say of a step of ``kind`` that ran from ``t0`` to ``t1`` (``waited`` of it for the CPU, against
        an estimate of ``expected``), if it ended at least ``at_least_ns`` past the held grant's deadline; else ""."""
        grant = self.grant
        if grant is None or t1 - grant.deadline_ns <= at_least_ns:
            return ""
        estimate = f"an estimate of {expected / 1e6:.1f} ms" if expected >= 0 else "no estimate yet"
        return (
            f"{kind!r} ran {(t1 - grant.deadline_ns) / 1e6:.1f} ms past its bubble's end: it took {(t1 - t0) / 1e6:.1f}"
            f" ms ({waited / 1e6:.1f} ms of it waiting for the CPU) against {estimate}, and started"
            f" {(grant.deadline_ns - t0) / 1e6:.1f} ms before the deadline"
        )

    def hand_back(self, reason: p.GrantDoneReason, *, estimate_ns: int, total_steps: int) -> p.GrantDone | None:
        """Give the grant held back: what was done in it, for ``reason``; None where none is held."""
        grant = self.grant
        if grant is None:
            return None
        done = self._done(grant.grant_id, grant.bubble_t_ns, self._tally, reason, estimate_ns, total_steps)
        self.grant, self._tally = None, _Tally()
        return done

    def unheld_done(
        self, grant_id: int, reason: p.GrantDoneReason, *, estimate_ns: int, total_steps: int
    ) -> p.GrantDone:
        """The GrantDone of a grant never held (an armed one whose bubble passed unseen): nothing ran in it."""
        return self._done(grant_id, 0, _Tally(), reason, estimate_ns, total_steps)

    def _done(
        self,
        grant_id: int,
        bubble_t_ns: int,
        tally: _Tally,
        reason: p.GrantDoneReason,
        estimate_ns: int,
        total_steps: int,
    ) -> p.GrantDone:
        return p.GrantDone(
            task_id=self.assign.task_id,
            grant_id=grant_id,
            steps=tally.steps,
            busy_ns=tally.busy_ns,
            first_step_delay_ns=tally.first_ns,
            overrun_ns=tally.overrun_ns,
            reason=reason,
            step_estimate_ns=estimate_ns,
            last_step_end_ns=tally.last_end_ns,
            first_step_ns=bubble_t_ns + tally.first_ns if tally.first_ns >= 0 else 0,
            total_steps=total_steps,
            cpu_ns=tally.cpu_ns,
            armed=tally.armed,
            cpu_at_start_ns=tally.cpu_at_start_ns,
            last_step_start_ns=tally.last_start_ns,
            cpu_at_last_step_ns=tally.cpu_at_last_start_ns,
        )
