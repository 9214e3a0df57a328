"""One scheduler per device: hands each bubble to the side tasks placed there.

Bubble events are handled synchronously by the manager's events loop (the
latency-critical path); worker reports and task changes come through the
device's own coroutine and inbox, in order.

Side tasks of a device take turns, as kernels of several processes would on
one GPU. When a bubble starts, the scheduler grants it to the next task (round
robin) whose estimated step fits in the bubble; a task that gives the grant
back early (its next step no longer fits, or it finished) passes the rest of
the bubble on to another task whose step does fit. When the bubble ends the
grant is revoked. All accounting of bubble time and its use lives here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from freeride import protocol as p
from freeride.observe.base import Observers
from freeride.observe.stats import LatencyRecorder
from freeride.serve.tasks import TaskRecord

__all__ = ["PROBE_AFTER_BUBBLES", "DeviceInput", "DeviceScheduler", "TaskChanged"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TaskChanged:
    """A task of this device became runnable, or left."""

    task: TaskRecord


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """A worker gave a grant back."""

    task: TaskRecord
    done: p.GrantDone


PROBE_AFTER_BUBBLES = 20
"""A task whose estimate has not fit this many bubbles in a row gets a one-step probe."""

DeviceInput = p.BubbleStarted | p.BubbleEnded | TaskChanged | WorkerReport

SendFn = Callable[[TaskRecord, p.ManagerToWorker], bool]


@dataclass(slots=True)
class _GrantState:
    task: TaskRecord
    bubble_t_ns: int = 0
    bubble_end_ns: int = 0
    """Actual end of the bubble (0 while it lasts)."""
    last_step_end_ns: int = 0
    returned: bool = False
    resumed_ns: int = 0
    """When an imperative program was resumed for this grant."""
    busy_ns: int = 0
    """Side-task time the grant reported."""
    busy_before_ns: int = 0
    overrun_ns: int = 0
    """What the worker reported as past the grant's deadline (used if the bubble's end is never seen)."""


class DeviceScheduler:
    """Grants the bubbles of one device to its side tasks."""

    def __init__(
        self,
        device: str,
        *,
        send: SendFn,
        latency: LatencyRecorder,
        margin_ns: int,
        observers: Observers | None = None,
    ) -> None:
        self.device = device
        self.inbox: asyncio.Queue[DeviceInput] = asyncio.Queue()
        self.tasks: list[TaskRecord] = []
        self._send = send
        self._observers = observers
        self._latency = latency
        self._margin_ns = margin_ns
        # who trains here
        self.stage = -1
        self.rank = -1
        self.framework = ""
        self.alive = False
        self.spare_memory = -1
        self.cpu_affinity: list[int] = []
        self.device_memory = -1
        """Total memory of the device (from the rank's Hello)."""
        self.free_memory = -1
        """Free memory NVML last reported (-1 without NVML)."""
        self.dropped = 0
        # bubble state
        self._bubble: p.BubbleStarted | None = None
        self._deadline_ns = 0
        self._tried: set[int] = set()
        self._starved: dict[int, int] = {}
        """Consecutive bubbles a task's estimate kept it out of."""
        self._holder: int | None = None
        self._grants: dict[int, _GrantState] = {}
        self._next_grant = 1
        self._rr = 0
        # accounting
        self.bubbles = 0
        self.bubble_ns = 0
        self.used_ns = 0
        self.overruns = 0
        self.overrun_ns = 0
        self.train_steps = 0
        self.first_seen_ns = time.monotonic_ns()

    # -- coroutine ------------------------------------------------------------

    async def run(self) -> None:
        """Consume the inbox forever (cancelled at shutdown)."""
        while True:
            self.handle(await self.inbox.get())

    def handle(self, item: DeviceInput) -> None:
        match item:
            case p.BubbleStarted():
                self._on_bubble_started(item)
            case p.BubbleEnded():
                self._on_bubble_ended(item)
            case WorkerReport(task=task, done=done):
                self._on_grant_done(task, done)
            case TaskChanged(task=task):
                self._on_task_changed(task)

    # -- public views ---------------------------------------------------------

    def status(self) -> p.DeviceStatus:
        return p.DeviceStatus(
            device=self.device,
            stage=self.stage,
            rank=self.rank,
            framework=self.framework,
            alive=self.alive,
            bubbles=self.bubbles,
            bubble_ns=self.bubble_ns,
            used_ns=max(0, self.used_ns),
            overruns=self.overruns,
            overrun_ns=self.overrun_ns,
            spare_memory=self.spare_memory,
            steps=self.train_steps,
            dropped=self.dropped,
            free_memory=self.free_memory,
        )

    def bubble_share(self) -> float:
        elapsed = time.monotonic_ns() - self.first_seen_ns
        return self.bubble_ns / elapsed if elapsed > 0 else 0.0

    def committed_memory(self) -> int:
        return sum(max(0, t.spec.peak_memory) for t in self.tasks if t.state in ("starting", "running"))

    def placeable_memory(self) -> int:
        """Spare memory for placement: the stage's spare, bounded by what NVML sees free now.

        NVML's free memory already excludes the side tasks running here, which
        placement subtracts again, so they are added back.
        """
        if self.free_memory < 0:
            return self.spare_memory
        live = self.free_memory + self.committed_memory()
        return live if self.spare_memory < 0 else min(self.spare_memory, live)

    def backend_lost(self) -> None:
        """The rank training here is gone: stop handing out its bubble."""
        self.alive = False
        if self._bubble is not None:
            self._revoke_current()
            self._bubble = None

    # -- events ---------------------------------------------------------------

    def _on_bubble_started(self, ev: p.BubbleStarted) -> None:
        if self._bubble is not None:  # the end of the previous one was lost
            self._revoke_current()
            for grant_id, state in list(self._grants.items()):
                if state.returned and not state.bubble_end_ns:
                    self._account_overrun(state)  # against the deadline: the best left to go by
                    del self._grants[grant_id]
        self._bubble = ev
        self._deadline_ns = ev.t_ns + ev.expected_ns
        self._tried.clear()
        self.bubbles += 1
        if ev.spare_memory >= 0:
            self.spare_memory = ev.spare_memory
        self._grant_next(fresh=True)

    def _on_bubble_ended(self, ev: p.BubbleEnded) -> None:
        self.bubble_ns += ev.duration_ns
        for state in self._grants.values():
            if state.bubble_end_ns == 0:
                state.bubble_end_ns = ev.t_ns
                if state.returned:
                    self._account_overrun(state)
        self._grants = {gid: s for gid, s in self._grants.items() if not s.returned}
        self._revoke_current()
        self._bubble = None

    def _on_task_changed(self, task: TaskRecord) -> None:
        if task.device != self.device or task.state in ("finished", "failed", "cancelled"):
            if task in self.tasks:
                self.tasks.remove(task)
            holder = self._holder
            held = self._grants.get(holder) if holder is not None else None
            if holder is not None and held is not None and held.task is task:
                del self._grants[holder]
                self._holder = None
                self._grant_next(fresh=False)
            return
        if task not in self.tasks:
            self.tasks.append(task)
        if task.runnable and self._holder is None and self._bubble is not None:
            self._grant_next(fresh=False)

    def _on_grant_done(self, task: TaskRecord, done: p.GrantDone) -> None:
        if self._observers is not None:
            self._observers.grant_done(self.device, task.task_id, task.name, done)
        task.estimate_ns = done.step_estimate_ns
        # absolute when the worker counts (a Progress may have overtaken this report)
        task.steps = max(task.steps, done.total_steps) if done.total_steps >= 0 else task.steps + done.steps
        task.busy_ns += done.busy_ns
        self.used_ns += done.busy_ns
        if done.first_step_delay_ns >= 0:
            self._latency.record(done.first_step_delay_ns)
        state = self._grants.get(done.grant_id)
        if state is not None:
            state.returned = True
            state.busy_ns = done.busy_ns
            state.last_step_end_ns = done.last_step_end_ns
            state.overrun_ns = done.overrun_ns
            # time past the bubble's actual end is not "used"; until that end is known the
            # grant waits (the deadline is an expectation, erring early on purpose)
            if state.bubble_end_ns:
                self._account_overrun(state)
                self._grants.pop(done.grant_id)
        if self._holder == done.grant_id:
            self._holder = None
            if done.reason in ("no_fit", "finished") and self._bubble is not None:
                self._grant_next(fresh=False)

    # -- granting -------------------------------------------------------------

    def _account_overrun(self, state: _GrantState) -> None:
        end = state.bubble_end_ns
        late = state.last_step_end_ns - end if end and state.last_step_end_ns else state.overrun_ns
        if late > 0:
            self.overruns += 1
            self.overrun_ns += late
            self.used_ns -= min(late, state.busy_ns)  # "used" is side-task time inside the bubble

    def _revoke_current(self) -> None:
        if self._holder is None:
            return
        grant_id, self._holder = self._holder, None
        state = self._grants.get(grant_id)
        if state is None:
            return
        program = state.task.imperative
        if program is None:
            self._send(state.task, p.Revoke(grant_id=grant_id))
            return
        # An imperative program has no say: stop it (its deadline timer may have already)
        # and account for the grant as a worker would.
        program.suspend()
        busy = program.busy_ns - state.busy_before_ns
        self._on_grant_done(
            state.task,
            p.GrantDone(
                task_id=state.task.task_id,
                grant_id=grant_id,
                steps=1 if busy > 0 else 0,
                busy_ns=busy,
                first_step_delay_ns=state.resumed_ns - state.bubble_t_ns if busy > 0 else -1,
                overrun_ns=0,
                reason="revoked",
                last_step_end_ns=state.resumed_ns + busy if busy > 0 else 0,
                first_step_ns=state.resumed_ns if busy > 0 else 0,
            ),
        )

    def _grant_next(self, *, fresh: bool) -> None:
        if self._bubble is None or self._holder is not None or not self.tasks:
            return
        remaining = self._deadline_ns - time.monotonic_ns() - self._margin_ns
        if remaining <= 0:
            return
        n = len(self.tasks)
        for k in range(n):
            task = self.tasks[(self._rr + k) % n]
            if not task.runnable or task.task_id in self._tried:
                continue
            estimate = task.estimate_ns
            probe = False
            if estimate > remaining:
                # An estimate is only corrected by running steps: a task shut out of
                # bubble after bubble gets one step at the start of a bubble now and then.
                starved = self._starved.get(task.task_id, 0) + (1 if fresh else 0)
                self._starved[task.task_id] = starved
                if not (fresh and starved >= PROBE_AFTER_BUBBLES):
                    continue
                probe = True
            elif estimate < 0 and not fresh:
                continue  # a task whose step time is unknown probes only at the start of a bubble
            self._starved.pop(task.task_id, None)
            grant_id = self._next_grant
            self._next_grant += 1
            self._tried.add(task.task_id)
            self._rr = (self._rr + k + 1) % n
            grant = p.Grant(
                grant_id=grant_id, bubble_t_ns=self._bubble.t_ns, deadline_ns=self._deadline_ns, probe=probe
            )
            state = _GrantState(task=task, bubble_t_ns=self._bubble.t_ns)
            program = task.imperative
            if program is not None:
                state.busy_before_ns = program.busy_ns
                state.resumed_ns = time.monotonic_ns()
                program.resume(self._deadline_ns)  # SIGCONT now, SIGSTOP at the deadline minus the margin
            elif not self._send(task, grant):
                continue
            self._holder = grant_id
            self._grants[grant_id] = state
            return
