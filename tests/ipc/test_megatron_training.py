"""Megatron-core training on CPU with FreeRide attached: real ranks, real waits.

Each test launches ``tools/train/megatron_gpt.py`` as two gloo ranks (one
pinned core each) and, where it needs them, collects the ranks' bubble events
on a PULL socket bound by the test. The ground truth for waits is megatron's
own ``config.timers`` hooks around its p2p calls (``--recv-timers``), which
FreeRide does not use.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _events import EventTap
from _quiet import quietest_async, require_quiet

from freeride import protocol as p
from freeride.backends.launch import launch_env
from freeride.backends.megatron.plan import iterations, megatron_schedule
from freeride.backends.schedule import Durations
from freeride.backends.session import ENV_EVENTS
from freeride.backends.tracker import schedule_priors
from freeride.profile import RankObservations, read_observations
from freeride.transport import new_async_context

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "train" / "megatron_gpt.py"
MS = 1_000_000
RANKS = 2
TIMEOUT_S = 300


@dataclass
class Run:
    """What one training launch produced."""

    steps: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """Per rank, its per-step JSON records in step order."""
    done: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Per rank, its final JSON record."""
    events: list[p.BackendEvent] = field(default_factory=list)
    returncode: int = -1
    stdout: str = ""
    stderr: str = ""

    def losses(self) -> list[float]:
        return [float(r["loss"]) for rank in self.steps.values() for r in rank if r["loss"] is not None]

    def bubbles(self, rank: int) -> list[tuple[p.BubbleStarted, p.BubbleEnded]]:
        ends = {(e.step, e.index): e for e in self.events if isinstance(e, p.BubbleEnded) and e.rank == rank}
        return [
            (s, ends[(s.step, s.index)])
            for s in self.events
            if isinstance(s, p.BubbleStarted) and s.rank == rank and (s.step, s.index) in ends
        ]


def train_args(*extra: str, steps: int = 8, compute: str = "sleep") -> list[str]:
    return [
        "--spawn",
        str(RANKS),
        "--steps",
        str(steps),
        "--compute",
        compute,
        "--micro-batches",
        "4",
        "--recv-timers",
        *extra,
    ]


def _parse(run: Run) -> None:
    for line in run.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if "step" in record:
                run.steps.setdefault(int(record["rank"]), []).append(record)
            elif record.get("done"):
                run.done[int(record["rank"])] = record
    for records in run.steps.values():
        records.sort(key=lambda r: int(r["step"]))


async def _collect(receiver: EventTap, run: Run, goodbyes: asyncio.Event, kill_after: int | None) -> None:
    seen: set[int] = set()
    while len(seen) < RANKS:
        event = await receiver.recv()
        if not isinstance(event, p.Hello | p.BubbleStarted | p.BubbleEnded | p.StepFinished | p.Heartbeat | p.Goodbye):
            raise AssertionError(f"undecodable frame from a rank: {event}")
        run.events.append(event)
        if isinstance(event, p.Goodbye):
            seen.add(event.rank)
        if kill_after is not None and len(run.events) >= kill_after:
            receiver.close()  # the "manager" dies: nobody listens any more
            return
    goodbyes.set()


async def launch(
    args: list[str],
    env: Mapping[str, str],
    *,
    events: str | None = None,
    kill_after: int | None = None,
) -> Run:
    """Run the training script; with ``events``, bind a PULL socket there first and collect."""
    run = Run()
    ctx = new_async_context()
    receiver = EventTap(ctx, events) if events is not None else None
    goodbyes = asyncio.Event()
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
                    collector = asyncio.create_task(_collect(receiver, run, goodbyes, kill_after), name="collect")
                out, err = await proc.communicate()
                if collector is not None:
                    if kill_after is None:
                        await collector  # every Goodbye was sent before the ranks exited
                    else:
                        collector.cancel()
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
    finally:
        if receiver is not None:
            receiver.close()
        ctx.term()
    run.returncode = proc.returncode if proc.returncode is not None else -1
    run.stdout = out.decode()
    run.stderr = err.decode()
    _parse(run)
    assert run.returncode == 0, f"training failed ({run.returncode}):\n{run.stderr[-4000:]}"
    assert sorted(run.steps) == list(range(RANKS)), run.stderr[-4000:]
    return run


def plain_env() -> dict[str, str]:
    """The environment without any FreeRide hook."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FREERIDE_")}
    env["PYTHONPATH"] = os.pathsep.join(
        x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x and "_autoload" not in x
    )
    return env


# --------------------------------------------------------------------------
# bubbles: positions and totals (sleep compute, deterministic)
# --------------------------------------------------------------------------

SETTLED = 3
"""Steps left out of comparisons: the first has no measurements, the next ones fill the history."""
TOL_NS = MS
"""Slack between FreeRide's wrapper and megatron's timer just inside the same p2p call."""


def _check_positions_and_totals(run: Run, rank: int) -> None:
    records = run.steps[rank]
    recv = [(int(s), int(s) + int(d)) for r in records[SETTLED:] for s, d in r["recv"]]
    bubbles = [(s, e) for s, e in run.bubbles(rank) if s.step >= SETTLED]
    assert bubbles, f"rank {rank}: no bubble announced after step {SETTLED}"
    # positions: each announced bubble is one measured receive: it ends when the receive
    # returns, and starts when the rank stopped computing to call it (a little before
    # megatron's timer inside the call starts; more when the shared core is busy)
    leads: list[int] = []
    for start, end in bubbles:
        t0, t1 = start.t_ns, end.t_ns
        hits = [(a, b) for a, b in recv if a - TOL_NS <= t1 <= b + TOL_NS]
        assert hits, f"rank {rank} step {start.step} bubble {start.index} [{t0}, {t1}] ends outside every receive"
        a, _ = hits[0]
        leads.append(a - t0)
    leads.sort()
    assert leads[0] >= -TOL_NS, f"rank {rank}: a bubble starts after its receive: {leads}"
    assert statistics.median(leads) <= TOL_NS // 2, f"rank {rank}: bubbles start early: {leads}"
    assert leads[int(0.9 * (len(leads) - 1))] <= 3 * TOL_NS, f"rank {rank}: bubbles start early: {leads}"
    # the long receive waits were announced: most of their time lies in bubbles (one-off stalls
    # of a busy shared core at usually short places are not predicted, by design)
    long_waits = [(a, b) for a, b in recv if b - a >= 5 * MS]
    covered = sum(
        min(b, e.t_ns) - max(a, s.t_ns) for a, b in long_waits for s, e in bubbles if s.t_ns < b and e.t_ns > a
    )
    long_total = sum(b - a for a, b in long_waits)
    assert covered >= 0.8 * long_total, f"rank {rank}: bubbles cover {covered / long_total:.0%} of the long waits"
    # totals: the bubbles' time is the long waits' time (bubbles at stable 1-5 ms places add a
    # little), and what was predicted is what was measured
    measured = sum(e.duration_ns for _, e in bubbles)
    assert long_total * 0.8 <= measured <= long_total * 1.1 + sum(b - a for a, b in recv if b - a < 5 * MS), (
        f"rank {rank}: announced {measured} vs long waits {long_total}"
    )
    # predictions err low (a bubble predicted too long makes side tasks overrun into training,
    # one too short only leaves some of it unused)
    # never 10% over in all; under, per bubble, by what the shared core's one-off stalls add
    # (a few stalls can double a run's total, so the typical bubble is judged, not the sum)
    expected = sum(s.expected_ns for s, _ in bubbles)
    assert expected <= 1.10 * measured, f"rank {rank}: expected {expected} vs measured {measured}"
    ratios = [s.expected_ns / max(1, e.duration_ns) for s, e in bubbles]
    assert statistics.median(ratios) >= 0.6, f"rank {rank}: predicted / measured per bubble {sorted(ratios)}"


def _check_schedule_places(observations: list[RankObservations], name: str, chunks: int) -> None:
    """Megatron's schedule, simulated with the measured compute times, has the long waits where they are."""
    forward, backward, waits = [], [], []
    for obs in observations:
        steps = obs.steps[SETTLED:]
        forward.append(statistics.median(t for s in steps for t in s.forward_ns) / 1e9)
        backward.append(statistics.median(t for s in steps for t in s.backward_ns) / 1e9)
        places: dict[str, list[int]] = {}
        for s in steps:
            for w in s.waits:
                places.setdefault(w.key, []).append(w.duration_ns)
        waits.append({k: statistics.median(v) for k, v in places.items()})
    # one p2p hop: a receive whose data had already arrived
    hops = [ns for per_rank in waits for ns in per_rank.values() if ns < 3 * MS]
    durations = Durations(forward=tuple(forward), backward=tuple(backward), comm=statistics.median(hops) / 1e9)
    p = len(observations)
    schedule = megatron_schedule(name, p, observations[0].num_microbatches, chunks, p)
    groups = tuple(iterations(schedule, s) for s in range(p))
    for obs, measured in zip(observations, waits, strict=True):
        priors = {
            str(k): ns
            for k, ns in schedule_priors(schedule, obs.stage, durations, merge_tail=True, groups=groups).items()
        }
        # long on one side is a wait on the other (a place near a threshold may fall either way)
        long = {k for k, ns in priors.items() if ns >= 5 * MS} | {k for k, ns in measured.items() if ns >= 5 * MS}
        for key in long:
            sim, real = priors.get(key, 0), measured.get(key, 0)
            assert min(sim, real) >= 2 * MS, f"rank {obs.rank}: {key} simulated {sim} vs measured {real}"
        sim_total, real_total = sum(priors[k] for k in long), sum(measured[k] for k in long)
        # a model of the step, without optimizer time, host overhead or a busy shared core (one p2p hop
        # is taken as the median quick receive): looser than what the adapter announces is held to
        assert sim_total == pytest.approx(real_total, rel=0.20), f"rank {obs.rank}: {priors} vs {measured}"


@pytest.mark.parametrize(
    ("schedule", "extra"),
    [("1f1b", []), ("interleaved", ["--schedule", "interleaved", "--vpp", "2"])],
    ids=["1f1b", "interleaved"],
)
async def test_bubbles_match_measured_receive_waits(
    schedule: str, extra: list[str], runtime_dir: Path, tmp_path: Path
) -> None:
    endpoint = f"ipc://{runtime_dir}/ev"

    async def attempt(i: int) -> tuple[Run, Path]:
        profile_dir = tmp_path / f"profile-{i}"
        env = launch_env(plain_env(), events=endpoint, mode="profile", profile_dir=profile_dir)
        return await launch(train_args(*extra, steps=10), env, events=endpoint), profile_dir

    (run, profile_dir), other = await quietest_async(attempt)
    for rank in range(RANKS):
        _check_positions_and_totals(run, rank)
    # a rank repeats its Hello (once it publishes its bubble starts, and now and then): the last one counts
    hellos = list({e.rank: e for e in run.events if isinstance(e, p.Hello)}.values())
    assert sorted((h.rank, h.stage, h.framework) for h in hellos) == [(0, 0, "megatron"), (1, 1, "megatron")]
    finished = [e for e in run.events if isinstance(e, p.StepFinished)]
    assert len(finished) == 10 * RANKS
    observations = read_observations(profile_dir)
    assert [o.rank for o in observations] == [0, 1]
    assert all(len(o.steps) == 10 for o in observations)
    require_quiet(other, f"the profiled megatron run ({schedule})")
    _check_schedule_places(observations, schedule, 2 if schedule == "interleaved" else 1)


async def test_overlapped_p2p_waits_are_tracked(runtime_dir: Path, tmp_path: Path) -> None:
    """With ``overlap_p2p_comm`` megatron waits on request handles, outside the p2p methods."""
    endpoint = f"ipc://{runtime_dir}/ev"
    profile_dir = tmp_path / "profile"
    env = launch_env(plain_env(), events=endpoint, mode="profile", profile_dir=profile_dir)
    run = await launch(train_args("--schedule", "interleaved", "--overlap-p2p", steps=8), env, events=endpoint)
    observations = read_observations(profile_dir)
    schedule = megatron_schedule("interleaved", RANKS, 4, 2, RANKS)
    for obs in observations:
        steps = obs.steps[SETTLED:]
        idle = sum(s.duration_ns - sum(s.forward_ns) - sum(s.backward_ns) for s in steps)
        waited = sum(w.duration_ns for s in steps for w in s.waits)
        # what is not compute is waiting, bar the p2p launches and bookkeeping between actions
        assert 0.5 * idle <= waited <= idle, f"rank {obs.rank}: waited {waited} of {idle} idle"
        f = statistics.median(t for s in steps for t in s.forward_ns) / 1e9
        b = statistics.median(t for s in steps for t in s.backward_ns) / 1e9
        # waits sit right before the action that needs the data: the plain simulation's places
        priors = schedule_priors(schedule, obs.stage, Durations.uniform(RANKS, f, b), merge_tail=True)
        places: dict[str, list[int]] = {}
        for s in steps:
            for w in s.waits:
                places.setdefault(w.key, []).append(w.duration_ns)
        for before, ns in priors.items():
            if ns >= 3 * MS:
                assert statistics.median(places.get(str(before), [0])) >= MS, f"rank {obs.rank}: no wait at {before}"
        bubbles = run.bubbles(obs.rank)
        assert any(s.step >= SETTLED for s, _ in bubbles), f"rank {obs.rank}: nothing announced"


# --------------------------------------------------------------------------
# the training job does not notice FreeRide
# --------------------------------------------------------------------------

LOSS_ARGS = train_args("--schedule", "interleaved", "--vpp", "2", steps=6, compute="matmul")


@pytest.fixture(scope="module")
def baseline_losses() -> list[float]:
    """Losses of a run without FreeRide (shared by the tests below)."""
    run = asyncio.run(launch(LOSS_ARGS, plain_env()))
    losses = run.losses()
    assert len(losses) == 6 and all(x > 0 for x in losses)
    return losses


async def test_losses_are_identical_with_freeride_and_no_manager(
    baseline_losses: list[float], runtime_dir: Path
) -> None:
    env = plain_env()
    env[ENV_EVENTS] = f"ipc://{runtime_dir}/nobody-listens"
    run = await launch([*LOSS_ARGS, "--attach"], env)
    assert run.losses() == baseline_losses
    for rank in range(RANKS):
        stats = run.done[rank]["freeride"]
        assert stats["steps"] == 6 and stats["sent"] == 0 and stats["dropped"] > 0, stats


async def test_training_survives_a_manager_that_dies(baseline_losses: list[float], runtime_dir: Path) -> None:
    endpoint = f"ipc://{runtime_dir}/ev"
    env = launch_env(plain_env(), events=endpoint)
    run = await launch(LOSS_ARGS, env, events=endpoint, kill_after=12)
    assert len(run.events) == 12  # it was attached and talking before the socket went away
    assert run.losses() == baseline_losses
    for rank in range(RANKS):
        stats = run.done[rank]["freeride"]
        # what it sent after: bubbles published to nobody (never counted), step reports kept for a later send
        assert stats["steps"] == 6, stats
    times = [float(r["step_ms"]) for r in run.steps[0][1:]]
    assert max(times) < 5 * statistics.median(times), f"a step stalled after the manager died: {times}"
