"""Process trees as /proc states them: who descends from whom, who is in a process group."""

from __future__ import annotations

import os
import subprocess
import sys

from freeride.host.procs import descendants, descends_from, group_members


def test_a_child_descends_from_its_parents_and_not_the_other_way() -> None:
    me, parent = os.getpid(), os.getppid()
    assert descends_from(me, me) and descends_from(me, parent)
    assert not descends_from(parent, me)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as child:
        try:
            assert descends_from(child.pid, me) and descends_from(child.pid, parent)
        finally:
            child.kill()
    assert not descends_from(child.pid, me)  # gone (reaped): nothing to follow


def test_descendants_are_children_and_grandchildren_and_never_the_process_itself() -> None:
    sleep = "import time; time.sleep(30)"
    parent = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {sleep!r}]); print(flush=True); {sleep}"
    with subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == b"\n"  # the grandchild is started
            mine = descendants(child.pid)
            assert len(mine) == 1 and descends_from(mine[0], child.pid)
            assert set(descendants(os.getpid())) >= {child.pid, mine[0]}
            assert os.getpid() not in descendants(os.getpid())
        finally:
            for pid in descendants(child.pid):
                os.kill(pid, 9)
            child.kill()


def test_group_members_lists_a_new_group_and_only_it() -> None:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True) as child:
        try:
            assert group_members(child.pid) == [child.pid]
            assert os.getpid() not in group_members(child.pid)
        finally:
            child.kill()
