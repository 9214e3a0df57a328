"""Side tasks from submission to exit: validation, placement, worker processes, restarts.

The :class:`Supervisor` belongs to the manager and runs on its event loop. It
owns no socket: messages to workers go through the ``send`` function the
manager gives it, messages from workers come in through :meth:`Supervisor.on_worker`.
It is the only writer of :class:`~freeride.serve.tasks.TaskRecord`, and it
tells the task's device scheduler of every change by a synchronous call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, assert_never

import msgspec

from freeride import protocol as p
from freeride.clock import MONOTONIC, Clock
from freeride.host.cgroup import remove_own_cgroups
from freeride.observe.base import Observers
from freeride.serve.capacity import Settling, bubble_share, plan_moves
from freeride.serve.config import ServeConfig
from freeride.serve.declarations import gpu_views, last_lines, pending_reason, with_declarations
from freeride.serve.gates import GatePages
from freeride.serve.intake import check_spec
from freeride.serve.liveness import Liveness
from freeride.serve.placement import DeviceView, NoFit, place
from freeride.serve.processes import TaskProcesses
from freeride.serve.ranks import DeviceInfo
from freeride.serve.runners import SendFn
from freeride.serve.scheduler import DeviceScheduler
from freeride.serve.tasks import TaskRecord, restart_delay_s, task_name

__all__ = ["KEEP_ENDED", "MAX_LIVE_TASKS", "Supervisor"]

logger = logging.getLogger(__name__)

KEEP_ENDED = 1000
"""Tasks that have ended (finished, failed, cancelled) kept in the table for status; older ones are dropped."""
MAX_LIVE_TASKS = 10_000
"""Tasks that wait or run at once, at most: a control client cannot fill the manager's memory."""

SpawnFn = Callable[[Coroutine[Any, Any, None], str], object]


class Supervisor:
    """Keeps every side task of the manager, and its worker process or program."""

    def __init__(
        self,
        config: ServeConfig,
        *,
        devices: dict[str, DeviceInfo],
        schedulers: dict[str, DeviceScheduler],
        send: SendFn,
        observers: Observers,
        gates: GatePages | None = None,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.config = config
        self._gates = gates if gates is not None else GatePages(None)
        self.devices = devices
        """Read only: written by :class:`~freeride.serve.ranks.Ranks`."""
        self.schedulers = schedulers
        self.tasks: dict[int, TaskRecord] = {}
        self.observers = observers
        self._send = send
        self._clock = clock
        self._next_task = 1
        self._unknown = 0
        """Messages from workers the table does not know (log sampling)."""
        self._spawn: SpawnFn | None = None
        self.processes = TaskProcesses(config, devices=devices, tasks=self.tasks, send=send, clock=clock)
        self._settling = Settling(config.settle_s, clock=clock)
        self.liveness = Liveness(config, schedulers, notify=self._notify, clock=clock)

    def start(self, spawn: SpawnFn) -> None:
        """Begin supervising, with ``spawn`` putting coroutines in the manager's TaskGroup."""
        self._spawn = spawn
        spawn(self._liveness(), "supervisor-liveness")
        spawn(self._placing(), "supervisor-placing")
        for task in self.tasks.values():
            if task.state == "starting" and task.runner is None:
                spawn(self._supervise(task), f"task-{task.task_id}")

    def stop(self) -> None:
        self._spawn = None

    @property
    def mps_pipe_dir(self) -> Path | None:
        """Pipe directory of the MPS daemon side tasks join (None without MPS)."""
        return self.processes.mps_pipe_dir

    @mps_pipe_dir.setter
    def mps_pipe_dir(self, pipe_dir: Path | None) -> None:
        self.processes.mps_pipe_dir = pipe_dir

    def _notify(self, task: TaskRecord) -> None:
        self.observers.task_status(task.status())
        scheduler = self.schedulers.get(task.device)
        if scheduler is not None:
            scheduler.on_task_changed(task)

    # -- from workers -----------------------------------------------------------------

    def on_worker(self, ident: bytes, msg: p.WorkerToManager) -> None:
        """Handle a message from a worker (identified by its socket identity)."""
        task = self.tasks.get(msg.task_id)
        if task is None or task.ident != ident:
            self._unknown += 1
            if self._unknown <= 10 or self._unknown % 1000 == 0:  # a stray worker repeats itself
                logger.warning(
                    "[workers] message for unknown task %d from %r (%d so far)", msg.task_id, ident, self._unknown
                )
            return
        match msg:
            case p.WorkerReady() if not msg.set_up:
                if msg.protocol_version != p.PROTOCOL_VERSION:
                    task.error = f"worker speaks protocol {msg.protocol_version}, manager {p.PROTOCOL_VERSION}"
                    self._send(task.ident, p.Stop(reason=task.error))
                    return
                self._send(task.ident, self._assignment(task))
            case p.WorkerReady():
                gate = self._gates.get(task.device) if msg.gate else None
                if gate is not None:  # before the scheduler hears the task is ready: it may be armed at once
                    gate.ready[task.task_id] = msg.gate
                task.ready(estimate_ns=msg.step_estimate_ns, steps=msg.steps, packs=msg.packs)
                self.processes.tighten(task)
                self._notify(task)
            case p.GrantDone():
                self.report(task, msg)
            case p.Progress(steps=steps, metrics=metrics, estimates=estimates, waiting=waiting):
                task.metrics.update(_finite(metrics))
                task.steps = max(task.steps, steps)
                task.waiting = waiting
                if estimates:
                    task.estimates = dict(estimates)
            case p.Checkpointed(steps=steps, path=path):
                task.checkpointed_steps, task.checkpoint_error = steps, ""
                logger.debug("[workers] task %d checkpointed at step %d to %s", task.task_id, steps, path)
            case p.CheckpointFailed(steps=steps, error=error):
                task.checkpoint_error = error
                logger.warning(
                    "[workers] task %d (%s): checkpoint at step %d failed, will retry: %s",
                    task.task_id,
                    task.name,
                    steps,
                    error,
                )
            case p.TaskFinished(metrics=metrics):
                task.metrics.update(_finite(metrics))
                task.finish()
                logger.info("[workers] task %d (%s) finished after %d steps", task.task_id, task.name, task.steps)
                self._notify(task)
            case p.TaskFailed(error=error, traceback=tb, final=final):
                task.error, task.traceback = error, last_lines(tb)
                task.park()
                if final:  # it cannot start at all: a restart would fail the same way
                    task.no_restart()
                logger.error("[workers] task %d (%s) failed: %s\n%s", task.task_id, task.name, error, tb)
                self._notify(task)
            case _:
                assert_never(msg)

    def report(self, task: TaskRecord, done: p.GrantDone) -> None:
        """A grant came back, from a worker or a program's runner: the one way to account for it."""
        task.account(done)
        scheduler = self.schedulers.get(task.device)
        if scheduler is not None:
            scheduler.on_grant_done(task, done)

    def note_process_memory(self, used_by_pid: dict[int, int]) -> None:
        """Device memory per process, as NVML reads it."""
        for task in self.tasks.values():
            if task.pid and task.pid in used_by_pid:
                task.device_memory = used_by_pid[task.pid]

    def _typical_bubble_ns(self, device: str) -> int:
        scheduler = self.schedulers.get(device)
        return scheduler.typical_bubble_ns(self.devices[device]) if scheduler is not None else 0

    def _gate_path(self, device: str) -> str:
        """``device``'s bubble gate page, for its workers ("" none)."""
        gate = self._gates.get(device)
        return str(gate.path) if gate is not None else ""

    def _assignment(self, task: TaskRecord) -> p.Assign:
        workdir = self.processes.workdir(task)
        if not isinstance(task.spec, p.IterativeSpec):
            raise TypeError(f"task {task.task_id} is a program: it has no worker to assign")
        return p.Assign(
            task_id=task.task_id,
            spec=task.spec,
            device=task.device,
            checkpoint_path=str(task.checkpoint_path),
            margin_ns=self.config.margin_ns,
            checkpoint_every_ns=int(self.config.checkpoint_every_s * 1e9),
            cpu_affinity=self.processes.cores(task),
            workdir=str(workdir),
            memory_limit=self.processes.peak(task),
            side_priority=self.config.side_priority,
            max_loss_ns=task.max_loss_ns,
            max_loss_steps=task.max_loss_steps,
            # rehearsing steps outside bubbles is free only while no rank trains on the device
            warm_up=not self.devices[task.device].alive,
            estimates_dir=str(self.config.estimates_dir.absolute()),  # the worker runs in its workdir
            bubble_ns=self._typical_bubble_ns(task.device),
            gate_path=self._gate_path(task.device),
        )

    # -- submit and place ---------------------------------------------------------------

    def submit(self, spec: p.TaskSpec) -> p.Submitted | p.Rejected:
        """Validate, record and place a side task."""
        live = sum(not t.terminal for t in self.tasks.values())
        if live >= MAX_LIVE_TASKS:
            return p.Rejected(
                reason=f"{live} tasks already wait or run here (at most {MAX_LIVE_TASKS}); cancel some first"
            )
        problem = check_spec(spec)
        if problem:
            return p.Rejected(reason=problem)
        checkpoint_dir, iterative = self.config.checkpoint_dir, isinstance(spec, p.IterativeSpec)
        if isinstance(spec, p.IterativeSpec):  # one spelling per task: its name keys its checkpoint
            from freeride.tasks.targets import resolve

            checked = with_declarations(msgspec.structs.replace(spec, target=resolve(spec.target)))
            if isinstance(checked, str):
                return p.Rejected(reason=checked)
            spec = checked
            if checked.checkpoint_dir:
                checkpoint_dir = Path(checked.checkpoint_dir)
        name = self._free_name(task_name(spec))
        task = TaskRecord(
            task_id=self._next_task,
            spec=spec,
            name=name,
            checkpoint_path=checkpoint_dir / f"{name}.pt",
            max_loss_ns=int(self.config.max_loss_s * 1e9) if iterative else 0,
            max_loss_steps=self.config.max_loss_steps if iterative else 0,
        )
        where = self._placement(task)
        if isinstance(where, NoFit):
            return p.Rejected(reason=where.reason)
        self._next_task += 1
        self._prune()
        self.tasks[task.task_id] = task
        if where is not None:
            self._start(task, where)
        logger.info("[tasks] task %d (%s) submitted, device %s", task.task_id, name, where or "pending")
        return p.Submitted(task_id=task.task_id, device=where or "")

    def _prune(self) -> None:
        """Drop the oldest ended tasks beyond :data:`KEEP_ENDED` (the table only grows here, at submit)."""
        ended = [t for t in self.tasks.values() if t.terminal and t.runner is None]
        for task in ended[: max(0, len(ended) - KEEP_ENDED)]:
            del self.tasks[task.task_id]
            scheduler = self.schedulers.get(task.device)
            if scheduler is not None:
                scheduler.forget_task(task.task_id)

    def _free_name(self, name: str) -> str:
        """``name``, or ``name-2``, ``name-3``... if a live task holds it (names key checkpoints)."""
        live = {t.name for t in self.tasks.values() if not t.terminal}
        candidate, n = name, 1
        while candidate in live:
            n += 1
            candidate = f"{name}-{n}"
        return candidate

    def _share(self, info: DeviceInfo) -> float:
        return bubble_share(info, self.schedulers.get(info.name))

    def _views(self) -> list[DeviceView]:
        placed: dict[str, list[TaskRecord]] = {}
        for t in self.tasks.values():
            if t.active:
                placed.setdefault(t.device, []).append(t)
        views = []
        for info in self.devices.values():
            mine = placed.get(info.name, [])
            committed = sum(max(0, t.spec.peak_memory) for t in mine)
            # NVML's free memory already excludes the side tasks running here, which
            # placement subtracts again, so they are added back.
            spare = info.spare_memory
            if info.free_memory >= 0:
                live = info.free_memory + committed
                spare = live if spare < 0 else min(spare, live)
            views.append(
                DeviceView(
                    device=info.name,
                    spare_memory=spare,
                    committed_memory=committed,
                    tasks=len(mine),
                    bubble_share=self._share(info),
                    alive=info.alive,
                    departed=info.departed,
                )
            )
        return views

    def _placement(self, task: TaskRecord, waiting: str | None = None) -> str | NoFit | None:
        """Where ``task`` goes now; ``waiting``: why unpinned tasks must wait, if already asked.

        A task left without a device says why in ``pending_reason``.
        """
        if not task.spec.device:
            task.pending_reason = self._settling.waiting(self.devices, self._share) if waiting is None else waiting
            if task.pending_reason:
                return None
        views = self._views()
        if task.spec.device_kind == "gpu":
            gpus = gpu_views(views, pinned=task.spec.device)
            if isinstance(gpus, NoFit):
                return gpus
            views = gpus
        where = place(task.spec.peak_memory, views, pinned=task.spec.device)
        task.pending_reason = pending_reason(task.spec, views, self.devices) if where is None else ""
        return where

    def place_pending(self) -> None:
        """Place tasks that waited for a device, now that one may fit; move those that gain by it."""
        waiting = self._settling.waiting(self.devices, self._share)  # asked even with none pending: the clock starts
        for task in self.tasks.values():
            if task.state == "pending" and not task.device:
                where = self._placement(task, waiting)
                if isinstance(where, str):
                    self._start(task, where)
        self._rebalance()

    async def _placing(self) -> None:
        """Place waiting tasks once the settle time is over, and move tasks as the bubbles are learned."""
        while True:
            await asyncio.sleep(0.5)
            self.place_pending()

    def _rebalance(self) -> None:
        now = self._clock.now_ns()
        planned = plan_moves(
            self.tasks.values(), self._views(), now_ns=now, gain=self.config.move_gain, every_s=self.config.move_every_s
        )
        for task, device, why in planned:
            logger.info(
                "[tasks] task %d (%s) moves from %s to %s: %s", task.task_id, task.name, task.device, device, why
            )
            task.move(device, now)
            self._notify(task)
            if task.runner is not None:
                task.runner.stop(f"moving to {device}")  # it checkpoints, exits, and resumes there

    def _start(self, task: TaskRecord, device: str) -> None:
        task.place(device)
        self._notify(task)
        if self._spawn is not None:  # otherwise start() does
            self._spawn(self._supervise(task), f"task-{task.task_id}")

    # -- run, restart, stop ---------------------------------------------------------------

    async def _supervise(self, task: TaskRecord) -> None:
        """Run the task's worker or program; a failure here fails the task, never the manager."""
        try:
            await self._supervise_inner(task)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("[tasks] task %d (%s): supervision failed", task.task_id, task.name)
            task.runner = None
            if not task.terminal:
                task.fail(f"could not run the task: {type(exc).__name__}: {exc}")
            self._notify(task)

    async def _supervise_inner(self, task: TaskRecord) -> None:
        """Run the task's worker or program; restart it (from its checkpoint) after a crash."""
        while True:
            if task.terminal:  # cancelled before (or between) its starts
                return
            if isinstance(task.spec, p.ProgramSpec):
                code = await self.processes.run_program(
                    task, report=lambda done: self.report(task, done), notify=lambda: self._notify(task)
                )
            else:
                code = await self.processes.run_worker(task)
            left = task.device
            restart = task.exited(code)
            scheduler = self.schedulers.get(left)
            if scheduler is not None:  # grants its process never gave back: a restart starts clean
                scheduler.forget(task)
            if task.device != left:  # a move: at once, from the checkpoint it just wrote
                if scheduler is not None:
                    scheduler.on_task_changed(task)  # it leaves that device
                logger.info("[tasks] task %d (%s) resumes on %s", task.task_id, task.name, task.device)
                self._notify(task)
                continue
            if task.state == "finished":
                logger.info("[tasks] task %d (%s) finished", task.task_id, task.name)
            elif task.state == "failed":
                logger.error("[tasks] task %d (%s) failed for good: %s", task.task_id, task.name, task.error)
            elif restart:
                logger.warning(
                    "[tasks] task %d (%s) crashed (%s); restart %d/%d from its checkpoint",
                    task.task_id,
                    task.name,
                    task.error,
                    task.restarts,
                    task.spec.max_restarts,
                )
            if not restart:
                self._notify(task)
                return
            task.backoff_s = restart_delay_s(
                task.restarts, base_s=self.config.restart_backoff_s, max_s=self.config.restart_backoff_max_s
            )
            self._notify(task)
            logger.info("[tasks] task %d (%s): restart in %.3gs", task.task_id, task.name, task.backoff_s)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(task.backoff_s):
                    await task.done.wait()  # a cancel ends the wait

    def _cancellable(self, task_id: int) -> TaskRecord | p.Rejected:
        task = self.tasks.get(task_id)
        if task is None:
            return p.Rejected(reason=f"no task {task_id}; `freeride status` lists them")
        if task.terminal:
            return p.Rejected(reason=f"task {task_id} is already {task.state}")
        return task

    def cancel_nowait(self, task_id: int) -> p.Cancelled | p.Rejected:
        """Start stopping a task and answer at once; the stop goes on in the background.

        What the control socket calls: a task that does not stop (a hung step)
        must not hold up every other client for the stop timeout.
        """
        task = self._cancellable(task_id)
        if isinstance(task, p.Rejected):
            return task
        if self._spawn is None:
            return p.Rejected(reason="the manager is not running")
        self._spawn(self._stop_task(task, "cancelled"), f"cancel-task-{task_id}")
        return p.Cancelled(task_id=task_id, kind=task.spec.kind)

    async def cancel(self, task_id: int) -> p.Cancelled | p.Rejected:
        """Stop a task and wait until it has; it checkpoints first, so submitting it again resumes it."""
        task = self._cancellable(task_id)
        if isinstance(task, p.Rejected):
            return task
        await self._stop_task(task, "cancelled")
        if self._spawn is not None:  # its supervisor records the exit
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.stop_timeout_s):
                    await task.done.wait()
        return p.Cancelled(task_id=task_id, kind=task.spec.kind)

    async def _stop_task(self, task: TaskRecord, reason: str) -> None:
        task.request_stop()
        self._notify(task)
        runner = task.runner
        if runner is None or not runner.alive:
            if not task.terminal and task.runner is None:
                task.cancel()  # nothing runs it now (pending, or between two restarts)
                self._notify(task)
            return
        scheduler = self.schedulers.get(task.device)
        if scheduler is not None:
            scheduler.slow.release(task)  # a frozen worker must read its Stop
        gate = self._gates.get(task.device)
        if gate is not None:
            gate.release(task.task_id)  # and so must one whose step waits behind its slot of the device gate
        runner.stop(reason)
        await self.processes.terminate(task, runner)

    # -- liveness -------------------------------------------------------------------

    async def _liveness(self) -> None:
        """Look for slow and hung steps, a few times per ``hang_after_s``."""
        while True:
            await asyncio.sleep(self.liveness.period_s)
            self.liveness.check()

    async def stop_all(self) -> None:
        """Ask every live task to checkpoint and stop; terminate those that do not."""
        live = [t for t in self.tasks.values() if t.alive]
        if live:
            logger.info("[shutdown] stopping %d side task(s)", len(live))
        await asyncio.gather(*(self._stop_task(t, "manager shutting down") for t in live))
        remove_own_cgroups()


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    """Metrics a task reported, without NaN or infinities (JSON has no spelling for them)."""
    return {k: v for k, v in metrics.items() if math.isfinite(v)}
