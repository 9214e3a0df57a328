"""The checkpoint-evaluation sample (llm-eval): each new checkpoint of a watched directory scored as a plain
evaluation scores it. Models are built from configs with seeded random weights (nothing is downloaded)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from freeride.sidetask import TaskContext, UnboundedGate
from freeride.sidetasks._llm import load_causal_lm
from freeride.sidetasks.llm_eval import CheckpointEvaluation, checkpoints_in

pytest.importorskip("transformers")


def _ctx(workdir: Path) -> TaskContext:
    return TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=workdir)


def _model(seed: int) -> torch.nn.Module:
    model, _ = load_causal_lm("tiny-gpt2", device=torch.device("cpu"), dtype=torch.float32, seed=seed)
    return model


def _plain_loss(model: torch.nn.Module, task: CheckpointEvaluation) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in task._held_out:
            logits = model(x).logits
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"))
            count += y.numel()
    return total / count


def _results(path: Path) -> list[dict[str, float | str]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def _run_until(task: CheckpointEvaluation, gate: UnboundedGate, results: Path, count: int) -> None:
    runner = asyncio.create_task(task.run(gate))
    try:
        async with asyncio.timeout(60):
            while len(_results(results)) < count:
                await asyncio.sleep(0.02)
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


async def test_each_new_checkpoint_is_scored_as_a_plain_evaluation_scores_it(tmp_path: Path) -> None:
    watch, work = tmp_path / "ckpt", tmp_path / "work"
    watch.mkdir()
    torch.save(_model(1).state_dict(), watch / "step-100.pt")
    torch.save({"model": _model(2).state_dict(), "optimizer": {}}, watch / "step-200.pt")
    (watch / "step-300.pt.tmp").write_bytes(b"half written")  # a saver's temporary: never read
    task = CheckpointEvaluation(watch=str(watch), batches=2, batch_size=2, context=8, settle_s=0, poll_s=0.02)
    await task.setup(_ctx(work))
    gate = UnboundedGate()
    results = work / "evaluations.jsonl"
    await _run_until(task, gate, results, 2)
    assert [r["checkpoint"] for r in _results(results)] == ["step-100.pt", "step-200.pt"]
    for record, seed in zip(_results(results), (1, 2), strict=True):
        assert record["loss"] == pytest.approx(_plain_loss(_model(seed), task), rel=1e-6)
        assert record["perplexity"] == pytest.approx(math.exp(float(record["loss"])))
    assert gate.kinds == ["load", "eval", "eval"] * 2, "a load, then one held-out batch a step"
    assert gate.reported["evaluated"] == 2 and gate.reported["loss"] == _results(results)[-1]["loss"]

    # one saved by save_pretrained arrives later; a restart evaluates only it
    _model(3).save_pretrained(watch / "checkpoint-300")
    again = CheckpointEvaluation(watch=str(watch), batches=2, batch_size=2, context=8, settle_s=0, poll_s=0.02)
    await again.setup(_ctx(work))
    assert again.done_names == {"step-100.pt", "step-200.pt"}
    await _run_until(again, UnboundedGate(), results, 3)
    last = _results(results)[-1]
    assert last["checkpoint"] == "checkpoint-300"
    assert last["loss"] == pytest.approx(_plain_loss(_model(3), again), rel=1e-6)


async def test_the_next_checkpoint_is_read_on_a_thread_while_the_one_before_is_evaluated(tmp_path: Path) -> None:
    watch, work = tmp_path / "ckpt", tmp_path / "work"
    watch.mkdir()
    for k in range(3):
        torch.save(_model(k).state_dict(), watch / f"step-{k}.pt")
        os.utime(watch / f"step-{k}.pt", ns=(k + 1, k + 1))
    task = CheckpointEvaluation(watch=str(watch), batches=2, batch_size=2, context=8, settle_s=0, poll_s=0.02)
    await task.setup(_ctx(work))
    seen: list[tuple[str, str]] = []
    reading_ahead = threading.Event()
    read, record = task.read, task._record

    def reading(path: Path) -> object:
        seen.append(("read", path.name))
        assert threading.current_thread().name.startswith("freeride-eval-read")
        if path.name == "step-1.pt":
            reading_ahead.set()
        return read(path)

    def recording(name: str, loss: float) -> None:
        if name == "step-0.pt":  # its scoring ends only once the next one is being read
            assert reading_ahead.wait(10), "step-1.pt was not read while step-0.pt was evaluated"
        seen.append(("scored", name))
        record(name, loss)

    task.read, task._record = reading, recording  # type: ignore[method-assign]
    await _run_until(task, UnboundedGate(), work / "evaluations.jsonl", 3)
    assert [name for what, name in seen if what == "read"] == ["step-0.pt", "step-1.pt", "step-2.pt"]  # each once
    assert seen.index(("read", "step-2.pt")) < seen.index(("scored", "step-2.pt"))


async def test_a_checkpoint_of_another_model_is_left_out_with_a_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    watch = tmp_path / "ckpt"
    watch.mkdir()
    torch.save({"weight": torch.zeros(3)}, watch / "other.pt")
    torch.save(_model(1).state_dict(), watch / "mine.pt")
    os.utime(watch / "other.pt", ns=(1, 1))  # oldest: looked at first
    task = CheckpointEvaluation(watch=str(watch), batches=1, batch_size=1, context=4, settle_s=0, poll_s=0.02)
    await task.setup(_ctx(tmp_path / "work"))
    await _run_until(task, UnboundedGate(), tmp_path / "work" / "evaluations.jsonl", 1)
    assert task.skipped == {"other.pt"} and task.done_names == {"mine.pt"}
    assert "other.pt: cannot load it, left out" in caplog.text


def test_a_checkpoint_still_changing_is_not_taken(tmp_path: Path) -> None:
    (tmp_path / "a.pt").write_bytes(b"x")
    (tmp_path / ".b.pt").write_bytes(b"x")
    (tmp_path / "c.partial").write_bytes(b"x")
    (tmp_path / "notes.txt").write_bytes(b"x")
    (tmp_path / "dir-without-config").mkdir()
    assert checkpoints_in(tmp_path, settle_s=60) == []
    later = (tmp_path / "a.pt").stat().st_mtime_ns + 61 * 10**9
    assert checkpoints_in(tmp_path, settle_s=60, now_ns=later) == [tmp_path / "a.pt"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "watch must name"),
        ({"watch": "/nonexistent"}, "is not a directory"),
        ({"batches": 0}, "batches must be >= 1"),
        ({"poll_s": 0.0}, "poll_s > 0"),
        ({"model": "/nonexistent"}, "neither a built-in one"),
    ],
)
def test_bad_options_are_refused_with_what_is_wrong(tmp_path: Path, options: dict[str, object], message: str) -> None:
    options = {"watch": str(tmp_path), **options} if "watch" not in options and options else options
    with pytest.raises(ValueError, match=message):
        CheckpointEvaluation(**options)  # type: ignore[arg-type]
