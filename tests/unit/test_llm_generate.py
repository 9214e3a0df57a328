"""The batch-generation sample (llm-generate) against Hugging Face's own ``generate`` on the same batches.

Models are built from configs with seeded random weights (nothing is downloaded); the tokenizer of the
text test is trained here on a few words.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from freeride.sidetask import TaskContext
from freeride.sidetask.alone import run_alone
from freeride.sidetasks._llm import load_causal_lm
from freeride.sidetasks.llm_generate import DEFAULT_BATCH, BatchGeneration, batch_size_for

transformers = pytest.importorskip("transformers")


def _ctx(workdir: Path, *, memory_limit: int = -1) -> TaskContext:
    return TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=workdir, memory_limit=memory_limit)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _reference(task: BatchGeneration, model_name: str, max_new: int) -> list[list[int]]:
    """``model.generate`` (greedy) on the task's prompts, in the task's batches, left-padded as it pads them."""
    model, _ = load_causal_lm(model_name, device=torch.device("cpu"), dtype=torch.float32, seed=0)
    pad, eos = model.config.pad_token_id, model.config.eos_token_id
    out: list[list[int]] = []
    for first in range(0, len(task.prompts), task.batch_size):
        batch = task.prompts[first : first + task.batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            gen = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=pad,
                eos_token_id=eos,
            )  # fmt: skip
        for row in gen[:, width:].tolist():
            out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out


@pytest.mark.parametrize("model_name", ["tiny-gpt2", "tiny-llama"])
async def test_generates_what_hugging_faces_generate_does_batch_by_batch(tmp_path: Path, model_name: str) -> None:
    task = BatchGeneration(model=model_name, num_prompts=10, prompt_tokens=12, max_new_tokens=6, batch_size=4)
    await run_alone(task, steps=1000, ctx=_ctx(tmp_path))
    assert task.done()
    lines = _lines(tmp_path / "generations.jsonl")
    assert [line["index"] for line in lines] == list(range(10))
    assert [line["output_ids"] for line in lines] == _reference(task, model_name, 6)
    # 3 batches (4, 4, 2): each a prefill and at most 5 decodes
    assert task.metrics()["prompts_done"] == 10 and task.metrics()["batch_size"] == 4


async def test_a_restart_resumes_after_the_last_complete_line_and_ends_as_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    whole = BatchGeneration(num_prompts=9, prompt_tokens=8, max_new_tokens=5, batch_size=3)
    await run_alone(whole, steps=1000, ctx=_ctx(tmp_path / "whole"))
    expected = (tmp_path / "whole" / "generations.jsonl").read_text()

    first = BatchGeneration(num_prompts=9, prompt_tokens=8, max_new_tokens=5, batch_size=3)
    await run_alone(first, steps=8, ctx=_ctx(tmp_path / "cut"))  # one batch written, the second one in flight
    state = first.state_dict()
    out = tmp_path / "cut" / "generations.jsonl"
    assert len(_lines(out)) == 3 and state["written"] == 3
    with open(out, "a") as f:
        f.write('{"index": 3, "output_ids": [5')  # a write torn by a kill

    again = BatchGeneration(num_prompts=9, prompt_tokens=8, max_new_tokens=5, batch_size=3)
    again.load_state_dict(state)
    await run_alone(again, steps=1000, ctx=_ctx(tmp_path / "cut"))
    assert out.read_text() == expected

    restarted = BatchGeneration(num_prompts=9, prompt_tokens=8, max_new_tokens=5, batch_size=3)
    await run_alone(restarted, steps=1000, ctx=_ctx(tmp_path / "cut"))  # no checkpoint: the file says it is done
    assert restarted.done() and out.read_text() == expected


async def test_text_prompts_through_a_saved_model_and_its_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "bubbles", "pass"]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=["[BOS]", "[EOS]", "[PAD]", "[UNK]"]))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]", unk_token="[UNK]"
    )
    model, _ = load_causal_lm("tiny-gpt2", device=torch.device("cpu"), dtype=torch.float32)
    saved = tmp_path / "model"
    model.save_pretrained(saved)
    fast.save_pretrained(saved)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"text": "the quick brown fox"}) + "\n" + json.dumps({"input_ids": [5, 6]}) + "\n")
    task = BatchGeneration(model=str(saved), prompts=str(prompts), max_new_tokens=4, output="out/gen.jsonl")
    await run_alone(task, steps=100, ctx=_ctx(tmp_path / "work"))
    lines = _lines(tmp_path / "work" / "out" / "gen.jsonl")
    assert [line["index"] for line in lines] == [0, 1]
    assert task.prompts[0] == fast("the quick brown fox")["input_ids"]
    for line in lines:
        assert line["text"] == fast.decode(line["output_ids"], skip_special_tokens=True)


def test_the_batch_comes_from_the_memory_the_task_may_use() -> None:
    assert batch_size_for(-1, per_token=1024, tokens=100, weights=10**6) == DEFAULT_BATCH
    assert batch_size_for(10**6 + 2 * 1024 * 100 * 7, per_token=1024, tokens=100, weights=10**6) == 7
    assert batch_size_for(10**6, per_token=1024, tokens=100, weights=10**6) == 1  # not even one: one, and it fails
    assert batch_size_for(10**12, per_token=1, tokens=1, weights=0) == 256


async def test_a_capped_task_sizes_its_batch_to_the_cap(tmp_path: Path) -> None:
    task = BatchGeneration(num_prompts=4, prompt_tokens=10, max_new_tokens=6)
    await task.setup(_ctx(tmp_path, memory_limit=8 << 20))
    weights = sum(p.numel() * 4 for p in task._model.parameters())
    per_token = 2 * 2 * 64 * 4  # keys and values, 2 layers, 64 wide, float32
    longest = max(map(len, task.prompts)) + 6
    assert task.batch_size == min(256, ((8 << 20) - weights) // (2 * per_token * longest))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"batch_size": 1000}, "batch_size must be in"),
        ({"prompts": "/nonexistent.jsonl"}, "is not a file"),
        ({"dtype": "int8"}, "dtype must be"),
    ],
)
def test_bad_options_are_refused_with_what_is_wrong(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchGeneration(**options)


async def test_a_bad_model_or_prompt_file_says_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a built-in one"):
        await BatchGeneration(model=str(tmp_path / "nothing")).setup(_ctx(tmp_path))
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match="needs a model saved with its tokenizer"):
        await BatchGeneration(prompts=str(bad)).setup(_ctx(tmp_path))
