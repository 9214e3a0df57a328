"""A side task's process: its worker or program started with its caps, cores and cgroup, and ended.

One :class:`TaskProcesses` per manager, used by the
:class:`~freeride.serve.supervisor.Supervisor` (which decides when a task runs,
restarts or stops): what memory a task may use (its declared peak, else what
its device can spare), how that cap is enforced (RLIMIT_AS, a cgroup, MPS or
PyTorch's memory fraction), which cores it runs on, and the worker's or
program's start, wait and termination.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from freeride import protocol as p
from freeride.clock import MONOTONIC, Clock
from freeride.gpu.memcap import MemoryCap, plan_memory_cap
from freeride.gpu.smshare import plan_sm_share
from freeride.host.cgroup import TaskCgroup
from freeride.host.memory import meminfo
from freeride.serve.config import ServeConfig
from freeride.serve.cores import side_task_cores, stage_position, thread_env
from freeride.serve.imperative import ImperativeProcess
from freeride.serve.progress import Progress, progress_source, watch_progress
from freeride.serve.ranks import DeviceInfo
from freeride.serve.runners import ProgramRunner, Runner, SendFn, WorkerRunner
from freeride.serve.tasks import TaskRecord, spawn_worker, stop_process
from freeride.tasks.programs import device_env, program_env

__all__ = ["TaskProcesses"]

logger = logging.getLogger(__name__)

_SETUP_ROOM = 1 << 30
"""Host memory a worker may use beyond its task's cap until set up (interpreter, torch, the task's imports)."""
_WORKER_SLACK = 64 << 20
"""Added to a set-up worker's use and its task's cap: allocator slack."""


class TaskProcesses:
    """Starts, caps and ends the processes of a manager's side tasks."""

    def __init__(
        self,
        config: ServeConfig,
        *,
        devices: dict[str, DeviceInfo],
        tasks: dict[int, TaskRecord],
        send: SendFn,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.config = config
        self.devices = devices
        """Read only: written by :class:`~freeride.serve.ranks.Ranks`."""
        self.tasks = tasks
        """Read only: the supervisor's table."""
        self._send = send
        self._clock = clock
        self.mps_pipe_dir: Path | None = None
        """Pipe directory of the MPS daemon side tasks join (None without MPS)."""

    def workdir(self, task: TaskRecord) -> Path:
        """Where the task's worker runs and keeps its own outputs."""
        workdir = self.config.state_dir / "tasks" / task.name
        workdir.mkdir(parents=True, exist_ok=True)
        return workdir

    def cores(self, task: TaskRecord) -> list[int]:
        """The cores the task's process runs on (see :mod:`freeride.serve.cores`)."""
        info = self.devices[task.device]
        return side_task_cores(info.name, info.cpu_affinity, position=stage_position(info, self.devices.values()))

    def peak(self, task: TaskRecord) -> int:
        """The memory ``task`` may use: its declared (or profiled) peak.

        A task that declares none may use what its device can spare beside the
        peaks the other tasks there declared (all of the spare memory if they
        took it all): never the whole machine. -1 only where nothing is known.
        """
        if task.spec.peak_memory > 0:
            return task.spec.peak_memory
        spare = self.spare(task.device)
        others = sum(
            max(0, t.spec.peak_memory)
            for t in self.tasks.values()
            if t is not task and t.device == task.device and t.active
        )
        return spare - others if spare - others > 0 else spare

    def spare(self, name: str) -> int:
        """What device ``name`` can spare for side tasks; -1 where nothing is known.

        Before its stage says (a task pinned to a device ahead of training), an
        estimate that leaves the stage room: on a GPU half of what NVML sees free;
        on the host its available memory shared by the host devices known here.
        """
        info = self.devices[name]
        if info.spare_memory >= 0:
            return info.spare_memory
        if name.startswith("cuda:"):
            return info.free_memory // 2 if info.free_memory > 0 else -1
        available = meminfo("MemAvailable")
        hosts = sum(1 for other in self.devices if not other.startswith("cuda:"))
        return available // max(1, hosts) if available > 0 else -1

    def tighten(self, task: TaskRecord) -> None:
        """A worker is set up: cap its cgroup at what it uses now plus its task's cap."""
        group = task.cgroup
        if group is None or not group.memory_by or task.memory_cap <= 0:
            return
        used = group.memory_current()
        if used > 0:
            group.set_memory_max(used + task.memory_cap + _WORKER_SLACK)

    def cgroup(self, task: TaskRecord, host_cap: int) -> TaskCgroup | None:
        """The cgroup a task's processes run in; ``host_cap`` bytes of host memory, -1 for no cap.

        A GPU task's declared peak is device memory: its cgroup holds its
        processes (setsid ones included) but caps nothing.
        """
        if task.device.partition(":")[0] == "cuda":
            host_cap = -1
        return TaskCgroup.create(f"task-{task.task_id}-{task.restarts}", memory_max=host_cap)

    def memory_cap(self, task: TaskRecord) -> MemoryCap:
        device = self.devices[task.device]
        kind = task.device.partition(":")[0]
        peak = self.peak(task)
        if kind not in ("cpu", "cuda"):  # a backend's own device naming: host memory, like cpu
            cap = plan_memory_cap("cpu:0", peak)
        else:
            cap = plan_memory_cap(task.device, peak, mps_pipe_dir=self.mps_pipe_dir, total_bytes=device.device_memory)
        task.memory_cap = peak if cap.mechanism != "none" else -1
        task.memory_cap_by = "" if cap.mechanism == "none" else cap.mechanism
        # the SM share rides along: fixed at the process's start, like the memory cap
        share, sm_env = plan_sm_share(task.device, task.spec.sm_share, mps_pipe_dir=self.mps_pipe_dir)
        task.sm_share = share
        return MemoryCap(mechanism=cap.mechanism, env={**cap.env, **sm_env}, rlimit_as=cap.rlimit_as) if sm_env else cap

    async def run_worker(self, task: TaskRecord) -> int:
        cap = self.memory_cap(task)
        host = task.memory_cap if cap.mechanism == "rlimit_as" else -1
        group = self.cgroup(task, host + _SETUP_ROOM if host > 0 else -1)
        env = dict(cap.env)
        if group is not None and group.memory_by:
            env["FREERIDE_MEMORY_CAP_BY"] = task.memory_cap_by = group.memory_by
        process: asyncio.subprocess.Process | None = None
        try:
            process = await spawn_worker(
                task,
                python=self.config.python,
                endpoint=self.config.endpoints.workers,
                log_dir=self.config.log_dir,
                cpu_affinity=self.cores(task),
                extra_env=env,
                workdir=self.workdir(task),
            )
            if group is not None:
                try:
                    group.add(process.pid)
                    task.cgroup = group
                except OSError as exc:
                    logger.warning("[tasks] task %d: cannot move its worker into %s: %s", task.task_id, group.v2, exc)
            if task.terminal:  # cancelled while the worker was being started
                return await stop_process(process, timeout_s=0)
            task.runner = WorkerRunner(task.ident, process, send=self._send)
            code = await process.wait()
            if code != 0 and group is not None and group.oom_killed():
                task.error = f"worker killed: over its memory cap of {task.memory_cap >> 20} MiB"
            return code
        finally:
            # A worker still running (the manager is shutting down) is asked to checkpoint
            # and stop first: its cgroup goes when it has (see _stop_task).
            if group is not None and (process is None or process.returncode is not None):
                task.cgroup = None
                group.remove()  # and whatever the worker left running

    async def run_program(
        self, task: TaskRecord, *, report: Callable[[p.GrantDone], None], notify: Callable[[], None]
    ) -> int:
        """Start an imperative task's program stopped, let bubbles run it, and wait for its exit.

        ``report`` takes each grant's report; ``notify`` is told when the program is ready and when it ends.
        """
        cores = self.cores(task)
        cap = self.memory_cap(task)
        host = task.memory_cap if cap.mechanism == "rlimit_as" else -1
        # tight: the program's own declared peak, with a little slack for the allocator
        group = self.cgroup(task, host + max(host // 16, 8 << 20) if host > 0 else -1)
        if group is not None and group.memory_by:
            task.memory_cap_by = group.memory_by
        spec = task.spec
        if not isinstance(spec, p.ProgramSpec):
            raise TypeError(f"task {task.task_id} is no program")
        cwd = Path(spec.cwd) if spec.cwd else self.workdir(task)
        program = ImperativeProcess(
            spec.argv,
            env={**program_env(spec.env, os.environ), **device_env(task.device), **thread_env(cores), **cap.env},
            log_dir=self.config.log_dir,
            name=f"task-{task.task_id}-{task.name}",
            cpu_affinity=cores,
            # kept under a cgroup too: a huge allocation then fails cleanly (MemoryError) instead of an OOM kill
            memory_limit=cap.rlimit_as if cap.mechanism == "rlimit_as" else -1,
            margin_ns=self.config.margin_ns,
            sync_every=spec.sync_every,
            cwd=cwd,
            cgroup=group,
        )
        reader = progress_source(
            file=spec.progress_file,
            pattern=spec.progress_pattern,
            cwd=cwd,
            stdout=self.config.log_dir / f"{program.name}.out",
        )
        try:
            await program.start()
        except OSError as exc:
            if group is not None:
                group.remove()
            task.error = f"cannot start {spec.argv[0]!r}: {exc}"
            return 127
        if task.terminal:  # cancelled while the program was being started
            return (await program.terminate(timeout_s=self.config.stop_timeout_s)).returncode
        if self.config.side_priority == "low":
            with contextlib.suppress(OSError):  # the same low CPU priority as iterative workers
                os.setpriority(os.PRIO_PGRP, program.pid, 19)
        task.runner = ProgramRunner(
            task.task_id,
            program,
            report=report,
            clock=self._clock,
            total_steps=(lambda: max(task.steps, 0)) if reader is not None else None,
        )
        task.ready()
        notify()
        if reader is None:
            info = await program.wait()
        else:
            info = await watch_progress(program, reader, lambda seen: _progressed(task, seen))
        task.park()
        notify()
        task.busy_ns = program.busy_ns
        task.metrics.update({"user_s": info.user_s, "system_s": info.system_s, "max_rss_mb": info.max_rss_kb / 1024})
        if info.returncode != 0:
            why = f"killed by signal {info.signal}" if info.signal else f"exited with code {info.returncode}"
            if group is not None and group.oom_killed():
                why += f": over its memory cap of {task.memory_cap >> 20} MiB"
            task.error = f"program {why} (log: {self.config.log_dir / program.name}.err)"
        # what it left running, its watchdog and its cgroup go with it
        await program.terminate(timeout_s=self.config.stop_timeout_s)
        return info.returncode

    async def terminate(self, task: TaskRecord, runner: Runner) -> None:
        """End the process ``runner`` drives, once it was asked to stop: at once if it does not."""
        match runner:
            case ProgramRunner(program=program):
                await program.terminate(timeout_s=self.config.stop_timeout_s)
            case WorkerRunner(process=process):
                await stop_process(process, timeout_s=self.config.stop_timeout_s)
                if task.cgroup is not None:
                    task.cgroup.remove()  # what the worker left running
                    task.cgroup = None


def _progressed(task: TaskRecord, seen: Progress) -> None:
    """A program's own step count and metrics, as its progress file or stdout says them."""
    if seen.step >= 0:
        task.steps = max(task.steps, seen.step)
    task.metrics.update(seen.metrics)
