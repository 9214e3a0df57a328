"""The worker takes time spent waiting for a CPU out of the step times it learns from."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from freeride.worker.gate import ThreadRunDelay


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="needs Linux schedstat")
def test_run_delay_grows_while_another_process_holds_the_core() -> None:
    """A real competing process on the same core: this thread's wait for the CPU is what the clock reads."""
    core = sorted(os.sched_getaffinity(0))[0]
    before_affinity = os.sched_getaffinity(0)
    spin = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    hog = subprocess.Popen([sys.executable, "-c", spin])
    try:
        os.sched_setaffinity(0, {core})
        time.sleep(0.2)  # the hog is running on the core
        delay = ThreadRunDelay()
        d0, t0 = delay.ns(), time.monotonic_ns()
        while time.monotonic_ns() - t0 < 200_000_000:  # 200 ms of wall time, shared with the hog
            pass
        waited = delay.ns() - d0
        delay.close()
    finally:
        hog.kill()
        hog.wait()
        os.sched_setaffinity(0, before_affinity)
    # sharing a core with an equal-priority spinner, about half of the 200 ms is spent waiting
    assert waited > 20_000_000, waited
    assert delay.ns() == 0  # closed: reads as no delay, never raises
