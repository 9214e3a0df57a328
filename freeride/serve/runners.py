"""How a side task is handed bubbles: one interface for iterative workers and imperative programs.

The device scheduler grants and revokes through a :class:`Runner`; it asks
which kind of task it serves only before arming one (a program cannot be
armed: see :mod:`~freeride.serve.arming`). Whatever a grant did comes back the
same way for both kinds, as a :class:`~freeride.protocol.GrantDone` passed to the
supervisor's report function: a worker sends its own over the socket; a program
has no say, so its runner writes one when it freezes the program.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from typing import Protocol

from freeride import protocol as p
from freeride.clock import MONOTONIC, Clock
from freeride.host.procs import group_members, process_cpu_ns
from freeride.serve.imperative import ImperativeProcess

__all__ = ["ProgramRunner", "ReportFn", "Runner", "SendFn", "WorkerRunner"]

logger = logging.getLogger(__name__)

SendFn = Callable[[bytes, p.ManagerToWorker], bool]
"""Sends a message to the worker of a socket identity without blocking; False if it could not."""

ReportFn = Callable[[p.GrantDone], None]
"""Where a runner hands a grant's report (the supervisor, which tells the scheduler)."""


class Runner(Protocol):
    """A task's side of a grant, whichever kind of task it is."""

    @property
    def pid(self) -> int:
        """The worker's or program's process id (0 before it exists)."""
        ...

    @property
    def alive(self) -> bool:
        """Whether the process exists."""
        ...

    def grant(self, grant: p.Grant) -> bool:
        """Let the task run until ``grant.deadline_ns``; False if the grant could not be handed over."""
        ...

    def arm(self, arm: p.Arm) -> bool:
        """Let the task start on the next bubble by itself (see :class:`~freeride.protocol.Arm`).

        Returns:
            Whether the arm was handed over; False if the task cannot be armed (a program).
        """
        ...

    def disarm(self, grant_id: int) -> None:
        """Withdraw the arm ``grant_id``."""
        ...

    def revoke(self, grant_id: int) -> None:
        """The bubble ended: no more work under ``grant_id``.

        The grant's report follows through the report function: at once for a
        program, when the worker answers for a worker.
        """
        ...

    def stop(self, reason: str) -> None:
        """Ask the task to checkpoint and exit (a program is terminated by its supervisor)."""
        ...

    def cpu_ns(self) -> int:
        """CPU time the task's processes have run so far (all threads), in ns; -1 if unreadable."""
        ...

    def cpu_at_grant(self) -> int:
        """The task's CPU clock as it was when the last grant was handed over (-1 unknown)."""
        ...

    def hold(self, frozen: bool) -> None:
        """Freeze the task's processes in the middle of a step, or thaw them (see
        :mod:`freeride.serve.slowsteps`)."""
        ...


class WorkerRunner:
    """An iterative task's worker process, reached through the manager's worker socket."""

    def __init__(self, ident: bytes, process: asyncio.subprocess.Process, *, send: SendFn) -> None:
        self._ident = ident
        self.process = process
        self._send = send
        self._cpu_at_grant = -1

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    def grant(self, grant: p.Grant) -> bool:
        sent = self._send(self._ident, grant)
        # read after the grant is on its way: this is on the bubble-start -> step path (a
        # clock read is ~1 us; the worker wakes on its own core)
        self._cpu_at_grant = self.cpu_ns() if sent else -1
        return sent

    def arm(self, arm: p.Arm) -> bool:
        return self._send(self._ident, arm)

    def disarm(self, grant_id: int) -> None:
        self._send(self._ident, p.Disarm(grant_id=grant_id))

    def revoke(self, grant_id: int) -> None:
        self._send(self._ident, p.Revoke(grant_id=grant_id))

    def stop(self, reason: str) -> None:
        self._send(self._ident, p.Stop(reason=reason))

    def cpu_ns(self) -> int:
        return process_cpu_ns(self.process.pid)

    def cpu_at_grant(self) -> int:
        return self._cpu_at_grant

    def hold(self, frozen: bool) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGSTOP if frozen else signal.SIGCONT)  # it leads its session


class ProgramRunner:
    """An imperative task's program: SIGCONT on a grant, SIGSTOP at its deadline or on revoke."""

    def __init__(
        self,
        task_id: int,
        program: ImperativeProcess,
        *,
        report: ReportFn,
        clock: Clock = MONOTONIC,
        total_steps: Callable[[], int] | None = None,
    ) -> None:
        self._task_id = task_id
        self._total_steps = total_steps
        """The step count the program itself reports (its progress file or stdout); None counts grants."""
        self.program = program
        self._report = report
        self._clock = clock
        self._grant: p.Grant | None = None
        self._resumed_ns = 0
        self._busy_before_ns = 0
        self._cpu_at_grant = -1
        self._members: list[int] = [program.pid] if program.pid > 0 else []
        """The program's process group as last listed while it was frozen.

        Listing a group scans /proc (about a millisecond here): too slow for a bubble's start
        or end, where the program runs on meanwhile. A child started since is missed until
        the next freeze."""

    @property
    def pid(self) -> int:
        return max(self.program.pid, 0)

    @property
    def alive(self) -> bool:
        return not self.program.exited

    def grant(self, grant: p.Grant) -> bool:
        if self._grant is not None:  # a grant never revoked (its bubble's end was lost)
            self.revoke(self._grant.grant_id)
        self._grant = grant
        self._busy_before_ns = self.program.busy_ns
        self._cpu_at_grant = self.cpu_ns()  # exact: the program is frozen until the resume below
        self._resumed_ns = self._clock.now_ns()
        # SIGCONT now, SIGSTOP at the deadline minus the margin (the grant's, which the device's guard adapts)
        self.program.resume(grant.deadline_ns, margin_ns=grant.margin_ns if grant.margin_ns >= 0 else None)
        return True

    def arm(self, arm: p.Arm) -> bool:
        return False  # a program is resumed by signals from the manager, which must see the bubble first

    def disarm(self, grant_id: int) -> None:
        pass

    def revoke(self, grant_id: int) -> None:
        grant = self._grant
        if grant is None or grant.grant_id != grant_id:
            return
        self._grant = None
        # Its deadline timer may have stopped it already; stopping again is a no-op.
        self.program.suspend()
        cpu = self.cpu_ns()
        if self.program.pid > 0:  # frozen now: list the group again, off the bubble's start
            self._members = group_members(self.program.pid) or [self.program.pid]
        busy = self.program.busy_ns - self._busy_before_ns
        ran = busy > 0
        self._report(
            p.GrantDone(
                task_id=self._task_id,
                grant_id=grant_id,
                steps=1 if ran else 0,
                busy_ns=busy,
                first_step_delay_ns=self._resumed_ns - grant.bubble_t_ns if ran else -1,
                overrun_ns=0,
                reason="revoked",
                last_step_end_ns=self._resumed_ns + busy if ran else 0,
                first_step_ns=self._resumed_ns if ran else 0,
                cpu_ns=cpu,
                total_steps=self._total_steps() if self._total_steps is not None else -1,
            )
        )

    def stop(self, reason: str) -> None:
        if self._grant is not None:
            self.revoke(self._grant.grant_id)
        logger.debug("[tasks] task %d: program stop requested (%s)", self._task_id, reason)

    def cpu_ns(self) -> int:
        total, seen = 0, False
        for pid in self._members:
            cpu = process_cpu_ns(pid)
            if cpu >= 0:
                total, seen = total + cpu, True
        return total if seen else -1

    def cpu_at_grant(self) -> int:
        return self._cpu_at_grant

    def hold(self, frozen: bool) -> None:
        pass  # frozen outside its grants already: its grants end in a freeze, never in an overrun
