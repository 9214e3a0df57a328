"""What the LLM samples share: a causal LM from a saved directory or a built-in config, and their prompts."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "TINY_MODELS",
    "cache_argument",
    "check_model",
    "counting_sequences",
    "load_causal_lm",
    "read_prompts",
    "synthetic_prompts",
    "token_stream",
]

TINY_MODELS: dict[str, dict[str, Any]] = {
    "tiny-gpt2": {
        "model_type": "gpt2", "vocab_size": 512, "n_positions": 256, "n_embd": 64, "n_layer": 2, "n_head": 4,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    },
    "tiny-llama": {
        "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    },
}  # fmt: skip
"""Models built from a config with seeded random weights: for trying a sample out and for tests (nothing
downloaded). Anything else names the directory of a model saved with ``save_pretrained``."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "the LLM samples need Hugging Face transformers: pip install 'freeride-runtime[llm]'"
        ) from None
    return transformers


def _dtype_argument(transformers: Any) -> str:
    """What ``from_pretrained`` and ``from_config`` call the weights' dtype (``torch_dtype`` before transformers 5)."""
    return "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


def cache_argument(model: Any) -> str:
    """What ``model``'s forward calls its KV cache, in and out (``past_key_values`` before transformers 5)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def check_model(name: str) -> None:
    """Refuse a model name that is neither built in (:data:`TINY_MODELS`) nor a directory.

    Raises:
        ValueError: saying which names are built in.
    """
    if name not in TINY_MODELS and not Path(name).expanduser().is_dir():
        raise ValueError(
            f"model {name!r} is neither a built-in one ({', '.join(TINY_MODELS)}) nor a directory saved with"
            " save_pretrained"
        )


def load_causal_lm(name: str, *, device: torch.device, dtype: torch.dtype, seed: int = 0) -> tuple[Any, Any]:
    """The model called ``name`` (see :data:`TINY_MODELS`) on ``device`` in eval mode, and its tokenizer (or None).

    Raises:
        ValueError: ``name`` is neither a built-in model nor a directory.
    """
    transformers = _transformers()
    if name in TINY_MODELS:
        settings = dict(TINY_MODELS[name])
        config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, **{_dtype_argument(transformers): dtype})
        tokenizer = None
    else:
        check_model(name)
        path = Path(name).expanduser()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, **{_dtype_argument(transformers): dtype}
        )
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError):
            tokenizer = None  # a model saved without one: prompts must be token ids
    return model.to(device).eval(), tokenizer


def read_prompts(path: Path, tokenizer: Any) -> list[list[int]]:
    """The prompts of a JSONL file, as token ids: each line ``{"input_ids": [...]}`` or ``{"text": ...}``.

    Raises:
        ValueError: a line that is neither, text without a tokenizer, an empty prompt, or no prompt at all.
    """
    prompts: list[list[int]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from None
            if isinstance(item, dict) and "input_ids" in item:
                ids = item["input_ids"]
                if not (isinstance(ids, list) and all(isinstance(t, int) and t >= 0 for t in ids)):
                    raise ValueError(f"{path}:{lineno}: input_ids must be a list of token ids")
            elif isinstance(item, dict) and isinstance(item.get("text"), str):
                if tokenizer is None:
                    raise ValueError(f"{path}:{lineno}: a text prompt needs a model saved with its tokenizer")
                ids = list(tokenizer(item["text"])["input_ids"])
            else:
                raise ValueError(f'{path}:{lineno}: expected {{"text": ...}} or {{"input_ids": [...]}}')
            if not ids:
                raise ValueError(f"{path}:{lineno}: empty prompt")
            prompts.append(ids)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def synthetic_prompts(count: int, tokens: int, *, vocab: int, seed: int = 0) -> list[list[int]]:
    """``count`` seeded random prompts of 1 to ``tokens`` tokens (ids 3 and up: clear of the tiny models' specials)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, tokens + 1, (count,), generator=g)
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in lengths]


def token_stream(path: Path, tokenizer: Any, *, at_least: int) -> torch.Tensor:
    """The prompts of a JSONL file (see :func:`read_prompts`) joined into one stream of token ids.

    Raises:
        ValueError: as :func:`read_prompts`, or fewer than ``at_least`` tokens in all.
    """
    stream = torch.tensor([t for text in read_prompts(path, tokenizer) for t in text], dtype=torch.long)
    if len(stream) < at_least:
        raise ValueError(f"the data has {len(stream)} tokens: fewer than context + 1 ({at_least})")
    return stream


def counting_sequences(count: int, length: int, *, vocab: int, seed: int) -> torch.Tensor:
    """``(count, length)`` token ids, each row counting up (mod the ids 3 and up) from a seeded start: learnable."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(3, vocab, (count, 1), generator=g)
    return 3 + (starts - 3 + torch.arange(length)) % (vocab - 3)
