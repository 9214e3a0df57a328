"""Where the manager's own threads run: on spare cores where there are some, never on a training rank's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from freeride.host.owncores import Placement, place_manager


def test_no_rank_on_the_managers_cores_leaves_it_where_it_was() -> None:
    assert place_manager(frozenset({0, 1, 2, 3}), frozenset()) == Placement(frozenset({0, 1, 2, 3}), "")
    placement = place_manager(frozenset({2, 3}), frozenset({0, 1}))
    assert (placement.cores, placement.reason) == (frozenset({2, 3}), "")


def test_spare_cores_take_the_manager_off_the_ranks_cores() -> None:
    placement = place_manager(frozenset(range(8)), frozenset({0, 1, 2, 3}))
    assert placement.cores == frozenset({4, 5, 6, 7})
    assert placement.reason == "manager on core(s) 4,5,6,7, none of a training rank's"


def test_without_a_spare_core_the_manager_stays_and_says_so() -> None:
    placement = place_manager(frozenset({0, 1}), frozenset({0, 1}))
    assert placement.cores == frozenset({0, 1})
    assert placement.reason == "manager shares the training ranks' cores (0,1): no core it may use is spare"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move off one")
def test_every_thread_of_the_process_moves_and_later_threads_follow() -> None:
    """In a child process: this one keeps its cores."""
    cores = sorted(os.sched_getaffinity(0))
    script = textwrap.dedent(
        f"""
        import os, threading, time
        from freeride.host.owncores import OwnCores
        stop = threading.Event()
        before = threading.Thread(target=stop.wait); before.start()
        own = OwnCores()
        own.update(frozenset({{{cores[0]}}}))  # a rank on the first core: the others are spare
        after = threading.Thread(target=stop.wait); after.start(); time.sleep(0.05)
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        assert len(tids) == 3
        assert all(os.sched_getaffinity(t) == set({cores[1:]}) for t in tids), "every thread, the later one too"
        own.update(frozenset({cores}))  # ranks on every core: back where it was
        assert all(os.sched_getaffinity(t) == set({cores}) for t in tids)
        stop.set(); before.join(); after.join()
        print("ok", own.placement.reason)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok manager shares the training ranks' cores")
