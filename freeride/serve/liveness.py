"""Steps that do not end in their bubble: slow ones run on in bubbles only, hung ones are killed.

A grant still out well after its bubble ended (``hang_after_s``, and
``hang_factor`` times the step's estimate) is looked at twice, a check apart:

- if the worker computed meanwhile (its CPU clock advanced by at least
  :data:`PROGRESS_SHARE` of the time between the looks) the step is *slow*: it is
  frozen between bubbles and finishes in bubble time (:mod:`freeride.serve.slowsteps`),
  with no work lost and no restart;
- otherwise it is *hung*: the worker is killed and the task restarts from its
  checkpoint. A frozen step is hung once it ran ``hang_after_s`` of bubble time
  without computing.

A task that hangs again before it wrote a new checkpoint would only hang again
from the same state: it fails for good instead of restarting forever.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from freeride.clock import MONOTONIC, Clock
from freeride.serve.config import ServeConfig
from freeride.serve.runners import ProgramRunner, WorkerRunner
from freeride.serve.scheduler import DeviceScheduler, Overdue
from freeride.serve.tasks import TaskRecord

__all__ = ["PROGRESS_SHARE", "SLOW_PREFIX", "Liveness"]

logger = logging.getLogger(__name__)

PROGRESS_SHARE = 0.01
"""A step past its grace that used at least this share of a core between two looks is computing.

A blocked step (a sleep, a lock, a read that never returns) uses none; a step
that computes at nice 19 beside a busy stage still gets more than this."""
MIN_PROGRESS_NS = 1_000_000
"""Less CPU than this between two looks is no progress, however far apart they are."""
SLOW_PREFIX = "step slow:"
"""How a slow step's note in the task's ``error`` begins (cleared when the step ends)."""


@dataclass(slots=True)
class _Look:
    t_ns: int
    cpu_ns: int
    thawed_ns: int


class Liveness:
    """Looks at the overdue grants of every device a few times per ``hang_after_s``."""

    def __init__(
        self,
        config: ServeConfig,
        schedulers: dict[str, DeviceScheduler],
        *,
        notify: Callable[[TaskRecord], None],
        clock: Clock = MONOTONIC,
    ) -> None:
        self.config = config
        self.schedulers = schedulers
        self._notify = notify
        self._clock = clock
        self._looks: dict[int, _Look] = {}
        self._slow: dict[int, TaskRecord] = {}
        """Tasks whose slow step has not ended yet (their note stands)."""

    @property
    def period_s(self) -> float:
        return min(1.0, self.config.hang_after_s / 4)

    def _grace(self, task: TaskRecord) -> int:
        after = int(self.config.hang_after_s * 1e9)
        return max(after, int(self.config.hang_factor * max(task.estimate_ns, 0)))

    def check(self) -> None:
        """Judge every overdue grant that was looked at before; note the others for the next look."""
        now = self._clock.now_ns()
        seen: set[int] = set()
        for scheduler in list(self.schedulers.values()):
            for late in scheduler.overdue(now, self._grace):
                seen.add(late.task.task_id)
                self._judge(late, scheduler, now)
        for task_id in set(self._looks) - seen:
            del self._looks[task_id]
        for task_id, task in list(self._slow.items()):
            if task_id not in seen:  # its slow step ended (or its worker did)
                del self._slow[task_id]
                if task.error.startswith(SLOW_PREFIX):
                    task.error = ""
                    self._notify(task)

    def _judge(self, late: Overdue, scheduler: DeviceScheduler, now: int) -> None:
        task = late.task
        cpu = task.runner.cpu_ns() if task.runner is not None else -1
        look = self._looks.get(task.task_id)
        self._looks[task.task_id] = _Look(now, cpu, late.thawed_ns)
        if look is None:
            return  # judged at the next look
        progressed = cpu - look.cpu_ns if cpu >= 0 and look.cpu_ns >= 0 else 0
        if late.thawed_ns < 0:  # not frozen yet
            if progressed >= max(MIN_PROGRESS_NS, PROGRESS_SHARE * (now - look.t_ns)):
                self._slow_step(task, late.late_ns, scheduler)
            else:
                self._hung(task, late.late_ns, scheduler)
        elif progressed >= MIN_PROGRESS_NS:
            pass  # frozen, and computing in its bubbles: the look above starts a new window
        elif late.thawed_ns - look.thawed_ns < int(self.config.hang_after_s * 1e9):
            self._looks[task.task_id] = look  # not computing yet: the window goes on
        else:
            self._hung(task, late.late_ns, scheduler)

    def _slow_step(self, task: TaskRecord, late_ns: int, scheduler: DeviceScheduler) -> None:
        task.slow = True
        task.error = (
            f"{SLOW_PREFIX} still computing {late_ns / 1e9:.1f}s after its bubble ended"
            f" (estimate {max(task.estimate_ns, 0) / 1e6:.1f} ms); it goes on in bubbles only"
        )
        logger.warning("[tasks] task %d (%s): %s", task.task_id, task.name, task.error)
        scheduler.freeze(task)
        self._slow[task.task_id] = task
        self._notify(task)

    def _hung(self, task: TaskRecord, late_ns: int, scheduler: DeviceScheduler) -> None:
        runner = task.runner
        task.hangs += 1
        again = task.hang_checkpoint == task.checkpointed_steps
        task.hang_checkpoint = task.checkpointed_steps
        task.error = (
            f"step hung: still running {late_ns / 1e9:.1f}s after its bubble ended"
            f" (estimate {max(task.estimate_ns, 0) / 1e6:.1f} ms) and not computing; killed, "
        )
        if again:
            start = "its start" if task.checkpointed_steps < 0 else f"its checkpoint at step {task.checkpointed_steps}"
            task.error += f"not restarted: it hung before, from the same state ({start})"
            task.no_restart()
        else:
            task.error += "restarts from its checkpoint"
        logger.error("[tasks] task %d (%s): %s", task.task_id, task.name, task.error)
        self._looks.pop(task.task_id, None)
        self._slow.pop(task.task_id, None)
        task.park()
        scheduler.forget(task)
        self._notify(task)
        if task.cgroup is not None:
            task.cgroup.kill()
        match runner:
            case WorkerRunner(process=process) if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)  # the worker leads its own session
            case ProgramRunner(program=program):
                program.suspend()
            case _:
                pass
