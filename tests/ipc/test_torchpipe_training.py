"""The whole path on real torch.distributed.pipelining jobs (gloo, CPU), under ``freeride launch``.

2 stages: 1F1B, interleaved 1F1B and ZBV (profiled first), interleaved zero
bubble and DualPipeV; 4 stages: 1F1B, interleaved 1F1B and ZBV (4 ranks x 2
chunks). A machine with fewer cores than ranks pins two ranks to a core, and
each still trains as a device of its own (``cpu:<local rank>``).

For each case the unmodified training script runs once without FreeRide (the
reference losses). For the profiled cases, ``freeride profile`` runs it and
writes the bubble profile; ``freeride serve --profile --trace`` knows every
device from it and records every announced bubble; one ``SpinSteps`` side task
is pinned to each stage's device before ``freeride launch`` runs the training.
The other cases share one launch for every check (CI time): ``freeride serve
--trace`` learns the devices from the ranks' hellos, and the side tasks are
pinned to them then. Training runs with ``--recv-timers``, the script's own
timing of torch's p2p waits (a hook of its own around ``_wait_batch_p2p``,
outside FreeRide's).

Checked: bubbles reach the manager from every stage, the announced bubbles
cover the measured waits and lie inside them (within 10 %), the losses are
those of the run without FreeRide (2-rank cases: every schedule; the 4-rank
runs train as many steps), and the side tasks get steps. The waits
covered are the schedule's: those at the places in the step (the n-th wait of
a rank's step) whose median wait lasts 4 ms or more. A loaded 2-core machine
also stalls a rank now and then elsewhere, for milliseconds; such a stall is
no bubble of the schedule, and announced time outside any wait still counts
against the 10 %.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import freeride_cmd, poll, serving, status, submit_spin_steps

from freeride import protocol as p
from freeride.observe.timeline import load_trace
from freeride.profile import load_profile
from freeride.transport import ControlClient, Endpoints

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train" / "torchpipe_gpt.py"
STEP_MS = 2.0
MS = 1_000_000
MIN_BUBBLE_NS = MS
"""Waits expected shorter are not announced (the backends' default ``min_bubble_ns``)."""
PREDICTOR_HISTORY = 3
"""The framework tracker's predictor: the shortest of the last three waits at a place (``StepTracker``)."""
PROFILED = (("1f1b", 2), ("interleaved", 2), ("zbv", 2))
"""(--schedule, ranks): profiled first, side tasks set up before training starts."""
ONE_LAUNCH = (("interleaved-zb", 2), ("dualpipev", 2), ("1f1b", 4), ("interleaved", 4), ("zbv", 4))
"""(--schedule, ranks): one launch for every check, side tasks set up once the ranks said hello."""
STEPS = 16
ONE_LAUNCH_STEPS = 30
"""More: the side tasks start while the job trains, and the waits settle after that."""
ONE_LAUNCH_SETTLED = 12
UNREFERENCED_RANKS = 4
"""Cases with this many ranks check no losses against a run without FreeRide: every schedule's losses
are checked with 2 ranks, and a 4-rank run's start (four processes importing torch on two cores) takes
as long as its 30 steps."""
REFERENCE_STEPS = 3
PROFILE_STEPS = 4
SETTLED = 6
"""Steps from which every long wait is announced: a place is predicted by the least of its last
3 waits (V-shaped schedules have no simulated prior), so a place whose first waits were short is
announced only once those have left the history."""

Case = tuple[str, int]


def _ids(cases: tuple[Case, ...]) -> list[str]:
    return [f"{schedule}-{ranks}" for schedule, ranks in cases]


def _train(case: Case, steps: int, *extra: str) -> list[str]:
    schedule, ranks = case
    return [
        sys.executable,
        str(SCRIPT),
        "--spawn",
        str(ranks),
        "--compute",
        "sleep",
        "--micro-batches",
        "4",
        "--layers",
        str(2 * ranks),  # 4 ranks: steps long enough for the side tasks to start while the job trains
        # long passes: the waits stand well above the jitter of a shared 2-core machine
        "--sleep-forward-ms",
        "10",
        "--sleep-backward-ms",
        "20",
        "--schedule",
        schedule,
        "--steps",
        str(steps),
        *extra,
    ]


def _plain_env() -> dict[str, str]:
    """Without FreeRide variables; PYTHONPATH (the test tasks' folder) stays for the workers."""
    return {k: v for k, v in os.environ.items() if not k.startswith("FREERIDE_")}


def _records(stdout: str) -> list[dict[str, Any]]:
    records = []
    for line in stdout.splitlines():
        if line.startswith("{") and '"step"' in line:
            record: dict[str, Any] = json.loads(line)
            records.append(record)
    return records


def _losses(stdout: str) -> list[float]:
    records = sorted(_records(stdout), key=lambda r: r["step"])
    return [r["loss"] for r in records if r["loss"] is not None]


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_plain_env())
    assert done.returncode == 0, done.stderr[-4000:]
    assert "differs from FreeRide's" not in done.stderr, done.stderr[-4000:]  # the plan is the order torch runs
    return done


@pytest.fixture(scope="module", params=PROFILED, ids=_ids(PROFILED))
def schedule(request: pytest.FixtureRequest) -> Case:
    schedule, ranks = request.param
    return str(schedule), int(ranks)


@pytest.fixture(scope="module")
def job_dir(schedule: Case) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="frtp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(schedule: Case) -> list[float]:
    """The losses of the first steps without FreeRide."""
    return _reference(schedule)


def _reference(case: Case) -> list[float]:
    return _losses(_run(_train(case, REFERENCE_STEPS)).stdout)


@pytest.fixture(scope="module")
def profiled(job_dir: Path, schedule: Case) -> Path:
    out = job_dir / "job.profile.json"
    done = _run(
        freeride_cmd(
            "profile", "--runtime-dir", str(job_dir), "--out", str(out), "--", *_train(schedule, PROFILE_STEPS)
        )
    )
    assert done.stderr.count("[attach] torchpipe rank") == schedule[1], done.stderr[-4000:]
    return out


def test_profile_describes_every_stage(schedule: Case, profiled: Path) -> None:
    ranks = schedule[1]
    profile = load_profile(profiled)
    assert [s.stage for s in profile.stages] == list(range(ranks))
    assert all(s.framework == "torchpipe" and s.steps == PROFILE_STEPS - 1 for s in profile.stages)
    assert len(set(profile.devices)) == ranks
    for stage in profile.stages:
        assert stage.bubbles, stage  # every stage of these schedules waits for its neighbour
        assert 0.03 < stage.bubble_fraction < 0.6, (stage.stage, stage.bubble_fraction)


def _inside(spans: list[tuple[int, int]], start: int, end: int) -> int:
    return sum(max(0, min(e, end) - max(s, start)) for s, e in spans)


def test_bubbles_match_waits_and_side_tasks_run_in_them(
    schedule: Case, runtime_dir: Path, reference: list[float], profiled: Path
) -> None:
    devices = load_profile(profiled).devices
    trace_path = runtime_dir / "trace.json"
    with serving(runtime_dir, "--profile", str(profiled), "--trace", str(trace_path), env=_plain_env()):
        submit_spin_steps(runtime_dir, devices, STEP_MS)
        launched = _run(
            freeride_cmd("launch", "--runtime-dir", str(runtime_dir), "--", *_train(schedule, STEPS, "--recv-timers"))
        )
        assert "manager reachable" in launched.stderr, launched.stderr[-4000:]
        reply = status(runtime_dir)

    _check(schedule, launched.stdout, reply, trace_path, devices, reference, steps=STEPS, settled=SETTLED)


def _submit_now(runtime_dir: Path, devices: list[str]) -> None:
    """Submit one side task per device through the control socket (``freeride submit`` takes seconds to start)."""
    with ControlClient(Endpoints.ipc(runtime_dir).control, timeout_s=30) as client:
        for device in devices:
            spec = p.IterativeSpec(
                target="_tasks:SpinSteps",
                device=device,
                options={"step_ms": STEP_MS},
                step_time_ns=int(STEP_MS * MS),
            )
            reply = client.request(p.Submit(spec=spec))
            assert isinstance(reply, p.Submitted) and reply.device == device, reply


@pytest.mark.parametrize("case", ONE_LAUNCH, ids=_ids(ONE_LAUNCH))
def test_one_launch_bubbles_match_waits_and_side_tasks_run_in_them(case: Case, runtime_dir: Path) -> None:
    ranks = case[1]
    reference = [] if ranks == UNREFERENCED_RANKS else _reference(case)
    trace_path = runtime_dir / "trace.json"
    out, err = runtime_dir / "train.out", runtime_dir / "train.err"
    cmd = freeride_cmd(
        "launch", "--runtime-dir", str(runtime_dir), "--", *_train(case, ONE_LAUNCH_STEPS, "--recv-timers")
    )
    with serving(runtime_dir, "--trace", str(trace_path), env=_plain_env()):
        with out.open("w") as stdout, err.open("w") as stderr:
            job = subprocess.Popen(
                cmd, stdout=stdout, stderr=stderr, text=True, env=_plain_env(), start_new_session=True
            )
        try:
            training: list[p.DeviceStatus] = []

            def every_rank_said_hello() -> bool:
                training[:] = [d for d in status(runtime_dir).devices if d.alive and d.framework == "torchpipe"]
                return len(training) == ranks or job.poll() is not None

            poll(every_rank_said_hello, 180, "every rank's hello")
            assert len(training) == ranks, (training, err.read_text()[-4000:])
            devices = [d.device for d in sorted(training, key=lambda d: d.stage)]
            _submit_now(runtime_dir, devices)
            assert job.wait(300) == 0, err.read_text()[-4000:]
        finally:
            if job.poll() is None:  # the launcher and the ranks it started
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
        reply = status(runtime_dir)
    stderr_text = err.read_text()
    assert "differs from FreeRide's" not in stderr_text, stderr_text[-4000:]  # the plan is the order torch runs
    assert stderr_text.count("[attach] torchpipe rank") == ranks, stderr_text[-4000:]
    assert "manager reachable" in stderr_text, stderr_text[-4000:]
    assert len(set(devices)) == ranks
    _check(
        case, out.read_text(), reply, trace_path, devices, reference, steps=ONE_LAUNCH_STEPS, settled=ONE_LAUNCH_SETTLED
    )


def _check(
    case: Case,
    stdout: str,
    reply: p.StatusReply,
    trace_path: Path,
    devices: list[str],
    reference: list[float],
    *,
    steps: int,
    settled: int,
) -> None:
    # training computes what it computes alone
    losses = _losses(stdout)
    assert len(losses) == steps and losses[: len(reference)] == reference, (case, losses, reference)
    assert all(math.isfinite(loss) for loss in losses), (case, losses)

    # bubbles reached the manager from every stage, and the side tasks ran in them
    by_device = {d.device: d for d in reply.devices}
    tasks = {t.device: t for t in reply.tasks}
    for device in devices:
        d = by_device[device]
        assert d.steps == steps and d.bubbles >= steps - settled, (device, d.steps, d.bubbles)
        assert d.used_ns > 0, (device, d.used_ns, d.bubble_ns)
        assert tasks[device].steps > 0

    # the announced bubbles against the waits the script measured itself
    trace = load_trace(trace_path)
    records = _records(stdout)
    for stage, device in enumerate(devices):
        announced = trace.devices[device].bubbles
        mine = [r for r in records if r["rank"] == stage and r["step"] >= settled]
        # the schedule's waits: the places (a wait's position in the step) whose median wait is long;
        # a stall of a loaded machine elsewhere is no bubble of the schedule, and no backend could foresee it
        length = min(len(r["recv"]) for r in mine)
        places = [i for i in range(length) if statistics.median(r["recv"][i][1] for r in mine) >= 4 * MS]
        assert places, (stage, mine)
        # of those, the ones the rank's rule announces: it predicts a place's wait by the shortest of its
        # last three there (decision D41), so after a short one the place goes unannounced for three steps
        by_step = {r["step"]: r for r in records if r["rank"] == stage}
        foreseen = [
            (r["step"], i)
            for r in mine
            for i in places
            if all(
                len(by_step.get(r["step"] - k, {}).get("recv", ())) > i
                and by_step[r["step"] - k]["recv"][i][1] >= MIN_BUBBLE_NS
                for k in range(1, PREDICTOR_HISTORY + 1)
            )
        ]
        assert len(foreseen) >= len(mine) * len(places) // 2, (stage, foreseen)
        waits = [(t0, t0 + ns) for r in mine for i, (t0, ns) in enumerate(r["recv"]) if (r["step"], i) in foreseen]
        measured = sum(e - s for s, e in waits)
        covered = sum(_inside(announced, s, e) for s, e in waits)
        missed = [
            (r["step"], i, ns // 1000, _inside(announced, t0, t0 + ns) // 1000)
            for r in mine
            for i, (t0, ns) in enumerate(r["recv"])
            if (r["step"], i) in foreseen and _inside(announced, t0, t0 + ns) < 0.9 * ns
        ]
        assert covered >= 0.9 * measured, (stage, places, covered, measured, missed)
        all_waits = [
            (t0, t0 + ns) for r in records if r["rank"] == stage and r["step"] >= settled for t0, ns in r["recv"]
        ]
        first = min(s for s, _ in all_waits)
        late = [(s, e) for s, e in announced if s >= first]
        outside = sum(e - s for s, e in late) - sum(_inside(late, s, e) for s, e in all_waits)
        assert outside <= 0.1 * sum(e - s for s, e in late), (stage, outside, late)
