"""Megatron-core on CPU, real gloo ranks: the finalize tail, evaluation calls and pipeline size 1.

One two-rank launch (1F1B, sleep compute, a ``finalize_model_grads_func``, a
forward-only evaluation call after every second step) is checked several ways
against the script's own ground truth: megatron's ``config.timers`` hooks
around its receives and the script's timing of its finalize call, neither of
which FreeRide uses. A plain launch of the same job gives the results FreeRide
must not change. Pipeline size 1 runs as one rank, with and without FreeRide.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _events import EventTap
from _quiet import quietest, require_quiet

from freeride import protocol as p
from freeride.backends.launch import launch_env
from freeride.profile import read_observations
from freeride.transport import new_async_context

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train" / "megatron_gpt.py"
MS = 1_000_000
TIMEOUT_S = 300
STEPS, EVAL_EVERY = 10, 2
SETTLED = 3
"""Training steps left out of comparisons: the first has no measurements, the next ones fill the history."""
JOB = ["--steps", str(STEPS), "--compute", "sleep", "--micro-batches", "4", "--recv-timers"]
GAPS_JOB = ["--spawn", "2", *JOB, "--finalize", "--eval-every", str(EVAL_EVERY)]
SINGLE_JOB = ["--spawn", "1", *JOB, "--steps", "4", "--eval-every", "2", "--log-level", "info"]


@dataclass
class Run:
    """What one training launch produced."""

    steps: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """Per rank, its training records in step order."""
    evals: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """Per rank, its evaluation records in order."""
    done: dict[int, dict[str, Any]] = field(default_factory=dict)
    events: list[p.BackendEvent] = field(default_factory=list)
    stderr: str = ""
    profile: Path | None = None
    """Where the ranks wrote their observations (profile mode)."""
    other_work: float = 0.0
    """The share of the cores' time other work took during the run (see ``_quiet``)."""

    def results(self) -> list[tuple[int, int, bool, Any, Any]]:
        """Every (rank, step, eval, loss, grad norm) the job computed."""
        rows = [
            (rank, int(r["step"]), bool(r.get("eval")), r["loss"], r.get("grad_norm"))
            for records in (self.steps, self.evals)
            for rank, rank_records in records.items()
            for r in rank_records
        ]
        return sorted(rows)

    def bubbles(self, rank: int) -> list[tuple[p.BubbleStarted, p.BubbleEnded]]:
        ends = {(e.step, e.index): e for e in self.events if isinstance(e, p.BubbleEnded) and e.rank == rank}
        return [
            (s, ends[(s.step, s.index)])
            for s in self.events
            if isinstance(s, p.BubbleStarted) and s.rank == rank and (s.step, s.index) in ends
        ]


def _parse(run: Run, stdout: str) -> None:
    for line in stdout.splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if record.get("done"):
            run.done[int(record["rank"])] = record
        elif "step" in record:
            into = run.evals if record.get("eval") else run.steps
            into.setdefault(int(record["rank"]), []).append(record)
    for records in (*run.steps.values(), *run.evals.values()):
        records.sort(key=lambda r: int(r["step"]))


async def _collect(receiver: EventTap, run: Run, ranks: int) -> None:
    goodbyes: set[int] = set()
    while len(goodbyes) < ranks:
        event = await receiver.recv()
        if not isinstance(event, p.Hello | p.BubbleStarted | p.BubbleEnded | p.StepFinished | p.Heartbeat | p.Goodbye):
            raise AssertionError(f"undecodable frame from a rank: {event}")
        run.events.append(event)
        if isinstance(event, p.Goodbye):
            goodbyes.add(event.rank)


async def launch(args: list[str], env: Mapping[str, str], *, ranks: int, events: str | None = None) -> Run:
    """Run the training script; with ``events``, bind a PULL socket there first and collect until every Goodbye."""
    run = Run()
    ctx = new_async_context()
    receiver = EventTap(ctx, events) if events is not None else None
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(SCRIPT),
            *args,
            env=dict(env),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            async with asyncio.timeout(TIMEOUT_S):
                collector = None
                if receiver is not None:
                    collector = asyncio.create_task(_collect(receiver, run, ranks), name="collect")
                out, err = await proc.communicate()
                if collector is not None:
                    await collector  # every Goodbye was sent before the ranks exited
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
    finally:
        if receiver is not None:
            receiver.close()
        ctx.term()
    run.stderr = err.decode()
    _parse(run, out.decode())
    assert proc.returncode == 0, f"training failed ({proc.returncode}):\n{run.stderr[-4000:]}"
    assert sorted(run.steps) == list(range(ranks)), run.stderr[-4000:]
    return run


def plain_env() -> dict[str, str]:
    """The environment without any FreeRide hook."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FREERIDE_")}
    env["PYTHONPATH"] = os.pathsep.join(
        x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x and "_autoload" not in x
    )
    return env


@pytest.fixture(scope="module")
def short_dir() -> Iterator[Path]:
    """Runtime directory of the module's launches (ipc paths must stay short)."""
    path = Path(tempfile.mkdtemp(prefix="frgap-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def gaps_run(short_dir: Path) -> Run:
    """The two-rank job with FreeRide attached (profile mode), its events collected; made again once if
    other work took the cores meanwhile (the announcements' checks are of timing precision)."""

    def attempt(i: int) -> Run:
        endpoint = f"ipc://{short_dir}/ev{i}"
        profile = short_dir / f"profile{i}"
        env = launch_env(plain_env(), events=endpoint, mode="profile", profile_dir=profile)
        run = asyncio.run(launch(GAPS_JOB, env, ranks=2, events=endpoint))
        run.profile = profile
        return run

    run, run.other_work = quietest(attempt)
    return run


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


def _check_announced(
    bubbles: list[tuple[p.BubbleStarted, p.BubbleEnded]], waits: list[tuple[int, int]], what: str
) -> None:
    """The long ``waits`` lie in announced bubbles, each predicted as long as it lasted (erring low)."""
    long_waits = [(a, a + d) for a, d in waits if d >= 5 * MS]
    assert long_waits, f"{what}: no long wait to announce"
    hits = [(s, e) for s, e in bubbles if any(_overlap(s.t_ns, e.t_ns, a, b) for a, b in long_waits)]
    covered = sum(_overlap(s.t_ns, e.t_ns, a, b) for s, e in hits for a, b in long_waits)
    total = sum(b - a for a, b in long_waits)
    assert covered >= 0.8 * total, f"{what}: bubbles cover {covered / total:.0%} of the long waits"
    measured = sum(e.duration_ns for _, e in hits)
    expected = sum(s.expected_ns for s, _ in hits)
    assert expected <= 1.10 * measured, f"{what}: expected {expected} vs measured {measured}"
    ratios = sorted(s.expected_ns / max(1, e.duration_ns) for s, e in hits)
    assert statistics.median(ratios) >= 0.6, f"{what}: predicted / measured per bubble {ratios}"


def test_finalize_tail_is_announced_where_the_last_stage_waits(gaps_run: Run) -> None:
    """The last stage ends each step waiting in the finalize all-reduce for stage 0's last backward."""
    last = gaps_run.steps[1][SETTLED:]
    finalize = [tuple(r["finalize"]) for r in last]
    assert all(d >= 5 * MS for _, d in finalize), f"the last stage hardly waited in finalize: {finalize}"
    require_quiet(gaps_run.other_work, "the finalize tail's announcements")
    _check_announced(gaps_run.bubbles(1), finalize, "finalize of rank 1")
    # stage 0 runs the last backward: in its finalize it waits only for the all-reduce itself
    first = [tuple(r["finalize"]) for r in gaps_run.steps[0][SETTLED:]]
    at_0 = [(s, e) for s, e in gaps_run.bubbles(0) if any(_overlap(s.t_ns, e.t_ns, a, a + d) for a, d in first)]
    assert all(s.expected_ns < 5 * MS for s, _ in at_0), f"rank 0 announced long bubbles in its finalize: {at_0}"


def test_evaluation_calls_are_announced_with_their_own_plan(gaps_run: Run) -> None:
    """Forward-only calls: the last stage waits for stage 0's first forward, and that is what is announced."""
    evals = gaps_run.evals[1]
    assert len(evals) == STEPS // EVAL_EVERY
    finished = [e for e in gaps_run.events if isinstance(e, p.StepFinished)]
    assert sorted(e.rank for e in finished) == [0] * 15 + [1] * 15  # 10 training and 5 evaluation calls
    # the profile describes training steps only
    assert gaps_run.profile is not None
    observations = read_observations(gaps_run.profile)
    assert [o.rank for o in observations] == [0, 1]
    assert all(len(o.steps) == STEPS for o in observations)
    require_quiet(gaps_run.other_work, "the evaluation calls' announcements")
    waits = [(int(a), int(d)) for r in evals for a, d in r["recv"]]
    _check_announced(gaps_run.bubbles(1), waits, "evaluation of rank 1")
    # training's plan kept working after the evaluation calls (each call has its own plan)
    assert "no longer announced" not in gaps_run.stderr


def test_training_and_evaluation_results_are_unchanged(gaps_run: Run) -> None:
    baseline = asyncio.run(launch(GAPS_JOB, plain_env(), ranks=2))
    assert gaps_run.results() == baseline.results()
    assert len(baseline.results()) == 2 * (STEPS + STEPS // EVAL_EVERY)
    assert all(stats["freeride"]["steps"] == STEPS + STEPS // EVAL_EVERY for stats in gaps_run.done.values())


def test_pipeline_size_one_attaches_says_so_and_trains_unchanged(short_dir: Path) -> None:
    endpoint = f"ipc://{short_dir}/ev1"
    run = asyncio.run(launch(SINGLE_JOB, launch_env(plain_env(), events=endpoint), ranks=1, events=endpoint))
    hellos = [e for e in run.events if isinstance(e, p.Hello)]
    assert hellos and {(h.rank, h.stage, h.num_stages, h.framework) for h in hellos} == {(0, 0, 1, "megatron")}
    assert not [e for e in run.events if isinstance(e, p.BubbleStarted | p.BubbleEnded | p.StepFinished)]
    lines = [line for line in run.stderr.splitlines() if "[attach]" in line]
    assert len(lines) == 1 and "pipeline size 1" in lines[0] and "no pipeline bubbles" in lines[0], lines
    stats = run.done[0]["freeride"]
    assert stats["steps"] == 0 and stats["sent"] >= 1, stats  # nothing tracked; its Hello went out
    baseline = asyncio.run(launch(SINGLE_JOB, plain_env(), ranks=1))
    assert run.results() == baseline.results() and len(run.results()) == 4 + 2


def test_profile_of_a_job_without_pipeline_says_so_and_stops_it(short_dir: Path) -> None:
    """``freeride profile`` on a pipeline-size-1 job: no profile, one line why, the job stopped, not run out."""
    out = short_dir / "single.json"
    job = [sys.executable, str(SCRIPT), "--spawn", "1", *JOB, "--steps", "100000"]  # hours, unless stopped
    cmd = [sys.executable, "-m", "freeride.cli", "profile", "--runtime-dir", str(short_dir), "--out", str(out)]
    done = subprocess.run([*cmd, "--", *job], env=plain_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "pipeline size 1: it has no pipeline bubbles, so no profile written; the job was stopped" in done.stderr
    assert not out.exists()
