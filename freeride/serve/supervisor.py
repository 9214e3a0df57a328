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
import importlib.util
import logging
import math
import os
import shutil
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, assert_never

import msgspec

from freeride import protocol as p
from freeride.clock import MONOTONIC, Clock
from freeride.gpu.memcap import MemoryCap, plan_memory_cap
from freeride.observe.base import Observers
from freeride.serve.config import ServeConfig
from freeride.serve.imperative import ImperativeProcess
from freeride.serve.placement import DeviceView, NoFit, place
from freeride.serve.ranks import DeviceInfo
from freeride.serve.runners import ProgramRunner, SendFn, WorkerRunner
from freeride.serve.scheduler import DeviceScheduler
from freeride.serve.tasks import TaskRecord, spawn_worker, stop_process, task_name

__all__ = ["Supervisor"]

logger = logging.getLogger(__name__)

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
        clock: Clock = MONOTONIC,
    ) -> None:
        self.config = config
        self.devices = devices
        """Read only: written by :class:`~freeride.serve.ranks.Ranks`."""
        self.schedulers = schedulers
        self.tasks: dict[int, TaskRecord] = {}
        self.observers = observers
        self._send = send
        self._clock = clock
        self._next_task = 1
        self._spawn: SpawnFn | None = None
        self.mps_pipe_dir: Path | None = None
        """Pipe directory of the MPS daemon side tasks join (None without MPS)."""

    def start(self, spawn: SpawnFn) -> None:
        """Begin supervising, with ``spawn`` putting coroutines in the manager's TaskGroup."""
        self._spawn = spawn
        for task in self.tasks.values():
            if task.state == "starting" and task.runner is None:
                spawn(self._supervise(task), f"task-{task.task_id}")

    def stop(self) -> None:
        self._spawn = None

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
            logger.warning("[workers] message for unknown task %d from %r", msg.task_id, ident)
            return
        match msg:
            case p.WorkerReady() if not msg.set_up:
                if msg.protocol_version != p.PROTOCOL_VERSION:
                    task.error = f"worker speaks protocol {msg.protocol_version}, manager {p.PROTOCOL_VERSION}"
                    self._send(task.ident, p.Stop(reason=task.error))
                    return
                self._send(task.ident, self._assignment(task))
            case p.WorkerReady():
                task.ready(estimate_ns=msg.step_estimate_ns, steps=msg.steps)
                self._notify(task)
            case p.GrantDone():
                self.report(task, msg)
            case p.Progress(steps=steps, metrics=metrics):
                task.metrics.update(_finite(metrics))
                task.steps = max(task.steps, steps)
            case p.Checkpointed(steps=steps, path=path):
                logger.debug("[workers] task %d checkpointed at step %d to %s", task.task_id, steps, path)
            case p.TaskFinished(metrics=metrics):
                task.metrics.update(_finite(metrics))
                task.finish()
                logger.info("[workers] task %d (%s) finished after %d steps", task.task_id, task.name, task.steps)
                self._notify(task)
            case p.TaskFailed(error=error, traceback=tb):
                task.error = error
                task.park()
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

    def _assignment(self, task: TaskRecord) -> p.Assign:
        device = self.devices[task.device]
        workdir = self.config.state_dir / "tasks" / task.name
        workdir.mkdir(parents=True, exist_ok=True)
        return p.Assign(
            task_id=task.task_id,
            spec=task.spec,
            device=task.device,
            checkpoint_path=str(task.checkpoint_path),
            margin_ns=self.config.margin_ns,
            checkpoint_every_ns=int(self.config.checkpoint_every_s * 1e9),
            cpu_affinity=device.cpu_affinity,
            workdir=str(workdir),
            memory_limit=task.spec.peak_memory,
            side_priority=self.config.side_priority,
        )

    # -- submit and place ---------------------------------------------------------------

    def submit(self, spec: p.TaskSpec) -> p.Submitted | p.Rejected:
        """Validate, record and place a side task."""
        problem = _check_spec(spec)
        if problem:
            return p.Rejected(reason=problem)
        if spec.kind == "iterative":  # one spelling per task: its name keys its checkpoint
            from sidetasks import resolve

            spec = msgspec.structs.replace(spec, target=resolve(spec.target))
        name = self._free_name(task_name(spec))
        task = TaskRecord(
            task_id=self._next_task,
            spec=spec,
            name=name,
            checkpoint_path=self.config.checkpoint_dir / f"{name}.pt",
        )
        where = self._placement(task)
        if isinstance(where, NoFit):
            return p.Rejected(reason=where.reason)
        self._next_task += 1
        self.tasks[task.task_id] = task
        if where is not None:
            self._start(task, where)
        logger.info("[tasks] task %d (%s) submitted, device %s", task.task_id, name, where or "pending")
        return p.Submitted(task_id=task.task_id, device=where or "")

    def _free_name(self, name: str) -> str:
        """``name``, or ``name-2``, ``name-3``... if a live task holds it (names key checkpoints)."""
        live = {t.name for t in self.tasks.values() if not t.terminal}
        candidate, n = name, 1
        while candidate in live:
            n += 1
            candidate = f"{name}-{n}"
        return candidate

    def _view(self, info: DeviceInfo) -> DeviceView:
        mine = [t for t in self.tasks.values() if t.device == info.name and t.active]
        committed = sum(max(0, t.spec.peak_memory) for t in mine)
        # NVML's free memory already excludes the side tasks running here, which
        # placement subtracts again, so they are added back.
        spare = info.spare_memory
        if info.free_memory >= 0:
            live = info.free_memory + committed
            spare = live if spare < 0 else min(spare, live)
        scheduler = self.schedulers.get(info.name)
        return DeviceView(
            device=info.name,
            spare_memory=spare,
            committed_memory=committed,
            tasks=len(mine),
            bubble_share=scheduler.bubble_share() if scheduler is not None else 0.0,
            alive=info.alive,
        )

    def _placement(self, task: TaskRecord) -> str | NoFit | None:
        views = [self._view(info) for info in self.devices.values()]
        return place(task.spec.peak_memory, views, pinned=task.spec.device)

    def place_pending(self) -> None:
        """Place tasks that waited for a device, now that one may fit."""
        for task in self.tasks.values():
            if task.state == "pending" and not task.device:
                where = self._placement(task)
                if isinstance(where, str):
                    self._start(task, where)

    def _start(self, task: TaskRecord, device: str) -> None:
        task.place(device)
        self._notify(task)
        if self._spawn is not None:  # otherwise start() does
            self._spawn(self._supervise(task), f"task-{task.task_id}")

    def _memory_cap(self, task: TaskRecord) -> MemoryCap:
        device = self.devices[task.device]
        kind = task.device.partition(":")[0]
        if kind not in ("cpu", "cuda"):  # a backend's own device naming: host memory, like cpu
            return plan_memory_cap("cpu:0", task.spec.peak_memory)
        return plan_memory_cap(
            task.device,
            task.spec.peak_memory,
            mps_pipe_dir=self.mps_pipe_dir,
            total_bytes=device.device_memory,
        )

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
            if task.spec.kind == "imperative":
                code = await self._run_program(task)
            else:
                code = await self._run_worker(task)
            restart = task.exited(code)
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
            self._notify(task)
            if not restart:
                return

    async def _run_worker(self, task: TaskRecord) -> int:
        process = await spawn_worker(
            task,
            python=self.config.python,
            endpoint=self.config.endpoints.workers,
            log_dir=self.config.log_dir,
            cpu_affinity=self.devices[task.device].cpu_affinity,
            extra_env=self._memory_cap(task).env,
        )
        if task.terminal:  # cancelled while the worker was being started
            return await stop_process(process, timeout_s=0)
        task.runner = WorkerRunner(task.ident, process, send=self._send)
        return await process.wait()

    async def _run_program(self, task: TaskRecord) -> int:
        """Start an imperative task's program stopped, let bubbles run it, and wait for its exit."""
        device = self.devices[task.device]
        cap = self._memory_cap(task)
        program = ImperativeProcess(
            task.spec.argv,
            env={**os.environ, **cap.env},
            log_dir=self.config.log_dir,
            name=f"task-{task.task_id}-{task.name}",
            cpu_affinity=device.cpu_affinity,
            memory_limit=cap.rlimit_as if cap.mechanism == "rlimit_as" else -1,
            margin_ns=self.config.margin_ns,
        )
        try:
            await program.start()
        except OSError as exc:
            task.error = f"cannot start {task.spec.argv[0]!r}: {exc}"
            return 127
        if task.terminal:  # cancelled while the program was being started
            return (await program.terminate(timeout_s=self.config.stop_timeout_s)).returncode
        if self.config.side_priority == "low":
            with contextlib.suppress(OSError):  # the same low CPU priority as iterative workers
                os.setpriority(os.PRIO_PGRP, program.pid, 19)
        task.runner = ProgramRunner(
            task.task_id, program, report=lambda done: self.report(task, done), clock=self._clock
        )
        task.ready()
        self._notify(task)
        info = await program.wait()
        task.park()
        self._notify(task)
        task.busy_ns = program.busy_ns
        task.metrics.update({"user_s": info.user_s, "system_s": info.system_s, "max_rss_mb": info.max_rss_kb / 1024})
        if info.returncode != 0:
            why = f"killed by signal {info.signal}" if info.signal else f"exited with code {info.returncode}"
            task.error = f"program {why} (log: {self.config.log_dir / program.name}.err)"
        return info.returncode

    async def cancel(self, task_id: int) -> p.Cancelled | p.Rejected:
        """Stop a task; it checkpoints first, so submitting it again resumes it."""
        task = self.tasks.get(task_id)
        if task is None:
            return p.Rejected(reason=f"no task {task_id}; `freeride status` lists them")
        if task.terminal:
            return p.Rejected(reason=f"task {task_id} is already {task.state}")
        await self._stop_task(task, "cancelled")
        return p.Cancelled(task_id=task_id)

    async def _stop_task(self, task: TaskRecord, reason: str) -> None:
        task.request_stop()
        self._notify(task)
        runner = task.runner
        if runner is None or not runner.alive:
            if not task.terminal and task.runner is None:
                task.cancel()  # nothing runs it now (pending, or between two restarts)
                self._notify(task)
            return
        runner.stop(reason)
        match runner:
            case ProgramRunner(program=program):
                await program.terminate(timeout_s=self.config.stop_timeout_s)
            case WorkerRunner(process=process):
                await stop_process(process, timeout_s=self.config.stop_timeout_s)

    async def stop_all(self) -> None:
        """Ask every live task to checkpoint and stop; terminate those that do not."""
        live = [t for t in self.tasks.values() if t.alive]
        if live:
            logger.info("[shutdown] stopping %d side task(s)", len(live))
        await asyncio.gather(*(self._stop_task(t, "manager shutting down") for t in live))


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    """Metrics a task reported, without NaN or infinities (JSON has no spelling for them)."""
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


def _check_spec(spec: p.TaskSpec) -> str:
    """Why ``spec`` cannot run, or an empty string."""
    if spec.kind == "iterative":
        from sidetasks import resolve

        try:
            module = resolve(spec.target).partition(":")[0]
        except ValueError as exc:
            return str(exc)
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is None:
            return f"cannot import module {module!r} (is it installed in the manager's environment?)"
        return ""
    if not spec.argv:
        return "an imperative task needs a command"
    if shutil.which(spec.argv[0]) is None:
        return f"command {spec.argv[0]!r} not found on PATH"
    return ""
