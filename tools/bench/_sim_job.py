"""The simulated pipeline (``freeride.backends.sim``) as a training job for the benchmark harness.

Runs a :class:`freeride.backends.sim.SimPipeline` (one real process per stage, blocked on
each other over pipes, each pinned to its core) and, when it is done, prints one
JSON line per stage and step (``rank``, ``stage``, ``step``, ``step_ms``), as
the training scripts do. Under ``freeride launch`` the stages send their bubble
events to the manager the launcher names; otherwise to an address nobody
listens on (each event is dropped at once, ~1 µs)::

    python tools/bench/_sim_job.py --spawn 2 --steps 60 --compute cpu
    python tools/bench/_sim_job.py --spawn 2 --steps 8 --profile-out job.profile.json

``--profile-out`` writes a bubble profile (as ``freeride profile`` would for a
framework job) from the simulated schedule and the measured step time, so that
the manager knows the devices before the first run. Each line also carries the
stage's CPU time in the step (``cpu_ms``). With ``--compute cpu`` (the
default) a stage burns its core until it has had its compute time, so a side
task sharing the core delays it as a side kernel would delay a GPU's training.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from freeride.backends.schedule import Durations, bubbles, build_schedule, simulate
from freeride.backends.session import ENV_EVENTS
from freeride.backends.sim import SimConfig, SimPipeline, StageResult
from freeride.cli.sim import add_pipeline_options, sim_config
from freeride.profile import BubbleProfile, Profile, StageProfile, write_profile
from freeride.transport import Endpoints

__all__ = ["main", "sim_profile"]


def sim_profile(config: SimConfig, results: list[StageResult]) -> Profile:
    """The bubble profile of ``config``'s job: bubbles from its simulated schedule, step times as measured."""
    p, m = config.num_stages, config.num_microbatches
    timeline = simulate(
        build_schedule(config.schedule, p, m, config.num_chunks),
        Durations.uniform(p, config.forward_s, config.backward_s),
    )
    windows = bubbles(timeline, min_duration=config.min_bubble_s)
    stages = []
    for r in results:
        kept = windows[r.stage]
        step_ns = int(statistics.median(r.step_ns)) if r.step_ns else int(timeline.makespan * 1e9)
        stages.append(
            StageProfile(
                stage=r.stage,
                rank=config.rank_offset + r.stage,
                device=config.device(r.stage),
                framework="sim",
                num_stages=p,
                num_microbatches=m,
                steps=len(r.step_ns),
                step_time_ns=step_ns,
                bubble_ns=sum(int(w.duration * 1e9) for w in kept),
                spare_memory=config.spare_memory,
                forward_ns=int(config.forward_s * 1e9),
                backward_ns=int(config.backward_s * 1e9),
                bubbles=[
                    BubbleProfile(
                        index=w.index,
                        key="tail" if w.before is None else str(w.before),
                        offset_ns=int(w.start * 1e9),
                        duration_ns=int(w.duration * 1e9),
                        p5_ns=int(w.duration * 1e9),
                        p95_ns=int(w.duration * 1e9),
                        count=len(r.step_ns),
                    )
                    for w in kept
                ],
            )
        )
    return Profile(stages=stages)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spawn", type=int, default=2, help="pipeline stages (one process each)")
    ap.add_argument("--steps", type=int, default=60)
    add_pipeline_options(ap, compute="cpu")
    ap.add_argument("--profile-out", metavar="FILE", help="also write a bubble profile of the job")
    ns = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="frsim-") as nobody:
        endpoint = os.environ.get(ENV_EVENTS) or Endpoints.ipc(Path(nobody)).events
        config = sim_config(ns, endpoint=endpoint, stages=ns.spawn, steps=ns.steps)
        with SimPipeline(config) as sim:
            results = sim.join()
    if len(results) < ns.spawn or any(len(r.step_ns) < ns.steps for r in results):
        print(f"sim: {len(results)} of {ns.spawn} stages finished their steps", file=sys.stderr)
        return 1
    for r in results:
        for step, (duration, cpu) in enumerate(zip(r.step_ns, r.cpu_ns, strict=True)):
            line = {"rank": r.stage, "stage": r.stage, "step": step, "step_ms": round(duration / 1e6, 3)}
            print(json.dumps({**line, "cpu_ms": round(cpu / 1e6, 3)}))
    if ns.profile_out:
        write_profile(sim_profile(config, results), Path(ns.profile_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
