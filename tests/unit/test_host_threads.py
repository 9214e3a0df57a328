"""A process's placement and priority reach every thread it has, not only the calling one.

Run in a child process (a real one: the test process's own placement must not change), which
starts libzmq's I/O thread first, as a side-task worker does with its first socket.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_CHILD = """
import json, os, threading, zmq
from freeride.host.threads import lower_priority, pin, threads
ctx = zmq.Context()
sock = ctx.socket(zmq.PUB)  # libzmq's threads exist from here
core = min(os.sched_getaffinity(0))
pin([core])
lower_priority(19)
later = threading.Thread(target=lambda: None)  # started afterwards: inherits the calling thread's settings
later.start()
out = {str(t): [sorted(os.sched_getaffinity(t)), os.getpriority(os.PRIO_PROCESS, t)] for t in threads()}
later.join()
sock.close()
ctx.term()
print(json.dumps({"core": core, "threads": out}))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux only")
def test_every_thread_is_pinned_and_lowered_including_libzmqs() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=True)
    seen = json.loads(out.stdout)
    placed = seen["threads"].values()
    assert len(placed) >= 3  # the main thread and libzmq's I/O and reaper threads at least
    assert all(cores == [seen["core"]] and nice == 19 for cores, nice in placed), seen
