"""Training of any ``nn.Module`` with its optimizer as a side task, cut automatically into bubble-sized steps.

A user subclasses :class:`PartitionedTraining` and builds the model, its
optimizer, the loss and the data in :meth:`PartitionedTraining.build`; at
setup the task traces and times the model on its device and plans steps
(see :mod:`freeride.partition.plan`). One batch is then:

* forward steps (kinds ``f...``), a few atoms each (the first fetches the batch);
* backward steps (``b...``), from the loss back to the input;
* optimizer steps (``u...``), a run of parameters (or rows of a large one) each.

A kind names the work a step runs (see :meth:`freeride.partition.plan.Plan.kind`):
``f0-7.3ac2`` runs nodes 0 to 6 forward, ``u0-4096`` updates the first 4096
rows of the parameters; the same work has the same kind in every grouping and
every run, so its measured time is never another piece's.

Packing (:meth:`PartitionedTraining.fit_piece`): where a forward or backward
step does not fit what is left of a bubble, its first half by measured cost
may (a step of its own kind), and the rest runs next, so the end of a bubble
takes half a step rather than none.

The parameters after each batch are those of ``opt.zero_grad();
loss_fn(model(x), y).backward(); opt.step()`` on the same batch (``model(*x)``
where ``x`` is a tuple), up to the rounding of summing gradients in another order;
with the options, of the same loop with its forward and loss under ``torch.autocast``,
``clip_grad_norm_`` before ``opt.step()`` and ``scheduler.step()`` after it
(see :mod:`freeride.partition.recipe`).

Checkpoints are exact at every step boundary. During the forward and backward
passes the state describes the batch's start (its data position, random state
and the model's buffers as they were then: batch-norm statistics are updated by
the forward pass), so a restored task runs the batch again from its first step and
reaches the same numbers; parameters do not change before the update, and
their gradients start from none. During the update the state holds the
gradients and how many rows of the parameters are already updated.

The data must be re-iterable (a list, a ``Dataset``-like or a class with
``__iter__``) and yield the same batches each time it is iterated from the
start: a restore rebuilds it and skips the batches already used (replaying
them, unless the data has ``iter_from(position)``, an iterator from batch
``position`` of its first pass on).
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from freeride.partition._common import EMA, Batches, Partitioned, capture_rng, restore_rng, to_device
from freeride.partition.evaluation import Evaluation
from freeride.partition.graph import Executor
from freeride.partition.plan import Step, make_plan
from freeride.partition.recipe import Recipe
from freeride.partition.saved import plan_state, reused_plan
from freeride.partition.update import ChunkedUpdate

__all__ = ["PartitionedTraining", "TrainingParts"]


class TrainingParts(NamedTuple):
    """What :meth:`PartitionedTraining.build` returns."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[Any, Any], torch.Tensor]
    """Called as ``loss_fn(model(x), y)`` for each batch ``(x, y)`` (``model(*x)`` where ``x`` is a tuple)."""
    data: Iterable[Any]
    """Yields ``(x, y)`` batches; re-iterable, the same batches each pass."""
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    """Of ``optimizer``; stepped once per batch, after the batch's update (None: a constant learning rate)."""
    eval_data: Iterable[Any] | None = None
    """Held-out ``(x, y)`` batches, re-iterable, evaluated whole every ``eval_every`` batches (see
    :mod:`freeride.partition.evaluation`)."""


class PartitionedTraining(Partitioned):
    """Train any model with its optimizer, in steps sized for the bubbles of its device.

    Subclass it and implement :meth:`build`. Options (keyword arguments):
    ``target_ms`` (0: the longest a step should take, in milliseconds; 0
    sizes it from the device's bubbles, see :func:`~freeride.partition.piece_target_s`),
    ``steps`` (0: train until stopped; else the number of batches),
    ``profile_runs`` (2: timed runs per piece at setup),
    ``clip_grad_norm`` (0: off; else the batch's whole gradient is clipped to
    this total norm before its update, as ``torch.nn.utils.clip_grad_norm_``),
    ``autocast_dtype`` (None: off; else forward pieces and the loss run under
    ``torch.autocast`` with this dtype), ``eval_every`` (0: off; else the mean
    loss over :attr:`TrainingParts.eval_data` after every ``eval_every``
    batches, see :mod:`freeride.partition.evaluation`). A learning-rate scheduler comes from
    :meth:`build` (:attr:`TrainingParts.scheduler`). See :mod:`freeride.partition.recipe`.

    Metrics: ``loss`` (last batch), ``loss_ema``, ``batches``, ``steps_per_batch``;
    ``lr`` with a scheduler, ``grad_norm`` (before clipping) with clipping,
    ``eval_loss`` (the last evaluation's) and ``evaluations`` with evaluation.
    """

    def __init__(
        self,
        *,
        target_ms: float = 0.0,
        steps: int = 0,
        profile_runs: int = 2,
        clip_grad_norm: float = 0.0,
        autocast_dtype: torch.dtype | None = None,
        eval_every: int = 0,
    ) -> None:
        super().__init__(target_ms=target_ms, steps=steps, profile_runs=profile_runs)
        self.recipe = Recipe(clip_grad_norm=clip_grad_norm, autocast_dtype=autocast_dtype)
        self.evaluation = Evaluation(eval_every)
        self.model: nn.Module = nn.Identity()
        self.loss = math.nan
        self.loss_ema = math.nan
        self._phase = "forward"
        self._pos = 0
        self._cursor = 0
        self._in_batch = False
        self._start: tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        """While a batch is in flight before its update: its data position, random state and buffers at its start."""
        self._atom = 0
        """Atoms of the current forward or backward step already run (its first half ran as a step of its own)."""
        self._halve = False
        """The next step is the current step's first half (chosen by :meth:`fit_piece`)."""
        self.chunks: list[tuple[int, int, float]] = []
        """The optimizer step's runs of pieces ``(lo, hi, planned seconds)``, one step each."""
        self._chunk_kinds: list[str] = []
        self._update_s: list[float] = []
        """Each parameter's measured update time (kept in checkpoints with the plan)."""
        """Each chunk's kind: the global rows it updates, ``u{first}-{end}``."""

    @abc.abstractmethod
    def build(self) -> TrainingParts:
        """Build the model (on :attr:`device`), its optimizer, the loss and the data; called once, in setup."""

    def _take(self, parts: TrainingParts) -> None:
        self.model, self.optimizer, self.loss_fn = parts.model, parts.optimizer, parts.loss_fn
        self.batches = Batches(parts.data)
        self.update = ChunkedUpdate(self.optimizer)
        self.recipe.attach(parts.scheduler, self.optimizer)
        self.evaluation.attach(parts.eval_data)

    def _plan(self, saved: object) -> None:
        x, y = self._split(to_device(self.batches.peek(), self.device))
        rng, buffers = capture_rng(self.device), self._buffers()
        self.model.train()
        kept = saved if isinstance(saved, dict) else {}
        with self.recipe.forward(self.device):  # timed as it will run (backward too: for its time only)
            self.plan = reused_plan(self.model, x, saved, target_s=self.target_s, training=True) or make_plan(
                self.model, x, y, self.loss_fn, target_s=self.target_s, device=self.device, runs=self.profile_runs
            )
        target_s = self.target_s
        update_s = kept.get("update_s")
        if not (isinstance(update_s, list) and len(update_s) == len(self.update.params)):
            update_s = self.update.profile(self.device)
        self._update_s = [float(c) for c in update_s]
        self.chunks = ChunkedUpdate.chunks(self.update.split(self._update_s, target_s), target_s)
        pieces = self.update.pieces
        self._chunk_kinds = [f"u{pieces[lo].lo}-{pieces[hi - 1].hi}" for lo, hi, _ in self.chunks]
        evaluation = (self._pending or {}).get("eval")
        self.evaluation.make_plan(
            self.model,
            saved=evaluation.get("plan") if isinstance(evaluation, dict) else None,
            target_s=target_s,
            device=self.device,
            runs=self.profile_runs,
            forward=self._forward,
        )
        # planning ran the model: undo what that changed
        restore_rng(rng, self.device)
        self._load_buffers(buffers)
        for p in self.model.parameters():
            p.grad = None
        self.executor = Executor(self.plan.graph, self.plan.atoms, self.loss_fn)
        self._apply_pending()

    def _forward(self) -> contextlib.AbstractContextManager[Any]:
        return self.recipe.forward(self.device)

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
        piece = self.update.piece_at(self._cursor)
        return next(j for j, (lo, hi, _) in enumerate(self.chunks) if lo <= piece < hi)

    def _current(self) -> Step | None:
        assert self.plan is not None
        if self._phase == "forward":
            return self.plan.forward[self._pos]
        if self._phase == "backward":
            return self.plan.backward[self._pos]
        return None

    def _piece(self) -> Step | None:
        """What the next step runs: the current forward or backward step, its first half or its rest."""
        step = self._current()
        if step is None or not (self._halve or self._atom):
            return step
        head, rest = self._halves(step, self._phase)
        return rest if self._atom else head

    def _halves(self, step: Step, phase: str) -> tuple[Step, Step]:
        """A forward or backward step's atoms cut where the first part's measured cost reaches half of the whole."""
        assert self.plan is not None
        costs = self.plan.forward_s if phase == "forward" else self.plan.backward_s
        cut, run = 1, costs[step.atoms[0]]
        while cut < len(step.atoms) - 1 and run + costs[step.atoms[cut]] <= step.cost_s / 2:
            run += costs[step.atoms[cut]]
            cut += 1
        prefix = "f" if phase == "forward" else "b"
        head = Step(self.plan.kind(prefix, step.atoms[:cut]), step.atoms[:cut], run)
        rest = step.atoms[cut:]
        return head, Step(self.plan.kind(prefix, rest), rest, max(0.0, step.cost_s - run))

    def step_kind(self) -> str:
        if self.plan is None:
            return ""
        if self._phase == "eval":
            return self.evaluation.current().kind
        step = self._piece()
        return step.kind if step is not None else self._chunk_kinds[self._chunk()]

    def fit_piece(self, room_ns: int, estimate_ns: Callable[[str], int]) -> str | None:
        """The whole forward or backward step if it fits in ``room_ns``, else its first half if that does.

        The optimizer's chunks, a step's rest and a step of one atom are left as they are.
        """
        step = self._current()
        if step is None or self._atom or len(step.atoms) < 2:
            return None
        whole = estimate_ns(step.kind)
        if whole < 0 or whole <= room_ns:
            self._halve = False
            return step.kind
        head, _ = self._halves(step, self._phase)
        need = estimate_ns(head.kind)
        if need < 0:  # not measured yet: the whole step's time, scaled by the half's planned share
            need = round(whole * head.cost_s / step.cost_s) if step.cost_s > 0 else whole
        if need > room_ns:
            return None
        self._halve = True
        return head.kind

    def _costs(self) -> dict[str, float]:
        costs = super()._costs()
        if self.plan is not None:
            for phase, steps in (("forward", self.plan.forward), ("backward", self.plan.backward)):
                for step in steps:
                    if len(step.atoms) > 1:
                        head, rest = self._halves(step, phase)
                        costs[head.kind], costs[rest.kind] = head.cost_s, rest.cost_s
        costs.update(zip(self._chunk_kinds, (cost for _, _, cost in self.chunks), strict=True))
        costs.update(self.evaluation.costs())
        return costs

    def step(self) -> None:
        if self.plan is None:
            raise RuntimeError(f"{type(self).__name__}: step() before setup()")
        t0 = self._clock()
        if self._phase == "eval":  # its steps are their own plan's: not the training's drift
            self.evaluation.step(self.model, self.loss_fn, self.device, self._forward)
            if not self.evaluation.active:
                self._phase = "forward"
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return
        step = self._piece()
        if step is not None:  # the whole step, or a half: the first sets where the rest starts
            head = self._halve and not self._atom
            self._atom, self._halve = len(step.atoms) if head else 0, False
        if self._phase == "forward":
            if self._pos == 0 and not self._in_batch:
                self._begin_batch()
            with self.recipe.forward(self.device):
                for k in step.atoms:  # type: ignore[union-attr]
                    self.executor.forward(k)
            if not self._atom:
                self._pos += 1
            if self._pos == len(self.plan.forward):
                assert self.executor.loss is not None
                self.loss = float(self.executor.loss.detach())
                self._phase, self._pos = "backward", 0
        elif self._phase == "backward":
            for k in step.atoms:  # type: ignore[union-attr]
                self.executor.backward(k)
            if not self._atom:
                self._pos += 1
            if self._pos == len(self.plan.backward):
                self.executor.reset()
                self.recipe.clip(self.model)  # the batch's whole gradient, before any update chunk
                self._phase, self._cursor, self._start = "update", 0, None
        else:
            _, hi, _ = self.chunks[self._chunk()]
            stop = self.update.pieces[hi - 1].hi
            self.update.step(self._cursor, stop)
            self._cursor = stop
            if self._cursor >= self.update.rows:
                self._end_batch()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._observe(step, self._clock() - t0)

    def _begin_batch(self) -> None:
        self._start = (self.batches.position, capture_rng(self.device), self._buffers())
        x, y = self._split(to_device(self.batches.next(), self.device))
        for p in self.model.parameters():
            p.grad = None
        self.model.train()
        self.executor.begin(x, y)
        self._in_batch = True

    def _end_batch(self) -> None:
        for p in self.model.parameters():
            p.grad = None
        self.recipe.end_batch()
        self.batches_done += 1
        self.loss_ema = self.loss if math.isnan(self.loss_ema) else EMA * self.loss_ema + (1 - EMA) * self.loss
        self._phase, self._pos, self._cursor, self._in_batch = "forward", 0, 0, False
        self._maybe_regroup()
        if self.evaluation.due(self.batches_done):
            self.evaluation.begin()
            self._phase = "eval"

    def done(self) -> bool:
        return super().done() and not self.evaluation.active  # the last batch's evaluation too

    def metrics(self) -> dict[str, float]:
        plan = self.plan
        per_batch = len(plan.forward) + len(plan.backward) + len(self.chunks) if plan is not None else 0
        out = {
            "loss": self.loss,
            "loss_ema": self.loss_ema,
            "batches": float(self.batches_done),
            "steps_per_batch": float(per_batch),
        }
        if self.recipe.scheduler is not None:
            out["lr"] = self.recipe.lr
        if self.recipe.clip_grad_norm > 0:
            out["grad_norm"] = self.recipe.grad_norm
        out.update(self.evaluation.metrics())
        return out

    def _capture(self) -> dict[str, Any]:
        mid = self._start is not None
        model = self.model.state_dict()
        position, rng = self.batches.position, capture_rng(self.device)
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
            "update_in": "rows",
            "update_pending": self.update.pending() if updating else None,
            "grads": [p.grad for p in self.update.params] if updating else None,
            "batches": self.batches_done,
            "loss": self.loss,
            "loss_ema": self.loss_ema,
            "mid_batch": mid,
            "recipe": self.recipe.state_dict(),
            "eval": self.evaluation.state_dict(),
            "extra": self.extra_state(),
            "plan": None if self.plan is None else {**plan_state(self.plan), "update_s": self._update_s},
        }

    def _restore(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.batches.seek(int(state["position"]))
        restore_rng(state["rng"], self.device)
        self.executor.reset()
        for p in self.model.parameters():
            p.grad = None
        self._start, self._pos, self._in_batch = None, 0, False
        self._atom, self._halve = 0, False
        if int(state["update"]) >= 0:
            for param, grad in zip(self.update.params, state["grads"], strict=True):
                param.grad = None if grad is None else grad.to(param.device)
            at = int(state["update"])
            if state.get("update_in") != "rows":  # written when positions counted parameters, not rows
                at = self.update.param_start(at) if at < len(self.update.params) else self.update.rows
            self.update.load_pending(state.get("update_pending"))
            self._phase, self._cursor = "update", at
        else:
            self.update.load_pending(None)
            self._phase, self._cursor = "forward", 0
        self.batches_done = int(state["batches"])
        self.loss, self.loss_ema = float(state["loss"]), float(state["loss_ema"])
        self.recipe.load_state_dict(state.get("recipe") or {})
        self.evaluation.load_state_dict(state.get("eval") or {})
        if self.evaluation.active:
            self._phase = "eval"
        self.load_extra_state(state.get("extra") or {})
