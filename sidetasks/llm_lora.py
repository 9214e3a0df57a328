"""LoRA fine-tuning of a Hugging Face causal LM in bubble-sized steps (an LLM side task).

The base model's weights stay frozen; a low-rank pair of matrices beside each
targeted projection (``W x + (alpha / rank) B A x``, B starting at zero, so the
model starts as it was) is trained with AdamW on next-token prediction. The
model goes through :class:`freeride.partition.PartitionedTraining` like any
other: exported with ``torch.export`` (fx cannot trace Hugging Face models),
cut into pieces sized for the device's bubbles, each timed where the task
landed. The result is equal to the plain training loop's (tested).

The data is a JSONL file of texts or token ids (as ``llm-generate``'s
prompts), joined into one token stream and cut into windows, or, without
one, seeded sequences of a learnable pattern (each token the one before plus
one) for trying it out. Window ``i`` comes from a generator seeded by ``seed``
and ``i``, so the data replays exactly after a restore.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from freeride.partition import PartitionedTraining, TrainingParts
from freeride.sidetasks._batches import TokenWindows
from freeride.sidetasks._common import sample_seed
from freeride.sidetasks._llm import check_model, counting_sequences, load_causal_lm, token_stream
from freeride.sidetasks._options import check_at_least, check_file, check_positive

__all__ = ["LoRAFineTuning", "LoRALinear", "add_lora"]


class LoRALinear(nn.Module):
    """A frozen projection (``nn.Linear``, or GPT-2's ``Conv1D``) plus its trained low-rank update."""

    def __init__(self, base: nn.Module, *, rank: int, alpha: float) -> None:
        super().__init__()
        weight = base.weight
        assert isinstance(weight, torch.Tensor)
        if isinstance(base, nn.Linear):
            in_features, out_features = weight.shape[1], weight.shape[0]
        else:  # transformers' Conv1D keeps its weight as (in, out)
            in_features, out_features = weight.shape[0], weight.shape[1]
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, in_features, device=weight.device, dtype=weight.dtype))
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank, device=weight.device, dtype=weight.dtype))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scale
        return out


def add_lora(model: nn.Module, targets: set[str], *, rank: int, alpha: float) -> list[str]:
    """Freeze ``model`` and wrap each module whose own name is in ``targets`` in a :class:`LoRALinear`.

    Returns:
        The wrapped modules' full names.

    Raises:
        ValueError: no module of ``model`` has one of those names.
    """
    model.requires_grad_(False)
    wrapped = []
    for name, module in list(model.named_modules()):
        parent_name, _, own = name.rpartition(".")
        if own in targets and hasattr(module, "weight") and module.weight.dim() == 2:
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, own, LoRALinear(module, rank=rank, alpha=alpha))
            wrapped.append(name)
    if not wrapped:
        names = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"no module named {sorted(targets)} in the model; its linear layers are named {names}")
    return wrapped


def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy; the model's output arrives as it returns it (a ModelOutput with logits)."""
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class LoRAFineTuning(PartitionedTraining):
    """Fine-tune a causal LM's LoRA adapters (base frozen) with AdamW on next-token prediction.

    Options: ``model`` ("tiny-gpt2"; or "tiny-llama", or the directory of a model
    saved with ``save_pretrained``), ``data`` ("": seeded counting sequences; else
    a JSONL file of ``{"text": ...}`` (with a tokenizer saved beside the model) or
    ``{"input_ids": [...]}``), ``targets`` ("c_attn,q_proj,v_proj": the projections
    that get adapters, by their own names), ``rank`` (8), ``alpha`` (16),
    ``batch_size`` (4), ``context`` (32 tokens), ``lr`` (1e-3), ``seed`` (0), and
    the partitioning options ``target_ms``, ``steps`` and ``profile_runs``.

    Metrics: those of :class:`~freeride.partition.PartitionedTraining` (``loss``,
    ``loss_ema``, ``batches``...), and ``trained_parameters``.
    """

    def __init__(
        self,
        *,
        model: str = "tiny-gpt2",
        data: str = "",
        targets: str = "c_attn,q_proj,v_proj",
        rank: int = 8,
        alpha: float = 16.0,
        batch_size: int = 4,
        context: int = 32,
        lr: float = 1e-3,
        seed: int = 0,
        target_ms: float = 0.0,
        steps: int = 0,
        profile_runs: int = 2,
    ) -> None:
        super().__init__(target_ms=target_ms, steps=steps, profile_runs=profile_runs)
        check_at_least(1, rank=rank, batch_size=batch_size, context=context)
        check_positive(alpha=alpha, lr=lr)
        check_file(data=data)
        check_model(model)
        self.model_name, self.data_path = model, data
        self.targets = {t.strip() for t in targets.split(",") if t.strip()}
        if not self.targets:
            raise ValueError("targets must name at least one projection")
        self.rank, self.alpha, self.batch_size, self.context = rank, alpha, batch_size, context
        self.lr, self.seed = lr, seed
        self.trained_parameters = 0

    def _stream(self, tokenizer: Any, vocab: int) -> torch.Tensor:
        if not self.data_path:  # learnable, so the loss must fall
            seed = sample_seed(self.seed, 22, 0)
            return counting_sequences(256, self.context + 1, vocab=vocab, seed=seed).flatten()
        return token_stream(Path(self.data_path).expanduser(), tokenizer, at_least=self.context + 1)

    def build(self) -> TrainingParts:
        model, tokenizer = load_causal_lm(self.model_name, device=self.device, dtype=torch.float32, seed=self.seed)
        model.config.use_cache = False  # training: no KV cache in the outputs
        torch.manual_seed(self.seed)
        add_lora(model, self.targets, rank=self.rank, alpha=self.alpha)
        trained = [p for p in model.parameters() if p.requires_grad]
        self.trained_parameters = sum(p.numel() for p in trained)
        optimizer = torch.optim.AdamW(trained, lr=self.lr)
        data = TokenWindows(
            self._stream(tokenizer, model.config.vocab_size),
            batch_size=self.batch_size,
            context=self.context,
            seed=self.seed,
            stream=21,
            device=self.device,
        )
        return TrainingParts(model.train(), optimizer, _loss, data)

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out["trained_parameters"] = float(self.trained_parameters)
        return out
