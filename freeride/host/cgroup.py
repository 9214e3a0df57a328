"""A cgroup per side task (Linux), where this process may make them.

A process group holds only the processes that stay in it: a child that calls
``setsid`` leaves it, and ``killpg`` (SIGSTOP at a bubble's end, SIGKILL on
cancel) no longer reaches it. A cgroup holds every descendant, whatever it
does, and can cap their memory together by what they use (not by address
space, as ``RLIMIT_AS`` does).

Two hierarchies are used when they can be written:

* cgroup v2 (the unified one): membership, ``cgroup.kill``, and ``memory.max``
  where the memory controller can be enabled for our children;
* cgroup v1 ``memory`` (hybrid hosts): ``memory.limit_in_bytes`` where v2 has no
  memory controller.

Groups are made under the cgroup this process is in, in a directory named after
it (``freeride-<pid>``). Where neither hierarchy is writable (an unprivileged
container, a non-root user without delegation) :meth:`TaskCgroup.create`
returns ``None``; the callers then fall back to process groups and
``RLIMIT_AS``, and a ``setsid`` child escapes them (see docs).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TaskCgroup", "cgroups_available", "remove_own_cgroups"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Roots:
    v2: Path | None
    """Our own directory under the v2 hierarchy, if writable (``freeride-<pid>`` goes in it)."""
    v1_memory: Path | None
    """Likewise under the v1 memory hierarchy."""


def _own_path(controller: str) -> str | None:
    """This process's cgroup path in the hierarchy of ``controller`` ("" for v2)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        number, controllers, path = line.split(":", 2)
        if controller == "" and number == "0" and controllers == "":
            return path
        if controller and controller in controllers.split(","):
            return path
    return None


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fs type, super options) of every mount."""
    out: list[tuple[str, str, str]] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) > 4 and len(tail) >= 3:
            out.append((fields[4].replace("\\040", " "), tail[0], tail[2]))
    return out


def _writable_dir(base: Path) -> Path | None:
    """``base/freeride-<pid>`` if it can be made (it is made again when needed, removed when empty)."""
    mine = base / f"freeride-{os.getpid()}"
    try:
        mine.mkdir(exist_ok=True)
    except OSError:
        return None
    with contextlib.suppress(OSError):  # a probe: made again when a task needs it
        mine.rmdir()
    return mine


@functools.cache
def _roots() -> _Roots:
    v2 = v1 = None
    for point, fstype, opts in _mounts():
        if fstype == "cgroup2" and v2 is None:
            own = _own_path("")
            if own is not None:
                v2 = _writable_dir(Path(point) / own.lstrip("/"))
        elif fstype == "cgroup" and "memory" in opts.split(",") and v1 is None:
            own = _own_path("memory")
            if own is not None:
                v1 = _writable_dir(Path(point) / own.lstrip("/"))
    return _Roots(v2=v2, v1_memory=v1)


def _enable_v2_memory(mine: Path) -> None:
    """Let the groups in ``mine`` have ``memory.max`` where the parent delegates the controller (v2 only)."""
    for where in (mine.parent, mine):
        controllers = _read(where / "cgroup.controllers").split()
        if "memory" not in controllers:
            return
        if "memory" not in _read(where / "cgroup.subtree_control").split():
            with contextlib.suppress(OSError):  # EBUSY: processes live in it (the no-internal-process rule)
                (where / "cgroup.subtree_control").write_text("+memory")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def cgroups_available() -> bool:
    """Whether side tasks here get cgroups (membership at least; memory caps per :attr:`TaskCgroup.memory_by`)."""
    roots = _roots()
    return roots.v2 is not None or roots.v1_memory is not None


def remove_own_cgroups() -> None:
    """Remove this process's ``freeride-<pid>`` directories (once its tasks' groups are gone)."""
    if not _roots.cache_info().currsize:
        return
    roots = _roots()
    for path in (roots.v2, roots.v1_memory):
        if path is not None:
            with contextlib.suppress(OSError):
                path.rmdir()


class TaskCgroup:
    """The cgroup(s) of one side task's process tree.

    Args are internal; use :meth:`create`.
    """

    def __init__(self, v2: Path | None, v1_memory: Path | None) -> None:
        self.v2 = v2
        self.v1_memory = v1_memory
        self.memory_by = ""
        """What caps the memory: ``cgroup2``, ``cgroup1``, or "" (nothing here)."""
        self.memory_max = -1

    @classmethod
    def create(cls, name: str, *, memory_max: int = -1) -> TaskCgroup | None:
        """Make the cgroup(s) of a task named ``name`` (a plain file name); None where none can be made.

        Args:
            name: Unique among the live tasks of this process.
            memory_max: Bytes its processes may use together; -1 for no cap.
        """
        roots = _roots()
        made: dict[str, Path] = {}
        for kind, root in (("v2", roots.v2), ("v1", roots.v1_memory)):
            if root is None:
                continue
            path = root / name
            try:
                root.mkdir(exist_ok=True)
                if kind == "v2":
                    _enable_v2_memory(root)
                path.mkdir(exist_ok=True)
            except OSError as exc:
                logger.warning("[tasks] cannot make cgroup %s: %s", path, exc)
                continue
            made[kind] = path
        if not made:
            return None
        group = cls(made.get("v2"), made.get("v1"))
        if memory_max > 0:
            group.set_memory_max(memory_max)
        return group

    # -- membership -------------------------------------------------------------

    def add(self, pid: int) -> None:
        """Move process ``pid`` (and so every child it makes from now on) into the group.

        Raises:
            OSError: If it cannot be moved.
        """
        for path in self._dirs():
            (path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        """The processes in the group now."""
        seen: set[int] = set()
        for path in self._dirs():
            seen.update(int(x) for x in _read(path / "cgroup.procs").split())
        return sorted(seen)

    def signal(self, sig: int, *, skip_group: int = -1) -> int:
        """Send ``sig`` to every process in the group (except those in process group ``skip_group``).

        Returns:
            How many processes were signalled.
        """
        n = 0
        for pid in self.pids():
            try:
                if skip_group > 0 and os.getpgid(pid) == skip_group:
                    continue
                os.kill(pid, sig)
                n += 1
            except ProcessLookupError:
                continue
        return n

    def kill(self) -> None:
        """SIGKILL every process in the group, those that fork meanwhile included (``cgroup.kill`` on v2)."""
        if self.v2 is not None and (self.v2 / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (self.v2 / "cgroup.kill").write_text("1")
                return
        self.signal(signal.SIGKILL)

    # -- memory -----------------------------------------------------------------

    def set_memory_max(self, limit: int) -> None:
        """Cap the group's memory at ``limit`` bytes (where a hierarchy here has the controller)."""
        if self.v2 is not None and (self.v2 / "memory.max").exists():
            with contextlib.suppress(OSError):
                (self.v2 / "memory.max").write_text(str(limit))
                with contextlib.suppress(OSError):  # no swapping past the cap either
                    (self.v2 / "memory.swap.max").write_text("0")
                self.memory_by, self.memory_max = "cgroup2", limit
                return
        if self.v1_memory is not None:
            with contextlib.suppress(OSError):
                (self.v1_memory / "memory.limit_in_bytes").write_text(str(limit))
                with contextlib.suppress(OSError):
                    (self.v1_memory / "memory.memsw.limit_in_bytes").write_text(str(limit))
                self.memory_by, self.memory_max = "cgroup1", limit

    def memory_current(self) -> int:
        """Bytes the group uses now; -1 where unknown."""
        for path, name in ((self.v2, "memory.current"), (self.v1_memory, "memory.usage_in_bytes")):
            if path is not None:
                text = _read(path / name).strip()
                if text.isdigit():
                    return int(text)
        return -1

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the group for going over its memory cap."""
        if self.memory_by == "cgroup2" and self.v2 is not None:
            for line in _read(self.v2 / "memory.events").splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip() not in ("", "0"):
                    return True
        if self.memory_by == "cgroup1" and self.v1_memory is not None:
            for line in _read(self.v1_memory / "memory.oom_control").splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip() not in ("", "0"):
                    return True
            return _read(self.v1_memory / "memory.failcnt").strip() not in ("", "0")
        return False

    # -- end --------------------------------------------------------------------

    def remove(self) -> None:
        """Kill what is left in the group and remove it (idempotent; best effort)."""
        if self.pids():
            self.kill()
            # a killed process leaves its cgroup only once it has exited: rmdir fails (EBUSY)
            # until then, and a directory left behind would never be removed
            deadline = time.monotonic() + 1.0
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.002)
        for path in self._dirs():
            with contextlib.suppress(OSError):  # EBUSY while a killed process is still exiting
                path.rmdir()
            with contextlib.suppress(OSError):  # ours, unless another task's group is in it
                path.parent.rmdir()
        self.v2 = self.v1_memory = None

    def kill_file(self) -> str:
        """Path whose write of ``1`` kills the group (for a watchdog); "" where there is none."""
        if self.v2 is not None and (self.v2 / "cgroup.kill").exists():
            return str(self.v2 / "cgroup.kill")
        return ""

    def _dirs(self) -> list[Path]:
        return [p for p in (self.v2, self.v1_memory) if p is not None]
