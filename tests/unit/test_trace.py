"""TraceWriter: the trace-event file it writes, and reading it back."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from _traceformat import load_checked

from freeride import protocol as p
from freeride.observe.timeline import load_trace, parse_trace
from freeride.observe.trace import SIDE_TASKS_PID, TRAINING_PID, TraceWriter

MS = 1_000_000
T0 = 1_000_000_123_456_789  # a monotonic clock a few days after boot, with sub-µs digits
STEP = 40 * MS
BUBBLES = [(10 * MS, 15 * MS), (25 * MS, 30 * MS)]
"""Offsets of the bubbles inside each step of stage 0."""


def hello(rank: int) -> p.Hello:
    return p.Hello(
        protocol_version=p.PROTOCOL_VERSION,
        rank=rank,
        stage=rank,
        num_stages=2,
        device=f"cpu:{rank}",
        framework="sim",
        pid=100 + rank,
    )


def run_steps(writer: TraceWriter, steps: int, *, rank: int = 0) -> None:
    """Feed ``steps`` steps of one rank: two bubbles each, then StepFinished."""
    for step in range(steps):
        base = T0 + step * STEP
        for index, (b0, b1) in enumerate(BUBBLES):
            kw: dict[str, Any] = {"rank": rank, "stage": rank, "device": f"cpu:{rank}", "step": step, "index": index}
            writer.backend_event(p.BubbleStarted(**kw, t_ns=base + b0, expected_ns=4 * MS))
            writer.backend_event(p.BubbleEnded(**kw, t_ns=base + b1, duration_ns=b1 - b0))
        writer.backend_event(
            p.StepFinished(rank=rank, stage=rank, step=step, t_ns=base + STEP, duration_ns=STEP, bubble_ns=10 * MS)
        )


def grant(task_id: int, grant_id: int, first: int, last: int, steps: int) -> p.GrantDone:
    return p.GrantDone(
        task_id=task_id,
        grant_id=grant_id,
        steps=steps,
        busy_ns=last - first,
        first_step_delay_ns=50_000,
        overrun_ns=0,
        reason="revoked",
        first_step_ns=first,
        last_step_end_ns=last,
    )


def ns(ts_us: float) -> int:
    return round(ts_us * 1000)


def slices(events: list[dict[str, Any]], pid: int, cat: str) -> list[tuple[int, int, dict[str, Any]]]:
    return [
        (ns(e["ts"]), ns(e["ts"]) + ns(e["dur"]), e["args"]) for e in events if e["pid"] == pid and e.get("cat") == cat
    ]


def test_trace_has_compute_bubbles_steps_and_side_task_work(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    now = [T0]
    writer = TraceWriter(path, clock=lambda: now[0])
    writer.backend_event(hello(0))
    writer.backend_event(hello(1))
    writer.task_status(
        p.TaskStatus(task_id=7, name="spin", kind="iterative", state="running", device="cpu:0", steps=0, busy_ns=0)
    )
    run_steps(writer, 3)
    writer.grant_done("cpu:0", 7, "spin", grant(7, 1, T0 + 10 * MS + 50_000, T0 + 14 * MS, steps=3))
    writer.grant_done("cpu:0", 7, "spin", grant(7, 2, 0, 0, steps=0))  # gave the grant back unused
    now[0] = T0 + 3 * STEP
    writer.task_status(
        p.TaskStatus(
            task_id=7,
            name="spin",
            kind="iterative",
            state="cancelled",
            device="cpu:0",
            steps=3,
            busy_ns=4 * MS,
            metrics={"loss": 0.5},
        )
    )
    writer.close()
    events = load_checked(path)

    names = {(e["pid"], e["tid"], e["name"]): e["args"] for e in events if e["ph"] == "M"}
    assert names[(TRAINING_PID, 0, "process_name")] == {"name": "training"}
    assert names[(SIDE_TASKS_PID, 0, "process_name")] == {"name": "side tasks"}
    stage0 = next(tid for (pid, tid, n), a in names.items() if n == "thread_name" and a["name"] == "stage 0 (cpu:0)")
    assert names[(SIDE_TASKS_PID, 7, "thread_name")]["name"] == "spin (task 7) on cpu:0"

    # compute is each step minus its bubbles, exactly (ns survive the µs encoding)
    compute = [(s, e) for s, e, _ in slices(events, TRAINING_PID, "compute")]
    bubbles = [(s, e) for s, e, _ in slices(events, TRAINING_PID, "bubble")]
    expected_compute, expected_bubbles = [], []
    for step in range(3):
        base = T0 + step * STEP
        cuts = [base] + [base + t for b in BUBBLES for t in b] + [base + STEP]
        expected_compute += [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts), 2)]
        expected_bubbles += [(base + b0, base + b1) for b0, b1 in BUBBLES]
    assert compute == expected_compute
    assert bubbles == expected_bubbles
    assert all(a["expected_ns"] == 4 * MS and a["device"] == "cpu:0" for _, _, a in slices(events, 1, "bubble"))
    busy = sum(e - s for s, e in compute) + sum(e - s for s, e in bubbles)
    assert busy == 3 * STEP  # the track covers every step without gaps or double counting

    steps = [e for e in events if e.get("cat") == "step"]
    assert [(e["name"], e["tid"], ns(e["ts"]), e["args"]["duration_ns"]) for e in steps] == [
        (f"step {s}", stage0, T0 + (s + 1) * STEP, STEP) for s in range(3)
    ]

    (work,) = slices(events, SIDE_TASKS_PID, "side_task")
    assert work[:2] == (T0 + 10 * MS + 50_000, T0 + 14 * MS)
    assert work[2]["steps"] == 3 and work[2]["busy_ns"] == 4 * MS - 50_000 and work[2]["device"] == "cpu:0"
    states = [
        (e["name"], ns(e["ts"]), e["args"]["steps"], e["args"]["metrics"])
        for e in events
        if e.get("cat") == "task_status"
    ]
    assert states == [("running", T0, 0, {}), ("cancelled", T0 + 3 * STEP, 3, {"loss": 0.5})]


def test_checkpoint_time_is_side_task_work(tmp_path: Path) -> None:
    # A worker counts checkpoints in its busy time: a grant may hold only a
    # checkpoint, or start with one before its first step.
    path = tmp_path / "t.json"
    writer = TraceWriter(path)
    end = T0 + 5 * MS
    only = p.GrantDone(
        task_id=1,
        grant_id=1,
        steps=0,
        busy_ns=3 * MS,
        first_step_delay_ns=-1,
        overrun_ns=0,
        reason="no_fit",
        last_step_end_ns=end,
    )
    first = T0 + 20 * MS  # 1 ms of checkpoint, then two 2 ms steps
    before = p.GrantDone(
        task_id=1,
        grant_id=2,
        steps=2,
        busy_ns=5 * MS,
        first_step_delay_ns=0,
        overrun_ns=0,
        reason="revoked",
        first_step_ns=first,
        last_step_end_ns=first + 4 * MS,
    )
    writer.grant_done("cpu:0", 1, "ckpt", only)
    writer.grant_done("cpu:0", 1, "ckpt", before)
    writer.close()
    work = slices(load_checked(path), SIDE_TASKS_PID, "side_task")
    assert [(s, e, a["steps"], a["busy_ns"]) for s, e, a in work] == [
        (end - 3 * MS, end, 0, 3 * MS),
        (first - MS, first + 4 * MS, 2, 5 * MS),
    ]


def test_a_step_reported_before_its_bubbles_is_drawn_when_they_come(tmp_path: Path) -> None:
    # A rank publishes its bubbles on a socket of its own and sends its step reports
    # on the events socket: the last step's report and the goodbye may come first.
    path = tmp_path / "t.json"
    writer = TraceWriter(path)
    writer.backend_event(hello(0))
    events: list[p.BackendEvent] = []
    for step in range(3):
        base = T0 + step * STEP
        for index, (b0, b1) in enumerate(BUBBLES):
            kw: dict[str, Any] = {"rank": 0, "stage": 0, "device": "cpu:0", "step": step, "index": index}
            events.append(p.BubbleEnded(**kw, t_ns=base + b1, duration_ns=b1 - b0))
    reports = [
        p.StepFinished(rank=0, stage=0, step=s, t_ns=T0 + (s + 1) * STEP, duration_ns=STEP, bubble_ns=10 * MS)
        for s in range(3)
    ]
    goodbye = p.Goodbye(rank=0, t_ns=T0 + 3 * STEP + MS, dropped=0)
    # step 0's report after both its bubbles; steps 1 and 2 and the goodbye ahead of their second bubbles
    for ev in [*events[:2], reports[0], events[2], reports[1], events[3], events[4], reports[2], goodbye, events[5]]:
        writer.backend_event(ev)
    writer.close()
    trace = load_checked(path)
    bubbles = [(s, e) for s, e, _ in slices(trace, TRAINING_PID, "bubble")]
    assert bubbles == [(T0 + n * STEP + b0, T0 + n * STEP + b1) for n in range(3) for b0, b1 in BUBBLES]
    compute = sum(e - s for s, e, _ in slices(trace, TRAINING_PID, "compute"))
    assert compute == 3 * (STEP - 10 * MS)
    assert [e["name"] for e in trace if e.get("cat") in ("step", "rank")] == ["step 0", "step 1", "step 2", "goodbye"]


def test_a_step_whose_bubbles_never_come_is_drawn_at_the_next_bubble_or_on_close(tmp_path: Path) -> None:
    # Bubbles published before the manager's subscription reached the rank are lost to it.
    path = tmp_path / "t.json"
    writer = TraceWriter(path)
    writer.backend_event(hello(0))
    for step in range(2):
        writer.backend_event(
            p.StepFinished(rank=0, stage=0, step=step, t_ns=T0 + (step + 1) * STEP, duration_ns=STEP, bubble_ns=MS)
        )
    later = p.BubbleEnded(rank=0, stage=0, device="cpu:0", step=2, index=0, t_ns=T0 + 2 * STEP + 2 * MS, duration_ns=MS)
    writer.backend_event(later)
    writer.backend_event(
        p.StepFinished(rank=0, stage=0, step=2, t_ns=T0 + 3 * STEP, duration_ns=STEP, bubble_ns=2 * MS)
    )  # its second bubble never comes
    writer.close()
    trace = load_checked(path)
    assert [ns(e["ts"]) for e in trace if e.get("cat") == "step"] == [T0 + STEP, T0 + 2 * STEP, T0 + 3 * STEP]
    assert [(s, e) for s, e, _ in slices(trace, TRAINING_PID, "bubble")] == [
        (T0 + 2 * STEP + MS, T0 + 2 * STEP + 2 * MS)
    ]


def test_a_state_change_written_while_a_grant_ran_keeps_the_trace_valid(tmp_path: Path) -> None:
    # A grant's slice is written when the grant is done; a state change (here the
    # task's progress) written while it ran has a later time but was written first.
    path = tmp_path / "t.json"
    now = [T0 + 200 * MS]
    writer = TraceWriter(path, clock=lambda: now[0])
    running = p.TaskStatus(
        task_id=3, name="spin", kind="iterative", state="running", device="cpu:0", steps=100, busy_ns=9 * MS
    )
    writer.task_status(running)
    writer.grant_done("cpu:0", 3, "spin", grant(3, 23, T0, T0 + 390 * MS, steps=2))
    writer.close()
    events = load_checked(path)
    (work,) = slices(events, SIDE_TASKS_PID, "side_task")
    assert work[:2] == (T0, T0 + 390 * MS)
    (state,) = [e for e in events if e.get("cat") == "task_status"]
    assert (ns(state["ts"]), state["args"]["task_id"], state["args"]["steps"]) == (T0 + 200 * MS, 3, 100)
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names[state["tid"]] == "spin (task 3) on cpu:0: state"
    # read back, the state belongs to its task
    task = parse_trace(path.read_bytes()).tasks[3]
    assert (task.state, len(task.grants)) == ("running", 1)


def test_interference_is_drawn_from_the_bubble_end_with_the_stages_wait_in_its_args(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    writer = TraceWriter(path)
    writer.interference("cpu:0", 1, "t", T0, 3 * MS, stage_wait_ns=2 * MS)
    writer.interference("cpu:0", 1, "t", T0 + MS, MS)  # overlaps the first: drawn after it, its length kept
    writer.close()
    drawn = slices(load_checked(path), SIDE_TASKS_PID, "interference")
    assert [(s, e, a["interference_ns"], a["stage_wait_ns"], a["bubble_end_ns"]) for s, e, a in drawn] == [
        (T0, T0 + 3 * MS, 3 * MS, 2 * MS, T0),
        (T0 + 3 * MS, T0 + 4 * MS, MS, 0, T0 + MS),
    ]


def test_a_second_writer_of_the_same_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text("old contents")
    writer = TraceWriter(path)
    try:
        with pytest.raises(OSError, match="another process"):
            TraceWriter(path)
        run_steps(writer, 1)
    finally:
        writer.close()
    assert len([e for e in load_checked(path) if e.get("cat") == "step"]) == 1


def test_timestamps_are_exact_microseconds(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    writer = TraceWriter(path)
    run_steps(writer, 1)
    writer.close()
    text = path.read_text()
    first_bubble = T0 + BUBBLES[0][0]
    assert f'"ts":{first_bubble // 1000}.{first_bubble % 1000:03d}' in text


def test_file_is_valid_json_after_every_flush(tmp_path: Path) -> None:
    # A crash between flushes must leave a file Perfetto can open: the closing
    # brackets are rewritten after each batch.
    path = tmp_path / "t.json"
    writer = TraceWriter(path, flush_interval_s=3600)
    try:
        assert json.loads(path.read_text())["traceEvents"] == []  # header and tail from the start
        run_steps(writer, 2)
        assert writer.flush()
        first = load_checked(path)
        assert len([e for e in first if e.get("cat") == "step"]) == 2
        for step in range(2, 4):
            base = T0 + step * STEP
            writer.backend_event(p.StepFinished(rank=0, stage=0, step=step, t_ns=base + STEP, duration_ns=STEP))
        assert writer.flush()
        second = load_checked(path)
        assert second[: len(first)] == first
        assert len([e for e in second if e.get("cat") == "step"]) == 4
    finally:
        writer.close()
    assert len(load_checked(path)) == len(second)


def test_a_full_batch_is_written_without_a_flush(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    writer = TraceWriter(path, flush_interval_s=3600, batch=8)
    try:
        run_steps(writer, 3)  # > 8 events: compute, bubbles and step markers
        deadline = time.monotonic() + 10

        def written() -> bool:
            try:
                return bool(json.loads(path.read_text())["traceEvents"])
            except json.JSONDecodeError:  # read while the writer thread was mid-write: look again
                return False

        while not written():
            assert time.monotonic() < deadline, "the writer thread never wrote the full batch"
            time.sleep(0.01)
    finally:
        writer.close()


def test_bubbles_of_a_backend_without_steps_are_written_on_close(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    writer = TraceWriter(path)
    kw: dict[str, Any] = {"rank": 3, "stage": 1, "device": "cuda:1", "step": 0, "index": 0}
    writer.backend_event(p.BubbleStarted(**kw, t_ns=T0, expected_ns=MS))
    writer.backend_event(p.BubbleEnded(**kw, t_ns=T0 + 2 * MS, duration_ns=2 * MS))
    writer.close()
    writer.close()  # idempotent
    events = load_checked(path)
    assert [(s, e) for s, e, _ in slices(events, TRAINING_PID, "bubble")] == [(T0, T0 + 2 * MS)]
    assert not slices(events, TRAINING_PID, "compute")


def test_read_back_and_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    writer = TraceWriter(path)
    writer.backend_event(hello(0))
    run_steps(writer, 3)
    writer.grant_done("cpu:0", 7, "spin", grant(7, 1, T0 + 10 * MS + 50_000, T0 + 14 * MS, steps=3))
    writer.close()
    trace = load_trace(path)
    dev = trace.devices["cpu:0"]
    assert dev.stage == 0
    assert dev.steps == {s: (T0 + s * STEP, T0 + (s + 1) * STEP) for s in range(3)}
    assert dev.bubbles[:2] == [(T0 + b0, T0 + b1) for b0, b1 in BUBBLES]
    (g,) = trace.tasks[7].grants
    assert (g.start_ns, g.end_ns, g.steps, g.device) == (T0 + 10 * MS + 50_000, T0 + 14 * MS, 3, "cpu:0")

    # a crash in the middle of a write leaves half an event: read up to the last whole one
    data = path.read_bytes()
    cut = data[: data.rindex(b'"step 2"')]
    partial = parse_trace(cut)
    assert set(partial.devices["cpu:0"].steps) == {0, 1}
