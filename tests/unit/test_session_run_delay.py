"""A rank reports how long its thread waited for its core at a bubble's end (BubbleEnded.waited_runnable_ns)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import cast

import pytest
from _sessionfix import Recorder

from freeride.backends.session import BackendConfig, BackendSession
from freeride.host.schedstat import ThreadRunDelay
from freeride.transport import EventEmitter

MS = 1_000_000


class Counter:
    """A run delay counter the test moves; counts its reads (one per bubble start and end)."""

    def __init__(self) -> None:
        self.value = 1_000 * MS
        self.reads = 0
        self.closed = False

    def ns(self) -> int:
        self.reads += 1
        return self.value

    def close(self) -> None:
        self.closed = True


def session(recorder: Recorder, run_delay: object | None = None) -> BackendSession:
    config = BackendConfig(
        endpoint="ipc:///nonexistent", rank=0, stage=0, num_stages=2, device="cpu:0", framework="test", min_bubble_ns=0
    )
    return BackendSession(config, emitter=cast(EventEmitter, recorder), run_delay=cast(ThreadRunDelay, run_delay))


def spin_for(ns: int) -> None:
    """Let a bubble last ``ns`` (a reported wait is bounded by the bubble's own length)."""
    t0 = time.monotonic_ns()
    while time.monotonic_ns() - t0 < ns:
        pass


def test_the_wait_between_a_bubbles_start_and_end_is_reported_with_its_end() -> None:
    recorder, counter = Recorder(), Counter()
    s = session(recorder, counter)
    s.bubble_started(0, 10 * MS)
    spin_for(3 * MS)
    counter.value += 2 * MS
    s.bubble_ended()
    s.bubble_started(0, 10 * MS)
    s.bubble_ended()
    assert [e.waited_runnable_ns for e in recorder.ended()] == [2 * MS, 0]
    assert counter.reads == 4  # one read at each start and each end, nothing more
    s.close()
    assert counter.closed


def test_a_bubble_timed_on_the_device_reports_no_host_wait() -> None:
    recorder, counter = Recorder(), Counter()
    s = session(recorder, counter)
    now = time.monotonic_ns()
    s.bubble_started(0, 10 * MS, t_ns=now)
    counter.value += 2 * MS
    s.bubble_ended(t_ns=now + 5 * MS)
    assert [e.waited_runnable_ns for e in recorder.ended()] == [0]
    assert counter.reads == 0


def test_the_wait_is_never_longer_than_the_bubble() -> None:
    recorder, counter = Recorder(), Counter()
    s = session(recorder, counter)
    now = time.monotonic_ns()
    s.bubble_started(0, 10 * MS)
    counter.value += 10**12  # a counter that jumped (another thread's): bounded by the bubble itself
    s.bubble_ended()
    [ended] = recorder.ended()
    assert 0 < ended.waited_runnable_ns == ended.duration_ns <= time.monotonic_ns() - now


def test_a_counter_read_from_another_thread_than_the_one_that_opened_it_reads_zero() -> None:
    delay = ThreadRunDelay()
    if delay.ns() == 0 and not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("needs Linux schedstat")
    seen: list[int] = []
    other = threading.Thread(target=lambda: seen.append(delay.ns()))
    other.start()
    other.join()
    assert seen == [0]
    delay.close()
    assert delay.ns() == 0  # closed: reads as no wait, never raises


def test_a_missing_counter_reads_zero() -> None:
    delay = ThreadRunDelay("/nonexistent/schedstat")
    assert delay.ns() == 0


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="needs Linux schedstat")
def test_a_stage_sharing_its_core_with_a_spinning_process_reports_its_wait() -> None:
    """A real competitor at the same priority on the same core: the stage is runnable, not running, part of the time.

    The "bubble" here is spent spinning (runnable throughout) rather than
    blocked, so the wait does not depend on when the kernel preempts a waking
    thread: about half of the wall time is spent waiting for the core.
    """
    core = sorted(os.sched_getaffinity(0))[0]
    before = os.sched_getaffinity(0)
    spin = (
        f"import os, sys\nos.sched_setaffinity(0, {{{core}}})\nsys.stdout.write('x')\nsys.stdout.flush()\nwhile 1: pass"
    )
    hog = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE)
    recorder = Recorder()
    try:
        assert hog.stdout is not None and hog.stdout.read(1) == b"x"  # pinned and spinning
        os.sched_setaffinity(0, {core})
        s = session(recorder, ThreadRunDelay())
        s.bubble_started(0, 10 * MS)
        spin_for(200 * MS)
        s.bubble_ended()
        s.close()
    finally:
        hog.kill()
        hog.wait()
        if hog.stdout is not None:
            hog.stdout.close()
        os.sched_setaffinity(0, before)
    [ended] = recorder.ended()
    assert 20 * MS < ended.waited_runnable_ns <= ended.duration_ns
