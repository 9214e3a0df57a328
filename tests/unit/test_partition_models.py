"""Hugging Face models and torch's own LSTM and Transformer partition as they are and train as plain steps do."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from _torchfix import deterministic_one_thread  # noqa: F401 - autouse fixture
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.modeling_outputs import ModelOutput

from freeride.partition import InferenceParts, PartitionedInference, PartitionedTraining, TrainingParts
from freeride.partition.values import flatten, rebuild
from freeride.sidetask import TaskContext

VOCAB, SEQ = 100, 16


def _gpt2() -> nn.Module:
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    return BertForMaskedLM(
        BertConfig(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
        )
    )


def _llama() -> nn.Module:
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(config)


def _lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), y.reshape(-1))


def _tokens(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(VOCAB, (2, SEQ), generator=g), torch.randint(VOCAB, (2, SEQ), generator=g)) for _ in range(n)
    ]


def _series(shape_x: tuple[int, ...], shape_y: tuple[int, ...], n: int = 2) -> list[tuple[Any, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(shape_x, generator=g), torch.randn(shape_y, generator=g)) for _ in range(n)]


def _seq2seq(n: int = 2) -> list[tuple[Any, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        ((torch.randn(2, SEQ, 32, generator=g), torch.randn(2, 8, 32, generator=g)), torch.randn(2, 8, 32))
        for _ in range(n)
    ]


class _Logits(nn.Module):
    """The wrapper a user writes first: fx traces it, and keeps the GPT-2 inside whole."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = _gpt2()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(tokens).logits


Case = tuple[Callable[[], nn.Module], Callable[[Any, torch.Tensor], torch.Tensor], Callable[[], list[Any]]]

CASES: dict[str, Case] = {
    "gpt2": (_gpt2, _lm_loss, _tokens),
    "bert": (_bert, _lm_loss, _tokens),
    "llama": (_llama, _lm_loss, _tokens),
    "lstm": (
        lambda: nn.LSTM(8, 16, 2, batch_first=True),
        lambda out, y: F.mse_loss(out[0], y),
        lambda: _series((2, SEQ, 8), (2, SEQ, 16)),
    ),
    "transformer": (lambda: nn.Transformer(32, 2, 1, 1, 64, batch_first=True), F.mse_loss, _seq2seq),
    "gpt2-logits": (_Logits, lambda out, y: F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1)), _tokens),
}


class _Task(PartitionedTraining):
    def __init__(self, model: nn.Module, loss_fn: Any, data: list[Any], *, target_ms: float = 0.05) -> None:
        super().__init__(target_ms=target_ms, profile_runs=1)
        self.parts = TrainingParts(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3), loss_fn, data)

    def build(self) -> TrainingParts:
        return self.parts


def _ctx() -> TaskContext:
    return TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=Path("."))


def _call(model: nn.Module, x: Any) -> Any:
    return model(*x) if type(x) is tuple else model(x)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_model_from_its_config_trains_in_pieces_as_plain_steps_do(case: str) -> None:
    make, loss_fn, data = CASES[case]
    torch.manual_seed(0)
    model = make()
    plain, before = copy.deepcopy(model), copy.deepcopy(model.state_dict())
    batches = data()
    task = _Task(model, loss_fn, batches)
    asyncio.run(task.setup(_ctx()))
    assert task.plan is not None and len(task.plan.forward) > 3 and len(task.plan.backward) > 3
    torch.manual_seed(7)  # dropout draws the same numbers in both
    while task.batches_done < len(batches):
        task.step()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, eps=1e-3)
    torch.manual_seed(7)
    for x, y in batches:
        plain.train()
        opt.zero_grad()
        loss_fn(_call(plain, x), y).backward()
        opt.step()
    for (name, got), want in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.values(), strict=True))


class _Pair(NamedTuple):
    hidden: torch.Tensor
    gate: torch.Tensor


@dataclasses.dataclass
class _Boxed:
    hidden: torch.Tensor
    gate: torch.Tensor


@dataclasses.dataclass
class _Output(ModelOutput):
    hidden: torch.Tensor | None = None
    gate: torch.Tensor | None = None


class _Encoder(nn.Module):
    def __init__(self, kind: type) -> None:
        super().__init__()
        self.kind, self.a, self.b = kind, nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Any:
        hidden, gate = self.a(x), torch.sigmoid(self.b(x))
        return self.kind(hidden=hidden, gate=gate)


class _Head(nn.Module):
    """Reads its input's fields by name and by position, as later code reads a model's output."""

    def __init__(self, kind: type) -> None:
        super().__init__()
        self.kind, self.proj = kind, nn.Linear(8, 8)

    def forward(self, enc: Any) -> Any:
        assert type(enc) is self.kind
        first = enc[0] if self.kind is not _Boxed else enc.hidden
        return self.kind(hidden=self.proj(first * enc.gate), gate=enc.gate)


class _Chain(nn.Module):
    def __init__(self, kind: type) -> None:
        super().__init__()
        self.enc, self.head = _Encoder(kind), _Head(kind)

    def forward(self, x: torch.Tensor) -> Any:
        return self.head(self.enc(x))


@pytest.mark.parametrize("kind", [_Pair, _Boxed, _Output], ids=["namedtuple", "dataclass", "ModelOutput"])
def test_an_output_keeps_its_type_across_piece_boundaries(kind: type) -> None:
    def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
        assert type(out) is kind
        return F.mse_loss(out.hidden + out.gate, y)

    torch.manual_seed(0)
    model = _Chain(kind)
    plain = copy.deepcopy(model)
    batches = _series((4, 8), (4, 8))
    task = _Task(model, loss_fn, batches, target_ms=0.001)  # a piece per node: the outputs cross boundaries
    asyncio.run(task.setup(_ctx()))
    while task.batches_done < 2:
        task.step()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, eps=1e-3)
    for x, y in batches:
        opt.zero_grad()
        loss_fn(plain(x), y).backward()
        opt.step()
    for got, want in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_containers_are_built_again_as_their_types_and_unchanged_ones_kept() -> None:
    t = torch.ones(2)
    value = [_Pair(t, t), _Boxed(t, t), _Output(hidden=t), OrderedDict(a=t), (t, {"b": t}), torch.Size([2])]
    doubled = rebuild(value, lambda v: v * 2 if isinstance(v, torch.Tensor) else v)
    assert [type(v) for v in doubled] == [type(v) for v in value]
    assert torch.equal(doubled[2].hidden, t * 2) and torch.equal(doubled[2][0], t * 2) and doubled[2].gate is None
    assert doubled[5] is value[5]  # nothing in it changed: the same object
    leaves, build, dropped = flatten({"out": _Output(hidden=t), "cache": object(), "n": 3})
    again = build([t + 1])
    assert len(leaves) == 1 and dropped == ["object"] and again["cache"] is None and again["n"] == 3
    assert type(again["out"]) is _Output and torch.equal(again["out"].hidden, t + 1)


class _Infer(PartitionedInference):
    def __init__(self, model: nn.Module, data: list[torch.Tensor]) -> None:
        super().__init__(target_ms=0.05, profile_runs=1)
        self.parts = InferenceParts(model, data)
        self.outputs: list[Any] = []

    def build(self) -> InferenceParts:
        return self.parts

    def consume(self, output: Any, batch: Any) -> None:
        self.outputs.append(output)


def test_a_hugging_face_model_infers_in_pieces_as_a_whole() -> None:
    torch.manual_seed(0)
    model = _bert()
    inputs = [x for x, _ in _tokens()]
    task = _Infer(model, inputs)
    asyncio.run(task.setup(_ctx()))
    while task.batches_done < len(inputs):
        task.step()
    model.eval()
    with torch.no_grad():
        for out, x in zip(task.outputs, inputs, strict=True):
            assert type(out).__name__ == "MaskedLMOutput"
            torch.testing.assert_close(out.logits, model(x).logits, rtol=1e-5, atol=1e-6)


def test_a_piece_that_stays_over_its_target_is_logged_with_its_module_and_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    make, loss_fn, data = CASES["lstm"]
    model = make()
    with caplog.at_level(logging.INFO, logger="freeride.partition"):
        asyncio.run(_Task(model, loss_fn, data(), target_ms=1e-6).setup(_ctx()))  # no operation takes 1 ns
    said = caplog.text
    assert "torch.fx cannot trace its forward (TraceError: symbolically traced variables" in said
    assert "exported by torch.export instead" in said
    assert "LSTM:lstm stays over the target:" in said and " ms forward, " in said


class _ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) if x.sum() > 0 else -self.fc(x)


def test_a_model_neither_tracer_takes_is_refused_with_both_causes() -> None:
    model = _ValueBranch()
    task = _Task(model, F.mse_loss, _series((2, 4), (2, 4)))
    with pytest.raises(ValueError) as info:
        asyncio.run(task.setup(_ctx()))
    message = str(info.value)
    assert "torch.fx cannot trace its forward (TraceError: symbolically traced variables" in message
    assert "nor torch.export export it (" in message
