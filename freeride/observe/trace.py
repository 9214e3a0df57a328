"""Timeline traces: bubbles, training compute and side-task work, for Perfetto.

:class:`TraceWriter` is an :class:`~freeride.observe.Observer` that writes the
Trace Event Format (JSON Object Format) that Perfetto UI and
``chrome://tracing`` open:

* process ``training``: one thread per device (its stage), with ``compute``
  and ``bubble`` slices and a ``step N`` instant at the end of each step. The
  compute slices are the parts of a step not spent in announced bubbles. A
  rank's bubbles and its step reports may come on different sockets, in either
  order: a step is drawn once its bubbles are in (their time adds up to the
  step's bubble time, or a later bubble came);
* process ``side tasks``: one thread per task, with one slice per grant (first
  step start, or checkpoint start, to last step end; steps and busy time in
  its args) and an instant per state change (with the task's steps and
  metrics).

Timestamps are the ranks' and workers' ``CLOCK_MONOTONIC`` nanoseconds, written
as exact microseconds. The observer calls only buffer small tuples; a writer
thread encodes them and appends to the file in bulk, rewriting the closing
brackets after each batch, so the file is valid JSON after every flush (about
once a second) and a crash loses at most the last second. (A reader that
races a write, e.g. polling the file, can see it half written and should
read again.)
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from freeride import protocol as p
from freeride.observe.base import Observer

__all__ = ["SIDE_TASKS_PID", "TRAINING_PID", "TraceWriter"]

logger = logging.getLogger(__name__)

TRAINING_PID = 1
"""Trace process of the training stages."""
SIDE_TASKS_PID = 2
"""Trace process of the side tasks."""

_HEAD = b'{"displayTimeUnit":"ms","otherData":{"generator":"freeride","clock":"CLOCK_MONOTONIC"},"traceEvents":[\n'
_TAIL = b"\n]}\n"
_MAX_PENDING_BUBBLES = 8192
"""Bubbles kept per device while waiting for the step that contains them (a rank's step
reports may come about a second after its bubbles)."""
_MAX_WAITING_STEPS = 64
"""Steps kept per device while waiting for their bubbles: past this the oldest is drawn with the bubbles that came."""
_INTERFERENCE_TID = 1 << 24
"""Track of a task's interference slices: this plus its task id (beside the task's own track)."""
_STATUS_TID = 2 << 24
"""Track of a task's state changes: this plus its task id.

Not the task's own track: a grant's slice is written when the grant is done, and
may begin before a state change written while it ran.
"""

_Args = dict[str, Any] | tuple[tuple[str, ...], tuple[Any, ...]] | None
"""A dict, or (keys, values): cheaper to build on the event loop, zipped by the writer thread."""
# (ph, name, cat, pid, tid, ts_ns, dur_ns, args): encoded by the writer thread
_Record = tuple[str, str, str, int, int, int, int, _Args]
_BUBBLE_KEYS = ("step", "index", "device", "expected_ns")
_COMPUTE_KEYS = ("step", "device")


_Bubble = tuple[int, int, int, int, int]
"""(start ns, end ns, step, index, expected ns)"""


@dataclass(slots=True)
class _Track:
    tid: int
    device: str
    stage: int = -1
    rank: int = -1
    pending: list[_Bubble] = field(default_factory=list)
    last_end_ns: int = 0
    steps: collections.deque[p.StepFinished] = field(default_factory=collections.deque)
    """Steps reported whose bubbles may still be on their way."""
    bubble_sum: dict[int, int] = field(default_factory=dict)
    """Per step, the duration of its bubbles received."""
    newest_bubble_ns: int = 0
    """The start of the latest bubble received."""
    goodbyes: list[p.Goodbye] = field(default_factory=list)
    """Goodbyes written once the steps before them are."""


def _us(ns: int) -> msgspec.Raw:
    """Nanoseconds as an exact decimal number of microseconds."""
    sign, ns = ("-", -ns) if ns < 0 else ("", ns)
    return msgspec.Raw(f"{sign}{ns // 1000}.{ns % 1000:03d}".encode())


def _encode(rec: _Record) -> bytes:
    ph, name, cat, pid, tid, ts, dur, args = rec
    event: dict[str, Any] = {"ph": ph, "name": name, "pid": pid, "tid": tid}
    if ph != "M":
        event["cat"] = cat
        event["ts"] = _us(ts)
    if ph == "X":
        event["dur"] = _us(dur)
    elif ph == "i":
        event["s"] = "t"
    if isinstance(args, tuple):
        event["args"] = dict(zip(*args, strict=True))
    elif args is not None:
        event["args"] = args
    return msgspec.json.encode(event)


class TraceWriter(Observer):
    """Observer writing a Chrome/Perfetto trace of bubbles and side-task work.

    Args:
        path: File to write (replaced if it exists).
        flush_interval_s: Longest time an event waits in memory.
        batch: Events that trigger a write before the interval is up.
        clock: Stamps task state changes (monotonic ns); replaceable in tests.

    Raises:
        OSError: ``path`` cannot be created, or another process writes it.
    """

    def __init__(
        self,
        path: Path,
        *,
        flush_interval_s: float = 1.0,
        batch: int = 4096,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if flush_interval_s <= 0:
            raise ValueError(f"flush_interval_s must be > 0, got {flush_interval_s}")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.path = path
        self._clock = clock
        self._interval_s = flush_interval_s
        self._batch = batch
        self._queue: collections.deque[_Record] = collections.deque()
        self._tracks: dict[str, _Track] = {}
        self._rank_device: dict[int, str] = {}
        self._open: dict[int, p.BubbleStarted] = {}
        self._tasks: set[int] = set()
        self._interference_end: dict[int, int] = {}
        self._closed = False
        self._kicked = False
        self._cv = threading.Condition()
        self._stop = False
        self._requested = 0
        self._written = 0
        self._failed = False
        path.parent.mkdir(parents=True, exist_ok=True)
        # owned by the writer thread until close(); locked, so a second writer fails instead of interleaving
        self._file: BinaryIO = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+b")
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._file.close()
            raise OSError(f"trace file {path} is being written by another process") from None
        self._file.truncate(0)
        self._file.write(_HEAD + _TAIL)
        self._file.flush()
        self._events_written = 0
        self._meta(TRAINING_PID, 0, "process_name", {"name": "training"})
        self._meta(TRAINING_PID, 0, "process_sort_index", {"sort_index": 0})
        self._meta(SIDE_TASKS_PID, 0, "process_name", {"name": "side tasks"})
        self._meta(SIDE_TASKS_PID, 0, "process_sort_index", {"sort_index": 1})
        self._thread = threading.Thread(target=self._run, name="freeride-trace", daemon=True)
        self._thread.start()
        logger.info("[trace] writing %s", path)

    # -- observer -------------------------------------------------------------

    def backend_event(self, event: p.BackendEvent) -> None:
        match event:
            case p.Hello(rank=rank, stage=stage, device=device):
                self._rank_device[rank] = device
                track = self._track(device)
                if (track.stage, track.rank) != (stage, rank):
                    track.stage, track.rank = stage, rank
                    self._name_track(track)
            case p.BubbleStarted(rank=rank, device=device):
                self._rank_device.setdefault(rank, device)
                self._open[rank] = event
            case p.BubbleEnded():
                self._on_bubble_ended(event)
            case p.StepFinished():
                self._on_step(event)
            case p.Goodbye(rank=rank):
                known = self._rank_device.get(rank)
                if known is not None:
                    track = self._track(known)
                    track.goodbyes.append(event)
                    self._draw_steps(track)
            case p.Heartbeat():
                pass

    def grant_done(self, device: str, task_id: int, task_name: str, done: p.GrantDone) -> None:
        self._task_track(task_id, task_name, device)
        end = done.last_step_end_ns
        if done.busy_ns <= 0 or end <= 0:
            return  # the grant was given back unused
        # busy time also counts checkpoints, which may precede the first step (or be all the grant held)
        start = end - done.busy_ns
        if 0 < done.first_step_ns <= end:
            start = min(start, done.first_step_ns)
        args = {
            "device": device,
            "task_id": task_id,
            "grant_id": done.grant_id,
            "steps": done.steps,
            "busy_ns": done.busy_ns,
            "first_step_delay_ns": done.first_step_delay_ns,
            "overrun_ns": done.overrun_ns,
            "reason": done.reason,
        }
        self._put(("X", task_name, "side_task", SIDE_TASKS_PID, task_id, start, end - start, args))

    def interference(
        self, device: str, task_id: int, task_name: str, t_ns: int, dur_ns: int, *, stage_wait_ns: int = 0
    ) -> None:
        # Drawn from the bubble's end, as a GPU would run it: the work a side task did
        # after its bubble ended, which on a GPU would have held back training.
        self._task_track(task_id, task_name, device)
        tid = _INTERFERENCE_TID + task_id  # a track of its own: it overlaps the grant's work slice
        # Slices on one track must not overlap: one that would (a step that ran on past the
        # next bubble) is drawn after the previous one; its length, the figure, is kept.
        start = max(t_ns, self._interference_end.get(task_id, 0))
        self._interference_end[task_id] = start + dur_ns
        args = {
            "device": device,
            "task_id": task_id,
            "interference_ns": dur_ns,
            "stage_wait_ns": stage_wait_ns,
            "bubble_end_ns": t_ns,
        }
        self._put(("X", f"{task_name} past bubble end", "interference", SIDE_TASKS_PID, tid, start, dur_ns, args))

    def task_status(self, status: p.TaskStatus) -> None:
        self._task_track(status.task_id, status.name, status.device)
        args: dict[str, Any] = {
            "task_id": status.task_id,
            "name": status.name,
            "kind": status.kind,
            "state": status.state,
            "device": status.device,
            "steps": status.steps,
            "busy_ns": status.busy_ns,
            "restarts": status.restarts,
            "metrics": dict(status.metrics),
        }
        if status.error:
            args["error"] = status.error
        tid = _STATUS_TID + status.task_id
        self._put(("i", status.state, "task_status", SIDE_TASKS_PID, tid, self._clock(), 0, args))

    def training_cost(self, cost: p.TrainingCost) -> None:
        """A counter of the job's measured cost (percent), and an instant with the whole figure."""
        now = self._clock()
        if cost.pairs:
            percent = {"median": cost.slowdown * 100, "low": cost.low * 100, "high": cost.high * 100}
            self._put(("C", "training cost (%)", "training_cost", TRAINING_PID, 0, now, 0, percent))
        self._put(("i", "training cost", "training_cost", TRAINING_PID, 0, now, 0, msgspec.structs.asdict(cost)))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Write everything buffered so far and wait until it is on disk (not fsynced).

        Returns:
            Whether the write completed within ``timeout_s``.
        """
        if self._closed:
            return not self._thread.is_alive() and not self._failed
        with self._cv:
            self._requested += 1
            target = self._requested
            self._cv.notify_all()
            return self._cv.wait_for(lambda: self._written >= target or self._failed, timeout_s)

    def close(self) -> None:
        """Write the bubbles still waiting for their step, flush, and close the file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for track in self._tracks.values():
            self._draw_steps(track, every=True)
            self._emit_pending(track, until_ns=None)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(30.0)
        if self._thread.is_alive():
            logger.error("[trace] writer thread did not finish; %s may be incomplete", self.path)
            return
        logger.info("[trace] %s: %d events", self.path, self._events_written)

    # -- training tracks ------------------------------------------------------

    def _track(self, device: str) -> _Track:
        track = self._tracks.get(device)
        if track is None:
            track = _Track(tid=len(self._tracks) + 1, device=device)
            self._tracks[device] = track
            self._name_track(track)
        return track

    def _name_track(self, track: _Track) -> None:
        label = track.device if track.stage < 0 else f"stage {track.stage} ({track.device})"
        self._meta(TRAINING_PID, track.tid, "thread_name", {"name": label})
        self._meta(TRAINING_PID, track.tid, "thread_sort_index", {"sort_index": max(track.stage, 0) * 1000 + track.tid})

    def _device_of(self, rank: int, device: str = "") -> _Track:
        return self._track(device or self._rank_device.get(rank) or f"rank{rank}")

    def _on_bubble_ended(self, ev: p.BubbleEnded) -> None:
        started = self._open.pop(ev.rank, None)
        expected = -1
        if started is not None and (started.step, started.index) == (ev.step, ev.index):
            expected = started.expected_ns
        self._rank_device.setdefault(ev.rank, ev.device)
        track = self._device_of(ev.rank, ev.device)
        start = ev.t_ns - ev.duration_ns
        if start < track.last_end_ns:
            # its step was drawn without it (it waited too long): the file's order on the track comes first
            logger.debug("[trace] %s: bubble %d.%d came after its step was drawn", track.device, ev.step, ev.index)
            return
        track.pending.append((start, ev.t_ns, ev.step, ev.index, expected))
        track.bubble_sum[ev.step] = track.bubble_sum.get(ev.step, 0) + ev.duration_ns
        track.newest_bubble_ns = max(track.newest_bubble_ns, start)
        if track.steps or track.goodbyes:
            self._draw_steps(track)
        if len(track.pending) > _MAX_PENDING_BUBBLES:  # a backend that never reports steps
            self._emit_pending(track, until_ns=None)

    def _on_step(self, ev: p.StepFinished) -> None:
        track = self._device_of(ev.rank)
        track.steps.append(ev)
        self._draw_steps(track)

    def _draw_steps(self, track: _Track, *, every: bool = False) -> None:
        """Draw the steps whose bubbles are in (``every``: all of them), then the goodbyes after them."""
        while track.steps:
            ev = track.steps[0]
            complete = (
                track.bubble_sum.get(ev.step, 0) >= ev.bubble_ns  # every bubble of the step, by its time
                or track.newest_bubble_ns >= ev.t_ns  # a later bubble: the step's own came before it
            )
            if not (every or complete or len(track.steps) > _MAX_WAITING_STEPS):
                break
            track.steps.popleft()
            track.bubble_sum.pop(ev.step, None)
            self._draw_step(track, ev)
        if not track.steps:
            for goodbye in track.goodbyes:
                self._emit_pending(track, until_ns=None)
                args = {"rank": goodbye.rank, "dropped": goodbye.dropped}
                ts = max(goodbye.t_ns, track.last_end_ns)
                self._put(("i", "goodbye", "rank", TRAINING_PID, track.tid, ts, 0, args))
            track.goodbyes.clear()

    def _draw_step(self, track: _Track, ev: p.StepFinished) -> None:
        start, end = ev.t_ns - ev.duration_ns, ev.t_ns
        cursor = max(start, track.last_end_ns)
        inside = sorted(b for b in track.pending if b[0] < end)
        track.pending = [b for b in track.pending if b[0] >= end]
        step_args = (_COMPUTE_KEYS, (ev.step, track.device))
        for bubble in inside:
            if bubble[0] > cursor:
                self._compute(track, cursor, bubble[0], step_args)
            self._bubble(track, bubble)
            cursor = max(cursor, bubble[1])
        if end > cursor:
            self._compute(track, cursor, end, step_args)
        args = {
            "step": ev.step,
            "device": track.device,
            "stage": ev.stage,
            "start_ns": start,
            "duration_ns": ev.duration_ns,
            "bubble_ns": ev.bubble_ns,
        }
        self._put(("i", f"step {ev.step}", "step", TRAINING_PID, track.tid, max(end, track.last_end_ns), 0, args))
        track.last_end_ns = max(track.last_end_ns, end)

    def _compute(self, track: _Track, start: int, end: int, args: _Args) -> None:
        self._put(("X", "compute", "compute", TRAINING_PID, track.tid, start, end - start, args))
        track.last_end_ns = max(track.last_end_ns, end)

    def _bubble(self, track: _Track, b: _Bubble) -> None:
        start, end, step, index, expected = b
        args = (_BUBBLE_KEYS, (step, index, track.device, expected))
        self._put(("X", "bubble", "bubble", TRAINING_PID, track.tid, start, end - start, args))
        if end > track.last_end_ns:
            track.last_end_ns = end

    def _emit_pending(self, track: _Track, until_ns: int | None) -> None:
        keep: list[_Bubble] = []
        for bubble in sorted(track.pending):
            if until_ns is None or bubble[0] < until_ns:
                self._bubble(track, bubble)
            else:
                keep.append(bubble)
        track.pending = keep

    # -- side-task tracks -----------------------------------------------------

    def _task_track(self, task_id: int, name: str, device: str) -> None:
        if task_id in self._tasks:
            return
        self._tasks.add(task_id)
        label = f"{name} (task {task_id})" + (f" on {device}" if device else "")
        self._meta(SIDE_TASKS_PID, task_id, "thread_name", {"name": label})
        self._meta(SIDE_TASKS_PID, task_id, "thread_sort_index", {"sort_index": 3 * task_id})
        tid = _INTERFERENCE_TID + task_id
        self._meta(SIDE_TASKS_PID, tid, "thread_name", {"name": f"{label}: compute past bubble ends"})
        self._meta(SIDE_TASKS_PID, tid, "thread_sort_index", {"sort_index": 3 * task_id + 1})
        tid = _STATUS_TID + task_id
        self._meta(SIDE_TASKS_PID, tid, "thread_name", {"name": f"{label}: state"})
        self._meta(SIDE_TASKS_PID, tid, "thread_sort_index", {"sort_index": 3 * task_id + 2})

    # -- buffering and writing ------------------------------------------------

    def _meta(self, pid: int, tid: int, name: str, args: dict[str, Any]) -> None:
        self._put(("M", name, "", pid, tid, 0, 0, args))

    def _put(self, rec: _Record) -> None:
        if self._stop:
            return  # closed: the writer thread has taken its last batch
        queue = self._queue
        queue.append(rec)
        if len(queue) >= self._batch and not self._kicked:
            self._kicked = True
            with self._cv:
                self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(
                    lambda: self._stop or self._requested > self._written or len(self._queue) >= self._batch,
                    self._interval_s,
                )
                stop, target = self._stop, self._requested
            self._kicked = False
            self._write_queued()
            with self._cv:
                self._written = max(self._written, target)
                self._cv.notify_all()
            if stop:
                break
        try:
            self._file.close()
        except OSError:
            logger.exception("[trace] closing %s failed", self.path)

    def _write_queued(self) -> None:
        chunks: list[bytes] = []
        for _ in range(len(self._queue)):
            chunks.append(_encode(self._queue.popleft()))
        if not chunks or self._failed:
            return
        try:
            self._file.seek(-len(_TAIL), 2)
            sep = b",\n" if self._events_written else b""
            self._file.write(sep + b",\n".join(chunks) + _TAIL)
            self._file.truncate()
            self._file.flush()
            self._events_written += len(chunks)
        except OSError:
            self._failed = True
            logger.exception("[trace] writing %s failed; no further events are written", self.path)
