"""Process trees as /proc states them: who descends from whom, who is in a process group."""

from __future__ import annotations

import os
import subprocess
import sys

from freeride.host.procs import descends_from, group_members


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


def test_group_members_lists_a_new_group_and_only_it() -> None:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True) as child:
        try:
            assert group_members(child.pid) == [child.pid]
            assert os.getpid() not in group_members(child.pid)
        finally:
            child.kill()
