"""RankCourtesy against real processes sharing one core with the test (Linux ``/proc``).

A child process stands in for the rank's announcing thread (its main thread's
id is its pid): one that spins is runnable while the test runs on the core, one
that blocks on a pipe is not.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from freeride.worker.courtesy import RankCourtesy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, pins cores")

MS = 1_000_000
SPIN = "import sys; sys.stdout.write('spinning\\n'); sys.stdout.flush()\nwhile True: pass"
BLOCK = "import sys; sys.stdin.read()"
SPIN_THEN_BLOCK = (
    "import sys, time\n"
    "t = time.process_time() + 0.02\n"  # 20 ms of CPU, then block like a rank in its receive
    "while time.process_time() < t: pass\n"
    "sys.stdout.write('blocking\\n'); sys.stdout.flush(); sys.stdin.read()"
)


@pytest.fixture
def core() -> Iterator[int]:
    """Pin the test's thread to one core for the test (the worker's situation)."""
    before = os.sched_getaffinity(0)
    core = min(before)
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, before)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def spawn(children: list[subprocess.Popen[bytes]], code: str, cores: set[int]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    children.append(proc)
    os.sched_setaffinity(proc.pid, cores)
    return proc


def settle(courtesy: RankCourtesy, want: bool) -> bool:
    """Poll until ``waiting()`` is ``want`` (the child must first start and move to its core), or 5 s pass."""
    deadline = time.monotonic() + 5
    while courtesy.waiting() != want and time.monotonic() < deadline:
        time.sleep(0.001)
    return courtesy.waiting()


def test_a_runnable_rank_thread_on_the_workers_core_is_yielded_to_up_to_the_bound(
    core: int, children: list[subprocess.Popen[bytes]]
) -> None:
    rank = spawn(children, SPIN, {core})
    # past its start-up, whose reads of files can block it for a moment (and end the yield early)
    assert rank.stdout is not None and rank.stdout.readline() == b"spinning\n"
    courtesy = RankCourtesy(bound_ns=5 * MS)
    courtesy.follow(rank.pid)
    assert settle(courtesy, True)
    spent = courtesy.defer()
    assert spent >= 5 * MS  # a thread that never blocks keeps the worker yielding only that long
    courtesy.close()
    assert not courtesy.waiting()


def test_a_rank_thread_that_blocks_is_yielded_to_until_it_has_blocked(
    core: int, children: list[subprocess.Popen[bytes]]
) -> None:
    rank = spawn(children, SPIN_THEN_BLOCK, {core})
    courtesy = RankCourtesy(bound_ns=10_000 * MS)
    courtesy.follow(rank.pid)
    assert settle(courtesy, True)
    spent = courtesy.defer()
    assert 0 < spent < 10_000 * MS
    assert rank.stdout is not None and rank.stdout.readline() == b"blocking\n"
    assert not courtesy.waiting()
    assert courtesy.defer() == 0  # blocked: nothing to wait for


def test_a_blocked_rank_thread_costs_no_yield(core: int, children: list[subprocess.Popen[bytes]]) -> None:
    rank = spawn(children, BLOCK, {core})
    courtesy = RankCourtesy()
    courtesy.follow(rank.pid)
    assert not settle(courtesy, False)
    assert courtesy.defer() == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_nothing_is_yielded_to_a_thread_on_another_core_or_by_an_unpinned_worker(
    children: list[subprocess.Popen[bytes]],
) -> None:
    before = os.sched_getaffinity(0)
    mine, other = sorted(before)[:2]
    rank = spawn(children, SPIN, {other})
    try:
        os.sched_setaffinity(0, {mine})
        courtesy = RankCourtesy()
        courtesy.follow(rank.pid)
        time.sleep(0.05)  # the child runs on its own core: there is no state to wait for
        assert not courtesy.waiting()
        assert courtesy.defer() == 0
        courtesy.close()
        os.sched_setaffinity(0, {mine, other})
        unpinned = RankCourtesy()
        unpinned.follow(rank.pid)
        assert not unpinned.waiting()  # a worker on several cores has no core of its own to give
    finally:
        os.sched_setaffinity(0, before)


def test_a_thread_that_is_gone_or_unknown_is_not_waited_for(core: int, children: list[subprocess.Popen[bytes]]) -> None:
    rank = spawn(children, SPIN, {core})
    courtesy = RankCourtesy()
    courtesy.follow(rank.pid)
    assert settle(courtesy, True)
    rank.kill()
    rank.wait(timeout=10)
    assert not courtesy.waiting()
    assert courtesy.defer() == 0
    courtesy.follow(0)
    assert not courtesy.waiting()
