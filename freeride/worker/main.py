"""The process that runs one iterative side task: ``python -m freeride.worker``.

The worker connects to the manager, receives its :class:`~freeride.protocol.Assign`,
pins itself to the cores of its device, builds the task, sets it up, restores
its checkpoint into it and then runs the task's coroutine through a
:class:`~freeride.worker.gate.GrantGate`, which decides when each step may
start. A failure before the first step (``__init__``, ``setup``, the
checkpoint's load) is reported as final: a restart would only repeat it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from freeride import protocol as p
from freeride.gpu.streams import step_end_sync, use_side_stream
from freeride.host.procs import bind_to_parent
from freeride.host.threads import lower_priority, pin
from freeride.sidetask import IterativeTask, TaskContext, TaskStopped
from freeride.tasks.declared import declared, validate_options
from freeride.tasks.estimates import EstimatesStore
from freeride.transport import BubbleListener, WorkerLink, new_async_context
from freeride.worker.armed import RankFeed
from freeride.worker.checkpoint import load_checkpoint, state_bytes, write_checkpoint
from freeride.worker.courtesy import RankCourtesy
from freeride.worker.gate import GrantGate
from freeride.worker.gated import bind_gated_steps
from freeride.worker.warmup import warm_up

__all__ = ["load_target", "main"]

logger = logging.getLogger(__name__)


def load_target(target: str) -> type[IterativeTask]:
    """Import a task named as :func:`freeride.tasks.resolve` accepts and check it is an :class:`IterativeTask`."""
    from freeride.tasks.targets import load

    return load(target)


def _save_checkpoint(task: IterativeTask, path: Path, steps: int) -> int:
    state = task.state_dict()
    if not state:
        return -1
    write_checkpoint(state, path, steps)  # only tasks with state pay for torch's import
    return state_bytes(state)


def _read_checkpoint(path: Path) -> dict[str, Any] | None:
    """The saved ``{"steps", "state"}`` at ``path``; None where there is none."""
    if not path.is_file():
        return None
    return load_checkpoint(path)  # weights only: a planted pickle must not run code here


def _restore(task: IterativeTask, saved: dict[str, Any] | None) -> int:
    """Load ``saved`` into ``task`` (set up); the steps it holds."""
    if saved is None:
        return 0
    task.load_state_dict(saved["state"])
    return int(saved["steps"])


def _estimates_store(assign: p.Assign, cls: type[IterativeTask]) -> EstimatesStore | None:
    """Where this task's step-time estimates are kept across runs (None: the manager keeps none)."""
    if not assign.estimates_dir:
        return None
    try:
        return EstimatesStore.for_task(
            Path(assign.estimates_dir),
            assign.spec.target,
            cls,
            dict(assign.spec.options),
            torch_device=_torch_device(assign.device),
        )
    except Exception as exc:  # an optimisation: never a reason to fail the task
        logger.warning("[estimates] not kept for task %d: %s: %s", assign.task_id, type(exc).__name__, exc)
        return None


def _lower_cpu_priority() -> None:
    """Side tasks yield the CPU to everything else: training ranks, their data loaders, the manager.

    The lowest nice level is the host-side twin of a low MPS client priority:
    a training thread (or the manager) that wakes up preempts the side task at
    once instead of after the scheduler's wake-up granularity. (SCHED_IDLE
    would go further but lets any unrelated busy process starve a side task
    even inside its bubbles.)
    """
    lower_priority(19)  # every thread, as for the cores


def _set_threads(n: int) -> None:
    """One compute thread per core the worker is pinned to, before the task builds anything.

    The manager sets ``OMP_NUM_THREADS`` too; this also holds where the task's
    environment or an earlier import fixed torch's thread pool otherwise.
    """
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        import torch

        torch.set_num_threads(n)


def _cap_torch_cuda_memory() -> None:
    """Keep PyTorch's caching allocator just under the MPS cap (set by the manager)."""
    fraction = os.environ.get("FREERIDE_TORCH_MEMORY_FRACTION")
    if not fraction:
        return
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(float(fraction), 0)


def _vm_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _cap_address_space(limit_bytes: int) -> None:
    """On a CPU device, cap what the task can still allocate to its declared peak.

    Set after setup, relative to what is mapped then: interpreter and library
    mappings (a large share of a torch process's address space) are not the
    task's memory. An allocation past the cap raises ``MemoryError``, which is
    reported as the task's failure. Never used on CUDA devices, where the
    driver reserves a huge virtual range.
    """
    import importlib.util
    import resource

    # torch maps most of a GiB of address space when imported; the checkpoint
    # writer imports it, and so may the task, after the cap: load it first
    if importlib.util.find_spec("torch") is not None:
        import torch  # noqa: F401
    size, rss = _vm_kb("VmSize") * 1024, _vm_kb("VmRSS") * 1024
    cap = size + max(0, limit_bytes - rss) + (64 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    logger.info("[worker] address space capped at %d MiB (peak %d MiB declared)", cap >> 20, limit_bytes >> 20)


def _torch_device(device: str) -> str:
    kind, _, _ = device.partition(":")
    return "cuda:0" if kind == "cuda" else "cpu"  # CUDA_VISIBLE_DEVICES leaves one GPU


async def _run(endpoint: str, task_id: int) -> int:
    ctx = new_async_context()
    link = WorkerLink(ctx, endpoint, task_id)
    feed = RankFeed(link, lambda bubbles: BubbleListener(ctx, bubbles))
    try:
        link.send_nowait(p.WorkerReady(protocol_version=p.PROTOCOL_VERSION, task_id=task_id, pid=os.getpid()))
        async with asyncio.timeout(60):
            msg = await link.recv()
            while not isinstance(msg, p.Assign):
                if isinstance(msg, p.Stop):
                    return 0
                msg = await link.recv()
        return await _serve(link, msg, feed)
    finally:
        feed.close()
        link.close()
        ctx.term()


async def _serve(link: WorkerLink, assign: p.Assign, feed: RankFeed) -> int:
    if assign.cpu_affinity:
        pin(assign.cpu_affinity)  # every thread: libzmq's I/O thread takes each of the worker's messages
        _set_threads(len(assign.cpu_affinity))
    if assign.side_priority == "low":  # "same": the stage's own, so an overrun delays it as on a GPU
        _lower_cpu_priority()
    _cap_torch_cuda_memory()
    # before the task builds anything: its kernels go to a lowest-priority stream
    stream = use_side_stream(_torch_device(assign.device))
    gated, gate_state = bind_gated_steps(assign.gate_path, stream.stream if stream is not None else None)
    if assign.gate_path and gated is None:
        logger.warning("[worker] device gate not used (steps wait on the host for their bubbles): %s", gate_state)
    task: IterativeTask | None = None
    set_up = False
    store: EstimatesStore | None = None
    gate: GrantGate | None = None
    try:
        cls = load_target(assign.spec.target)
        task = cls(**validate_options(declared(cls), assign.spec.options))
        workdir = Path(assign.workdir or ".")
        saved = _read_checkpoint(Path(assign.checkpoint_path))
        tctx = TaskContext(
            task_id=assign.task_id,
            device=assign.device,
            torch_device=_torch_device(assign.device),
            workdir=workdir,
            bubble_ns=assign.bubble_ns,
            memory_limit=assign.memory_limit,
            restoring=saved is not None,
        )
        await task.setup(tctx)  # first: the state a checkpoint restores needs the model it belongs to
        steps, saved = _restore(task, saved), None
        set_up = True
        store = _estimates_store(assign, cls)
        # also under the manager's cgroup cap (tighter): a huge allocation fails here as a MemoryError
        if assign.memory_limit > 0 and assign.device.startswith("cpu"):
            _cap_address_space(assign.memory_limit)
        gate = running = GrantGate(
            link,
            assign,
            task,
            steps,
            save=_save_checkpoint,
            device_sync=step_end_sync(stream),
            feed=feed,
            idle=None if store is None else lambda: store.save_if_due(running.estimates),
            courtesy=RankCourtesy(),
            gated=gated,
        )
        if store is not None:
            store.seed(gate.estimates)
        if assign.warm_up:
            rehearsal = await warm_up(task)
            if rehearsal is not None:  # the newest samples: this run's first-step costs are paid (nothing is cold)
                rehearsal.seed(gate.estimates)
        if task.state_dict():
            import torch  # noqa: F401 - load the serializer before timing a checkpoint
        gate.checkpoint_first()  # before any bubble: measures what a checkpoint costs
        link.send_nowait(
            p.WorkerReady(
                protocol_version=p.PROTOCOL_VERSION,
                task_id=assign.task_id,
                pid=os.getpid(),
                set_up=True,
                step_estimate_ns=gate.estimate_ns,
                steps=steps,
                packs=gate.packs,
                gate=gate_state,
            )
        )
        try:
            await task.run(gate)
        except TaskStopped as stop:
            gate.checkpoint_at_stop()
            link.send_nowait(gate.progress())
            logger.info("[worker] task %d stopped (%s) at step %d", assign.task_id, stop, gate.steps)
            return 0
        gate.finish("finished")
        gate.checkpoint()
        link.send_nowait(p.TaskFinished(task_id=assign.task_id, steps=gate.steps, metrics=task.metrics()))
        return 0
    except Exception as exc:
        link.send_nowait(
            p.TaskFailed(
                task_id=assign.task_id,
                error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(),
                final=not set_up,
            )
        )
        return 1
    finally:
        if store is not None and gate is not None:
            store.save(gate.estimates)  # also after a failure: what was measured holds
        if task is not None:
            await task.teardown()
        if gated is not None:
            gated.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m freeride.worker", description="FreeRide side-task worker")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--task-id", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    bind_to_parent(f"freeride-task{args.task_id}")  # never outlive the manager
    import uvloop

    return uvloop.run(_run(args.endpoint, args.task_id))


if __name__ == "__main__":
    sys.exit(main())
