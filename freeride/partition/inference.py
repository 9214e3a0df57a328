"""Inference of any ``nn.Module`` over its data, each batch in steps sized for the bubbles of its device.

One batch is the forward pass, a few pieces per step (kinds ``i...``, named by
the nodes they run: see :meth:`freeride.partition.plan.Plan.kind`; the first
fetches the batch), under ``torch.no_grad`` and in eval mode. A checkpoint
taken mid-batch describes the batch's start: a restored task runs it again.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from freeride.partition._common import Batches, Partitioned, capture_rng, restore_rng, to_device
from freeride.partition.graph import Executor
from freeride.partition.plan import make_plan
from freeride.partition.saved import plan_state, reused_plan

__all__ = ["InferenceParts", "PartitionedInference"]


class InferenceParts(NamedTuple):
    """What :meth:`PartitionedInference.build` returns."""

    model: nn.Module
    data: Iterable[Any]
    """Yields model inputs, or tuples whose first item is the input."""


class PartitionedInference(Partitioned):
    """Run any model over its data, one batch in several steps sized for the bubbles of its device.

    Subclass it, implement :meth:`build` and take each batch's output in
    :meth:`consume`. Options: ``target_ms`` (0: sized from the device's
    bubbles, see :func:`~freeride.partition.piece_target_s`), ``steps`` (0: until stopped;
    else the number of batches), ``profile_runs`` (2).

    Metrics: ``batches``, ``steps_per_batch``.
    """

    def __init__(self, *, target_ms: float = 0.0, steps: int = 0, profile_runs: int = 2) -> None:
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

    def _take(self, parts: InferenceParts) -> None:
        self.model = parts.model
        self.batches = Batches(parts.data)

    def _plan(self, saved: object) -> None:
        x = self._input(to_device(self.batches.peek(), self.device))
        rng = capture_rng(self.device)
        self.model.eval()
        with torch.no_grad():
            self.plan = reused_plan(self.model, x, saved, target_s=self.target_s, training=False) or make_plan(
                self.model, x, None, None, target_s=self.target_s, device=self.device, runs=self.profile_runs
            )
        restore_rng(rng, self.device)
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
                self._batch = to_device(self.batches.next(), self.device)
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
            "plan": None if self.plan is None else plan_state(self.plan),
        }

    def _restore(self, state: dict[str, Any]) -> None:
        self.batches.seek(int(state["position"]))
        self.executor.reset()
        self._pos, self._batch = 0, None
        self.batches_done = int(state["batches"])
        self.load_extra_state(state.get("extra") or {})
