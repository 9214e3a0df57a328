"""Bubble events from a DeepSpeed ``PipelineEngine``, without touching the training script.

One :class:`DeepSpeedAdapter` watches one engine. Each training batch it

* times the instructions in which the stage waits for its neighbours
  (``RecvActivation``, ``RecvGrad``, blocking sends; under DualPipeV only
  ``CommitP2P``, where its queued sends and receives of both directions run), the
  all-reduces inside ``ReduceTiedGrads``, ``ReduceGrads`` (data-parallel) and
  ``OptimizerStep`` (gradient norm) and the loss broadcast after the schedule,
  and announces each as a bubble right before it blocks, with the duration it
  expects there;
* keys every wait by its place in the step: the action it precedes in ``2F0``
  notation (DeepSpeed's ``buffer_id`` is a ring-buffer slot, so micro-batches are
  numbered by the passes' position in the 1F1B order; under DualPipeV it is
  ``phase * m + micro-batch``, the phase our chunk), ``send:<action>`` for a
  send that blocks before that action, ``tail:p2p`` for DualPipeV's commits after
  the last pass, or ``tail:tied<i>`` / ``tail:dp<i>`` / ``tail:opt<i>`` /
  ``tail:loss`` for the end-of-step syncs;
* leaves the rest to a :class:`~freeride.backends.tracker.StepTracker` with the plan of the
  schedule that runs (1F1B, or DualPipeV's own instruction lists, see
  :mod:`freeride.backends.deepspeed.dualpipev`): prediction from the measured history at
  each place and, before there is any, from a replay of the schedule with this
  rank's compute times; ``StepFinished`` per ``train_batch``; in profile
  mode, every wait recorded in an :class:`~freeride.backends.observations.ObservationLog`
  for :func:`freeride.profile.build_profile`.

On a GPU whose p2p goes through NCCL the instructions return to the host before
the device has waited: bubbles are then timed on the device's timeline
(:mod:`freeride.backends.cuda_timing`), announced when the compute stream reaches the
wait and measured by CUDA events; ``timing`` (or ``FREERIDE_BUBBLE_TIMING``)
forces host or device timing.

Nothing here may disturb training: our own errors are logged and swallowed, the
framework's pass through untouched, and a missing manager only costs dropped sends.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any, Unpack

from freeride.backends.deepspeed import _compat, dualpipev
from freeride.backends.deepspeed._device import device_name
from freeride.backends.memory import device_memory
from freeride.backends.rank import AdapterOptions, RankAdapter, RankPlace
from freeride.backends.schedule import Kind, one_f_one_b
from freeride.backends.tracker import StepPlan
from freeride.profile import StepRecord

__all__ = ["TAIL_LOSS", "DeepSpeedAdapter", "reduce_key", "tail_key"]

logger = logging.getLogger(__name__)

TAIL_LOSS = "tail:loss"
"""Key of the loss broadcast that ``train_batch`` runs after the schedule."""

_SPARE_MEMORY_EVERY = 100
_RECEIVES: dict[str, Kind] = {"RecvActivation": "F", "RecvGrad": "B"}
"""The pass each receive feeds."""


def tail_key(index: int) -> str:
    """Key of the ``index``-th all-reduce inside ``OptimizerStep``."""
    return f"tail:opt{index}"


def reduce_key(instruction: str, index: int) -> str:
    """Key of the ``index``-th all-reduce inside ``ReduceGrads`` (``tail:dp<i>``) or ``ReduceTiedGrads``."""
    return f"tail:{_compat.REDUCE_INSTRUCTIONS[instruction]}{index}"


class DeepSpeedAdapter(RankAdapter):
    """Emits the bubbles of one pipeline engine (the handle :func:`attach` returns).

    Args:
        engine: A ``deepspeed.runtime.pipe.engine.PipelineEngine``.
        **options: As for :class:`~freeride.backends.rank.RankAdapter` (``session``,
            ``mode``, ``profile_dir``, ``min_bubble_ns``, ``clock``, ``timing``, ``timeline``).
    """

    def __init__(self, engine: Any, **options: Unpack[AdapterOptions]) -> None:
        self.facts = _compat.engine_facts(engine)
        f = self.facts
        place = RankPlace(
            framework="deepspeed",
            rank=f.rank,
            stage=f.stage,
            num_stages=f.num_stages,
            device=device_name(f),
            device_type=f.device_type,
            device_index=f.device_index,
        )
        super().__init__(place, **options)
        self._engine = weakref.ref(engine)
        self._active = False
        """Inside the schedule or the loss broadcast of a tracked batch."""
        self._plans: dict[tuple[str, int, int, int], StepPlan] = {}
        self._occurrences: dict[str, int] = {}
        self._collectives: dict[str, int] = {}
        self._batched_p2p = False
        """The batch in flight runs DualPipeV: only ``CommitP2P`` blocks on p2p."""
        self._launches: dict[tuple[str, int, int, int], tuple[dualpipev.Launch, ...]] = {}
        """Per DualPipeV plan, what each of the rank's commits launches."""
        self._commit_launches: tuple[dualpipev.Launch, ...] = ()
        self._commits = 0
        _compat.shadow_instruction_map(engine, self._wrap_table(_compat.class_instruction_map(engine)))
        logger.debug(  # the session wrote the attach line; these are the details
            "[attach] deepspeed rank %d stage %d/%d on %s (mode %s)",
            self.facts.rank,
            self.facts.stage,
            self.facts.num_stages,
            self.device,
            self.mode,
        )

    # ------------------------------------------------------------------ hooks

    def run_schedule(self, original: _compat.ExecSchedule, engine: Any, pipe_schedule: Any) -> Any:
        """Run ``original(engine, pipe_schedule)`` as a timed training batch."""
        started = False
        try:
            started = self._begin(engine, pipe_schedule)
        except Exception:
            logger.exception("[step] cannot time this batch; it runs untimed")
        if not started:
            return original(engine, pipe_schedule)
        self._active = True
        try:
            return original(engine, pipe_schedule)
        finally:
            self._active = False  # the step stays open for the loss broadcast

    def run_aggregate_loss(self, original: Callable[[Any], Any], engine: Any) -> Any:
        """Run ``train_batch``'s loss broadcast as the last wait of the batch, then close the step."""
        if self.closed or not self.tracker.in_step:
            return original(engine)
        self._active = True
        try:
            return self._wait(TAIL_LOSS, original, (engine,), {})
        finally:
            self._active = False
            self._end_step()

    def _begin(self, engine: Any, pipe_schedule: Any) -> bool:
        if self.closed:
            return False
        facts = _compat.schedule_facts(pipe_schedule)
        if not facts.training:
            return False
        if self.tracker.in_step:  # a batch whose loss was never aggregated (custom train loop)
            self._end_step()
        self._heartbeat_if_quiet()
        if self.mode == "profile" and self.log is None:
            self._open_log(engine, facts.name)
        self._occurrences.clear()
        self._collectives.clear()
        self._batched_p2p = facts.kind == "dualpipev"
        plan = self._plan(facts, pipe_schedule)
        self._commit_launches = self._launches.get((facts.kind, facts.stages, facts.micro_batches, facts.stage_id), ())
        self._commits = 0
        self.tracker.begin_step(plan, number=_compat.global_steps(engine), spare_memory=self.spare_memory)
        return True

    def _plan(self, facts: _compat.ScheduleFacts, pipe_schedule: Any) -> StepPlan:
        shape = (facts.kind, facts.stages, facts.micro_batches, facts.stage_id)
        plan = self._plans.get(shape)
        if plan is None:
            # with gradient clipping the step ends in the gradient-norm all-reduce;
            # without it the tail runs into the next batch's first receive
            merge_tail = self.facts.gradient_clipping <= 0
            if facts.kind == "dualpipev":
                rows = _compat.instruction_rows(pipe_schedule)
                priors = functools.partial(
                    dualpipev.wait_priors,
                    rows,
                    facts.stage_id,
                    micro_batches=facts.micro_batches,
                    tail_key=tail_key(0),
                    merge_tail=merge_tail,
                )
                self._launches[shape] = dualpipev.commit_launches(rows[facts.stage_id])
                plan = StepPlan(
                    schedule=dualpipev.to_schedule(rows, facts.micro_batches),
                    stage=facts.stage_id,
                    merge_tail=merge_tail,
                    tail_key=tail_key(0),
                    priors=priors,
                )
            else:
                plan = StepPlan(
                    schedule=one_f_one_b(facts.stages, facts.micro_batches),
                    stage=facts.stage_id,
                    merge_tail=merge_tail,
                    tail_key=tail_key(0),
                )
            self._plans[shape] = plan
        return plan

    def _open_log(self, engine: Any, schedule: str) -> None:
        log = self._new_log(num_microbatches=self.facts.micro_batches, schedule=schedule)
        weakref.finalize(engine, log.close)  # the engine may go away long before exit

    def _end_step(self) -> None:
        try:
            self.tracker.end_step()
        except Exception:
            logger.exception("[step] bookkeeping failed at the end of a step")

    def _step_finished(self, record: StepRecord) -> None:
        super()._step_finished(record)
        done = self.tracker.steps_done
        if done <= 2 or done % _SPARE_MEMORY_EVERY == 0:
            self.spare_memory, _ = device_memory(self.place.device_type, self.place.device_index)

    # ---------------------------------------------------------- instructions

    def _wrap_table(self, table: dict[type[Any], Callable[..., Any]]) -> dict[type[Any], Callable[..., Any]]:
        return {cls: self._wrap(cls.__name__, fn) for cls, fn in table.items()}

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in _compat.WAIT_INSTRUCTIONS:

            def wait_instruction(engine: Any, **kwargs: Any) -> Any:
                if not self._active:
                    return fn(engine, **kwargs)
                key = self._commit_key(name) if self._batched_p2p else self._wait_key(name)
                if key is None:
                    return fn(engine, **kwargs)
                return self._wait(key, fn, (engine,), kwargs)

            return wait_instruction
        if name in (_compat.FORWARD, _compat.BACKWARD):
            kind: Kind = "F" if name == _compat.FORWARD else "B"

            def compute_instruction(engine: Any, **kwargs: Any) -> Any:
                if not self._active:
                    return fn(engine, **kwargs)
                self._track(self.tracker.action_started, kind)
                t0 = self._clock()
                try:
                    return fn(engine, **kwargs)
                finally:
                    self._track(self.tracker.record_compute, kind, self._clock() - t0)

            return compute_instruction
        if name == _compat.OPTIMIZER_STEP or name in _compat.REDUCE_INSTRUCTIONS:
            key: Callable[[int], str] = (
                tail_key if name == _compat.OPTIMIZER_STEP else functools.partial(reduce_key, name)
            )

            def collectives(engine: Any, **kwargs: Any) -> Any:
                if not self._active:
                    return fn(engine, **kwargs)
                with _compat.timed_collectives(functools.partial(self._collective, name, key)):
                    return fn(engine, **kwargs)

            return collectives
        return fn

    def _commit_key(self, name: str) -> str | None:
        """The place of a DualPipeV instruction that can block (None: it cannot).

        Only commits with something queued block: sends and receives only queue work
        (but for the one-off shape exchange of the first batch, a warm-up step).
        """
        if name != _compat.COMMIT_P2P:
            return None
        index = self._commits
        self._commits += 1
        launch: dualpipev.Launch = self._commit_launches[index] if index < len(self._commit_launches) else "recv"
        return dualpipev.commit_key(launch, self.tracker.next_action) if launch else None

    def _wait_key(self, name: str) -> str:
        """The place of a wait: the pass it feeds, the pass a blocking send precedes, else its occurrence.

        ``buffer_id`` is a ring-buffer slot, not a micro-batch: passes are numbered by
        the 1F1B order the tracker follows (``TrainSchedule`` runs it; the unit tests check).
        """
        if self.tracker.plan is not None:
            after = self.tracker.next_action
            if name in _RECEIVES and after is not None and after.kind == _RECEIVES[name]:
                return str(after)
            if name in _compat.SEND_INSTRUCTIONS:
                return "send:tail" if after is None else f"send:{after}"
        n = self._occurrences.get(name, 0)
        self._occurrences[name] = n + 1
        return f"{name}#{n}"

    def _collective(
        self,
        instruction: str,
        key: Callable[[int], str],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        if not self._active:
            return fn(*args, **kwargs)
        index = self._collectives.get(instruction, 0)
        self._collectives[instruction] = index + 1
        return self._wait(key(index), fn, args, kwargs)

    def _wait(self, key: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call ``fn`` as a (possible) bubble at ``key`` of the batch in flight."""
        self._track(self.tracker.wait_started, key)
        try:
            return fn(*args, **kwargs)
        finally:
            self._track(self.tracker.wait_ended)

    @staticmethod
    def _track(call: Callable[..., None], *args: Any) -> None:
        """Our bookkeeping never raises into the training step."""
        try:
            call(*args)
        except Exception:
            logger.exception("[bubble] bookkeeping failed in %s", getattr(call, "__name__", call))

    # ---------------------------------------------------------------- close

    def close(self) -> None:
        """Stop timing the engine, write profile observations, say goodbye (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._active = False
        if self.tracker.in_step:
            self._end_step()
        engine = self._engine()
        if engine is not None:
            _compat.unshadow_instruction_map(engine)
        self._close_channel()
