"""Held-out evaluation inside partitioned training, in steps sized for the bubbles like the training's own.

Every ``eval_every`` batches, the task evaluates the model on the held-out
data that :meth:`~freeride.partition.PartitionedTraining.build` returned
(:attr:`~freeride.partition.TrainingParts.eval_data`): each held-out batch is
a forward pass in eval mode under ``torch.no_grad`` (and the recipe's
autocast, as the training's forward), cut into steps of kinds ``i...`` from a
plan of its own (the model in eval mode may be another graph: dropout off,
batch norm on its running statistics). The result, ``eval_loss``, is the mean
of ``loss_fn(model(x), y)`` over the held-out batches: the plain loop's

    model.eval()
    with torch.no_grad():
        eval_loss = mean(float(loss_fn(model(x), y)) for x, y in eval_data)
    model.train()

An evaluation changes neither the parameters nor the random state, so the
training around it is the training without it. A checkpoint taken during one
keeps the sum so far and the held-out batch in flight's position: a restored
task runs that batch again and ends the same evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from freeride.partition._common import to_device
from freeride.partition.graph import Executor
from freeride.partition.plan import Plan, Step, make_plan
from freeride.partition.saved import plan_state, reused_plan

__all__ = ["Evaluation"]

_END = object()
"""What :meth:`Evaluation._fetch` returns past the held-out data's last batch."""


class Evaluation:
    """A partitioned training task's evaluation on held-out data every ``every`` batches (0: none)."""

    def __init__(self, every: int) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"eval_every must be a number of batches >= 0 (0: no evaluation), got {every!r}")
        self.every = every
        self.plan: Plan | None = None
        self.loss = math.nan
        """The last evaluation's mean loss over the held-out batches (NaN before the first)."""
        self.evaluations = 0
        self.active = False
        """An evaluation is under way: the task's next steps are its."""
        self._data: Iterable[Any] = ()
        self._it: Iterator[Any] | None = None
        self._next: Any = _END
        """The next held-out batch to start (taken from the data one batch ahead, so the last is known)."""
        self._done = 0
        """Held-out batches this evaluation has finished."""
        self._sum = 0.0
        self._pos = 0
        """Steps of the held-out batch in flight already run."""
        self._target: Any = None

    @property
    def on(self) -> bool:
        return self.plan is not None

    def attach(self, data: Iterable[Any] | None) -> None:
        """Take :attr:`TrainingParts.eval_data` (left unused with ``eval_every`` 0).

        Raises:
            ValueError: ``eval_every`` without held-out data, or held-out data that is an iterator.
        """
        if self.every == 0:
            return
        if data is None:
            raise ValueError(
                f"eval_every is {self.every} but build() returned no eval_data: return the held-out (x, y)"
                " batches as TrainingParts(..., eval_data=...), or leave eval_every at 0"
            )
        if iter(data) is data:
            raise ValueError(
                f"eval_data is an iterator ({type(data).__name__}): give a re-iterable (a list, or a class with"
                " __iter__), evaluated whole every eval_every batches"
            )
        self._data = data

    def make_plan(
        self,
        model: nn.Module,
        *,
        saved: object,
        target_s: float,
        device: torch.device,
        runs: int,
        forward: Callable[[], AbstractContextManager[Any]],
    ) -> None:
        """Plan the held-out forward pass (the model in eval mode), taking back the ``saved`` plan where it holds.

        Nothing with ``eval_every`` 0. Leaves the model in training mode. The caller undoes the random draws.
        """
        if self.every == 0:
            return
        x, _ = _split(to_device(_first(self._data), device))
        model.eval()
        try:
            with torch.no_grad(), forward():
                self.plan = reused_plan(model, x, saved, target_s=target_s, training=False) or make_plan(
                    model, x, None, None, target_s=target_s, device=device, runs=runs
                )
        finally:
            model.train()
        self._executor = Executor(self.plan.graph, self.plan.atoms, None)

    def due(self, batches_done: int) -> bool:
        """Whether an evaluation starts after batch ``batches_done``."""
        return self.plan is not None and batches_done % self.every == 0

    def begin(self) -> None:
        self.active = True
        self._start_at(0, 0.0)

    def current(self) -> Step:
        assert self.plan is not None
        return self.plan.forward[self._pos]

    def step(
        self,
        model: nn.Module,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        device: torch.device,
        forward: Callable[[], AbstractContextManager[Any]],
    ) -> Step:
        """Run the evaluation's next step; returns it."""
        assert self.plan is not None
        step = self.current()
        with torch.no_grad():
            if self._pos == 0:
                x, self._target = _split(to_device(self._next, device))
                self._next = self._fetch()
                model.eval()
                self._executor.begin(x)
            with forward():
                for k in step.atoms:
                    self._executor.forward(k)
                self._pos += 1
                if self._pos == len(self.plan.forward):
                    self._sum += float(loss_fn(self._executor.output, self._target))
                    self._executor.reset()
                    self._pos, self._target, self._done = 0, None, self._done + 1
        if self._pos == 0 and self._next is _END:
            self.loss, self.evaluations, self.active = self._sum / self._done, self.evaluations + 1, False
            self._it = None
            model.train()
        return step

    def _fetch(self) -> Any:
        assert self._it is not None
        return next(self._it, _END)

    def _start_at(self, done: int, total: float) -> None:
        """Go on from held-out batch ``done`` (0-based) with ``total`` the loss summed over those before it."""
        self._it = iter(self._data)
        for _ in range(done):
            if self._fetch() is _END:
                raise ValueError(f"eval_data holds fewer batches than the {done} a checkpoint's evaluation had run")
        self._next = self._fetch()
        if self._next is _END:
            raise ValueError("eval_data yields no batches")
        self._done, self._sum, self._pos, self._target = done, total, 0, None

    def costs(self) -> dict[str, float]:
        return {} if self.plan is None else {s.kind: s.cost_s for s in self.plan.forward}

    def metrics(self) -> dict[str, float]:
        return {"eval_loss": self.loss, "evaluations": float(self.evaluations)} if self.on else {}

    def state_dict(self) -> dict[str, Any]:
        """The results so far, the evaluation under way (as at its held-out batch's start), the plan."""
        return {
            "loss": self.loss,
            "evaluations": self.evaluations,
            "under_way": {"done": self._done, "sum": self._sum} if self.active else None,
            "plan": None if self.plan is None else plan_state(self.plan),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` returned; an evaluation under way goes on from its batch's start."""
        if self.plan is not None:
            self._executor.reset()
        self.loss, self.evaluations = float(state.get("loss", math.nan)), int(state.get("evaluations", 0))
        self.active, self._pos, self._target = False, 0, None
        under_way = state.get("under_way")
        if under_way is not None and self.plan is not None:
            self.active = True
            self._start_at(int(under_way["done"]), float(under_way["sum"]))


def _first(data: Iterable[Any]) -> Any:
    for batch in data:
        return batch
    raise ValueError("eval_data yields no batches")


def _split(batch: Any) -> tuple[Any, Any]:
    if not (isinstance(batch, tuple | list) and len(batch) == 2):
        raise ValueError(f"a held-out batch must be a pair (x, y), got {type(batch).__name__}")
    return batch[0], batch[1]
