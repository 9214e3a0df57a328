"""What FreeRide costs a training job with no side work: the hooks alone, and the hooks with a manager beside them.

Runs a 2-stage training job (the simulated one of ``tools/bench/_sim_job.py``,
or with ``--job deepspeed`` ``tools/train/deepspeed_gpt.py`` with the arguments
after ``--``) in rounds of five runs, their order rotating from round to round: alone (twice: the A/A noise
floor), hooked with no manager (``freeride launch --no-manager``: every event is
dropped at once), hooked beside an idle ``freeride serve`` (started once, before
the first round, with no side task), and under a plain ``freeride launch``,
which starts a manager of its own for the run::

    python tools/bench/fixed_cost.py --rounds 8 --steps 60
    python tools/bench/fixed_cost.py --job deepspeed --rounds 8 --steps 60 -- --hidden 256 --seq 64 --micro-batch-size 8

and prints, per comparison, the median slowdown of the paired runs and its
order-statistic 95 % interval (``_stats.paired_slowdown``): the hooks' cost
(hooked vs alone), an idle manager's (served vs hooked), both (served vs
alone, launched vs alone), against the A/A floor. A run's figures are rank 0's
median step time past the first steps and, where the job reports it, the
ranks' CPU time per step (``_bench_figures.parse_steps``). Run it alone on the machine (``flock
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
from _bench_figures import StepFigures, parse_steps
from _bench_tasks import ROOT
from _pipeline_bench import manager_status, stop_serve, wait_for_serve
from _stats import Estimate, paired_slowdown
from deepspeed_overhead import SCRIPT as DEEPSPEED_SCRIPT
from sim_overhead import SCRIPT as SIM_SCRIPT

from freeride.cli.sim import add_pipeline_options, pipeline_argv
from freeride.transport import Endpoints

__all__ = ["main"]

SCRIPTS = {
    "sim": SIM_SCRIPT,
    "deepspeed": DEEPSPEED_SCRIPT,
}
"""The jobs ``--job`` names."""
KINDS = ("alone", "alone-again", "hooked", "served", "launched")
"""The runs of a round; the order rotates by one each round, so each kind runs in each place as often."""
COMPARISONS = (
    ("A/A: alone vs alone", "alone", "alone-again"),
    ("hooks, no manager, vs alone", "alone", "hooked"),
    ("an idle `freeride serve`, vs the hooks alone", "hooked", "served"),
    ("hooks and an idle `freeride serve`, vs alone", "alone", "served"),
    ("`freeride launch` starting its own manager, vs alone", "alone", "launched"),
)
"""What the report compares: its row's name, the first run's kind, the second's."""


def _job(steps: int, ns: argparse.Namespace) -> list[str]:
    command = [sys.executable, str(SCRIPTS[ns.job]), "--spawn", "2", "--steps", str(steps)]
    if ns.job == "deepspeed":
        return [*command, *ns.train_args]
    return [*command, *pipeline_argv(ns), *ns.train_args]


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
    add_pipeline_options(ap, compute="cpu")  # the simulated job's
    ap.add_argument("--job", default="sim", choices=sorted(SCRIPTS), help="the training job (default sim)")
    ap.add_argument("train_args", nargs="*", help="after --: more arguments for the job's script")
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
        runs: dict[str, list[StepFigures]] = {kind: [] for kind in KINDS}
        for r in range(ns.rounds):
            order = KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]
            for kind in order:
                stdout, _ = run_cmd(_command(kind, job, runtime))
                runs[kind].append(parse_steps(stdout))
            print(f"round {r}: " + ", ".join(f"{k} {runs[k][-1].step_ms:.2f} ms" for k in KINDS), file=sys.stderr)
        events = manager_status(endpoints).events
    finally:
        stop_serve(serve)
        shutil.rmtree(runtime, ignore_errors=True)

    shown = Path(job[1]).resolve().relative_to(ROOT)
    print(f"Job: `{' '.join(['python', str(shown), *job[2:]])}`; {ns.rounds} rounds, ")
    print(f"started {started}, load {load:.2f} -> {os.getloadavg()[0]:.2f}; `freeride serve` took {events} events.\n")
    has_cpu = all(f.cpu_ms is not None for kind in KINDS for f in runs[kind])
    cpu_head = (" ranks' CPU time: median | interval |", "---|---|") if has_cpu else ("", "")
    print("| comparison | median slowdown | 95 % interval | pairs |" + cpu_head[0])
    print("|---|---|---|---|" + cpu_head[1])
    for name, a, b in COMPARISONS:
        pairs = list(zip(runs[a], runs[b], strict=True))
        line = _line(name, paired_slowdown([(x.step_ms, y.step_ms) for x, y in pairs]))
        if has_cpu:
            cpu = paired_slowdown([(x.cpu_ms or 0.0, y.cpu_ms or 0.0) for x, y in pairs])
            line += f" {cpu.median:+.2%} | {cpu.low:+.2%} .. {cpu.high:+.2%} |".replace("%", " %")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
