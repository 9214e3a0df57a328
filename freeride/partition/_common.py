"""What the partitioned training and inference tasks share: options, data position, checkpoints before setup, drift."""

from __future__ import annotations

import abc
import logging
import math
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from freeride.partition.plan import Plan, Step, timer
from freeride.partition.values import rebuild
from freeride.sidetask import IterativeTask, TaskContext

__all__ = [
    "DEFAULT_TARGET_MS",
    "EMA",
    "Batches",
    "Partitioned",
    "capture_rng",
    "piece_target_s",
    "restore_rng",
    "to_device",
]

logger = logging.getLogger(__name__)

EMA = 0.9
"""Weight of the past in the smoothed loss and step-time drift."""
_DRIFT = 1.5
"""Measured over planned step time (smoothed) beyond which the steps are grouped again, or below its inverse."""
DEFAULT_TARGET_MS = 5.0
"""The longest a step should take where the device's bubbles are not known."""
_STEP_COST_S = 150e-6
"""What a step costs besides its work: the runtime's fit check, messages and accounting between two
steps (85-95 µs measured in a DeepSpeed CPU job) and the executor's own Python around the atoms."""
_TARGET_RANGE_S = (1e-3, 20e-3)
"""Bounds of a target sized from the bubbles: shorter steps are mostly fixed cost."""


def piece_target_s(bubble_ns: int) -> float:
    """The step length that loses the least of bubbles of typical length ``bubble_ns`` (0: not known).

    A bubble is lost at its end, where the next piece no longer fits (about
    half a step: 0.5 ``W`` per bubble of ``B``, measured with steps of 2-5 ms
    in a DeepSpeed CPU job), and between steps (a fixed cost ``c`` each). The
    share lost, ``0.5 W / B + c / W``, is least at ``W = sqrt(2 B c)``: 2.4
    ms in bubbles of 20 ms, 3 ms in bubbles of 30 ms, 5.5 ms in bubbles of 100
    ms. Where nothing is known, :data:`DEFAULT_TARGET_MS`.
    """
    if bubble_ns <= 0:
        return DEFAULT_TARGET_MS / 1e3
    low, high = _TARGET_RANGE_S
    return min(high, max(low, math.sqrt(2 * bubble_ns / 1e9 * _STEP_COST_S)))


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with its tensors on ``device``, its containers of the types they were."""
    return rebuild(value, lambda v: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)


def capture_rng(device: torch.device) -> dict[str, torch.Tensor]:
    """The process RNG state for the CPU and, on CUDA, for ``device`` (to keep in a checkpoint)."""
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def restore_rng(rng: dict[str, torch.Tensor], device: torch.device) -> None:
    """Undo :func:`capture_rng` (the CUDA part only on a CUDA device)."""
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)


class Batches:
    """Batches of a re-iterable, pass after pass; the whole state is :attr:`position`."""

    def __init__(self, data: Iterable[Any]) -> None:
        if iter(data) is data:
            raise ValueError(
                f"data is an iterator ({type(data).__name__}): give a re-iterable (a list, or a class with"
                " __iter__), so that a restored task can replay it"
            )
        self.data = data
        self.position = 0
        self._it: Iterator[Any] | None = None

    def next(self) -> Any:
        if self._it is None:
            self._it = iter(self.data)
        try:
            batch = next(self._it)
        except StopIteration:
            self._it = iter(self.data)
            try:
                batch = next(self._it)
            except StopIteration:
                raise ValueError("data yields no batches") from None
        self.position += 1
        return batch

    def peek(self) -> Any:
        """The first batch, without moving."""
        for batch in self.data:
            return batch
        raise ValueError("data yields no batches")

    def seek(self, position: int) -> None:
        resume = getattr(self.data, "iter_from", None)
        if callable(resume):  # the data can start anywhere: no need to replay it
            self._it, self.position = iter(resume(position)), position
            return
        self._it, self.position = None, 0
        while self.position < position:
            self.next()


class Partitioned(IterativeTask):
    """Options, deferred checkpoints and drift tracking shared by training and inference."""

    def __init__(self, *, target_ms: float = 0.0, steps: int = 0, profile_runs: int = 2) -> None:
        if not (target_ms >= 0 and math.isfinite(target_ms)):
            raise ValueError(
                f"target_ms must be a number of milliseconds >= 0 (0: sized from the device's bubbles), got {target_ms}"
            )
        if steps < 0:
            raise ValueError(f"steps must be >= 0 (0: until stopped), got {steps}")
        if profile_runs < 1:
            raise ValueError(f"profile_runs must be >= 1, got {profile_runs}")
        self.target_ms, self.steps, self.profile_runs = target_ms, steps, profile_runs
        self.target_s = target_ms / 1e3 if target_ms > 0 else DEFAULT_TARGET_MS / 1e3
        """The longest a step should take: ``target_ms``, or at setup sized from the device's bubbles."""
        self.device = torch.device("cpu")
        self.plan: Plan | None = None
        self.batches_done = 0
        self._ready = False
        self._restoring = False
        """Setup left planning to the checkpoint that follows it (its plan may be taken back)."""
        self._pending: dict[str, Any] | None = None
        self._drift = 1.0
        self._clock = time.perf_counter
        self._ran: set[str] = set()
        """Kinds run in this process: a kind's first run pays one-time costs and says nothing about drift."""

    async def setup(self, ctx: TaskContext) -> None:
        if self._ready:
            return
        self.device = torch.device(ctx.torch_device)
        self._clock = timer(self.device)
        self._size_steps(ctx)
        self._take(self.build())
        self._planned(ctx)

    @abc.abstractmethod
    def build(self) -> Any:
        """Build the model (on :attr:`device`) and what it works on; called once, in setup."""

    @abc.abstractmethod
    def _take(self, parts: Any) -> None:
        """Keep what :meth:`build` returned."""

    # -- planning and drift

    def _size_steps(self, ctx: TaskContext) -> None:
        """Set :attr:`target_s` for the device ``ctx`` names (unless ``target_ms`` fixed it)."""
        if self.target_ms > 0:
            return
        self.target_s = piece_target_s(ctx.bubble_ns)
        if ctx.bubble_ns > 0:
            logger.info(
                "[partition] steps of %.1f ms for bubbles of %.1f ms (half the bubble time in longer ones)",
                self.target_s * 1e3,
                ctx.bubble_ns / 1e6,
            )

    def _observe(self, step: Step | None, seconds: float) -> None:
        if step is None or step.cost_s <= 0:
            return
        if step.kind not in self._ran:
            # a fresh process's first batch took 1.6x the plan alone (allocations, kernel choice): a
            # regroup on it cut every later batch into pieces a third too small
            self._ran.add(step.kind)
            return
        self._drift = EMA * self._drift + (1 - EMA) * (seconds / step.cost_s)

    def _maybe_regroup(self) -> None:
        """At a batch boundary: group the steps again if step times drifted from the plan."""
        if self.plan is not None and not 1 / _DRIFT <= self._drift <= _DRIFT:
            logger.info("[partition] steps take %.2fx their planned time: grouping again", self._drift)
            self.plan.regroup(self._drift)
            self._drift = 1.0

    def step_cost(self, kind: str) -> float | None:
        """The planned seconds of a step of ``kind`` (measured at setup), or None for a kind not planned."""
        return self._costs().get(kind)

    def _costs(self) -> dict[str, float]:
        if self.plan is None:
            return {}
        return {s.kind: s.cost_s for s in (*self.plan.forward, *self.plan.backward)}

    def done(self) -> bool:
        return self.steps > 0 and self.batches_done >= self.steps

    # -- checkpoints before or after setup

    def state_dict(self) -> dict[str, Any]:
        if not self._ready:
            return dict(self._pending or {})
        return self._capture()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._ready:
            if state:
                self._restore(state)
            return
        if state:
            self._pending = dict(state)
        if self._restoring:
            self._restoring = False
            self._plan(state.get("plan") if state else None)

    def _planned(self, ctx: TaskContext) -> None:
        """End setup: plan now, or leave it to the checkpoint's state that follows (``ctx.restoring``)."""
        if ctx.restoring:
            self._restoring = True
        else:  # a state handed over before setup may hold a plan too
            self._plan(self._pending.get("plan") if self._pending else None)

    @abc.abstractmethod
    def _plan(self, saved: object) -> None:
        """Plan the steps, taking back the plan ``saved`` in a checkpoint where it still holds; then be ready."""

    def _apply_pending(self) -> None:
        self._ready = True
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._restore(state)

    @abc.abstractmethod
    def _capture(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def _restore(self, state: dict[str, Any]) -> None: ...

    def extra_state(self) -> dict[str, Any]:
        """A subclass's own state to checkpoint with the task's (as of the last batch boundary)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`extra_state` returned."""
