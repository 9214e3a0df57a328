"""One real pipeline stage whose neighbours are emulated: the training job of the GPU check.

The stage runs its rank's actions of a 1F1B schedule (``--stages``,
``--stage``, ``--microbatches``) on a small MLP: forward and backward are real
work on the device (CUDA kernels on a GPU, torch on one pinned core on CPU).
Its neighbours are emulated: before each action the stage receives what the
1F1B simulation says it waits for there, with the neighbours as fast as this
stage (their compute times are this stage's, measured in a first step without
waits). A receive waits as NCCL would:

* on CUDA, the host returns at once; a one-thread kernel on a separate "comm"
  stream spins for the wait after the compute stream's preceding work (NCCL's
  stream waits for it the same way), and the compute stream waits for it;
* on CPU the host sleeps, as a gloo receive blocks.

FreeRide's own rank-side pieces time it: a :class:`~freeride.backends.tracker.StepTracker`
with the 1F1B plan, a :class:`~freeride.backends.session.BackendSession` and, where
waits block on the device, a :class:`~freeride.backends.cuda_timing.DeviceTimeline`. It
prints one JSON line per step (``rank``, ``step``, ``step_ms``, ``compute_ms``:
the stage's own forward and backward time, by CUDA events on a GPU) for the
benchmark harness, and with ``--stats-out`` writes what the bubbles looked like
(announced vs measured). Under ``freeride launch`` its events go to that
manager; otherwise to an address nobody listens on::

    python tools/gpu/stage.py --steps 30
    python tools/gpu/stage.py --steps 8 --profile-out stage.profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from freeride.backends.cuda_timing import DeviceTimeline, timeline_for
from freeride.backends.schedule import Action, Durations, one_f_one_b
from freeride.backends.session import ENV_EVENTS, BackendConfig, BackendSession
from freeride.backends.tracker import StepPlan, StepTracker, schedule_priors
from freeride.profile import BubbleProfile, Profile, StageProfile, StepRecord, write_profile
from freeride.transport import Endpoints

__all__ = ["Stage", "main"]

_MIN_BUBBLE_NS = 1_000_000
_cuda: Any = torch.cuda  # Stream, Event and _sleep are untyped


class _Device:
    """Compute, waits and timing on CUDA or on one CPU core."""

    def __init__(self, kind: str) -> None:
        self.cuda = kind == "cuda"
        if self.cuda:
            self.torch_device = torch.device("cuda", torch.cuda.current_device())
            self.name = f"cuda:{self.torch_device.index}"
            self.comm: Any = _cuda.Stream()
            self._cycles_per_ms = self._calibrate_sleep()
        else:
            core = sorted(os.sched_getaffinity(0))[-1]
            os.sched_setaffinity(0, [core])  # one core plays the device
            torch.set_num_threads(1)
            self.torch_device = torch.device("cpu")
            self.name = f"cpu:{core}"

    def _calibrate_sleep(self) -> float:
        start, end = _cuda.Event(enable_timing=True), _cuda.Event(enable_timing=True)
        cycles = 20_000_000
        _cuda._sleep(1000)  # load the kernel
        start.record()
        _cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / max(float(start.elapsed_time(end)), 1e-3)

    def receive(self, seconds: float) -> None:
        """Wait for a neighbour's data that arrives ``seconds`` after the stage gets here."""
        if seconds <= 0:
            return
        if not self.cuda:
            time.sleep(seconds)
            return
        compute = torch.cuda.current_stream()
        self.comm.wait_stream(compute)
        with torch.cuda.stream(self.comm):
            _cuda._sleep(int(seconds * 1e3 * self._cycles_per_ms))
        compute.wait_stream(self.comm)

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter_ns()
        event = _cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ns(self, start: Any, end: Any) -> int:
        if not self.cuda:
            return int(end - start)
        return round(float(start.elapsed_time(end)) * 1e6)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().synchronize()


class Stage:
    """The stage's model, schedule and FreeRide hooks."""

    def __init__(self, args: argparse.Namespace) -> None:
        kind = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.dev = _Device(kind)
        self.args = args
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(args.depth):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*layers).to(self.dev.torch_device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.inputs = [
            torch.randn(args.batch, args.width, device=self.dev.torch_device) for _ in range(args.microbatches)
        ]
        self.plan = StepPlan(schedule=one_f_one_b(args.stages, args.microbatches), stage=args.stage, merge_tail=False)
        self.launched = bool(os.environ.get(ENV_EVENTS))
        self._own_dir: Path | None = None
        """The run's own socket dir when no launcher gave an endpoint (removed at close)."""
        endpoint = os.environ.get(ENV_EVENTS)
        if not endpoint:
            self._own_dir = Path(tempfile.mkdtemp(prefix="frstage-"))
            endpoint = Endpoints.ipc(self._own_dir).events
        self.session = BackendSession(
            BackendConfig(
                endpoint=endpoint,
                rank=0,
                stage=args.stage,
                num_stages=args.stages,
                device=self.dev.name,
                framework="gpu-check",
                min_bubble_ns=_MIN_BUBBLE_NS,
            )
        )
        self.timeline: DeviceTimeline | None = timeline_for(
            self.session, device_type="cuda" if self.dev.cuda else "cpu", timing=args.timing
        )
        self.records: list[StepRecord] = []
        self.tracker = StepTracker(
            self.session if self.timeline is None else self.timeline,
            min_bubble_ns=_MIN_BUBBLE_NS,
            warmup_steps=1,
            on_step=self.records.append,
            device=self.timeline,
        )
        self.gaps: dict[Action | None, float] = {}
        self.forward_ns: list[int] = []
        self.backward_ns: list[int] = []

    def _pass(self, action: Action, outputs: dict[int, torch.Tensor]) -> tuple[Any, Any]:
        start = self.dev.mark()
        if action.kind == "F":
            outputs[action.microbatch] = self.model(self.inputs[action.microbatch])
        else:
            loss: Any = outputs.pop(action.microbatch).square().mean()
            loss.backward()
        return start, self.dev.mark()

    def step(self, *, waits: bool) -> float:
        """One training step; returns the stage's compute time in it, in ms."""
        self.tracker.begin_step(self.plan)  # numbered by the tracker: calibration steps count too
        outputs: dict[int, torch.Tensor] = {}
        marks: list[tuple[str, Any, Any]] = []
        for action in self.plan.actions:
            if waits:
                self._wait(self.gaps.get(action, 0.0))
            self.tracker.action_started(action.kind)
            marks.append((action.kind, *self._pass(action, outputs)))
        if waits:
            self._wait(self.gaps.get(None, 0.0))  # the last gradients, then the step's sync
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.dev.synchronize()  # a training loop reads its loss once a step
        compute = 0
        for kind, start, end in marks:
            ns = self.dev.elapsed_ns(start, end)
            compute += ns
            (self.forward_ns if kind == "F" else self.backward_ns).append(ns)
            self.tracker.record_compute("F" if kind == "F" else "B", ns)
        self.tracker.end_step()
        return compute / 1e6

    def _wait(self, seconds: float) -> None:
        self.tracker.wait_started()
        self.dev.receive(seconds)
        self.tracker.wait_ended()

    def calibrate(self) -> None:
        """Run a step without waits; the neighbours' compute times are this stage's."""
        self.step(waits=False)
        self.step(waits=False)
        f = statistics.median(self.forward_ns) / 1e9
        b = statistics.median(self.backward_ns) / 1e9
        priors = schedule_priors(
            self.plan.schedule, self.args.stage, Durations.uniform(self.args.stages, f, b), merge_tail=False
        )
        self.gaps = {before: ns / 1e9 for before, ns in priors.items()}
        self.forward_ns.clear()
        self.backward_ns.clear()

    def stats(self) -> dict[str, Any]:
        """What the bubbles looked like: device-timeline accuracy, or the host's expected vs measured."""
        out: dict[str, Any] = {
            "launched": self.launched,
            "timing": "host" if self.timeline is None else "device",
            "device": self.dev.name,
            "forward_ms": statistics.median(self.forward_ns) / 1e6 if self.forward_ns else None,
            "backward_ms": statistics.median(self.backward_ns) / 1e6 if self.backward_ns else None,
            "bubble_ms": sum(self.gaps.values()) * 1e3,
        }
        if self.timeline is not None:
            out["accuracy"] = self.timeline.accuracy.summary()
        else:
            announced = [w for r in self.records for w in r.waits if w.expected_ns >= _MIN_BUBBLE_NS]
            errors = [w.expected_ns - w.duration_ns for w in announced]
            out["accuracy"] = {
                "announced": float(len(announced)),
                "waits": float(sum(len(r.waits) for r in self.records)),
                "abs_error_p50_ms": statistics.median(abs(e) for e in errors) / 1e6 if errors else float("nan"),
                "lag_p50_ms": 0.0,  # announced when the host got there: that is where it waits
            }
        return out

    def profile(self, step_ns: list[int]) -> Profile:
        bubbles = sorted(((a, s) for a, s in self.gaps.items() if s * 1e9 >= _MIN_BUBBLE_NS), key=_order(self.plan))
        profiled: list[BubbleProfile] = []
        for index, (before, seconds) in enumerate(bubbles):
            ns = int(seconds * 1e9)
            key = "tail" if before is None else str(before)
            profiled.append(
                BubbleProfile(index=index, key=key, offset_ns=0, duration_ns=ns, p5_ns=ns, p95_ns=ns, count=1)
            )
        stage = StageProfile(
            stage=self.args.stage,
            rank=0,
            device=self.dev.name,
            framework="gpu-check",
            num_stages=self.args.stages,
            num_microbatches=self.args.microbatches,
            steps=len(step_ns),
            step_time_ns=int(statistics.median(step_ns)),
            bubble_ns=sum(b.duration_ns for b in profiled),
            forward_ns=int(statistics.median(self.forward_ns)),
            backward_ns=int(statistics.median(self.backward_ns)),
            bubbles=profiled,
        )
        return Profile(stages=[stage])

    def close(self) -> None:
        (self.session if self.timeline is None else self.timeline).close()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)


def _order(plan: StepPlan) -> Callable[[tuple[Action | None, float]], int]:
    position = {a: i for i, a in enumerate(plan.actions)}
    return lambda item: position.get(item[0], len(position)) if item[0] is not None else len(position)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--spawn", type=int, default=1, help=argparse.SUPPRESS)  # the harness's rank count: one stage here
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--timing", choices=("auto", "host", "device"), default=None)
    ap.add_argument("--profile-out", type=Path, help="write the stage's bubble profile here")
    ap.add_argument("--stats-out", type=Path, help="directory for this run's bubble statistics (JSON)")
    args = ap.parse_args(argv)
    if not 0 <= args.stage < args.stages or args.microbatches < 1 or args.steps < 1:
        ap.error("need 0 <= --stage < --stages, --microbatches >= 1 and --steps >= 1")
    stage = Stage(args)
    try:
        stage.calibrate()
        step_ns: list[int] = []
        last = time.perf_counter_ns()
        for i in range(args.steps):
            compute_ms = stage.step(waits=True)
            now = time.perf_counter_ns()
            step_ns.append(now - last)
            last = now
            line = {"rank": 0, "stage": args.stage, "step": i, "step_ms": step_ns[-1] / 1e6, "compute_ms": compute_ms}
            print(json.dumps(line), flush=True)
        if args.profile_out is not None:
            write_profile(stage.profile(step_ns), args.profile_out)
    finally:
        stage.close()
    if args.stats_out is not None:
        args.stats_out.mkdir(parents=True, exist_ok=True)
        (args.stats_out / f"stage-{os.getpid()}.json").write_text(json.dumps(stage.stats()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
