"""Bubble events from one torch.distributed.pipelining schedule, without touching the training script.

One :class:`TorchPipeAdapter` watches one schedule object. Each training
``step()`` it

* begins a step in a :class:`~freeride.backends.tracker.StepTracker` whose plan is the
  schedule's own action lists translated to ``2F0`` notation
  (:mod:`freeride.backends.torchpipe.translate`);
* reports every compute pass (``forward_one_chunk``: F, ``backward_one_chunk``:
  B, ``backward_weight_one_chunk``: W) so the tracker knows which action comes next;
* treats every ``_wait_batch_p2p`` as a wait: one that holds a receive is keyed by
  the action it feeds (the next one in the list), one of sends only by
  ``send:<next action>`` (``send:tail`` for the sends torch drains at the end of
  the step). The tracker announces it as a bubble with the length it expects
  there, and ends it when the wait returns;
* times the stage's ``perform_reduce_grad`` (the gradient reduction over the
  data-parallel group, where a rank waits for its slowest replica) as the wait
  at :data:`TAIL_REDUCE`;
* on CUDA with NCCL, where ``_wait_batch_p2p`` returns to the host before the
  compute stream has waited, times those waits on the device's timeline
  (:mod:`freeride.backends.cuda_timing`) as the DeepSpeed and Megatron adapters do;
* ends the step when ``step()`` returns. torch's schedules have no pipeline-wide
  sync of their own at the end, so a rank's tail lands in the next step's first
  receive (``merge_tail``).

Nothing here may disturb training: our bookkeeping is called through
:meth:`TorchPipeAdapter._track`, which logs and counts its errors instead of
raising; the framework's own errors pass through untouched.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from typing import Any, Unpack

from freeride.backends.rank import AdapterOptions, RankAdapter, RankPlace
from freeride.backends.schedule import Kind, Schedule, gpipe, one_f_one_b
from freeride.backends.session import manager_reachable
from freeride.backends.torchpipe import _compat
from freeride.backends.torchpipe.translate import loop_placed, to_schedule
from freeride.backends.tracker import StepPlan

__all__ = ["SINGLE_STAGE_ORDERS", "TAIL_REDUCE", "TorchPipeAdapter", "device_name"]

logger = logging.getLogger(__name__)

TAIL_REDUCE = "tail:reduce_grad"
"""Key of the end-of-step gradient reduction (``perform_reduce_grad``)."""

SINGLE_STAGE_ORDERS: dict[str, Callable[[int, int], Schedule]] = {"Schedule1F1B": one_f_one_b, "ScheduleGPipe": gpipe}
"""The order the single-stage schedules' ``_step_microbatches`` loops run (torch 2.13's
``Schedule1F1B.pipeline_order`` misnumbers the micro-batches of all but the first rank;
the unit tests pin that these loops run exactly these orders)."""


def device_name(device_type: str, device_index: int) -> str:
    """``cuda:<index>``; on CPU ``cpu:<core>``, the core the rank is pinned to.

    A node with more ranks than cores (a deep pipeline tried on a small CPU
    machine) pins several ranks to one core; each still trains as a device of
    its own (a manager keeps one rank per device), named ``cpu:<local rank>``.
    Its rank's ``Hello`` reports the core it really runs on, and its side tasks
    are pinned there.
    """
    if device_type != "cpu":
        return f"{device_type}:{device_index}"
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    ncpu = os.cpu_count() or 1
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) > ncpu:
        return f"cpu:{local}"
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) == 1:
        return f"cpu:{cores[0]}"
    return f"cpu:{local % ncpu}"


def _global_rank(default: int) -> int:
    try:
        import torch.distributed as dist

        return int(dist.get_rank()) if dist.is_initialized() else default
    except Exception:
        return default


class TorchPipeAdapter(RankAdapter):
    """Emits the bubbles of one pipeline schedule (``Schedule1F1B``, ``ScheduleInterleaved1F1B``...).

    Args:
        schedule: A ``torch.distributed.pipelining`` schedule object.
        **options: As for :class:`~freeride.backends.rank.RankAdapter` (``session``,
            ``mode``, ``profile_dir``, ``min_bubble_ns``, ``clock``, ``timing``, ``timeline``).
    """

    def __init__(self, schedule: Any, **options: Unpack[AdapterOptions]) -> None:
        self.facts = _compat.schedule_facts(schedule)
        f = self.facts
        self.rank = _global_rank(f.rank)
        place = RankPlace(
            framework="torchpipe",
            rank=self.rank,
            stage=f.rank,
            num_stages=f.num_ranks,
            device=device_name(f.device_type, f.device_index),
            device_type=f.device_type,
            device_index=f.device_index,
        )
        super().__init__(place, **options)
        self.plan = self._build_plan(schedule)
        self.errors = 0
        """Our own errors, caught so that training never sees them."""
        self._schedule = weakref.ref(schedule)
        self._recv_works: dict[int, Any] = {}
        """id -> Work of the receives posted in the step in flight (kept alive so ids stay unique)."""
        endpoint = self.session.config.endpoint
        logger.debug(  # the session wrote the attach line; these are the details
            "[attach] torchpipe rank %d stage %d/%d (%s, %s) on %s: manager %s",
            self.rank,
            self.facts.rank,
            self.facts.num_ranks,
            self.facts.name,
            "stages " + ",".join(map(str, self.facts.stage_indices)),
            self.device,
            "reachable" if manager_reachable(self.session.sent, endpoint) else f"not reachable at {endpoint}",
        )

    def _build_plan(self, schedule: Any) -> StepPlan | None:
        """The step's plan from the schedule's action lists (or, for the two single-stage
        schedules whose hard-coded loop those lists misdescribe, the loop's own order)."""
        f = self.facts
        rows = _compat.schedule_actions(schedule)
        plan_schedule: Schedule | None = None
        why = "it lists no actions"
        if rows is not None:
            try:
                plan_schedule = to_schedule(
                    f.name,
                    rows,
                    stage_to_rank=f.stage_to_rank,
                    num_ranks=f.num_ranks,
                    num_microbatches=f.num_microbatches,
                )
            except ValueError as exc:
                why = str(exc)
        if plan_schedule is None and f.name in SINGLE_STAGE_ORDERS:
            plan_schedule = SINGLE_STAGE_ORDERS[f.name](f.num_ranks, f.num_microbatches)
            logger.debug(
                "[attach] %s: its action list does not match its loop (%s); using the loop's order", f.name, why
            )
        if plan_schedule is None:
            logger.warning(
                "[attach] cannot read %s's actions (%s): waits are predicted from measurements only", f.name, why
            )
            return None
        return StepPlan(
            schedule=plan_schedule,
            stage=self.facts.rank,
            merge_tail=True,
            simulated=loop_placed(self.facts.stage_to_rank, self.facts.num_ranks),
        )

    # ------------------------------------------------------------------ hooks

    def run_step(self, original: _compat.StepFn, schedule: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``original(schedule, *args, **kwargs)`` as one tracked training step."""
        if self.closed or not _compat.has_backward(schedule):
            return original(schedule, *args, **kwargs)
        self._track(self._begin)
        try:
            result = original(schedule, *args, **kwargs)
        except BaseException:
            self._track(self.tracker.abandon_step)
            self._recv_works.clear()
            raise
        self._track(self._end)
        return result

    def _begin(self) -> None:
        self._recv_works.clear()
        self._heartbeat_if_quiet()
        if self.mode == "profile" and self.log is None:
            self._open_log()
        self.tracker.begin_step(self.plan, spare_memory=self.spare_memory)

    def _end(self) -> None:
        self._recv_works.clear()
        self.tracker.end_step()

    def posted(self, ops: list[Any], works: list[Any]) -> None:
        """``_batch_p2p(ops)`` returned ``works``: remember those that receive."""
        if self.tracker.in_step and any(_compat.is_recv(op) for op in ops):
            for work in works:
                self._recv_works[id(work)] = work

    def wait(self, original: _compat.WaitBatchP2P, works: list[Any]) -> None:
        """Run ``original(works)`` as a wait of the step in flight."""
        if not works or not self.tracker.in_step:
            original(works)
            return
        self._track(self._wait_started, works)
        try:
            original(works)
        finally:
            self._track(self.tracker.wait_ended)

    def _wait_started(self, works: list[Any]) -> None:
        key: str | None = None
        if not any(id(w) in self._recv_works for w in works):
            after = self.tracker.next_action
            key = "send:tail" if after is None else f"send:{after}"
        self.tracker.wait_started(key)

    def sync(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the end-of-step gradient reduction as the wait at :data:`TAIL_REDUCE`."""
        if not self.tracker.in_step:
            return fn(*args, **kwargs)
        self._track(self.tracker.wait_started, TAIL_REDUCE)
        try:
            return fn(*args, **kwargs)
        finally:
            self._track(self.tracker.wait_ended)

    def compute(self, kind: Kind, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one compute pass, telling the tracker which action it is and how long it took."""
        if not self.tracker.in_step:
            return fn(*args, **kwargs)
        self._track(self.tracker.action_started, kind)
        t0 = self._clock()
        try:
            return fn(*args, **kwargs)
        finally:
            self._track(self.tracker.record_compute, kind, self._clock() - t0)

    def _track(self, call: Callable[..., object], *args: Any) -> None:
        """Our bookkeeping never raises into the training step: errors are logged and counted."""
        try:
            call(*args)
        except Exception:
            self.errors += 1
            if self.errors <= 3:
                logger.exception("[bubble] bookkeeping failed in %s", getattr(call, "__name__", call))

    # ------------------------------------------------------------- profile

    def _open_log(self) -> None:
        self._new_log(num_microbatches=self.facts.num_microbatches, schedule=self.facts.name)

    # ---------------------------------------------------------------- close

    def close(self) -> None:
        """Stop timing, write profile observations, say goodbye (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self.tracker.in_step:
            self._track(self.tracker.end_step)
        self._close_channel()
