"""What FreeRide costs a training job with no side work: the hooks alone, and the hooks with a manager beside them.

Runs the simulated 2-stage job of ``tools/bench/_sim_job.py`` in rounds of five
runs, their order rotating from round to round: alone (twice: the A/A noise
floor), hooked with no manager (``freeride launch --no-manager``: every event is
dropped at once), hooked beside an idle ``freeride serve`` (started once, before
the first round, with no side task), and under a plain ``freeride launch``,
which starts a manager of its own for the run::

    python tools/bench/fixed_cost.py --rounds 8 --steps 60

and prints, per comparison, the median slowdown of the paired runs and its
order-statistic 95 % interval (``_stats.paired_slowdown``): the hooks' cost
(hooked vs alone), an idle manager's (served vs hooked), both (served vs
alone, launched vs alone), against the A/A floor. The job's figure is rank 0's median step time
past the first steps. Run it alone on the machine (``flock
/tmp/freeride-bench.lock``): two benchmarks at once measure each other.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench_commands import freeride_cmd, plain_env, run_cmd  # tools/bench is the script's directory
from _bench_figures import parse_steps
from _pipeline_bench import manager_status, stop_serve, wait_for_serve
from _stats import Estimate, paired_slowdown

from freeride.transport import Endpoints

__all__ = ["main"]

SCRIPT = Path(__file__).resolve().parent / "_sim_job.py"
KINDS = ("alone", "alone-again", "hooked", "served", "launched")
"""The runs of a round; the order rotates by one each round, so each kind runs in each place as often."""


def _job(steps: int, ns: argparse.Namespace) -> list[str]:
    return [
        sys.executable, str(SCRIPT), "--spawn", "2", "--steps", str(steps), "--schedule", ns.schedule,
        "--microbatches", str(ns.microbatches), "--forward", ns.forward, "--backward", ns.backward,
        "--compute", "cpu",
    ]  # fmt: skip


def _command(kind: str, job: list[str], runtime: Path) -> list[str]:
    match kind:
        case "alone" | "alone-again":
            return job
        case "hooked":
            return freeride_cmd("launch", "--no-manager", "--runtime-dir", str(runtime / "nobody"), "--", *job)
        case "served":
            return freeride_cmd("launch", "--runtime-dir", str(runtime), "--", *job)
        case _:  # a runtime dir of its own each time: launch starts a manager there, for this run
            return freeride_cmd("launch", "--runtime-dir", tempfile.mkdtemp(prefix="run-", dir=runtime), "--", *job)


def _line(name: str, est: Estimate) -> str:
    cover = "" if est.coverage >= est.confidence else f", covers only {est.coverage:.0%}: too few rounds"
    return f"| {name} | {est.median:+.2%} | {est.low:+.2%} .. {est.high:+.2%}{cover} | {est.n} |".replace("%", " %")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8, help="rounds of five runs (default 8)")
    ap.add_argument("--steps", type=int, default=60, help="training steps per run (default 60)")
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--forward", default="10ms")
    ap.add_argument("--backward", default="20ms")
    ns = ap.parse_args(argv)
    if ns.rounds < 1 or ns.steps < 8:
        ap.error("--rounds must be >= 1 and --steps >= 8")
    job = _job(ns.steps, ns)
    runtime = Path(tempfile.mkdtemp(prefix="frfixed-", dir="/tmp"))
    endpoints = Endpoints.ipc(runtime)
    log = runtime / "serve.log"
    started, load = time.strftime("%Y-%m-%d %H:%M %Z"), os.getloadavg()[0]
    with open(log, "wb") as out:
        serve = subprocess.Popen(
            freeride_cmd("serve", "--runtime-dir", str(runtime)),
            env=plain_env(),
            stdout=subprocess.DEVNULL,
            stderr=out,
            start_new_session=True,
        )
    try:
        wait_for_serve("the manager", 60, lambda: bool(manager_status(endpoints)), serve, log)
        run_cmd(_command("served", job, runtime))  # warm-up, left out: caches, and the manager learns the bubbles
        steps: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for r in range(ns.rounds):
            order = KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]
            for kind in order:
                stdout, _ = run_cmd(_command(kind, job, runtime))
                steps[kind].append(parse_steps(stdout).step_ms)
            print(f"round {r}: " + ", ".join(f"{k} {steps[k][-1]:.2f} ms" for k in KINDS), file=sys.stderr)
        events = manager_status(endpoints).events
    finally:
        stop_serve(serve)
        shutil.rmtree(runtime, ignore_errors=True)

    def pairs(a: str, b: str) -> list[tuple[float, float]]:
        return list(zip(steps[a], steps[b], strict=True))

    print(f"Simulated job: `{' '.join(['python', 'tools/bench/_sim_job.py', *job[2:]])}`; {ns.rounds} rounds, ")
    print(f"started {started}, load {load:.2f} -> {os.getloadavg()[0]:.2f}; `freeride serve` took {events} events.\n")
    print("| comparison | median slowdown | 95 % interval | pairs |")
    print("|---|---|---|---|")
    print(_line("A/A: alone vs alone", paired_slowdown(pairs("alone", "alone-again"))))
    print(_line("hooks, no manager, vs alone", paired_slowdown(pairs("alone", "hooked"))))
    print(_line("an idle `freeride serve`, vs the hooks alone", paired_slowdown(pairs("hooked", "served"))))
    print(_line("hooks and an idle `freeride serve`, vs alone", paired_slowdown(pairs("alone", "served"))))
    print(_line("`freeride launch` starting its own manager, vs alone", paired_slowdown(pairs("alone", "launched"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
