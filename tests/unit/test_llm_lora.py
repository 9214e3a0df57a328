"""The LoRA sample (llm-lora): partitioned, its adapters train as the plain loop trains them, the base stays put.

Models are built from configs with seeded random weights (nothing is downloaded).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _torchfix import deterministic_one_thread  # noqa: F401 - autouse fixture

from freeride.sidetask import TaskContext
from freeride.sidetasks.llm_lora import LoRAFineTuning, add_lora

pytest.importorskip("transformers")


def _ctx(tmp_path: Path) -> TaskContext:
    return TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=tmp_path)


@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
def test_partitioned_lora_trains_as_the_plain_loop_and_leaves_the_base_alone(tmp_path: Path, model: str) -> None:
    batches = 3
    task = LoRAFineTuning(model=model, rank=4, batch_size=2, context=16, lr=1e-2, target_ms=0.05)
    parts = task.build()  # what setup builds, for the plain loop: same seed, same model, same adapters
    plain, data = copy.deepcopy(parts.model), list(itertools.islice(iter(parts.data), batches))
    before = {n: p.detach().clone() for n, p in plain.named_parameters()}
    asyncio.run(task.setup(_ctx(tmp_path)))
    assert task.plan is not None and len(task.plan.forward) > 3
    torch.manual_seed(7)  # dropout draws the same numbers in both
    while task.batches_done < batches:
        task.step()
    trained = [p for p in plain.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-2)
    torch.manual_seed(7)
    for x, y in data:
        opt.zero_grad()
        logits = plain(x).logits
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        opt.step()
    got = dict(task.model.named_parameters())
    for name, want in plain.named_parameters():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        changed = not torch.equal(want, before[name])
        assert changed == ("lora_" in name), f"{name}: only the adapters train"
    assert task.metrics()["trained_parameters"] == sum(p.numel() for p in trained) > 0


def test_targets_that_name_nothing_say_what_the_model_has() -> None:
    from freeride.sidetasks._llm import load_causal_lm

    model, _ = load_causal_lm("tiny-llama", device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"no module named \['c_attn'\].*'q_proj'"):
        add_lora(model, {"c_attn"}, rank=2, alpha=4.0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rank": 0}, "rank must be >= 1"),
        ({"alpha": 0.0}, "alpha must be"),
        ({"data": "/nonexistent.jsonl"}, "is not a file"),
        ({"model": "/nonexistent"}, "neither a built-in one"),
        ({"targets": " , "}, "targets must name"),
    ],
)
def test_bad_options_are_refused_with_what_is_wrong(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoRAFineTuning(**options)  # type: ignore[arg-type]
