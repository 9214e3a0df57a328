"""`freeride sim` and `freeride demo` build one SimConfig from the same flags.

The demo once copied SimConfig's fields into its own options and lost
``--chunks``: ``freeride demo --schedule interleaved --chunks 2`` ran with one
chunk. These tests give every sim flag a non-default value and check the
config that reaches the simulated pipeline, with a stand-in pipeline (and, for
the demo, a stand-in manager) so no process starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self

import pytest

import freeride.backends.sim
import freeride.cli.demo
from freeride import protocol as p
from freeride.backends.sim import SimConfig, StageResult
from freeride.cli.main import main
from freeride.serve.config import ServeConfig
from freeride.transport import Endpoints

SIM_FLAGS = [
    "--schedule", "interleaved", "--stages", "3", "--microbatches", "6", "--chunks", "2",
    "--steps", "7", "--forward", "3ms", "--backward", "5ms", "--compute", "spin",
]  # fmt: skip
EXPECTED = SimConfig(
    endpoint="",
    schedule="interleaved",
    num_stages=3,
    num_microbatches=6,
    num_chunks=2,
    steps=7,
    forward_s=0.003,
    backward_s=0.005,
    compute="spin",
)


class _FakePipeline:
    """Records the config it was built with; its stages finish at once."""

    configs: ClassVar[list[SimConfig]] = []

    def __init__(self, config: SimConfig) -> None:
        self.configs.append(config)

    def start(self) -> Self:
        return self

    def join(self) -> list[StageResult]:
        return []

    def terminate(self) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _FakeManager:
    """The part of Manager the demo drives, with no sockets and no workers."""

    instances: ClassVar[list[_FakeManager]] = []

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.devices: list[tuple[str, int, list[int]]] = []
        self.specs: list[p.TaskSpec] = []
        self.tasks: dict[int, object] = {}
        self.instances.append(self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        pass

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()

    def declare_device(self, name: str, *, stage: int, spare_memory: int, cpu_affinity: list[int]) -> None:
        self.devices.append((name, stage, cpu_affinity))

    def submit(self, spec: p.TaskSpec) -> p.Submitted:
        self.specs.append(spec)
        return p.Submitted(task_id=len(self.specs), device=spec.device)

    def live_backends(self) -> list[int]:
        return []

    def status(self) -> p.StatusReply:
        latency = p.LatencySummary(count=0, p50_ns=0, p99_ns=0, max_ns=0)
        return p.StatusReply(devices=[], tasks=[], latency=latency, events=0, rejected_frames=0, uptime_ns=0)


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_FakePipeline, "configs", [])
    monkeypatch.setattr(_FakeManager, "instances", [])
    monkeypatch.setattr(freeride.backends.sim, "SimPipeline", _FakePipeline)
    monkeypatch.setattr(freeride.cli.demo, "SimPipeline", _FakePipeline)
    monkeypatch.setattr(freeride.cli.demo, "Manager", _FakeManager)


@pytest.mark.usefixtures("fakes")
def test_sim_flags_reach_the_pipeline(tmp_path: Path) -> None:
    assert main(["sim", "--runtime-dir", str(tmp_path), *SIM_FLAGS]) == 0
    (config,) = _FakePipeline.configs
    assert config.endpoint == Endpoints.ipc(tmp_path).events
    assert dataclasses.replace(config, endpoint="") == EXPECTED


@pytest.mark.usefixtures("fakes")
def test_demo_flags_reach_the_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    # the stand-in manager reports no devices, so the demo's verdict is "not ok" (exit 1)
    assert main(["demo", *SIM_FLAGS, "--task", "pagerank", "--opt", "nodes=100"]) == 1
    (config,) = _FakePipeline.configs
    (manager,) = _FakeManager.instances
    assert config.endpoint == manager.config.endpoints.events
    assert dataclasses.replace(config, endpoint="") == EXPECTED
    assert [stage for _, stage, _ in manager.devices] == [0, 1, 2]
    assert [spec.target for spec in manager.specs] == ["freeride.sidetasks.pagerank:PageRank"] * 3
    assert all(spec.options == {"nodes": 100} for spec in manager.specs)
    assert "3 stages x 6 micro-batches x 2 chunks, 7 steps (spin compute)" in capsys.readouterr().out


def test_demo_defaults_are_a_valid_sim() -> None:
    options = freeride.cli.demo.DemoOptions()
    # 60 steps: the 7 held-back / harvested pairs a 95 % interval of the cost needs (2-step blocks, 1 in 4 held)
    assert options.sim.num_chunks == 1
    assert (options.sim.forward_s, options.sim.backward_s, options.sim.steps) == (0.010, 0.020, 60)


@pytest.mark.usefixtures("fakes")
def test_demo_gives_another_task_no_options_of_the_default_task() -> None:
    # graph-sgd's default eval_every would be an unknown keyword to any other task
    assert main(["demo", *SIM_FLAGS, "--task", "transformer-lm"]) == 1
    (manager,) = _FakeManager.instances
    assert [spec.options for spec in manager.specs] == [{}] * 3
