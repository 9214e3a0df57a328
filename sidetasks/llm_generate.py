"""Batch text generation with a Hugging Face causal LM, a KV cache and a file of prompts (an LLM side task).

Offline batch inference, the work teams put next to a training job: a file of
prompts in, one result per prompt out, written as each batch finishes. One
step is one forward pass of the current batch: the prefill of a new batch (its
prompts, left-padded, through the model at once, filling the KV cache) or one
decode position (the last token of each sequence against the cache). Greedy
decoding, the tokens ``model.generate`` gives for the same batch (tested
against it).

Its progress is the output file itself: on a restart, or with a checkpoint,
it resumes after the last complete line there (the batch in flight is done
again). The batch size comes from the memory the task may use (its cap: the
declared peak or the manager's share of spare memory) and what one sequence's
cache and activations take, unless given.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from freeride.sidetask import TaskContext
from freeride.sidetasks._common import DeviceTask, check_fingerprint, synchronize
from freeride.sidetasks._llm import cache_argument, load_causal_lm, read_prompts, synthetic_prompts
from freeride.sidetasks._options import check_at_least, check_file

__all__ = ["BatchGeneration", "batch_size_for"]

logger = logging.getLogger(__name__)

DEFAULT_BATCH = 8
"""Sequences per batch where nothing bounds the task's memory (a CPU device without a cap)."""
MAX_BATCH = 256


def batch_size_for(budget: int, *, per_token: int, tokens: int, weights: int, most: int = MAX_BATCH) -> int:
    """Sequences per batch that fit in ``budget`` bytes: the weights, then each sequence's cache and activations.

    ``per_token`` is what one token of one sequence keeps (its keys and values in
    every layer) and ``tokens`` the longest a sequence gets (prompt and new
    tokens). Activations of one forward are counted as four more tokens' worth of
    the hidden state per layer, generously. 1 at least: a task that cannot fit one
    sequence fails at its first allocation, with the allocator's message.
    """
    if budget <= 0:
        return DEFAULT_BATCH
    left = budget - weights
    per_sequence = per_token * tokens * 2  # the cache, and as much again for the forward's activations
    return max(1, min(most, left // per_sequence if per_sequence > 0 else most))


class BatchGeneration(DeviceTask):
    """Greedy generation for every prompt of a file, ``batch_size`` prompts at a time, one forward per step.

    Options: ``model`` ("tiny-gpt2": a 2-layer GPT-2 built from its config with
    seeded random weights, for trying it out; else the directory of a model saved
    with ``save_pretrained``, read with ``local_files_only``; its tokenizer, if
    saved there, turns ``text`` prompts into tokens and results back into text),
    ``prompts`` (a JSONL file, one prompt a line: ``{"text": ...}`` or
    ``{"input_ids": [...]}``; "": ``num_prompts`` seeded random prompts of
    ``prompt_tokens`` tokens), ``output`` ("generations.jsonl", relative to the
    task's work directory: one line per prompt, ``{"index", "output_ids"}`` and
    ``"text"`` with a tokenizer), ``max_new_tokens`` (32), ``batch_size`` (0:
    from the memory the task may use), ``dtype`` ("float32", or "bfloat16",
    "float16" on a GPU), ``seed`` (0: the random prompts and the tiny model's
    weights).

    Metrics: ``prompts_done``, ``prompts``, ``tokens_generated``, ``batch_size``.
    """

    warm_up = False
    """A step may write results to a file, which no restored state would undo."""

    def __init__(
        self,
        *,
        model: str = "tiny-gpt2",
        prompts: str = "",
        output: str = "generations.jsonl",
        max_new_tokens: int = 32,
        batch_size: int = 0,
        num_prompts: int = 64,
        prompt_tokens: int = 16,
        dtype: str = "float32",
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_at_least(1, max_new_tokens=max_new_tokens)
        if not 0 <= batch_size <= MAX_BATCH:
            raise ValueError(f"batch_size must be in [0, {MAX_BATCH}] (0: from the memory the task may use)")
        if num_prompts < 1 or prompt_tokens < 1:
            raise ValueError(f"num_prompts and prompt_tokens must be >= 1, got {num_prompts}, {prompt_tokens}")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        if not output:
            raise ValueError("output must name a file (relative to the task's work directory)")
        check_file(prompts=prompts)
        self.model_name, self.prompts_path, self.output = model, prompts, output
        self.max_new_tokens, self.batch_size, self.seed = max_new_tokens, batch_size, seed
        self.num_prompts, self.prompt_tokens, self.dtype_name = num_prompts, prompt_tokens, dtype
        self.prompts: list[list[int]] = []
        self.written = 0
        """Prompts whose results are in the output file (the next batch starts there)."""
        self.tokens_generated = 0
        self._model: Any = None
        self._tokenizer: Any = None
        self._pad = 0
        self._eos: int | None = None
        self._out_path = Path(output)
        # the batch in flight
        self._batch: list[int] = []
        self._ids = torch.empty(0, dtype=torch.long)
        """Every sequence of the batch so far, prompt (left-padded) and generated tokens."""
        self._mask = torch.empty(0, dtype=torch.long)
        self._cache: Any = None
        self._cache_name = "past_key_values"
        self._new = 0
        self._finished = torch.empty(0, dtype=torch.bool)

    # -- setup ------------------------------------------------------------------

    def _build(self, ctx: TaskContext) -> None:
        dtype = getattr(torch, self.dtype_name)
        if dtype != torch.float32 and self.device.type == "cpu":
            raise ValueError(f"dtype {self.dtype_name} needs a GPU; use float32 on {ctx.device}")
        self._model, self._tokenizer = load_causal_lm(self.model_name, device=self.device, dtype=dtype, seed=self.seed)
        self._cache_name = cache_argument(self._model)
        config = self._model.config
        self._eos = getattr(config, "eos_token_id", None)
        if isinstance(self._eos, list):
            self._eos = self._eos[0] if self._eos else None
        pad = getattr(config, "pad_token_id", None)
        self._pad = pad if pad is not None else (self._eos if self._eos is not None else 0)
        if self.prompts_path:
            self.prompts = read_prompts(Path(self.prompts_path).expanduser(), self._tokenizer)
        else:
            self.prompts = synthetic_prompts(
                self.num_prompts, self.prompt_tokens, vocab=config.vocab_size, seed=self.seed
            )
        self._out_path = ctx.workdir / self.output
        self.written = self._resume_point()
        if not self.batch_size:
            self.batch_size = self._sized_batch(ctx)
        logger.info(
            "[setup] llm-generate: %s, %d prompts (%d done), batch %d, %d new tokens, on %s",
            self.model_name, len(self.prompts), self.written, self.batch_size, self.max_new_tokens, self.device,
        )  # fmt: skip

    def _sized_batch(self, ctx: TaskContext) -> int:
        config = self._model.config
        layers = getattr(config, "num_hidden_layers", getattr(config, "n_layer", 1))
        hidden = getattr(config, "hidden_size", getattr(config, "n_embd", 1))
        heads = getattr(config, "num_attention_heads", getattr(config, "n_head", 1))
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        element = torch.finfo(getattr(torch, self.dtype_name)).bits // 8
        per_token = 2 * layers * hidden * kv_heads // heads * element
        longest = max((len(p) for p in self.prompts), default=1) + self.max_new_tokens
        weights = sum(p.numel() * p.element_size() for p in self._model.parameters())
        budget = ctx.memory_limit
        if budget <= 0 and self.device.type == "cuda":
            budget = torch.cuda.mem_get_info(self.device)[0] + weights  # the weights are in use already
        return batch_size_for(budget, per_token=per_token, tokens=longest, weights=weights)

    def _resume_point(self) -> int:
        """Complete lines of the output file, in order; a torn last line is cut off."""
        if not self._out_path.exists():
            return 0
        done, keep = 0, 0
        with open(self._out_path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break
                try:
                    index = json.loads(line)["index"]
                except (ValueError, KeyError, TypeError):
                    break
                if index != done:
                    break
                done += 1
                keep += len(line)
        if keep != self._out_path.stat().st_size:
            os.truncate(self._out_path, keep)
        return min(done, len(self.prompts))

    # -- steps ------------------------------------------------------------------

    def step_kind(self) -> str:
        return "decode" if self._batch else "prefill"

    def step(self) -> None:
        with torch.inference_mode():
            if not self._batch:
                self._prefill()
            else:
                self._decode()
        synchronize(self.device)
        if self._batch and (self._new >= self.max_new_tokens or bool(self._finished.all())):
            self._write_batch()

    def _prefill(self) -> None:
        first = self.written
        self._batch = list(range(first, min(first + self.batch_size, len(self.prompts))))
        prompts = [self.prompts[i] for i in self._batch]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self._pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: every sequence's next token is in the last column
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        self._ids, self._mask = ids.to(self.device), mask.to(self.device)
        self._finished = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        self._new = 0
        self._cache = None
        self._forward(self._ids)

    def _decode(self) -> None:
        self._forward(self._ids[:, -1:])

    def _forward(self, tokens: torch.Tensor) -> None:
        positions = (self._mask.cumsum(-1) - 1).clamp(min=0)[:, -tokens.shape[1] :]
        cache = {self._cache_name: self._cache}
        out = self._model(input_ids=tokens, attention_mask=self._mask, position_ids=positions, use_cache=True, **cache)
        self._cache = out[self._cache_name]
        nxt = out.logits[:, -1, :].argmax(-1)
        nxt = torch.where(self._finished, torch.full_like(nxt, self._pad), nxt)
        if self._eos is not None:
            self._finished |= nxt == self._eos
        self._ids = torch.cat([self._ids, nxt[:, None]], dim=-1)
        self._mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=-1)
        self._new += 1
        self.tokens_generated += len(self._batch)

    def _write_batch(self) -> None:
        generated = self._ids[:, -self._new :].tolist()
        self._out_path.parent.mkdir(parents=True, exist_ok=True)
        lines = []
        for index, tokens in zip(self._batch, generated, strict=True):
            if self._eos is not None and self._eos in tokens:
                tokens = tokens[: tokens.index(self._eos) + 1]
            record: dict[str, Any] = {"index": index, "output_ids": tokens}
            if self._tokenizer is not None:
                record["text"] = self._tokenizer.decode(tokens, skip_special_tokens=True)
            lines.append(json.dumps(record) + "\n")
        with open(self._out_path, "a", encoding="utf-8") as f:
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
        self.written = self._batch[-1] + 1
        self._batch, self._cache = [], None

    def done(self) -> bool:
        return self.written >= len(self.prompts) and not self._batch

    def step_cost(self, kind: str) -> float | None:
        """Tokens through the model: a prefill takes the prompts whole, a decode one token a sequence."""
        width = max((len(p) for p in self.prompts), default=self.prompt_tokens)
        if kind == "prefill":
            return float(self.batch_size * width)
        if kind == "decode":
            return float(self.batch_size)
        return None

    def metrics(self) -> dict[str, float]:
        return {
            "prompts_done": float(self.written),
            "prompts": float(len(self.prompts)),
            "tokens_generated": float(self.tokens_generated),
            "batch_size": float(self.batch_size),
        }

    # -- checkpoints ----------------------------------------------------------------

    def _fingerprint(self) -> dict[str, Any]:
        return {"model": self.model_name, "prompts": len(self.prompts), "max_new_tokens": self.max_new_tokens}

    def _capture(self) -> dict[str, Any]:
        return {"fingerprint": self._fingerprint(), "written": self.written, "tokens": self.tokens_generated}

    def _restore(self, state: dict[str, Any]) -> None:
        check_fingerprint(state, self._fingerprint())
        self.tokens_generated = int(state.get("tokens", 0))
        # the file is what was written: a checkpoint older than it does not undo lines, a newer one (the file
        # replaced meanwhile) cannot conjure them
        self.written = self._resume_point()
        self._batch, self._cache = [], None
