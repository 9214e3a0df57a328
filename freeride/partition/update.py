"""An optimizer's update applied to a few parameters, or a few rows of one, at a time.

``optimizer.step()`` updates every parameter of every group; here the groups
are narrowed to a run of parameters for one call and restored after it. For
the per-parameter optimizers (SGD, Adam, AdamW, RMSprop, Adagrad, ...) the
result is element for element that of one full step: each parameter's update
reads only its own gradient and state. Optimizers that look at all parameters
at once (LBFGS) are refused.

A parameter whose update alone is slower than a step may take is updated in
slices of its rows (dimension 0), when its optimizer is known to update
element by element: the slice is handed to the optimizer as a parameter of its
own, with views of the gradient and of the state's tensors, and the state's
scalars (``step``) as they were before the parameter's first slice; those are
written back once the last slice is done.

Positions are counted in rows over all parameters in group order (a 0-d
parameter is one row), so a position written in a checkpoint means the same
in a process that sliced the parameters differently.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MIN_SLICE_ELEMENTS", "ChunkedUpdate", "Piece"]

_WHOLE_STEP = (torch.optim.LBFGS,)

_ELEMENTWISE: frozenset[type[torch.optim.Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.Rprop,
        torch.optim.ASGD,
    }
)
"""Optimizers (exactly these classes, not subclasses) whose update of an element reads only that element."""


MIN_SLICE_ELEMENTS = 1 << 16
"""The fewest elements a slice has: below that the optimizer's own cost per call (~20-50 us) dominates."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows ``[lo, hi)`` of the global row count, all in parameter ``param``; ``whole``: all of its rows."""

    param: int
    lo: int
    hi: int
    whole: bool


class ChunkedUpdate:
    """Runs ``optimizer``'s step over a range of pieces of :attr:`params` (group order)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, _WHOLE_STEP):
            raise ValueError(
                f"{type(optimizer).__name__} updates all parameters together (it needs a closure); a partitioned"
                " task needs a per-parameter optimizer such as SGD, Adam or AdamW"
            )
        self.optimizer = optimizer
        seen: set[int] = set()
        self.params: list[torch.Tensor] = []
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    self.params.append(p)
        self._start: list[int] = []
        """Global row of each parameter's first row."""
        rows = 0
        for p in self.params:
            self._start.append(rows)
            rows += _rows(p)
        self.rows = rows
        """Rows of all parameters: the position once the update is done."""
        self.pieces: list[Piece] = [Piece(i, s, s + _rows(p), True) for i, (p, s) in enumerate(self._each())]
        self._base: dict[str, Any] | None = None
        """The scalars of the state of the parameter being updated in slices, as before its first slice."""
        self._base_param = -1
        self._base_fresh = False
        """That parameter had no state before its first slice (its slices start from none too)."""
        self._partial: dict[str, Any] = {}
        """For such a parameter, its new state so far: the optimizer holds none until the last slice."""
        self._written = 0
        """Rows of that parameter its slices wrote so far: the rest of :attr:`_partial` is not set yet."""

    def _each(self) -> zip[tuple[torch.Tensor, int]]:
        return zip(self.params, self._start, strict=True)

    @property
    def sliceable(self) -> bool:
        """Whether a parameter's update may be run in slices of rows (the optimizer updates element by element)."""
        return type(self.optimizer) in _ELEMENTWISE

    def split(self, costs: list[float], target_s: float) -> list[float]:
        """Cut parameters whose update (``costs[i]`` seconds) is over ``target_s`` into row slices; pieces' costs.

        Only for an element-by-element optimizer, and into slices of at least
        :data:`MIN_SLICE_ELEMENTS` elements; otherwise a parameter stays one piece.
        """
        self.pieces, out = [], []
        for i, ((p, start), cost) in enumerate(zip(self._each(), costs, strict=True)):
            rows = _rows(p)
            most = min(rows, p.numel() // MIN_SLICE_ELEMENTS)
            parts = min(most, math.ceil(cost / target_s)) if self.sliceable and p.dim() >= 1 else 1
            if parts <= 1:
                self.pieces.append(Piece(i, start, start + rows, True))
                out.append(cost)
                continue
            for k in range(parts):
                lo, hi = start + rows * k // parts, start + rows * (k + 1) // parts
                self.pieces.append(Piece(i, lo, hi, False))
                out.append(cost * (hi - lo) / rows)
        return out

    def piece_at(self, position: int) -> int:
        """Index of the piece holding row ``position`` (``position < rows``)."""
        return next(j for j, piece in enumerate(self.pieces) if piece.lo <= position < piece.hi)

    def param_start(self, param: int) -> int:
        """Global row of parameter ``param``'s first row."""
        return self._start[param]

    def step(self, position: int, stop: int) -> None:
        """Update global rows ``position`` to ``stop - 1`` (parameters with a gradient).

        ``position`` and ``stop`` are bounds of pieces, or inside a sliced
        parameter (a restored position); a whole parameter is updated from its
        first row only.
        """
        whole: list[int] = []
        for piece in self.pieces:
            if piece.hi <= position or piece.lo >= stop:
                continue
            lo, hi = max(piece.lo, position), min(piece.hi, stop)
            if piece.whole and lo == piece.lo and hi == piece.hi:
                whole.append(piece.param)
                continue
            self._update_whole(whole)
            whole = []
            self._update_rows(piece.param, lo, hi)
        self._update_whole(whole)

    def _update_whole(self, chosen_params: list[int]) -> None:
        if not chosen_params:
            return
        chosen = {id(self.params[i]) for i in chosen_params}
        self._narrowed(lambda g: [p for p in g["params"] if id(p) in chosen])

    def _narrowed(self, pick: Any) -> None:
        groups = self.optimizer.param_groups
        kept = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = pick(g)
            self.optimizer.step()
        finally:
            for g, params in zip(groups, kept, strict=True):
                g["params"] = params

    def _update_rows(self, i: int, lo: int, hi: int) -> None:
        p = self.params[i]
        if p.grad is None:
            return
        rows = _rows(p)
        first, last = self._start[i], self._start[i] + rows
        a, b = lo - first, hi - first
        state = self.optimizer.state
        if self._base_param != i:  # the first slice of this parameter's update (or the first after a restore)
            self._base_param = i
            self._base_fresh = not state.get(p)
            self._base = {k: _copy(v) for k, v in state[p].items() if not _per_row(v, p)} if p in state else {}
            self._partial, self._written = {}, 0
        full: dict[str, Any] = self._partial if self._base_fresh else state[p]
        view = p.detach()[a:b]
        view.grad = p.grad.detach()[a:b]
        if not self._base_fresh:
            sliced: dict[str, Any] = {k: v[a:b] for k, v in full.items() if _per_row(v, p)}
            sliced.update({k: _copy(v) for k, v in (self._base or {}).items()})
            state[view] = sliced
        try:
            self._narrowed(lambda g: [view] if any(q is p for q in g["params"]) else [])
            after = state.pop(view, {})
        finally:
            state.pop(view, None)
        for k, v in after.items():
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape == view.shape:
                whole = full.get(k)
                if whole is None:
                    # not zeroed: each slice writes its rows, so a large parameter's new state (VGG-19's
                    # 412 MB momentum) is not written whole by its first slice, a piece planned for 2 ms
                    whole = full[k] = torch.empty(p.shape, dtype=v.dtype, device=v.device)
                target = whole[a:b]
                if target.data_ptr() != v.data_ptr():
                    target.copy_(v)
            elif hi == last:
                full[k] = v
        self._written = b
        if hi == last:
            if self._base_fresh:
                state[p] = full
            self._base_param, self._base, self._partial = -1, None, {}

    def pending(self) -> dict[str, Any] | None:
        """What a checkpoint taken between two slices of one parameter must keep (None between parameters)."""
        if self._base_param < 0:
            return None
        if self._base_fresh:
            for v in self._partial.values():
                if isinstance(v, torch.Tensor) and v.dim() >= 1:
                    v[self._written :].zero_()  # rows no slice wrote yet: never saved as whatever memory held
        return {
            "param": self._base_param,
            "fresh": self._base_fresh,
            "scalars": self._base,
            "partial": self._partial if self._base_fresh else None,
            "written": self._written,
        }

    def load_pending(self, pending: dict[str, Any] | None) -> None:
        """Take back what :meth:`pending` returned."""
        if pending is None:
            self._base_param, self._base, self._base_fresh, self._partial, self._written = -1, None, False, {}, 0
            return
        self._base_param = int(pending["param"])
        self._base_fresh = bool(pending["fresh"])
        self._base = dict(pending["scalars"] or {})
        device = self.params[self._base_param].device
        self._partial = {k: v.to(device) for k, v in (pending["partial"] or {}).items()}
        # older checkpoints zeroed the whole state at the first slice: none of their rows is unset
        self._written = int(pending.get("written", _rows(self.params[self._base_param])))

    def profile(self, device: torch.device) -> list[float]:
        """Seconds each parameter's update takes (the second of two runs); parameters and state are restored."""
        state = copy.deepcopy(self.optimizer.state_dict())
        values = [p.detach().clone() for p in self.params]
        grads = [p.grad for p in self.params]
        costs = [0.0] * len(self.params)
        clock = time.process_time if device.type == "cpu" else time.perf_counter  # as plan.timer
        try:
            for p in self.params:
                p.grad = torch.zeros_like(p)
            for run in range(2):
                for i in range(len(self.params)):
                    t0 = clock()
                    self._update_whole([i])
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if run:
                        costs[i] = clock() - t0
        finally:
            with torch.no_grad():
                for p, value, grad in zip(self.params, values, grads, strict=True):
                    p.copy_(value)
                    p.grad = grad
            self.optimizer.load_state_dict(state)
        return costs

    @staticmethod
    def chunks(costs: list[float], target_s: float) -> list[tuple[int, int, float]]:
        """Runs ``(lo, hi, cost)`` of consecutive pieces under ``target_s`` (a slower one alone)."""
        out: list[tuple[int, int, float]] = []
        lo, total = 0, 0.0
        for i, cost in enumerate(costs):
            if i > lo and total + cost > target_s:
                out.append((lo, i, total))
                lo, total = i, 0.0
            total += cost
        if lo < len(costs):
            out.append((lo, len(costs), total))
        return out


def _rows(p: torch.Tensor) -> int:
    return int(p.shape[0]) if p.dim() >= 1 else 1


def _per_row(v: object, p: torch.Tensor) -> bool:
    """A state entry with one value per element of ``p`` (sliced with it); else a scalar of the parameter."""
    return isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape == p.shape


def _copy(v: object) -> object:
    return v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
