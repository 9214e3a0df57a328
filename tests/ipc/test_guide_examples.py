"""Every example of docs/writing-side-tasks.md, run the way the guide says.

Alone (``python docs/examples/X.py``, which runs the task with ``run_alone``);
the pi and packing tasks submitted by file path through the CLI, the packing
one as a filler, under a real manager with a simulated pipeline; the
imperative program submitted with the guide's options, twice, the second run
going on from what the first left in its working directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType

import pytest
from _quiet import OtherWork, require_quiet
from conftest import wait_until

from freeride.backends.sim import SimConfig, SimPipeline
from freeride.serve.manager import Manager
from freeride.sidetask import TaskContext, TaskStopped, UnboundedGate, run_alone

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
PATTERN = r"step (?P<step>\d+) loss (?P<loss>[\d.]+)"  # as in the guide


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("pi_estimate", "pi ~ 3.1"),
        ("packing_task", "sum of squares below 100000: 333328333350000"),
        ("spool_consumer", "['0.txt', '1.txt', '2.txt', '3.txt']"),
        ("partitioned_cnn", "for 24 batches; loss 0."),  # below ln 4 = 1.39: it learned
        ("partitioned_gpt2", "12 batches; loss "),
    ],
)
def test_an_iterative_example_runs_alone(name: str, says: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py")], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert says in done.stdout


async def test_pi_resumed_from_its_checkpoint_draws_what_an_uninterrupted_run_draws() -> None:
    pi = example("pi_estimate")
    whole, first, again = (pi.PiEstimate(batch=1000, seed=3) for _ in range(3))
    await run_alone(whole, steps=20)
    await run_alone(first, steps=10)
    await again.setup(TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=Path.cwd()))
    again.load_state_dict(first.state_dict())  # the lifecycle's order: after setup
    with pytest.raises(TaskStopped):
        await again.run(UnboundedGate(max_steps=10))
    assert (again.hits, again.total) == (whole.hits, whole.total)


def test_the_packing_task_offers_the_largest_piece_that_fits() -> None:
    task = example("packing_task").SumOfSquares(n=10_000, chunk=4096, min_piece=256)
    known = {"": 4_000_000}  # a whole chunk takes 4 ms; no piece measured yet
    assert task.fit_piece(5_000_000, lambda kind: known.get(kind, -1)) == ""
    assert task.fit_piece(1_100_000, lambda kind: known.get(kind, -1)) == "piece1024"
    assert task.step_kind() == "piece1024"
    task.step()
    assert (task.next, task.total) == (1024, sum(i * i for i in range(1024)))
    assert task.fit_piece(100_000, lambda kind: known.get(kind, -1)) is None  # not even 256 numbers fit
    assert task.step_kind() == "piece1024"  # the pending piece stays


@contextlib.asynccontextmanager
async def pipeline(manager: Manager) -> AsyncIterator[str]:
    """A simulated two-stage pipeline training until the block ends; yields stage 0's device."""
    config = SimConfig(endpoint=manager.config.endpoints.events, steps=100_000, forward_s=0.005, backward_s=0.010)
    sim = SimPipeline(config).start()
    try:
        yield config.device(0)
    finally:
        sim.terminate()


async def submit(runtime_dir: Path, *args: str, cwd: Path = ROOT) -> int:
    """``freeride submit ARGS`` as a separate process, as a user runs it; the new task's id."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "freeride.cli",
        "submit",
        "--runtime-dir",
        str(runtime_dir),
        "--wait",
        "0",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
    )
    async with asyncio.timeout(90):
        out, err = await proc.communicate()
    assert proc.returncode == 0, (out.decode(), err.decode())
    return int(out.decode().split()[1])


async def test_pi_and_a_packing_filler_submitted_by_file_path_share_a_stages_bubbles(
    manager: Manager, runtime_dir: Path
) -> None:
    async with pipeline(manager) as device:
        await wait_until(lambda: device in manager.schedulers, 30, "the pipeline's devices")
        pi = await submit(
            runtime_dir, "docs/examples/pi_estimate.py:PiEstimate", "--opt", "batch=20000", "--device", device
        )
        filler = await submit(runtime_dir, "docs/examples/packing_task.py:SumOfSquares", "--fill", "--device", device)
        tasks = manager.tasks[pi], manager.tasks[filler]
        # The filler only gets what pi leaves of a bubble (its tail): a few steps show it packs beside pi.
        # Where other work takes the cores, pi's steps wait for a core past the bubbles' ends and leave
        # no tail (one busy loop beside the test: 1 filler step in 180 s, 4 in 40 s): skipped, saying so.
        other = OtherWork()
        try:
            await wait_until(lambda: tasks[0].steps >= 20 and tasks[1].steps >= 5, 90, "both tasks to step in bubbles")
        except AssertionError as exc:
            require_quiet(other.share(), "a filler in the tails of pi's bubbles")
            margin = manager.schedulers[device].guard.margin_ns
            seen = [(t.state, t.steps, t.estimate_ns, t.packs, t.error) for t in tasks]
            raise AssertionError(f"{exc}: (state, steps, estimate, packs, error) {seen}, margin {margin} ns") from None
        await wait_until(lambda: "pi" in tasks[0].metrics, 60, "pi's metric in status")
    assert tasks[1].spec.fill and not tasks[0].spec.fill
    assert abs(tasks[0].metrics["pi"] - 3.14159) < 0.1


async def test_the_imperative_example_runs_as_the_guide_submits_it_and_goes_on_from_its_own_state(
    manager: Manager, runtime_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "runs" / "count").mkdir(parents=True)
    program = str(EXAMPLES / "count_program.py")
    options = ("--imperative", "--name", "count", "--cwd", "runs/count", "--progress-pattern", PATTERN)
    async with pipeline(manager) as device:
        await wait_until(lambda: device in manager.schedulers, 30, "the pipeline's devices")
        first = manager.tasks[
            await submit(
                runtime_dir, *options, "--device", device, "--", sys.executable, program, "--steps", "200", cwd=tmp_path
            )
        ]
        await wait_until(lambda: first.state == "finished", 120, "the program to finish in bubbles")
        again = manager.tasks[
            await submit(
                runtime_dir, *options, "--device", device, "--", sys.executable, program, "--steps", "210", cwd=tmp_path
            )
        ]
        await wait_until(lambda: again.state == "finished", 120, "the program to finish again")
    assert first.steps == 200 and first.metrics["loss"] == pytest.approx(1 / 200)
    assert again.steps == 210  # it printed steps 201..210 only: it went on from count.state
    assert (tmp_path / "runs" / "count" / "count.state").read_text() == "210"
    out = next(manager.config.log_dir.glob(f"task-{again.task_id}-*.out")).read_text()
    assert out.splitlines()[0] == "step 201 loss 0.004975"
