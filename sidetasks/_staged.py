"""SGD on a batch in steps short enough for short bubbles.

One optimizer step on a batch is split into smaller task steps:

* with ``micro_batch_size`` below the batch size, the batch is processed in
  micro-batches whose gradients are accumulated (loss scaled by the
  micro-batch's share of the batch), then the update runs as a step of its own;
* with ``layer_steps``, each micro-batch's forward pass runs one model segment
  per step (the model's ``segments()``), its backward pass likewise in reverse,
  and the update one chunk of at most ``chunk_elems`` parameter elements per step.

The update is SGD with momentum and weight decay, element for element what
``torch.optim.SGD`` computes (dampening 0, not Nesterov), applied to slices of
the flattened parameters so that no step touches more than a chunk.

Checkpoints stay exact at every step boundary: during a micro-batch's passes
the parameter gradients of that micro-batch are held aside (``torch.autograd.grad``)
and added to the accumulated ones only once it is complete, and the random
state and the model's buffers (batch-norm statistics) are remembered as they
were when it began. A checkpoint taken mid-micro-batch therefore describes the
state at its start, and a restore recomputes it, arriving at the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sidetasks._common import capture_rng
from sidetasks._cost import UPDATE_COST_PER_ELEMENT, backward_cost

__all__ = ["BatchResult", "StagedSGD"]

Batch = tuple[torch.Tensor, torch.Tensor]


class BatchResult:
    """What a completed optimizer step reports."""

    __slots__ = ("accuracy", "loss")

    def __init__(self, loss: float, accuracy: float) -> None:
        self.loss = loss
        self.accuracy = accuracy


class StagedSGD:
    """One batch's forward, backward and SGD update, a small piece per :meth:`advance`."""

    def __init__(
        self,
        model: nn.Module,
        segments: list[nn.Module],
        *,
        lr: float,
        momentum: float,
        weight_decay: float,
        micro_batch_size: int,
        layer_steps: bool,
        chunk_elems: int = 1 << 22,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if chunk_elems < 1:
            raise ValueError(f"chunk_elems must be >= 1, got {chunk_elems}")
        self.model = model
        self.segments = segments
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.micro_batch_size = micro_batch_size
        self.layer_steps = layer_steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._segment_params = [[p for p in seg.parameters() if p.requires_grad] for seg in segments]
        self.momentum_buffers: list[torch.Tensor | None] = [None] * len(self.params)
        self._chunks = _plan_chunks([p.numel() for p in self.params], chunk_elems if layer_steps else math.inf)
        # where the current batch stands
        self._batch: Batch | None = None
        self._micro = 0
        self._segment = 0
        self._phase = "forward"  # forward, backward, update
        self._chunk = 0
        self._loss_sum = 0.0
        self._correct = 0
        # the micro-batch in flight (layer steps only)
        self._inputs: list[torch.Tensor] = []
        self._outputs: list[torch.Tensor] = []
        self._loss: torch.Tensor | None = None
        self._grad: torch.Tensor | None = None
        self._pending: dict[int, torch.Tensor] = {}
        self._start_rng: dict[str, Any] | None = None
        """Set while a micro-batch is in flight (layer steps): the random state at its start."""
        self._start_totals = (0.0, 0)
        self._start_buffers: dict[str, torch.Tensor] | None = None
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._rows = [_row_blocks(seg, chunk_elems) if layer_steps else [] for seg in segments]
        """Per segment: the row blocks its leading linear layer runs in, one per step ([]: not split)."""
        self._piece = 0
        self._linear_out = torch.empty(0)
        self._linear_leaf: dict[int, torch.Tensor] = {}
        self._linear_grad = torch.empty(0)
        self._input_grad: torch.Tensor | None = None
        self._recycled = {
            self._index[id(p)] for k, seg in enumerate(segments) if self._rows[k] for p in seg.parameters()
        }
        """Parameters of the split linear layers, whose gradient buffers are kept from batch to batch."""
        self._spare: dict[int, torch.Tensor] = {}
        self._device = self.params[0].device if self.params else torch.device("cpu")

    @property
    def in_batch(self) -> bool:
        """Whether a batch has been fetched and not yet applied."""
        return self._batch is not None

    @property
    def num_micro(self) -> int:
        return 0 if self._batch is None else math.ceil(len(self._batch[1]) / self.micro_batch_size)

    def next_kind(self) -> str:
        """The step kind (see :meth:`freeride.sidetask.IterativeTask.step_kind`) of the next :meth:`advance`."""
        if self._phase == "update":
            return f"update{self._chunk}" if self.layer_steps else "update"
        if not self.layer_steps:
            return "micro"
        if self._rows[self._segment]:
            return f"{self._phase}{self._segment}.{self._piece}"
        return f"{self._phase}{self._segment}"

    def step_costs(self, forward: Sequence[float]) -> dict[str, float]:
        """Relative work of every step kind :meth:`next_kind` names, from each segment's forward work.

        Args:
            forward: The forward work of each segment for one micro-batch (see
                :func:`sidetasks._cost.segment_costs`).
        """
        if len(forward) != len(self.segments):
            raise ValueError(f"forward: {len(forward)} costs for {len(self.segments)} segments")
        backward = [backward_cost(cost, first=k == 0) for k, cost in enumerate(forward)]
        elems = [sum(hi - lo for _, lo, hi in chunk) * UPDATE_COST_PER_ELEMENT for chunk in self._chunks]
        if not self.layer_steps:
            return {"micro": sum(forward) + sum(backward), "update": sum(elems)}
        costs = {f"update{i}": cost for i, cost in enumerate(elems)}
        for k, rows in enumerate(self._rows):
            if not rows:
                costs[f"forward{k}"], costs[f"backward{k}"] = forward[k], backward[k]
                continue
            width = rows[-1][1]
            for j, (lo, hi) in enumerate(rows):
                costs[f"forward{k}.{j}"] = forward[k] * (hi - lo) / width
                costs[f"backward{k}.{j}"] = backward[k] * (hi - lo) / width
        return costs

    def advance(self, fetch: Callable[[], Batch]) -> BatchResult | None:
        """Do the next piece of work; returns the batch's loss and accuracy when its update is applied."""
        if self._batch is None:
            self._batch = fetch()
            self._micro, self._phase, self._loss_sum, self._correct = 0, "forward", 0.0, 0
        if self._phase == "update":
            return self._update_chunk()
        if self.layer_steps:
            self._layer_step()
        else:
            self._micro_step()
        return None

    # -- the passes

    def _micro_slice(self) -> Batch:
        assert self._batch is not None
        x, y = self._batch
        lo = self._micro * self.micro_batch_size
        return x[lo : lo + self.micro_batch_size], y[lo : lo + self.micro_batch_size]

    def _scaled_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        assert self._batch is not None
        loss = F.cross_entropy(logits, y) * (len(y) / len(self._batch[1]))
        self._loss_sum += float(loss.detach())
        self._correct += int((logits.detach().argmax(1) == y).sum())
        return loss

    def _micro_step(self) -> None:
        x, y = self._micro_slice()
        self.model.train()
        loss = self._scaled_loss(self.model(x), y)
        torch.autograd.backward(loss)
        self._next_micro()

    def _layer_step(self) -> None:
        k = self._segment
        if self._phase == "forward":
            if len(self._inputs) == k:  # the segment's first piece
                if k == 0:
                    self._start_rng = capture_rng(self._device)
                    self._start_totals = (self._loss_sum, self._correct)
                    self._start_buffers = {n: b.detach().clone() for n, b in self.model.named_buffers()}
                    x, _ = self._micro_slice()
                    self.model.train()
                    self._inputs.append(x)
                else:
                    self._inputs.append(self._outputs[-1].detach().requires_grad_())
            if self._rows[k]:
                if not self._forward_rows(k):
                    return
            else:
                self._outputs.append(self.segments[k](self._inputs[k]))
            if k + 1 < len(self.segments):
                self._segment += 1
            else:
                _, y = self._micro_slice()
                self._loss = self._scaled_loss(self._outputs[-1], y)
                self._phase = "backward"
            return
        if self._rows[k]:
            if not self._backward_rows(k):
                return
        else:
            self._backward_segment(k)
        self._inputs.pop()
        self._outputs.pop()
        if k > 0:
            self._segment -= 1
            return
        for i, grad in self._pending.items():
            param = self.params[i]
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
                if i in self._recycled:
                    self._spare[i] = grad
        self._pending.clear()
        self._loss = None
        self._start_rng = self._start_buffers = None
        self._next_micro()

    def _hold(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        i = self._index[id(param)]
        held = self._pending.get(i)
        self._pending[i] = grad if held is None else held + grad

    def _backward_segment(self, k: int) -> None:
        """Backward through segment ``k``, from its output's gradient to its input's and its parameters'."""
        out = self._loss if k == len(self.segments) - 1 else self._outputs[k]
        assert out is not None
        params = self._segment_params[k]
        wrt = params + ([self._inputs[k]] if k > 0 else [])
        grads = torch.autograd.grad(out, wrt, grad_outputs=self._grad, allow_unused=True) if wrt else ()
        for param, grad in zip(params, grads[: len(params)], strict=True):
            if grad is not None:
                self._hold(param, grad)
        self._grad = grads[-1] if k > 0 else None

    # -- a large linear layer, a block of its output rows per step

    def _split_segment(self, k: int) -> tuple[nn.Linear, nn.Module]:
        segment = self.segments[k]
        assert isinstance(segment, nn.Sequential) and isinstance(segment[0], nn.Linear)
        return segment[0], segment[1:]

    def _forward_rows(self, k: int) -> bool:
        """One block of rows of segment ``k``'s linear layer; the rest of the segment after the last. True when done."""
        linear, rest = self._split_segment(k)
        x = self._inputs[k]
        if self._piece == 0:
            self._linear_out = x.new_empty(x.shape[0], linear.out_features)
        lo, hi = self._rows[k][self._piece]
        with torch.no_grad():
            bias = None if linear.bias is None else linear.bias[lo:hi]
            self._linear_out[:, lo:hi] = F.linear(x.detach(), linear.weight[lo:hi], bias)
        self._piece += 1
        if self._piece < len(self._rows[k]):
            return False
        self._piece = 0
        leaf = self._linear_out.requires_grad_()
        self._linear_leaf[k] = leaf
        self._outputs.append(rest(leaf.clone()))  # a copy: the rest may work in place
        return True

    def _backward_rows(self, k: int) -> bool:
        """One block of rows of segment ``k``'s linear layer's backward. True when the segment is done."""
        linear, _ = self._split_segment(k)
        x = self._inputs[k].detach()
        if self._piece == 0:
            out = self._loss if k == len(self.segments) - 1 else self._outputs[k]
            assert out is not None
            (self._linear_grad,) = torch.autograd.grad(out, [self._linear_leaf[k]], grad_outputs=self._grad)
            self._input_grad = torch.zeros_like(x) if k > 0 else None
            for param in (linear.weight, linear.bias):
                if param is not None:
                    # every row block is written once per micro-batch, so the buffer needs no zeroing;
                    # reusing last batch's (a fresh one costs a page fault per 4 KiB)
                    i = self._index[id(param)]
                    spare = self._spare.pop(i, None)
                    self._pending[i] = spare if spare is not None else torch.empty_like(param)
        lo, hi = self._rows[k][self._piece]
        g = self._linear_grad[:, lo:hi]
        with torch.no_grad():
            torch.mm(g.t(), x, out=self._pending[self._index[id(linear.weight)]][lo:hi])
            if linear.bias is not None:
                torch.sum(g, 0, out=self._pending[self._index[id(linear.bias)]][lo:hi])
            if self._input_grad is not None:
                self._input_grad.addmm_(g, linear.weight[lo:hi])
        self._piece += 1
        if self._piece < len(self._rows[k]):
            return False
        self._piece = 0
        self._grad = self._input_grad
        del self._linear_leaf[k]
        return True

    def _next_micro(self) -> None:
        self._micro += 1
        self._segment = 0
        if self._micro >= self.num_micro:
            self._phase, self._chunk = "update", 0
        else:
            self._phase = "forward"

    # -- the update

    def _update_chunk(self) -> BatchResult | None:
        with torch.no_grad():
            for i, lo, hi in self._chunks[self._chunk]:
                self._sgd_slice(i, lo, hi)
        self._chunk += 1
        if self._chunk < len(self._chunks):
            return None
        assert self._batch is not None
        result = BatchResult(self._loss_sum, self._correct / len(self._batch[1]))
        for i, param in enumerate(self.params):
            if i in self._recycled and param.grad is not None:
                self._spare[i] = param.grad
            param.grad = None
        self._batch = None
        self._phase, self._micro, self._chunk = "forward", 0, 0
        return result

    def _sgd_slice(self, i: int, lo: int, hi: int) -> None:
        param = self.params[i]
        if param.grad is None:
            return
        p = param.view(-1)[lo:hi]
        d_p = param.grad.view(-1)[lo:hi]
        if self.weight_decay:
            d_p = d_p.add(p, alpha=self.weight_decay)
        if self.momentum:
            buf = self.momentum_buffers[i]
            if buf is None:
                buf = self.momentum_buffers[i] = torch.zeros_like(param)
            b = buf.view(-1)[lo:hi]
            b.mul_(self.momentum).add_(d_p)
            d_p = b
        p.add_(d_p, alpha=-self.lr)

    # -- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Momentum buffers, accumulated gradients and the batch's progress, as of the last step boundary.

        Mid-micro-batch (layer steps) the state is that of the micro-batch's
        start; the caller must also save :meth:`model_buffers` and :meth:`rng`.
        """
        return {
            "momentum": [None if b is None else b.detach().clone() for b in self.momentum_buffers],
            "grads": [None if p.grad is None else p.grad.detach().clone() for p in self.params],
            "micro": self._micro,
            "phase": "forward" if self._phase == "backward" else self._phase,
            "chunk": self._chunk,
            "loss_sum": self._start_totals[0] if self._start_rng is not None else self._loss_sum,
            "correct": self._start_totals[1] if self._start_rng is not None else self._correct,
        }

    def model_buffers(self) -> dict[str, torch.Tensor] | None:
        """The model's buffers as of the last boundary, if they differ from the live ones."""
        return self._start_buffers

    def rng(self) -> dict[str, Any] | None:
        """The random state as of the last boundary, if it differs from the live one."""
        return self._start_rng

    def load_state_dict(self, state: dict[str, Any], batch: Batch | None) -> None:
        """Restore :meth:`state_dict`; ``batch`` is the batch in progress (None between batches)."""
        self._inputs.clear()
        self._outputs.clear()
        self._pending.clear()
        self._loss = self._grad = None
        self._start_rng = self._start_buffers = None
        self._piece = 0
        self._linear_leaf.clear()
        self._input_grad = None
        self.momentum_buffers = list(state["momentum"])
        for param, grad in zip(self.params, state["grads"], strict=True):
            param.grad = None if grad is None else grad.to(param.device)
        self._batch = batch
        self._micro, self._phase, self._chunk = int(state["micro"]), str(state["phase"]), int(state["chunk"])
        self._segment = 0
        self._loss_sum, self._correct = float(state["loss_sum"]), int(state["correct"])


def _plan_chunks(sizes: list[int], limit: float) -> list[list[tuple[int, int, int]]]:
    """Split the concatenated parameters into runs of at most ``limit`` elements: (param, start, stop) slices."""
    chunks: list[list[tuple[int, int, int]]] = [[]]
    room = limit
    for i, size in enumerate(sizes):
        lo = 0
        while lo < size:
            if room <= 0:
                chunks.append([])
                room = limit
            hi = size if math.isinf(room) else min(size, lo + int(room))
            chunks[-1].append((i, lo, hi))
            room -= hi - lo
            lo = hi
    return chunks


def _row_blocks(segment: nn.Module, limit: int) -> list[tuple[int, int]]:
    """Row blocks of at most ``limit`` weights for a segment led by a large linear layer, else []."""
    if not isinstance(segment, nn.Sequential) or not len(segment) or not isinstance(segment[0], nn.Linear):
        return []
    linear = segment[0]
    if linear.weight.numel() <= limit or any(True for _ in segment[1:].parameters()):
        return []
    rows = max(1, limit // linear.in_features)
    return [(lo, min(lo + rows, linear.out_features)) for lo in range(0, linear.out_features, rows)]
