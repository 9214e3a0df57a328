"""Evaluation of the training job's own checkpoints as they appear: loss and perplexity on held-out data.

What teams buy separate GPUs for: every checkpoint the job saves is scored
on a held-out set while the job goes on. The task watches a directory; each
new checkpoint (a directory saved with ``save_pretrained``, or a state-dict
file, ``.pt``/``.pth``/``.bin`` read with ``torch.load(weights_only=True)`` or
``.safetensors``, for the architecture ``model`` names) is read from storage
on a thread of its own while the checkpoint before it is evaluated (the first
one while the task holds no bubble), loaded into the model in a step, then
evaluated one held-out batch per step, in the bubbles. Each result goes to a
JSONL file as it is complete and to the task's metrics (``freeride status``, Prometheus ``freeride_side_task_metric``).

A checkpoint is taken once it has not changed for ``settle_s`` seconds, and
never while its name starts with a dot or ends in ``.tmp`` or ``.partial``
(how savers write before they rename). The results file is the task's
progress: a restart evaluates what it does not list (the checkpoint in
flight again).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from freeride.sidetask import IterativeTask, StepGate, TaskContext
from freeride.sidetasks._common import sample_seed
from freeride.sidetasks._llm import check_model, counting_sequences, load_causal_lm, token_stream
from freeride.sidetasks._options import check_at_least, check_file

__all__ = ["CheckpointEvaluation", "checkpoints_in"]

logger = logging.getLogger(__name__)

STATE_FILES = (".pt", ".pth", ".bin", ".safetensors")
"""Names of state-dict files taken as checkpoints."""
_UNFINISHED = (".tmp", ".partial")


def _changed_ns(path: Path) -> int:
    """The latest modification time of ``path`` or, for a directory, of anything in it."""
    latest = path.stat().st_mtime_ns
    if path.is_dir():
        for child in path.rglob("*"):
            latest = max(latest, child.stat().st_mtime_ns)
    return latest


def checkpoints_in(watch: Path, *, settle_s: float, now_ns: int | None = None) -> list[Path]:
    """The checkpoints in ``watch`` that are complete by their look and unchanged for ``settle_s``, oldest first."""
    now = time.time_ns() if now_ns is None else now_ns
    found: list[tuple[int, str, Path]] = []
    for entry in watch.iterdir():
        name = entry.name
        if name.startswith(".") or name.endswith(_UNFINISHED):
            continue
        saved = entry.is_dir() and (entry / "config.json").is_file()
        if not (saved or (entry.is_file() and name.endswith(STATE_FILES))):
            continue
        try:
            changed = _changed_ns(entry)
        except FileNotFoundError:  # replaced while we looked
            continue
        if now - changed >= settle_s * 1e9:
            found.append((changed, name, entry))
    return [path for _, _, path in sorted(found)]


class CheckpointEvaluation(IterativeTask):
    """Score each new checkpoint in ``watch`` on held-out data: mean next-token loss and perplexity.

    Options: ``watch`` (the directory the training job saves checkpoints to;
    required), ``model`` ("tiny-gpt2": the architecture state-dict files are
    loaded into, a built-in one or a ``save_pretrained`` directory; a checkpoint
    that is itself such a directory brings its own), ``data`` ("": seeded
    counting sequences; else a JSONL file of ``{"text": ...}`` or
    ``{"input_ids": [...]}``, the held-out set), ``batches`` (8) of
    ``batch_size`` (4) windows of ``context`` (32) tokens, ``results``
    ("evaluations.jsonl", relative to the task's work directory), ``settle_s``
    (2.0), ``poll_s`` (1.0: how often the directory is looked at), ``seed`` (0).

    Metrics: ``evaluated``, ``skipped`` (checkpoints that did not load), ``loss`` and ``perplexity`` of the latest
    checkpoint, ``best_loss``.
    """

    warm_up = False
    """A step may write a result, which no restored state would undo."""

    def __init__(
        self,
        *,
        watch: str = "",
        model: str = "tiny-gpt2",
        data: str = "",
        batches: int = 8,
        batch_size: int = 4,
        context: int = 32,
        results: str = "evaluations.jsonl",
        settle_s: float = 2.0,
        poll_s: float = 1.0,
        seed: int = 0,
    ) -> None:
        if not watch:
            raise ValueError("watch must name the directory the training job saves its checkpoints to")
        if not Path(watch).expanduser().is_dir():
            raise ValueError(f"watch {watch!r} is not a directory")
        check_at_least(1, batches=batches, batch_size=batch_size, context=context)
        if not (settle_s >= 0 and math.isfinite(settle_s)) or not (poll_s > 0 and math.isfinite(poll_s)):
            raise ValueError(f"settle_s must be >= 0 and poll_s > 0, got {settle_s}, {poll_s}")
        check_file(data=data)
        check_model(model)
        if not results:
            raise ValueError("results must name a file (relative to the task's work directory)")
        self.watch, self.model_name, self.data_path = Path(watch).expanduser(), model, data
        self.batches, self.batch_size, self.context = batches, batch_size, context
        self.results, self.settle_s, self.poll_s, self.seed = results, settle_s, poll_s, seed
        self.device = torch.device("cpu")
        self.done_names: set[str] = set()
        """Checkpoints evaluated (their results are in the results file)."""
        self.skipped: set[str] = set()
        """Checkpoints that could not be loaded into ``model`` (left out, said in the log)."""
        self.latest: dict[str, float] = {}
        self.best_loss = math.inf
        self._base: Any = None
        self._held_out: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._results_path = Path(results)

    # -- setup --------------------------------------------------------------------

    async def setup(self, ctx: TaskContext) -> None:
        self.device = torch.device(ctx.torch_device)
        self._base, tokenizer = load_causal_lm(self.model_name, device=self.device, dtype=torch.float32, seed=self.seed)
        self._held_out = self._windows(tokenizer, self._base.config.vocab_size)
        self._results_path = ctx.workdir / self.results
        self._read_results()

    def _windows(self, tokenizer: Any, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The held-out batches: consecutive windows of the data's token stream, the same for every checkpoint."""
        need = self.batches * self.batch_size * (self.context + 1)
        if self.data_path:
            stream = token_stream(Path(self.data_path).expanduser(), tokenizer, at_least=self.context + 1)
            stream = stream.repeat(math.ceil(need / len(stream)))[:need]
        else:
            seed = sample_seed(self.seed, 31, 0)
            stream = counting_sequences(self.batches * self.batch_size, self.context + 1, vocab=vocab, seed=seed)
        windows = stream.view(self.batches, self.batch_size, self.context + 1).to(self.device)
        return [(w[:, :-1], w[:, 1:]) for w in windows]

    def _read_results(self) -> None:
        if not self._results_path.exists():
            return
        with open(self._results_path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                    self.done_names.add(str(record["checkpoint"]))
                    self.latest = {"loss": float(record["loss"]), "perplexity": float(record["perplexity"])}
                    self.best_loss = min(self.best_loss, float(record["loss"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a line torn by a kill: that checkpoint is evaluated again

    # -- the work -----------------------------------------------------------------

    async def arrivals(self) -> AsyncIterator[Path]:
        """New checkpoints, oldest first; waits for more when none is left."""
        while True:
            for path in checkpoints_in(self.watch, settle_s=self.settle_s):
                if path.name not in self.done_names and path.name not in self.skipped:
                    yield path
            await asyncio.sleep(self.poll_s)

    def read(self, path: Path) -> Any:
        """Checkpoint ``path`` read from storage: a model for a ``save_pretrained`` directory, else its state dict.

        Runs on the reader thread, never in a bubble's step.
        """
        if path.is_dir():
            model, _ = load_causal_lm(str(path), device=self.device, dtype=torch.float32)
            return model
        if path.name.endswith(".safetensors"):
            from safetensors.torch import load_file

            state: Any = load_file(str(path), device=str(self.device))
        else:
            state = torch.load(path, map_location=self.device, weights_only=True)
        if isinstance(state, dict) and isinstance(state.get("model"), dict):
            state = state["model"]  # {"model": ..., "optimizer": ...}, as training loops often save
        return state

    def load(self, path: Path) -> Any:
        """The model of checkpoint ``path``, read and loaded at once."""
        return self._model_of(self.read(path))

    def _model_of(self, read: Any) -> Any:
        if isinstance(read, torch.nn.Module):
            return read
        self._base.load_state_dict(read)
        return self._base

    def _after(self, path: Path) -> Path | None:
        """The checkpoint to read next, while ``path`` is evaluated (None: none is there yet)."""
        for later in checkpoints_in(self.watch, settle_s=self.settle_s):
            if later != path and later.name not in self.done_names and later.name not in self.skipped:
                return later
        return None

    async def run(self, gate: StepGate) -> None:
        ahead: tuple[Path, Future[Any]] | None = None
        """The next checkpoint, read while the one before is evaluated."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="freeride-eval-read") as reader:
            async for path in gate.idle_until(self.arrivals()):
                read = ahead[1] if ahead is not None and ahead[0] == path else reader.submit(self.read, path)
                try:
                    # read ahead and ready: loaded in a step, with no bubble given back to wait for storage
                    state = read.result() if read.done() else await gate.wait_for(asyncio.wrap_future(read))
                    async with gate.step("load"):
                        model = self._model_of(state)
                except (OSError, RuntimeError, ValueError) as exc:  # not this architecture's, or unreadable
                    logger.warning("[eval] %s: cannot load it, left out: %s", path.name, exc)
                    self.skipped.add(path.name)
                    ahead = None
                    continue
                following = self._after(path)
                ahead = None if following is None else (following, reader.submit(self.read, following))
                total, count = 0.0, 0
                for x, y in self._held_out:
                    async with gate.step("eval"):
                        with torch.inference_mode():
                            logits = model(x).logits
                            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
                            total += float(loss)
                            count += y.numel()
                self._record(path.name, total / count)
                gate.report(**self.metrics())
                del state, model

    def step(self) -> None:
        raise NotImplementedError("CheckpointEvaluation runs through run(): it waits for checkpoints")

    def _record(self, name: str, loss: float) -> None:
        perplexity = math.exp(min(loss, 700.0))
        self._results_path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"checkpoint": name, "loss": loss, "perplexity": perplexity, "time": time.time()})
        with open(self._results_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done_names.add(name)
        self.latest = {"loss": loss, "perplexity": perplexity}
        self.best_loss = min(self.best_loss, loss)
        logger.info("[eval] %s: loss %.4f, perplexity %.2f", name, loss, perplexity)

    def metrics(self) -> dict[str, float]:
        return {
            "evaluated": float(len(self.done_names)),
            "skipped": float(len(self.skipped)),
            "loss": self.latest.get("loss", math.nan),
            "perplexity": self.latest.get("perplexity", math.nan),
            "best_loss": self.best_loss,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"evaluated": sorted(self.done_names)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done_names |= set(state.get("evaluated", []))
