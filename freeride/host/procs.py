"""Process plumbing for :mod:`freeride.serve.imperative` (Linux only).

A deadline timer on ``timerfd`` (microsecond precision, where the event loops'
own timers round to milliseconds), reading a process's state from ``/proc``,
finding the live members of a process group, and the per-program watchdog.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import time
from collections.abc import Callable

__all__ = [
    "RESET_SIGNALS",
    "SHELL",
    "DeadlineTimer",
    "bind_to_parent",
    "descendants",
    "descends_from",
    "group_members",
    "process_cpu_ns",
    "read_state",
    "spawn_watchdog",
]

logger = logging.getLogger(__name__)

SHELL = "/bin/sh"
RESET_SIGNALS = (
    signal.SIGPIPE,
    signal.SIGXFSZ,
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
    signal.SIGCHLD,
    signal.SIGTSTP,
    signal.SIGTTIN,
    signal.SIGTTOU,
)
# Kills the program's group when the runtime's end of its stdin closes: if the
# runtime dies without terminating the program, a stopped group would otherwise
# stay stopped forever, holding its (device) memory.
# With a cgroup, its cgroup.kill file (argument 2) also gets those that left the
# group with setsid.
_WATCHDOG = 'read -r _; kill -KILL -"$1"; [ -z "$2" ] || echo 1 > "$2"'


class _TimerSpec(ctypes.Structure):
    _fields_ = (
        ("interval_s", ctypes.c_int64),
        ("interval_ns", ctypes.c_long),
        ("value_s", ctypes.c_int64),
        ("value_ns", ctypes.c_long),
    )


def _load_timerfd() -> ctypes.CDLL | None:
    if ctypes.sizeof(ctypes.c_long) != 8:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.timerfd_create.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.timerfd_settime.argtypes = (
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(_TimerSpec),
            ctypes.c_void_p,
        )
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _load_timerfd()
_CLOCK_MONOTONIC, _TFD_TIMER_ABSTIME = 1, 1
_TFD_FLAGS = os.O_NONBLOCK | os.O_CLOEXEC


class DeadlineTimer:
    """One-shot timer on the monotonic clock, fired from the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[int], None]) -> None:
        self._loop, self._callback = loop, callback
        self._when_ns = -1
        self._handle: asyncio.TimerHandle | None = None
        self._fd = _LIBC.timerfd_create(_CLOCK_MONOTONIC, _TFD_FLAGS) if _LIBC is not None else -1
        if self._fd >= 0:
            loop.add_reader(self._fd, self._on_fd)

    def arm(self, when_ns: int) -> None:
        self.cancel()
        self._when_ns = when_ns
        if self._fd >= 0 and _LIBC is not None:
            s, ns = divmod(max(when_ns, 1), 1_000_000_000)
            if _LIBC.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME, _TimerSpec(0, 0, s, ns), None) == 0:
                return
            logger.warning("timerfd_settime failed (errno %d); using loop timers", ctypes.get_errno())
        delay_s = (when_ns - time.monotonic_ns()) / 1e9
        self._handle = self._loop.call_at(self._loop.time() + delay_s, self._fire)

    def cancel(self) -> None:
        self._when_ns = -1
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._fd >= 0 and _LIBC is not None:
            _LIBC.timerfd_settime(self._fd, 0, _TimerSpec(0, 0, 0, 0), None)

    def close(self) -> None:
        self.cancel()
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1

    def _on_fd(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            return
        self._fire()

    def _fire(self) -> None:
        when, self._when_ns, self._handle = self._when_ns, -1, None
        if when >= 0:
            self._callback(when)


def read_state(fd: int) -> str:
    """State letter of a process from an open ``/proc/<pid>/stat``; ``X`` when it is gone."""
    try:
        raw = os.pread(fd, 512, 0)
    except OSError:
        return "X"
    end = raw.rfind(b")")
    return chr(raw[end + 2]) if 0 <= end < len(raw) - 2 else "X"


def spawn_watchdog(pgid: int, kill_file: str = "") -> tuple[int, int]:
    """Start the watchdog of group ``pgid``; returns its pid and the pipe end that keeps it waiting.

    Args:
        pgid: The process group it kills.
        kill_file: A cgroup's ``cgroup.kill``, written too ("" for none).
    """
    read_end, write_end = os.pipe()  # both close-on-exec: no program inherits the write end
    try:
        pid = os.posix_spawn(
            SHELL,
            ["freeride-watchdog", "-c", _WATCHDOG, "freeride-watchdog", str(pgid), kill_file],
            {"PATH": os.defpath},
            file_actions=[
                (os.POSIX_SPAWN_DUP2, read_end, 0),
                (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
            ],
            setsid=True,
            setsigdef=RESET_SIGNALS,
            setsigmask=(),
        )
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    return pid, write_end


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            members.append(int(entry.name))
    return members


def _stat_fields(pid: int) -> list[bytes]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, pgrp, ...); [] if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return raw[raw.rfind(b")") + 2 :].split()


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is ``ancestor`` or one of its descendants (by the parent chain in /proc)."""
    seen = 0
    while pid > 1 and seen < 64:
        if pid == ancestor:
            return True
        fields = _stat_fields(pid)
        if len(fields) < 2:
            return False
        pid = int(fields[1])
        seen += 1
    return pid == ancestor


def descendants(ancestor: int) -> list[int]:
    """The live descendants of process ``ancestor`` (itself excluded), from one reading of /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and len(fields := _stat_fields(int(entry.name))) >= 2:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [ancestor]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def bind_to_parent(name: str) -> None:
    """Name this process (``comm``) and have the kernel SIGKILL it when its parent dies.

    For helper processes (side-task workers, simulated stages) that must never
    outlive the process that started them, even one killed with SIGKILL.
    Linux only; a no-op elsewhere.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


_CPUCLOCK_SCHED = 2
"""Linux's per-process CPU clock of scheduler runtime (``CPUCLOCK_SCHED`` in the kernel's posix-cpu-timers)."""


def process_cpu_ns(pid: int) -> int:
    """CPU time of every thread of process ``pid`` so far, in ns; -1 if it cannot be read.

    This is the clock ``clock_getcpuclockid(3)`` names for the process, read
    without a file: the clock id of another process is ``(~pid << 3) | 2``.
    Within the process it equals ``CLOCK_PROCESS_CPUTIME_ID``.
    """
    if pid <= 0:
        return -1
    try:
        return time.clock_gettime_ns((~pid << 3) | _CPUCLOCK_SCHED)
    except OSError:  # gone, or another user's
        return -1
