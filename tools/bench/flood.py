"""Flood benchmark: what the manager absorbs, and what a flood costs control and harvesting.

A manager runs in this process (uvloop, as ``freeride serve`` runs it). A
sender process floods its events socket through the real :class:`EventEmitter`
with bubble events of made-up ranks on made-up devices (no side task there:
the cheapest events a flooder can send that still go through ranks and
scheduler), paced to a rate or as fast as it can. A prober process asks for
status every 20 ms, as ``freeride status`` would, and times each answer.

Three measurements, each with a fresh manager (``--rounds N`` runs only the third,
N times over, for intervals):

* absorbed: events/s the manager handles under an unpaced flood;
* status: p50/p99/max of status round trips, quiet and under ``--status-rate``
  events/s offered (goal: p99 under 50 ms);
* harvesting: a simulated 2-stage pipeline with one side task per stage (as
  tools/latency.py runs it), the share of its bubble time the side tasks
  used, quiet and under ``--harvest-rate`` events/s (goal: within 10 % of quiet).

    flock /tmp/freeride-bench.lock .venv/bin/python tools/bench/flood.py
    flock /tmp/freeride-bench.lock .venv/bin/python tools/bench/flood.py --rounds 6

With ``--rounds``, each round runs the pipeline quiet, with the flood to the
manager, with the flood to a sink and quiet again, in an order rotated from
round to round, and the ratios of the rounds (flood to quiet, sink to quiet,
flood to sink: what the manager's own work costs, and quiet to quiet: the
A/A floor) are given with the median's distribution-free 95 % interval
(``_stats.paired_slowdown``; 6 rounds or more for full coverage).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from _stats import Estimate, paired_slowdown  # tools/bench is the script's directory

from freeride import protocol as p
from freeride.observe.stats import quantile
from freeride.serve.config import ServeConfig
from freeride.serve.manager import Manager
from freeride.transport import (
    ControlClient,
    Endpoints,
    EventEmitter,
    EventReceiver,
    ManagerUnreachable,
    new_async_context,
)

__all__ = ["main"]

TASK = "freeride.sidetasks.graph_sgd:GraphSGD"
TASK_OPTIONS: dict[str, str | int | float | bool] = {"users": 500, "items": 200, "batch_edges": 512, "eval_every": 0}
"""Small SGD steps (well under a millisecond) that never finish: every bubble gets steps."""

FLOOD_RANKS = 8
FIRST_FLOOD_RANK = 1000
"""Made-up ranks, well clear of the simulated pipeline's."""
PROBE_TIMEOUT_S = 10.0


# -- child processes ------------------------------------------------------------------


def _send(endpoint: str, rate: float, seconds: float) -> dict[str, Any]:
    """Flood ``endpoint`` with bubble events at ``rate`` per second (0: as fast as possible)."""
    emitter = EventEmitter(endpoint, sndhwm=100_000)
    now_ns = time.monotonic_ns()
    pairs = []
    for k in range(FLOOD_RANKS):
        rank, device = FIRST_FLOOD_RANK + k, f"flood:{k}"
        start = p.BubbleStarted(rank=rank, stage=0, device=device, step=0, index=0, t_ns=now_ns, expected_ns=1_000_000)
        end = p.BubbleEnded(
            rank=rank, stage=0, device=device, step=0, index=0, t_ns=now_ns + 1_000_000, duration_ns=1_000_000
        )
        pairs.append((start, end))
    t0 = time.monotonic()
    deadline = t0 + seconds
    n = 0
    while (now := time.monotonic()) < deadline:
        target = int((now - t0) * rate) if rate > 0 else n + 512
        while n < target:
            start, end = pairs[(n >> 1) % FLOOD_RANKS]
            emitter.emit(end if n & 1 else start)
            n += 1
        if rate > 0:
            time.sleep(0.0005)
    elapsed = time.monotonic() - t0
    sent, dropped = emitter.sent, emitter.dropped
    emitter.close()
    return {"attempted_per_s": n / elapsed, "offered_per_s": sent / elapsed, "dropped": dropped}


def _probe(endpoint: str, seconds: float, every_s: float) -> dict[str, Any]:
    """Ask ``endpoint`` for status every ``every_s`` for ``seconds``; the round trips in ns."""
    rtts: list[int] = []
    timeouts = 0
    deadline = time.monotonic() + seconds
    client = ControlClient(endpoint, timeout_s=PROBE_TIMEOUT_S)
    try:
        while time.monotonic() < deadline:
            t = time.perf_counter_ns()
            try:
                reply = client.request(p.StatusRequest())
            except ManagerUnreachable:
                timeouts += 1
                rtts.append(int(PROBE_TIMEOUT_S * 1e9))
                client.close()  # a late reply must not answer the next request
                client = ControlClient(endpoint, timeout_s=PROBE_TIMEOUT_S)
                continue
            rtts.append(time.perf_counter_ns() - t)
            assert isinstance(reply, p.StatusReply), reply
            time.sleep(every_s)
    finally:
        client.close()
    return {"rtts_ns": rtts, "timeouts": timeouts}


async def _sink(endpoint: str, seconds: float) -> dict[str, Any]:
    """Read and decode events at ``endpoint`` and drop them: a flood's cost without a manager's work."""
    ctx = new_async_context()
    receiver = EventReceiver(ctx, endpoint)
    count = 0
    try:
        async with asyncio.timeout(seconds):
            while True:
                count += len(await receiver.recv_batch(64))
    except TimeoutError:
        pass
    finally:
        receiver.close()
        ctx.term()
    return {"received": count}


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, __file__, *args, stdout=asyncio.subprocess.PIPE)


async def _result(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"a flood.py child exited with {proc.returncode}")
    result: dict[str, Any] = json.loads(out)
    return result


async def _child(*args: str) -> dict[str, Any]:
    return await _result(await _spawn(*args))


# -- the manager side ---------------------------------------------------------------------


class _Served:
    """A fresh manager on this loop, in its own runtime directory."""

    def __init__(self) -> None:
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="fr-flood-"))
        self.config = ServeConfig(
            endpoints=Endpoints.ipc(self.runtime_dir), state_dir=self.runtime_dir / "state", checkpoint_every_s=3600
        )
        self.stop = asyncio.Event()
        self.manager = Manager(self.config)

    async def __aenter__(self) -> Manager:
        self._stack = AsyncExitStack()
        await self._stack.enter_async_context(self.manager)
        tg = await self._stack.enter_async_context(asyncio.TaskGroup())
        self._stack.callback(self.stop.set)  # runs first on exit: the TaskGroup then ends
        tg.create_task(self.manager.run(self.stop), name="flood-manager")
        return self.manager

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()


async def absorbed(seconds: float) -> dict[str, Any]:
    """Events/s the manager handles while a sender floods it as fast as it can."""
    async with _Served() as manager:
        sender = asyncio.ensure_future(_child("--send", manager.config.endpoints.events, "0", str(seconds + 3)))
        while manager.events == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)  # past the sender's start
        e0, t0 = manager.events, time.monotonic()
        await asyncio.sleep(seconds)
        e1, t1 = manager.events, time.monotonic()
        sent = await sender
    return {
        "absorbed_per_s": (e1 - e0) / (t1 - t0),
        "offered_per_s": sent["offered_per_s"],
        "attempted_per_s": sent["attempted_per_s"],
    }


def _rtt_summary(rtts: list[int]) -> dict[str, Any]:
    values = sorted(rtts)
    return {
        "count": len(values),
        "p50_ms": quantile(values, 0.5) / 1e6,
        "p99_ms": quantile(values, 0.99) / 1e6,
        "max_ms": values[-1] / 1e6 if values else 0.0,
    }


async def status_under(rate: float, seconds: float) -> dict[str, Any]:
    """Status round trips while ``rate`` events/s are offered (0: quiet)."""
    async with _Served() as manager:
        ep = manager.config.endpoints
        sender = None
        if rate > 0:
            sender = asyncio.ensure_future(_child("--send", ep.events, str(rate), str(seconds + 3)))
            while manager.events == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(1.0)
        e0, t0 = manager.events, time.monotonic()
        probed = await _child("--probe", ep.control, str(seconds))
        e1, t1 = manager.events, time.monotonic()
        sent = await sender if sender is not None else {"offered_per_s": 0.0}
    return {
        **_rtt_summary(probed["rtts_ns"]),
        "timeouts": probed["timeouts"],
        "offered_per_s": sent["offered_per_s"],
        "absorbed_per_s": (e1 - e0) / (t1 - t0),
    }


async def harvest(rate: float, seconds: float, *, elsewhere: bool = False) -> dict[str, Any]:
    """Share of a simulated pipeline's bubble time its side tasks used, with ``rate`` events/s of flood.

    ``elsewhere``: the flood goes to a sink process instead of the manager, so the
    host's cores carry the same sender (and a reader) but the manager does no work for it.
    """
    from freeride.backends.schedule import Durations, build_schedule, simulate
    from freeride.backends.sim import SimConfig, SimPipeline

    async with _Served() as manager:
        sim = SimConfig(endpoint=manager.config.endpoints.events, num_stages=2, forward_s=0.002, backward_s=0.004)
        timeline = simulate(
            build_schedule("1f1b", 2, sim.num_microbatches), Durations.uniform(2, sim.forward_s, sim.backward_s)
        )
        sim = replace(sim, steps=max(1, int(seconds / timeline.makespan)))
        devices = [sim.device(stage) for stage in range(2)]
        for stage, device in enumerate(devices):
            manager.declare_device(device, stage=stage, spare_memory=1 << 30, cpu_affinity=[sim.core(stage)])
            manager.submit(p.IterativeSpec(target=TASK, device=device, options=TASK_OPTIONS))
        while not all(t.runnable for t in manager.tasks.values()):
            if any(t.terminal for t in manager.tasks.values()):
                raise SystemExit("a side task ended before training started")
            await asyncio.sleep(0.05)
        sender = sink = None
        if rate > 0:
            target = manager.config.endpoints.events
            if elsewhere:
                target = f"ipc://{manager.config.state_dir}/sink"
                sink = await _spawn("--sink", target, str(4 * seconds + 30))
            sender = await _spawn("--send", target, str(rate), str(4 * seconds + 30))
            while manager.events == 0 and not elsewhere:
                await asyncio.sleep(0.01)
            await asyncio.sleep(1.0)
        e0, t0 = manager.events, time.monotonic()
        pipeline = SimPipeline(sim).start()
        try:
            await asyncio.to_thread(pipeline.join)
        finally:
            pipeline.terminate()
        e1, t1 = manager.events, time.monotonic()
        while manager.live_backends() and any(r < FIRST_FLOOD_RANK for r in manager.live_backends()):
            await asyncio.sleep(0.05)
        status = manager.status()
        for child in (sender, sink):
            if child is not None:
                child.terminate()  # told to go on long enough: training ends first
                await child.wait()
    mine = [d for d in status.devices if d.device in devices]
    bubble_ns = sum(d.bubble_ns for d in mine)
    return {
        "harvested": sum(d.used_ns for d in mine) / bubble_ns if bubble_ns else 0.0,
        "bubbles": sum(d.bubbles for d in mine),
        "events_per_s": (e1 - e0) / (t1 - t0),
        "training_s": t1 - t0,
        "grant_latency_p50_us": status.latency.p50_ns / 1e3,
        "grant_latency_p99_us": status.latency.p99_ns / 1e3,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "absorbed": await absorbed(args.absorb_s),
        "status_quiet": await status_under(0, args.status_s),
        "status_flood": await status_under(args.status_rate, args.status_s),
        "harvest_quiet": await harvest(0, args.harvest_s),
        "harvest_flood": await harvest(args.harvest_rate, args.harvest_s),
        "harvest_flood_elsewhere": await harvest(args.harvest_rate, args.harvest_s, elsewhere=True),
    }


HARVEST_RUNS = ("quiet", "flood", "sink", "quiet again")
"""The runs of a round, in the first round's order (each round starts one further on)."""
ROUND_RATIOS = (
    ("flood to the manager / quiet", "quiet", "flood"),
    ("same flood to a sink / quiet (control: the host's cores alone)", "quiet", "sink"),
    ("flood to the manager / flood to a sink (the manager's own work)", "sink", "flood"),
    ("quiet / quiet (A/A)", "quiet", "quiet again"),
)
"""(what, base run, compared run): each reported as the change of the bubble share used."""


async def harvest_rounds(args: argparse.Namespace) -> dict[str, Any]:
    """``args.rounds`` rounds of the four harvesting runs, each round's order rotated."""
    rounds: list[dict[str, Any]] = []
    for k in range(args.rounds):
        runs: dict[str, Any] = {}
        turn = k % len(HARVEST_RUNS)
        for name in HARVEST_RUNS[turn:] + HARVEST_RUNS[:turn]:
            rate = args.harvest_rate if name in ("flood", "sink") else 0
            runs[name] = await harvest(rate, args.harvest_s, elsewhere=name == "sink")
            print(f"round {k + 1}/{args.rounds} {name}: {runs[name]['harvested']:.1%}", file=sys.stderr, flush=True)
        rounds.append(runs)
    ratios: dict[str, Any] = {}
    for what, base, other in ROUND_RATIOS:
        pairs = [(r[base]["harvested"], r[other]["harvested"]) for r in rounds]
        est = paired_slowdown(pairs)
        ratios[what] = {"median": est.median, "low": est.low, "high": est.high, "coverage": est.coverage}
    return {"rounds": rounds, "ratios": ratios}


def _rounds_table(r: dict[str, Any], args: argparse.Namespace) -> str:
    quiet = sorted(run["quiet"]["harvested"] for run in r["rounds"])
    rows = [
        f"{len(r['rounds'])} rounds, {args.harvest_rate:,.0f} events/s offered, {args.harvest_s:g} s of training each;"
        f" bubble share used quiet: median {quiet[len(quiet) // 2]:.1%} (range {quiet[0]:.1%} .. {quiet[-1]:.1%})",
        "",
        "| change of the bubble share used | median | 95 % interval | coverage |",
        "| --- | ---: | --- | ---: |",
    ]
    for what, est in r["ratios"].items():
        e = Estimate(n=len(r["rounds"]), **est)
        rows.append(f"| {what} | {e.median:+.1%} | {e.low:+.1%} .. {e.high:+.1%} | {e.coverage:.1%} |")
    return "\n".join(rows)


def _table(r: dict[str, Any], args: argparse.Namespace) -> str:
    ab, sq, sf = r["absorbed"], r["status_quiet"], r["status_flood"]
    hq, hf, he = r["harvest_quiet"], r["harvest_flood"], r["harvest_flood_elsewhere"]

    def status_row(name: str, s: dict[str, Any], goal: str) -> str:
        return (
            f"| {name} | {s['offered_per_s']:,.0f} | {s['absorbed_per_s']:,.0f} | p50 {s['p50_ms']:.2f} ms,"
            f" p99 {s['p99_ms']:.2f} ms, max {s['max_ms']:.1f} ms ({s['count']} requests, {s['timeouts']} timeouts)"
            f" | {goal} |"
        )

    def harvest_row(name: str, h: dict[str, Any], rate: float, goal: str) -> str:
        change = h["harvested"] / hq["harvested"] - 1 if hq["harvested"] else 0.0
        return (
            f"| {name} | {rate:,.0f} | {h['events_per_s']:,.0f} | {h['harvested']:.1%} of {h['bubbles']} bubbles"
            f" ({change:+.0%} of quiet); grant latency p50 {h['grant_latency_p50_us']:.0f} µs,"
            f" p99 {h['grant_latency_p99_us']:.0f} µs | {goal} |"
        )

    rows = [
        "| measurement | offered events/s | manager handled events/s | result | goal |",
        "| --- | ---: | ---: | --- | --- |",
        f"| absorbed, unpaced flood | {ab['offered_per_s']:,.0f} | {ab['absorbed_per_s']:,.0f} | | |",
        status_row("status, quiet", sq, ""),
        status_row("status, flood", sf, "p99 < 50 ms"),
        harvest_row("harvesting, quiet", hq, 0, ""),
        harvest_row("harvesting, flood to the manager", hf, args.harvest_rate, "within 10 % of quiet"),
        harvest_row("harvesting, same flood to a sink", he, args.harvest_rate, "(control: the host's cores alone)"),
    ]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--absorb-s", type=float, default=8.0, help="length of the unpaced flood")
    parser.add_argument("--status-rate", type=float, default=100_000, help="events/s offered while probing status")
    parser.add_argument("--status-s", type=float, default=10.0, help="length of each status measurement")
    parser.add_argument("--harvest-rate", type=float, default=30_000, help="events/s offered while training")
    parser.add_argument("--harvest-s", type=float, default=15.0, help="training time of each harvesting run")
    parser.add_argument("--rounds", type=int, default=0, help="only harvesting: this many rounds of four runs")
    parser.add_argument("--json", action="store_true")
    # child modes
    parser.add_argument("--send", nargs=3, metavar=("ENDPOINT", "RATE", "SECONDS"), help=argparse.SUPPRESS)
    parser.add_argument("--sink", nargs=2, metavar=("ENDPOINT", "SECONDS"), help=argparse.SUPPRESS)
    parser.add_argument("--probe", nargs=2, metavar=("ENDPOINT", "SECONDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.send:
        print(json.dumps(_send(args.send[0], float(args.send[1]), float(args.send[2]))))
        return 0
    if args.sink:
        import uvloop

        print(json.dumps(uvloop.run(_sink(args.sink[0], float(args.sink[1])))))
        return 0
    if args.probe:
        print(json.dumps(_probe(args.probe[0], float(args.probe[1]), 0.02)))
        return 0
    import uvloop

    if args.rounds > 0:
        r = uvloop.run(harvest_rounds(args))
        print(json.dumps(r, indent=1) if args.json else _rounds_table(r, args))
        return 0
    r = uvloop.run(run(args))
    print(json.dumps(r, indent=1) if args.json else _table(r, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
