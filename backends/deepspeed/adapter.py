"""Bubble events from a DeepSpeed ``PipelineEngine``, without touching the training script.

One :class:`DeepSpeedAdapter` watches one engine. Each training batch it

* times the instructions in which the stage waits for its neighbours
  (``RecvActivation``, ``RecvGrad``; ``CommitP2P`` under DualPipeV), the
  gradient-norm all-reduce inside ``OptimizerStep`` and the loss broadcast after
  the schedule, and announces each as a bubble right before it blocks, with the
  duration it expects there;
* keys every wait by its place in the step: the action it precedes in ``2F0``
  notation (DeepSpeed's ``buffer_id`` is a ring-buffer slot, so micro-batches are
  numbered by counting forward and backward passes), ``send:<action>`` for a send
  that blocks before that action, or ``tail:opt<i>`` / ``tail:loss`` for the
  end-of-step syncs;
* predicts from the measured history at that place (:class:`BubblePredictor`),
  and before there is any, from :func:`backends.schedule.simulate` of the 1F1B
  schedule with this rank's measured forward and backward times;
* reports ``StepFinished`` per ``train_batch`` and, in profile mode, records
  every wait for :func:`freeride.profile.build_profile`.

Nothing here may disturb training: our own errors are logged and swallowed, the
framework's pass through untouched, and a missing manager only costs dropped sends.
"""

from __future__ import annotations

import atexit
import logging
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.deepspeed import _compat
from backends.deepspeed._device import device_memory, device_name
from backends.launch import Mode, read_mode
from backends.predict import BubblePredictor
from backends.schedule import Action, Durations, bubbles, one_f_one_b, simulate
from backends.session import BackendConfig, BackendSession, events_endpoint_from_env
from freeride.profile import RankObservations, StepRecord, WaitRecord, write_observations

__all__ = ["TAIL_LOSS", "DeepSpeedAdapter", "tail_key"]

logger = logging.getLogger(__name__)

TAIL_LOSS = "tail:loss"
"""Key of the loss broadcast that ``train_batch`` runs after the schedule."""

_MAX_RECORDED_STEPS = 10_000
_SPARE_MEMORY_EVERY = 100
_HEARTBEAT_NS = 1_000_000_000


def tail_key(index: int) -> str:
    """Key of the ``index``-th all-reduce inside ``OptimizerStep``."""
    return f"tail:opt{index}"


@dataclass(frozen=True, slots=True)
class _Keys:
    """Precomputed keys of one stage's waits in a 1F1B batch (built once per shape)."""

    forward: tuple[str, ...]
    """``forward[j]``: the receive before forward ``j``."""
    backward: tuple[str, ...]
    send: tuple[str, ...]
    """``send[n]``: a send after ``n`` passes (the last one: after all of them)."""

    @classmethod
    def build(cls, num_stages: int, micro_batches: int, stage: int) -> _Keys:
        order = one_f_one_b(num_stages, micro_batches).actions[stage]
        return cls(
            forward=tuple(str(Action(stage, "F", j)) for j in range(micro_batches)),
            backward=tuple(str(Action(stage, "B", j)) for j in range(micro_batches)),
            send=(*(f"send:{a}" for a in order), "send:tail"),
        )


@dataclass(slots=True)
class _Step:
    """Bookkeeping of the batch in flight."""

    step: int
    start_ns: int
    keys: _Keys | None
    """Wait keys of a TrainSchedule batch; None: key waits by occurrence."""
    forwards: int = 0
    backwards: int = 0
    collectives: int = 0
    occurrences: dict[str, int] = field(default_factory=dict)
    waits: list[WaitRecord] = field(default_factory=list)
    forward_ns: list[int] = field(default_factory=list)
    backward_ns: list[int] = field(default_factory=list)


class DeepSpeedAdapter:
    """Emits the bubbles of one pipeline engine (the handle :func:`attach` returns).

    Args:
        engine: A ``deepspeed.runtime.pipe.engine.PipelineEngine``.
        session: Where events go; by default a :class:`BackendSession` to the
            launcher's events endpoint.
        mode: ``profile`` also writes every wait to ``profile_dir``; default from
            the launcher's environment.
        profile_dir: Where profile observations go (``rank-<rank>.json``).
        min_bubble_ns: Waits expected to be shorter are not announced.
    """

    def __init__(
        self,
        engine: Any,
        *,
        session: BackendSession | None = None,
        mode: Mode | None = None,
        profile_dir: Path | None = None,
        min_bubble_ns: int = 1_000_000,
    ) -> None:
        env_mode, env_dir = read_mode()
        self.mode: Mode = env_mode if mode is None else mode
        self.profile_dir = env_dir if profile_dir is None else profile_dir
        if self.mode == "profile" and self.profile_dir is None:
            logger.warning("[attach] profile mode without a profile dir: observations are not written")
        self.facts = _compat.engine_facts(engine)
        self.device = device_name(self.facts)
        self.spare_memory, self.device_memory = device_memory(self.facts.device_type, self.facts.device_index)
        if session is None:
            session = BackendSession(
                BackendConfig(
                    endpoint=events_endpoint_from_env(),
                    rank=self.facts.rank,
                    stage=self.facts.stage,
                    num_stages=self.facts.num_stages,
                    device=self.device,
                    framework="deepspeed",
                    spare_memory=self.spare_memory,
                    device_memory=self.device_memory,
                    min_bubble_ns=min_bubble_ns,
                )
            )
        self.session = session
        self.predictor = BubblePredictor(history=3)
        self.closed = False
        self.steps_done = 0
        self.last_step: StepRecord | None = None
        self._engine = weakref.ref(engine)
        self._cur: _Step | None = None
        self._pending: _Step | None = None
        self._priors_for: tuple[int, int] | None = None
        self._keys_for: tuple[int, int, int] | None = None
        self._keys_cache: _Keys | None = None
        self._last_event_ns = time.monotonic_ns()
        self._records: list[StepRecord] = []
        self._schedule_name = ""
        _compat.shadow_instruction_map(engine, self._wrap_table(_compat.class_instruction_map(engine)))
        if self.mode == "profile":
            # at exit, or earlier if the engine goes away (whichever comes first writes; both may)
            atexit.register(self._write_observations)
            weakref.finalize(engine, self._write_observations)
        logger.info(
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
        try:
            return original(engine, pipe_schedule)
        finally:
            self._pending, self._cur = self._cur, None

    def run_aggregate_loss(self, original: Callable[[Any], Any], engine: Any) -> Any:
        """Run ``train_batch``'s loss broadcast as the last wait of the batch, then close the step."""
        pending = self._pending
        if pending is None or self.closed:
            return original(engine)
        self._cur = pending
        try:
            return self._wait(TAIL_LOSS, original, (engine,), {})
        finally:
            self._cur = self._pending = None
            self._finish(pending)

    def _begin(self, engine: Any, pipe_schedule: Any) -> bool:
        if self.closed:
            return False
        facts = _compat.schedule_facts(pipe_schedule)
        if not facts.training:
            return False
        if self._pending is not None:  # a batch whose loss was never aggregated (custom train loop)
            pending, self._pending = self._pending, None
            self._finish(pending)
        now = time.monotonic_ns()
        if now - self._last_event_ns > _HEARTBEAT_NS:
            self.session.heartbeat()
        self._schedule_name = facts.name
        if facts.kind == "train" and self._priors_for != (facts.stages, facts.micro_batches):
            self._set_priors(facts)
        self._cur = _Step(
            step=_compat.global_steps(engine),
            start_ns=time.monotonic_ns(),
            keys=self._keys(facts) if facts.kind == "train" else None,
        )
        return True

    def _finish(self, cur: _Step) -> None:
        try:
            now = time.monotonic_ns()
            self.session.step_finished(cur.step, now - cur.start_ns)
            self._last_event_ns = now
            record = StepRecord(
                step=cur.step,
                duration_ns=now - cur.start_ns,
                waits=cur.waits,
                forward_ns=cur.forward_ns,
                backward_ns=cur.backward_ns,
            )
            self.last_step = record
            if self.mode == "profile" and len(self._records) < _MAX_RECORDED_STEPS:
                self._records.append(record)
            self.steps_done += 1
            if self.steps_done <= 2 or self.steps_done % _SPARE_MEMORY_EVERY == 0:
                self.spare_memory, _ = device_memory(self.facts.device_type, self.facts.device_index)
        except Exception:
            logger.exception("[step] bookkeeping failed after step %d", cur.step)

    def _keys(self, facts: _compat.ScheduleFacts) -> _Keys:
        shape = (facts.stages, facts.micro_batches, facts.stage_id)
        if self._keys_cache is None or self._keys_for != shape:
            self._keys_cache = _Keys.build(*shape)
            self._keys_for = shape
        return self._keys_cache

    # ----------------------------------------------------------- prediction

    def _set_priors(self, facts: _compat.ScheduleFacts) -> None:
        """Expected waits from the 1F1B schedule and this rank's last measured compute times."""
        last = self.last_step
        if last is None or not last.forward_ns:
            return
        forward = statistics.median(last.forward_ns) / 1e9
        backward = statistics.median(last.backward_ns) / 1e9 if last.backward_ns else 2 * forward
        p, m, s = facts.stages, facts.micro_batches, facts.stage_id
        windows = bubbles(simulate(one_f_one_b(p, m), Durations.uniform(p, forward, backward)))[s]
        head_extra = 0.0
        for window in windows:
            if window.before is None and self.facts.gradient_clipping > 0:
                self.predictor.set_prior(tail_key(0), round(window.duration * 1e9))
            elif window.before is None:  # no sync at the end: the tail moves into the next head
                head_extra = window.duration
        for window in windows:
            if window.before is not None:
                extra = head_extra if window.before == Action(s, "F", 0) else 0.0
                self.predictor.set_prior(str(window.before), round((window.duration + extra) * 1e9))
        self._priors_for = (p, m)

    # ---------------------------------------------------------- instructions

    def _wrap_table(self, table: dict[type[Any], Callable[..., Any]]) -> dict[type[Any], Callable[..., Any]]:
        return {cls: self._wrap(cls.__name__, fn) for cls, fn in table.items()}

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in _compat.WAIT_INSTRUCTIONS:

            def wait_instruction(engine: Any, **kwargs: Any) -> Any:
                cur = self._cur
                if cur is None:
                    return fn(engine, **kwargs)
                return self._wait(self._wait_key(cur, name), fn, (engine,), kwargs)

            return wait_instruction
        if name in (_compat.FORWARD, _compat.BACKWARD):
            forward = name == _compat.FORWARD

            def compute_instruction(engine: Any, **kwargs: Any) -> Any:
                cur = self._cur
                if cur is None:
                    return fn(engine, **kwargs)
                t0 = time.monotonic_ns()
                try:
                    return fn(engine, **kwargs)
                finally:
                    elapsed = time.monotonic_ns() - t0
                    if forward:
                        cur.forwards += 1
                        cur.forward_ns.append(elapsed)
                    else:
                        cur.backwards += 1
                        cur.backward_ns.append(elapsed)

            return compute_instruction
        if name == _compat.OPTIMIZER_STEP:

            def optimizer_step(engine: Any, **kwargs: Any) -> Any:
                if self._cur is None:
                    return fn(engine, **kwargs)
                with _compat.timed_collectives(self._collective):
                    return fn(engine, **kwargs)

            return optimizer_step
        return fn

    def _wait_key(self, cur: _Step, name: str) -> str:
        keys = cur.keys
        if keys is not None:
            if name == "RecvActivation" and cur.forwards < len(keys.forward):
                return keys.forward[cur.forwards]
            if name == "RecvGrad" and cur.backwards < len(keys.backward):
                return keys.backward[cur.backwards]
            if name in _compat.SEND_INSTRUCTIONS:
                return keys.send[min(cur.forwards + cur.backwards, len(keys.send) - 1)]
        n = cur.occurrences.get(name, 0)
        cur.occurrences[name] = n + 1
        return f"{name}#{n}"

    def _collective(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        cur = self._cur
        if cur is None:
            return fn(*args, **kwargs)
        index = cur.collectives
        cur.collectives += 1
        return self._wait(tail_key(index), fn, args, kwargs)

    def _wait(self, key: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call ``fn`` as a (possible) bubble at ``key`` of the batch in flight."""
        cur = self._cur
        announced = False
        expected = -1
        # from before the announcement: what the manager sees as the bubble includes sending it
        t0 = time.monotonic_ns()
        if cur is not None:
            try:
                expected = self.predictor.expect(key)
                announced = self.session.bubble_started(cur.step, expected, spare_memory=self.spare_memory)
            except Exception:
                logger.exception("[bubble] cannot announce the wait at %s", key)
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.monotonic_ns()
            try:
                if announced:
                    self.session.bubble_ended()
                if cur is not None:
                    if self.steps_done > 0:  # the first batch runs slow (buffers, meta exchange)
                        self.predictor.observe(key, t1 - t0)
                    cur.waits.append(
                        WaitRecord(key=key, offset_ns=t0 - cur.start_ns, duration_ns=t1 - t0, expected_ns=expected)
                    )
            except Exception:
                logger.exception("[bubble] bookkeeping failed at %s", key)

    # ---------------------------------------------------------------- close

    def observations(self) -> RankObservations:
        """What this rank has recorded so far (profile mode)."""
        return RankObservations(
            framework="deepspeed",
            rank=self.facts.rank,
            stage=self.facts.stage,
            num_stages=self.facts.num_stages,
            device=self.device,
            num_microbatches=self.facts.micro_batches,
            schedule=self._schedule_name,
            spare_memory=self.spare_memory,
            device_memory=self.device_memory,
            steps=list(self._records),
        )

    def _write_observations(self) -> None:
        if self.mode != "profile" or self.profile_dir is None or not self._records:
            return
        try:
            path = write_observations(self.observations(), self.profile_dir)
            logger.info("[profile] rank %d: %d steps written to %s", self.facts.rank, len(self._records), path)
        except Exception:
            logger.exception("[profile] rank %d: cannot write observations", self.facts.rank)

    def close(self) -> None:
        """Stop timing the engine, write profile observations, say goodbye (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._cur = None
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._finish(pending)
        engine = self._engine()
        if engine is not None:
            _compat.unshadow_instruction_map(engine)
        if self.mode == "profile":
            atexit.unregister(self._write_observations)
            self._write_observations()
        self.session.close()
