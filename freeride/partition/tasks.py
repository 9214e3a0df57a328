"""Side tasks that train or run any ``nn.Module``, cut automatically into bubble-sized steps.

A user subclasses :class:`PartitionedTraining` and builds the model, its
optimizer, the loss and the data in :meth:`PartitionedTraining.build`; at
setup the task traces and times the model on its device and plans steps
(see :mod:`freeride.partition.plan`). One batch is then:

* ``f0`` .. ``fN``: the forward pass, a few atoms per step (``f0`` fetches the batch);
* ``b0`` .. ``bM``: the backward pass, from the loss back to the input;
* ``u0`` .. ``uK``: the optimizer step, a run of parameters per step.

The parameters after each batch are those of ``opt.zero_grad();
loss_fn(model(x), y).backward(); opt.step()`` on the same batch, up to the
rounding of summing gradients in another order.

Checkpoints are exact at every step boundary. During the forward and backward
passes the state describes the batch's start (its data position, random state
and the model's buffers as they were then: batch-norm statistics are updated by
the forward pass), so a restored task runs the batch again from ``f0`` and
reaches the same numbers; parameters do not change before the update, and
their gradients start from none. During the update the state holds the
gradients and how many parameters are already updated.

The data must be re-iterable (a list, a ``Dataset``-like or a class with
``__iter__``) and yield the same batches each time it is iterated from the
start: a restore rebuilds it and skips the batches already used (replaying
them, unless the data has ``iter_from(position)``, an iterator from batch
``position`` of its first pass on).
"""

from __future__ import annotations

import abc
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from freeride.partition.plan import Plan, Step, make_plan, timer
from freeride.partition.update import ChunkedUpdate
from freeride.sidetask import IterativeTask, TaskContext

__all__ = ["InferenceParts", "PartitionedInference", "PartitionedTraining", "TrainingParts"]

logger = logging.getLogger(__name__)

_EMA = 0.9
_DRIFT = 1.5
"""Measured over planned step time (smoothed) beyond which the steps are grouped again, or below its inverse."""


class TrainingParts(NamedTuple):
    """What :meth:`PartitionedTraining.build` returns."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[Any, Any], torch.Tensor]
    """Called as ``loss_fn(model(x), y)`` for each batch ``(x, y)``."""
    data: Iterable[Any]
    """Yields ``(x, y)`` batches; re-iterable, the same batches each pass."""


class InferenceParts(NamedTuple):
    """What :meth:`PartitionedInference.build` returns."""

    model: nn.Module
    data: Iterable[Any]
    """Yields model inputs, or tuples whose first item is the input."""


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple | list):
        return type(value)(_to(v, device) for v in value)
    return value


def _capture_rng(device: torch.device) -> dict[str, torch.Tensor]:
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def _restore_rng(rng: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)


class _Batches:
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


class _Partitioned(IterativeTask):
    """Options, deferred checkpoints and drift tracking shared by training and inference."""

    def __init__(self, *, target_ms: float = 5.0, steps: int = 0, profile_runs: int = 2) -> None:
        if not (target_ms > 0 and math.isfinite(target_ms)):
            raise ValueError(f"target_ms must be a positive number of milliseconds, got {target_ms}")
        if steps < 0:
            raise ValueError(f"steps must be >= 0 (0: until stopped), got {steps}")
        if profile_runs < 1:
            raise ValueError(f"profile_runs must be >= 1, got {profile_runs}")
        self.target_ms, self.steps, self.profile_runs = target_ms, steps, profile_runs
        self.device = torch.device("cpu")
        self.plan: Plan | None = None
        self.batches_done = 0
        self._ready = False
        self._pending: dict[str, Any] | None = None
        self._drift = 1.0
        self._clock = time.perf_counter

    # -- planning and drift

    def _observe(self, step: Step | None, seconds: float) -> None:
        if step is not None and step.cost_s > 0:
            self._drift = _EMA * self._drift + (1 - _EMA) * (seconds / step.cost_s)

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
        if not state:
            return
        if self._ready:
            self._restore(state)
        else:
            self._pending = dict(state)

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


class PartitionedTraining(_Partitioned):
    """Train any model with its optimizer, in steps sized for the bubbles of its device.

    Subclass it and implement :meth:`build`. Options (keyword arguments):
    ``target_ms`` (5: the longest a step should take, in milliseconds),
    ``steps`` (0: train until stopped; else the number of batches),
    ``profile_runs`` (2: timed runs per piece at setup).

    Metrics: ``loss`` (last batch), ``loss_ema``, ``batches``, ``steps_per_batch``.
    """

    def __init__(self, *, target_ms: float = 5.0, steps: int = 0, profile_runs: int = 2) -> None:
        super().__init__(target_ms=target_ms, steps=steps, profile_runs=profile_runs)
        self.model: nn.Module = nn.Identity()
        self.loss = math.nan
        self.loss_ema = math.nan
        self._phase = "forward"
        self._pos = 0
        self._cursor = 0
        self._in_batch = False
        self._start: tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        """While a batch is in flight before its update: its data position, random state and buffers at its start."""

    @abc.abstractmethod
    def build(self) -> TrainingParts:
        """Build the model (on :attr:`device`), its optimizer, the loss and the data; called once, in setup."""

    async def setup(self, ctx: TaskContext) -> None:
        if self._ready:
            return
        from freeride.partition.graph import Executor

        self.device = torch.device(ctx.torch_device)
        self._clock = timer(self.device)
        parts = self.build()
        self.model, self.optimizer, self.loss_fn = parts.model, parts.optimizer, parts.loss_fn
        self.batches = _Batches(parts.data)
        self.update = ChunkedUpdate(self.optimizer)
        x, y = self._split(_to(self.batches.peek(), self.device))
        rng, buffers = _capture_rng(self.device), self._buffers()
        self.model.train()
        self.plan = make_plan(
            self.model, x, y, self.loss_fn, target_s=self.target_ms / 1e3, device=self.device, runs=self.profile_runs
        )
        self.chunks = ChunkedUpdate.chunks(self.update.profile(self.device), self.target_ms / 1e3)
        # planning ran the model: undo what that changed
        _restore_rng(rng, self.device)
        self._load_buffers(buffers)
        for p in self.model.parameters():
            p.grad = None
        self.executor = Executor(self.plan.graph, self.plan.atoms, self.loss_fn)
        self._apply_pending()

    @staticmethod
    def _split(batch: Any) -> tuple[Any, Any]:
        if not (isinstance(batch, tuple | list) and len(batch) == 2):
            raise ValueError(f"a training batch must be a pair (x, y), got {type(batch).__name__}")
        return batch[0], batch[1]

    def _buffers(self) -> dict[str, torch.Tensor]:
        return {n: b.detach().clone() for n, b in self.model.named_buffers()}

    def _load_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, b in self.model.named_buffers():
                b.copy_(buffers[n])

    def _chunk(self) -> int:
        return next(j for j, (lo, hi, _) in enumerate(self.chunks) if lo <= self._cursor < hi)

    def _current(self) -> Step | None:
        assert self.plan is not None
        if self._phase == "forward":
            return self.plan.forward[self._pos]
        if self._phase == "backward":
            return self.plan.backward[self._pos]
        return None

    def step_kind(self) -> str:
        if self.plan is None:
            return ""
        step = self._current()
        return step.kind if step is not None else f"u{self._chunk()}"

    def _costs(self) -> dict[str, float]:
        costs = super()._costs()
        costs.update({f"u{j}": cost for j, (_, _, cost) in enumerate(getattr(self, "chunks", []))})
        return costs

    def step(self) -> None:
        if self.plan is None:
            raise RuntimeError(f"{type(self).__name__}: step() before setup()")
        t0 = self._clock()
        step = self._current()
        if self._phase == "forward":
            if self._pos == 0 and not self._in_batch:
                self._begin_batch()
            for k in step.atoms:  # type: ignore[union-attr]
                self.executor.forward(k)
            self._pos += 1
            if self._pos == len(self.plan.forward):
                assert self.executor.loss is not None
                self.loss = float(self.executor.loss.detach())
                self._phase, self._pos = "backward", 0
        elif self._phase == "backward":
            for k in step.atoms:  # type: ignore[union-attr]
                self.executor.backward(k)
            self._pos += 1
            if self._pos == len(self.plan.backward):
                self.executor.reset()
                self._phase, self._cursor, self._start = "update", 0, None
        else:
            _, hi, _ = self.chunks[self._chunk()]
            self.update.step(self._cursor, hi)
            self._cursor = hi
            if self._cursor >= len(self.update.params):
                self._end_batch()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._observe(step, self._clock() - t0)

    def _begin_batch(self) -> None:
        self._start = (self.batches.position, _capture_rng(self.device), self._buffers())
        x, y = self._split(_to(self.batches.next(), self.device))
        for p in self.model.parameters():
            p.grad = None
        self.model.train()
        self.executor.begin(x, y)
        self._in_batch = True

    def _end_batch(self) -> None:
        for p in self.model.parameters():
            p.grad = None
        self.batches_done += 1
        self.loss_ema = self.loss if math.isnan(self.loss_ema) else _EMA * self.loss_ema + (1 - _EMA) * self.loss
        self._phase, self._pos, self._cursor, self._in_batch = "forward", 0, 0, False
        self._maybe_regroup()

    def metrics(self) -> dict[str, float]:
        plan = self.plan
        per_batch = len(plan.forward) + len(plan.backward) + len(self.chunks) if plan is not None else 0
        return {
            "loss": self.loss,
            "loss_ema": self.loss_ema,
            "batches": float(self.batches_done),
            "steps_per_batch": float(per_batch),
        }

    def _capture(self) -> dict[str, Any]:
        mid = self._start is not None
        model = self.model.state_dict()
        position, rng = self.batches.position, _capture_rng(self.device)
        if self._start is not None:
            position, rng, buffers = self._start
            model.update({name: b for name, b in buffers.items() if name in model})  # persistent ones only
        updating = self._phase == "update"
        return {
            "model": model,
            "optimizer": self.optimizer.state_dict(),
            "position": position,
            "rng": rng,
            "update": self._cursor if updating else -1,
            "grads": [p.grad for p in self.update.params] if updating else None,
            "batches": self.batches_done,
            "loss": self.loss,
            "loss_ema": self.loss_ema,
            "mid_batch": mid,
            "extra": self.extra_state(),
        }

    def _restore(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.batches.seek(int(state["position"]))
        _restore_rng(state["rng"], self.device)
        self.executor.reset()
        for p in self.model.parameters():
            p.grad = None
        self._start, self._pos, self._in_batch = None, 0, False
        if int(state["update"]) >= 0:
            for param, grad in zip(self.update.params, state["grads"], strict=True):
                param.grad = None if grad is None else grad.to(param.device)
            self._phase, self._cursor = "update", int(state["update"])
        else:
            self._phase, self._cursor = "forward", 0
        self.batches_done = int(state["batches"])
        self.loss, self.loss_ema = float(state["loss"]), float(state["loss_ema"])
        self.load_extra_state(state.get("extra") or {})


class PartitionedInference(_Partitioned):
    """Run any model over its data, one batch in several steps sized for the bubbles of its device.

    Subclass it, implement :meth:`build` and take each batch's output in
    :meth:`consume`. Options: ``target_ms`` (5), ``steps`` (0: until stopped;
    else the number of batches), ``profile_runs`` (2).

    Metrics: ``batches``, ``steps_per_batch``.
    """

    def __init__(self, *, target_ms: float = 5.0, steps: int = 0, profile_runs: int = 2) -> None:
        super().__init__(target_ms=target_ms, steps=steps, profile_runs=profile_runs)
        self.model: nn.Module = nn.Identity()
        self._pos = 0
        self._batch: Any = None
        self._batch_position = 0

    @abc.abstractmethod
    def build(self) -> InferenceParts:
        """Build the model (on :attr:`device`) and the data; called once, in setup."""

    def consume(self, output: Any, batch: Any) -> None:
        """Take the model's output for ``batch`` (called once per batch, in its last step)."""

    @staticmethod
    def _input(batch: Any) -> Any:
        return batch[0] if isinstance(batch, tuple | list) else batch

    async def setup(self, ctx: TaskContext) -> None:
        if self._ready:
            return
        from freeride.partition.graph import Executor

        self.device = torch.device(ctx.torch_device)
        self._clock = timer(self.device)
        parts = self.build()
        self.model = parts.model
        self.batches = _Batches(parts.data)
        x = self._input(_to(self.batches.peek(), self.device))
        rng = _capture_rng(self.device)
        self.model.eval()
        with torch.no_grad():
            self.plan = make_plan(
                self.model, x, None, None, target_s=self.target_ms / 1e3, device=self.device, runs=self.profile_runs
            )
        _restore_rng(rng, self.device)
        self.executor = Executor(self.plan.graph, self.plan.atoms, None)
        self._apply_pending()

    def step_kind(self) -> str:
        return "" if self.plan is None else self.plan.forward[self._pos].kind

    def step(self) -> None:
        if self.plan is None:
            raise RuntimeError(f"{type(self).__name__}: step() before setup()")
        t0 = self._clock()
        step = self.plan.forward[self._pos]
        with torch.no_grad():
            if self._pos == 0:
                self._batch_position = self.batches.position
                self._batch = _to(self.batches.next(), self.device)
                self.model.eval()
                self.executor.begin(self._input(self._batch))
            for k in step.atoms:
                self.executor.forward(k)
        self._pos += 1
        if self._pos == len(self.plan.forward):
            output, batch = self.executor.output, self._batch
            self.executor.reset()
            self._pos, self._batch = 0, None
            self.batches_done += 1
            self.consume(output, batch)
            self._maybe_regroup()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._observe(step, self._clock() - t0)

    def metrics(self) -> dict[str, float]:
        per_batch = len(self.plan.forward) if self.plan is not None else 0
        return {"batches": float(self.batches_done), "steps_per_batch": float(per_batch)}

    def _capture(self) -> dict[str, Any]:
        mid = self._pos > 0
        return {
            "position": self._batch_position if mid else self.batches.position,
            "batches": self.batches_done,
            "extra": self.extra_state(),
        }

    def _restore(self, state: dict[str, Any]) -> None:
        self.batches.seek(int(state["position"]))
        self.executor.reset()
        self._pos, self._batch = 0, None
        self.batches_done = int(state["batches"])
        self.load_extra_state(state.get("extra") or {})
