"""FreeRide must not change training: same losses, same speed, with or without a manager.

Runs the same seeded 2-stage DeepSpeed job (real matmul compute on CPU) without
FreeRide and under FreeRide's hooks with no manager listening; then once more
with a manager that is SIGKILLed mid-run.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _deepspeed import TrainRun, plain_env, run_alone, run_training, train_cmd

from freeride import protocol as p
from freeride.backends.launch import launch_env
from freeride.backends.session import ENV_EVENTS
from freeride.transport import Endpoints

pytestmark = pytest.mark.slow

STEPS = 12

# A stand-in manager: binds the events endpoint, reports each bubble's step, never answers.
RECEIVER = """
import asyncio, sys
from freeride import protocol as p
from freeride.transport import new_async_context
from _events import EventTap  # follows the rank's bubble publisher, as a manager would

async def main():
    receiver = EventTap(new_async_context(), sys.argv[1])
    print("ready", flush=True)
    while True:
        event = await receiver.recv()
        if isinstance(event, p.BubbleStarted):
            print("bubble", event.step, flush=True)

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def runtime() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="frdt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def runs(runtime: Path) -> tuple[TrainRun, TrainRun]:
    """(without FreeRide, hooked with no manager), same seed and data."""
    cmd = train_cmd("--compute", "matmul", "--steps", str(STEPS), "--seed", "7")
    alone = run_alone(cmd)
    assert alone.returncode == 0, alone.explain()
    nobody = Endpoints.ipc(runtime / "nobody").events  # nothing is bound there
    hooked = asyncio.run(run_training(cmd, env=launch_env(plain_env(), events=nobody)))
    assert hooked.returncode == 0, hooked.explain()
    return alone, hooked


def test_losses_are_identical_with_freeride_attached(runs: tuple[TrainRun, TrainRun]) -> None:
    alone, hooked = runs
    for rank in (0, 1):
        assert len(alone.losses(rank)) == STEPS
        assert hooked.losses(rank) == alone.losses(rank)
    assert alone.losses(0)[-1] < alone.losses(0)[0]  # it does train


def test_hooked_without_manager_is_not_slower(runs: tuple[TrainRun, TrainRun]) -> None:
    alone, hooked = runs
    # generous: the machine is shared; the benchmark measures the real overhead
    for rank in (0, 1):
        assert hooked.median_step_ms(rank) <= 1.5 * alone.median_step_ms(rank) + 2.0


async def test_explicit_attach_without_the_launcher(runtime: Path) -> None:
    (runtime / "attach").mkdir(exist_ok=True)
    events = Endpoints.ipc(runtime / "attach").events
    steps = 6
    env = {**plain_env(), ENV_EVENTS: events}  # where the manager is; no import hook
    run = await run_training(train_cmd("--compute", "sleep", "--steps", str(steps), "--attach"), env=env, events=events)
    assert run.returncode == 0, run.explain()
    for rank in (0, 1):
        assert [e.step for e in run.of(p.StepFinished, rank)] == list(range(steps))
        assert {e.step for e in run.of(p.BubbleStarted, rank)} == set(range(1, steps))
        assert len(run.of(p.Goodbye, rank)) == 1  # handle.close() says goodbye once


async def test_training_survives_a_manager_killed_mid_run(runtime: Path) -> None:
    events = Endpoints.ipc(runtime / "killed").events
    (runtime / "killed").mkdir(exist_ok=True)
    env = plain_env()
    receiver = await asyncio.create_subprocess_exec(
        sys.executable, "-c", RECEIVER, events, env={**env, "PYTHONPATH": str(Path(__file__).parent)},
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert receiver.stdout is not None
    try:
        async with asyncio.timeout(30):
            assert (await receiver.stdout.readline()).strip() == b"ready"
        steps = 16
        cmd = train_cmd("--compute", "sleep", "--steps", str(steps))
        training = asyncio.create_task(run_training(cmd, env=launch_env(plain_env(), events=events)), name="training")
        async with asyncio.timeout(300):
            line = await receiver.stdout.readline()
        assert line.startswith(b"bubble"), line
        killed_at = int(line.split()[1])
        os.kill(receiver.pid, signal.SIGKILL)
        await receiver.wait()
        run = await training
    finally:
        if receiver.returncode is None:
            receiver.kill()
            await receiver.wait()
    assert run.returncode == 0, run.explain()
    assert killed_at < steps - 4  # the kill happened with most of the run still to go
    for rank in (0, 1):
        records = run.steps(rank)
        assert [r["step"] for r in records] == list(range(steps))
        before = [r["step_ms"] for r in records[2 : killed_at + 1]] or [records[2]["step_ms"]]
        after = [r["step_ms"] for r in records[killed_at + 2 :]]
        assert max(after) <= 1.5 * max(before) + 20.0
