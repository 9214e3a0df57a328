"""The training scripts' options: one shared set (tools/train/_args.py), and each script's own.

The scripts live in tools/train and import their helpers as sibling modules, so
they are imported with that directory on sys.path.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from types import ModuleType

import pytest

TRAIN_DIR = Path(__file__).resolve().parents[2] / "tools" / "train"
SCRIPTS = ["deepspeed_gpt", "megatron_gpt"]


@pytest.fixture(params=SCRIPTS)
def script(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(TRAIN_DIR))
    return importlib.import_module(request.param)


def test_both_scripts_take_the_shared_flags_with_the_same_defaults(script: ModuleType) -> None:
    common = importlib.import_module("_args").CommonArgs
    args = script.parse_args([])
    assert isinstance(args, common)
    shared = {f.name: getattr(args, f.name) for f in dataclasses.fields(common)}
    assert shared == {
        "steps": 10, "micro_batches": 4, "micro_batch_size": 4, "layers": 4, "hidden": 64, "heads": 4,
        "seq": 32, "vocab": 128, "compute": "matmul", "sleep_forward_ms": 5.0, "sleep_backward_ms": 10.0,
        "seed": 1234, "lr": 1e-3, "device": "cpu", "recv_timers": False, "jsonl": "", "spawn": 0, "attach": False,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "steps must be >= 1, got 0"),
        (["--vocab", "1"], "vocab must be >= 2, got 1"),
        (["--hidden", "10", "--heads", "3"], "hidden (10) must be a multiple of heads (3)"),
        (["--sleep-forward-ms", "-1"], "sleep_forward_ms and sleep_backward_ms must be >= 0"),
        (["--spawn", "-1"], "spawn must be >= 0, got -1"),
    ],
)
def test_both_scripts_reject_bad_shared_options_alike(
    script: ModuleType, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(message)


def test_deepspeed_options(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(TRAIN_DIR))
    ds = importlib.import_module("deepspeed_gpt")
    args = ds.parse_args(["--stages", "4", "--layers", "8", "--gradient-clipping", "0.5", "--local_rank", "1"])
    assert (args.stages, args.layers, args.gradient_clipping) == (4, 8, 0.5)
    with pytest.raises(SystemExit):
        ds.parse_args(["--layers", "3"])
    assert capsys.readouterr().err.strip().endswith("layers (3) must be a multiple of stages (2)")
    assert ds.parse_args([]).schedule == "1f1b"
    assert ds.parse_args([]).shm_op and not ds.parse_args(["--no-shm-op"]).shm_op
    assert ds.parse_args(["--schedule", "dualpipev"]).schedule == "dualpipev"  # 4 layers, 4 micro-batches, 2 stages
    with pytest.raises(SystemExit):
        ds.parse_args(["--schedule", "dualpipev", "--layers", "6"])
    assert capsys.readouterr().err.strip().endswith("layers (6) must be a multiple of 2 * stages (4)")
    with pytest.raises(SystemExit):
        ds.parse_args(["--schedule", "dualpipev", "--micro-batches", "3"])
    assert capsys.readouterr().err.strip().endswith("micro_batches (3) must be >= 2 * stages (4) for dualpipev")


def test_megatron_options(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(TRAIN_DIR))
    mg = importlib.import_module("megatron_gpt")
    assert (mg.parse_args([]).schedule, mg.parse_args([]).vpp) == ("1f1b", 1)
    args = mg.parse_args(["--schedule", "interleaved", "--overlap-p2p"])
    assert (args.schedule, args.vpp, args.overlap_p2p) == ("interleaved", 2, True)
    with pytest.raises(SystemExit):
        mg.parse_args(["--vpp", "2"])
    assert capsys.readouterr().err.strip().endswith("vpp and overlap_p2p need --schedule interleaved")
