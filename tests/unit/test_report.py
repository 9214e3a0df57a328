"""freeride report: numbers of a hand-made trace, worked out by hand."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from freeride.cli.main import main
from freeride.observe.report import Prices, ReportOptions, build_report, parse_throughputs
from freeride.observe.timeline import merge_traces, parse_trace

MS = 1_000_000
ROOT = Path(__file__).resolve().parents[2]

# Two stages, steps 0..3 (step 0 is warm-up and left out). Times in ms.
STEPS = {
    "cpu:0": {0: (0, 100), 1: (100, 200), 2: (200, 300), 3: (300, 400)},
    "cpu:1": {0: (0, 100), 1: (100, 200), 2: (200, 310), 3: (310, 410)},
}
BUBBLES = {
    # the last one crosses the end of step 3: only [395, 400] is inside a step
    "cpu:0": [(50, 100), (150, 180), (250, 280), (350, 380), (395, 410)],
    "cpu:1": [(100, 120), (200, 220), (310, 330)],
}
# (task id, name, device, start, end, steps, busy ms)
GRANTS = [
    (1, "pagerank-a", "cpu:0", 55, 95, 4, 40),  # in the warm-up step: not counted
    (1, "pagerank-a", "cpu:0", 150, 170, 2, 20),
    (1, "pagerank-a", "cpu:0", 250, 290, 4, 36),  # runs 10 ms past its bubble's end
    (1, "pagerank-a", "cpu:0", 396, 399, 1, 3),
    (2, "sgd-b", "cpu:1", 100, 118, 6, 18),
    (2, "sgd-b", "cpu:1", 312, 330, 3, 18),
    (3, "other", "cpu:1", 200, 210, 5, 10),  # no throughput given for it
]
BASELINE_STEP_MS = [99, 98, 98, 99]


def event(ph: str, name: str, cat: str, pid: int, tid: int, ts_ms: float, **extra: Any) -> dict[str, Any]:
    return {"ph": ph, "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts_ms * 1000, **extra}


def training_events(steps: dict[str, dict[int, tuple[int, int]]], bubbles: dict[str, list[tuple[int, int]]]) -> list:
    events: list[dict[str, Any]] = []
    for tid, device in enumerate(sorted(steps), start=1):
        stage = tid - 1
        for b0, b1 in bubbles.get(device, []):
            events.append(event("X", "bubble", "bubble", 1, tid, b0, dur=(b1 - b0) * 1000, args={"device": device}))
        for step, (s0, s1) in steps[device].items():
            args = {"step": step, "device": device, "stage": stage, "start_ns": s0 * MS, "duration_ns": (s1 - s0) * MS}
            events.append(event("i", f"step {step}", "step", 1, tid, s1, s="t", args=args))
    return events


def write(path: Path, events: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"traceEvents": events}))
    return path


@pytest.fixture
def traces(tmp_path: Path) -> tuple[Path, Path]:
    events = training_events(STEPS, BUBBLES)
    for task_id, name, device, start, end, steps, busy in GRANTS:
        args = {"device": device, "task_id": task_id, "steps": steps, "busy_ns": busy * MS}
        events.append(event("X", name, "side_task", 2, task_id, start, dur=(end - start) * 1000, args=args))
    baseline_steps, t = {}, 0
    for step, dur in enumerate(BASELINE_STEP_MS):
        baseline_steps[step] = (t, t + dur)
        t += dur
    baseline = training_events(
        {"cpu:0": baseline_steps}, {"cpu:0": [(t0 + 50, t0 + 80) for t0, _ in baseline_steps.values()]}
    )
    return write(tmp_path / "fr.json", events), write(tmp_path / "base.json", baseline)


OPTIONS = ReportOptions(
    prices=Prices(train_gpu_per_hour=4.0, side_gpu_per_hour=0.5),
    throughputs=parse_throughputs(["pagerank-*=10", "sgd-b=3"]),
    warmup_steps=1,
)


def test_report_numbers_by_hand(traces: tuple[Path, Path]) -> None:
    fr, base = traces
    report = build_report(parse_trace(fr.read_bytes()), OPTIONS, parse_trace(base.read_bytes()))
    s0, s1 = report.stages
    # stage 0, steps 1..3: bubbles 30 + 30 + 30 + 5 (clipped at the step's end) in 300 ms
    assert (s0.device, s0.steps, s0.step_ns, s0.bubble_ns) == ("cpu:0", 3, 300 * MS, 95 * MS)
    # harvested: 20 + 36 * 30/40 (a quarter of that grant lies past the bubble) + 3
    assert s0.harvested_ns == (20 + 27 + 3) * MS
    assert s0.bubble_share == pytest.approx(95 / 300)
    assert s0.harvested_share == pytest.approx(50 / 95)
    # stage 1: steps of 100, 110, 100 ms; bubbles 20 each; grants 18 + 18 + 10 all inside
    assert (s1.step_ns, s1.bubble_ns, s1.harvested_ns) == (310 * MS, 60 * MS, 46 * MS)

    # a pipeline step lasts as long as its slowest stage: 100, 110, 100 -> median 100, T_fr = 0.31 s
    assert report.median_step_ns == 100 * MS
    assert report.training_s == pytest.approx(0.310)
    assert report.baseline_median_step_ns == 98 * MS  # 98, 98, 99 after the warm-up step
    assert report.slowdown == pytest.approx(100 / 98 - 1)
    t_van = 0.310 * 98 / 100
    assert report.vanilla_s == pytest.approx(t_van)

    work = {t.name: (t.work, t.cheap_gpu_s) for t in report.tasks}
    assert work["pagerank-a"] == (2 + 4 + 1, pytest.approx(7 / 10))
    assert work["sgd-b"] == (6 + 3, pytest.approx(9 / 3))
    assert work["other"] == (5, None)
    k = 4.0 * 2 / 0.5  # two training GPUs (the devices in the trace)
    assert report.k == pytest.approx(k)
    expected = ((7 / 10 + 9 / 3) / k - (0.310 - t_van)) / t_van
    assert report.saving == pytest.approx(expected)
    assert any("other" in note for note in report.notes)


def test_bubble_time_not_harvested_is_split_by_where_it_lies(traces: tuple[Path, Path], tmp_path: Path) -> None:
    fr, _ = traces
    s0, s1 = build_report(parse_trace(fr.read_bytes()), OPTIONS).stages
    # stage 0: [150, 180] worked to 170 (10 after), [250, 280] all, [350, 380] none (30), [395, 400] from 396 to 399
    assert (s0.idle_ns, s0.lead_ns, s0.tail_ns, s0.gap_ns) == (30 * MS, 1 * MS, 11 * MS, 0)
    # stage 1: [100, 120] to 118, [200, 220] to 210, [310, 330] from 312
    assert (s1.idle_ns, s1.lead_ns, s1.tail_ns, s1.gap_ns) == (0, 2 * MS, 12 * MS, 0)
    # two tasks' grants in one bubble, 5 ms apart
    events = training_events({"cpu:0": {0: (0, 100), 1: (100, 200)}}, {"cpu:0": [(120, 160)]})
    for task_id, start, end in ((1, 121, 130), (2, 135, 150)):
        args = {"device": "cpu:0", "task_id": task_id, "steps": 1, "busy_ns": (end - start) * MS}
        events.append(event("X", f"t{task_id}", "side_task", 2, task_id, start, dur=(end - start) * 1000, args=args))
    [one] = build_report(parse_trace(write(tmp_path / "two.json", events).read_bytes()), OPTIONS).stages
    assert (one.idle_ns, one.lead_ns, one.tail_ns, one.gap_ns) == (0, 1 * MS, 10 * MS, 5 * MS)
    assert "after the last 25.0%" in build_report(parse_trace((tmp_path / "two.json").read_bytes()), OPTIONS).text()


def test_the_time_after_the_last_step_past_the_predicted_end_is_told_apart(tmp_path: Path) -> None:
    events = training_events({"cpu:0": {0: (0, 100), 1: (100, 200)}}, {"cpu:0": [(110, 150), (160, 190)]})
    for ev in events:  # the rank predicted 25 ms for the first bubble, nothing for the second
        if ev["cat"] == "bubble" and ev["ts"] == 110 * 1000:
            ev["args"]["expected_ns"] = 25 * MS
    for start, end in ((111, 120), (161, 170)):
        args = {"device": "cpu:0", "task_id": 1, "steps": 1, "busy_ns": (end - start) * MS}
        events.append(event("X", "t", "side_task", 2, 1, start, dur=(end - start) * 1000, args=args))
    report = build_report(parse_trace(write(tmp_path / "t.json", events).read_bytes()), OPTIONS)
    [one] = report.stages
    # after the last: 150 - 120 and 190 - 170; past the predicted end (135) only in the first: 150 - 135
    assert (one.bubble_ns, one.tail_ns, one.tail_past_ns) == (70 * MS, 50 * MS, 15 * MS)
    assert "after the last 71.4% (21.4% past the predicted end)" in report.text()


def test_the_workers_own_time_between_steps_is_told_apart(tmp_path: Path) -> None:
    events = training_events({"cpu:0": {0: (0, 100), 1: (100, 200)}}, {"cpu:0": [(110, 150)]})
    # one grant spanning 112-142 with 24 ms of steps in it: 6 ms were the worker's own, between steps
    args = {"device": "cpu:0", "task_id": 1, "steps": 8, "busy_ns": 24 * MS}
    events.append(event("X", "t", "side_task", 2, 1, 112, dur=30 * 1000, args=args))
    report = build_report(parse_trace(write(tmp_path / "t.json", events).read_bytes()), OPTIONS)
    [one] = report.stages
    assert (one.bubble_ns, one.harvested_ns, one.lead_ns, one.tail_ns) == (40 * MS, 24 * MS, 2 * MS, 8 * MS)
    assert one.between_steps_ns == 6 * MS
    assert (
        "after the last 20.0% (0.0% past the predicted end), between grants 0.0%, inside grants between steps 15.0%"
        in (report.text())
    )


def test_without_baseline_the_saving_assumes_no_slowdown(traces: tuple[Path, Path]) -> None:
    fr, _ = traces
    options = ReportOptions(
        prices=Prices(train_gpu_per_hour=4.0, side_gpu_per_hour=0.5, train_gpus=4), throughputs=OPTIONS.throughputs
    )
    report = build_report(parse_trace(fr.read_bytes()), options)
    assert report.slowdown is None
    assert report.k == pytest.approx(4.0 * 4 / 0.5)
    assert report.saving == pytest.approx((7 / 10 + 9 / 3) / report.k / 0.310)


def test_cli_report_json_and_text(traces: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    fr, base = traces
    argv = ["report", str(fr), "--baseline", str(base), "--train-gpu-price", "4", "--side-gpu-price", "0.5"]
    argv += ["--side-throughput", "pagerank-*=10", "sgd-b=3"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    expected = build_report(parse_trace(fr.read_bytes()), OPTIONS, parse_trace(base.read_bytes()))
    assert doc["saving"] == pytest.approx(expected.saving)
    assert [s["bubble_share"] for s in doc["stages"]] == pytest.approx([95 / 300, 60 / 310])
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert f"slowdown {100 / 98 - 1:+.2%}" in text
    assert f"saving: {expected.saving:.2%}" in text


def test_bad_input_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="NAME=STEPS_PER_S"):
        parse_throughputs(["pagerank"])
    with pytest.raises(ValueError, match="side_gpu_per_hour"):
        Prices(side_gpu_per_hour=0)
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    (tmp_path / "junk.json").write_text("hello")
    assert main(["report", str(tmp_path / "junk.json")]) == 2


def test_render_timeline_draws_the_hand_made_trace(traces: tuple[Path, Path], tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("render_timeline", ROOT / "tools" / "render_timeline.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    fr, _ = traces
    out = tmp_path / "timeline.png"
    assert tool.main([str(fr), "--out", str(out), "--start-step", "1", "--steps", "2"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert tool.main([str(fr), "--out", str(out), "--start-step", "50"]) == 2  # no steps there


def test_interference_slices_are_counted_per_stage_and_task(tmp_path: Path) -> None:
    """The trace's interference slices (compute after bubble ends), inside the counted steps only."""
    events = training_events(STEPS, BUBBLES)
    for task_id, name, device, start, end, steps, busy in GRANTS:
        args = {"device": device, "task_id": task_id, "steps": steps, "busy_ns": busy * MS}
        events.append(event("X", name, "side_task", 2, task_id, start, dur=(end - start) * 1000, args=args))
    for task_id, name, device, at_ms, dur_ms in [
        (1, "pagerank-a", "cpu:0", 100, 5),  # after the warm-up step's last bubble: falls in step 1, counted
        (1, "pagerank-a", "cpu:0", 280, 6),
        (2, "sgd-b", "cpu:1", 330, 2),
    ]:
        args = {"device": device, "task_id": task_id, "interference_ns": dur_ms * MS}
        events.append(
            event("X", f"{name} past bubble end", "interference", 2, task_id, at_ms, dur=dur_ms * 1000, args=args)
        )
    report = build_report(parse_trace(write(tmp_path / "fr.json", events).read_bytes()), OPTIONS)
    s0, s1 = report.stages
    assert (s0.interference_ns, s1.interference_ns) == (11 * MS, 2 * MS)
    assert s0.interference_share == pytest.approx(11 / 300)
    assert [t.interference_ns for t in report.tasks] == [11 * MS, 2 * MS, 0]
    text = report.text()
    assert "interference" in text and "one run" not in text  # no baseline: no slowdown claimed


def test_one_report_over_every_nodes_trace(traces: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Two nodes of one job, each with its own trace (its own clock): one report, devices named by node."""
    fr, _ = traces
    nodes = []
    for node in ("node-a", "node-b"):
        (fr.parent / node).mkdir()
        nodes.append(fr.parent / node / "trace.json")
        nodes[-1].write_bytes(fr.read_bytes())
    prices = ["--train-gpu-price", "4", "--side-gpu-price", "0.5"]
    assert main(["report", *map(str, nodes), *prices, "--side-throughput", "pagerank-*=10", "sgd-b=3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    one = build_report(parse_trace(fr.read_bytes()), OPTIONS)
    assert [s["device"] for s in doc["stages"]] == ["node-a/cpu:0", "node-b/cpu:0", "node-a/cpu:1", "node-b/cpu:1"]
    assert [s["harvested_ns"] for s in doc["stages"]] == [50 * MS, 50 * MS, 46 * MS, 46 * MS]
    assert len(doc["tasks"]) == 2 * len(one.tasks) and len({t["task_id"] for t in doc["tasks"]}) == 6
    assert sum(t["work"] for t in doc["tasks"]) == 2 * sum(t.work for t in one.tasks)
    assert doc["k"] == pytest.approx(2 * one.k)  # four training devices, not two
    with pytest.raises(ValueError, match="must differ"):
        merge_traces([("a", parse_trace(fr.read_bytes())), ("a", parse_trace(fr.read_bytes()))])
