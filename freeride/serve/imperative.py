"""Run an unmodified program only inside bubbles.

An imperative side task is any command. :class:`ImperativeProcess` starts it in
its own session (so its process group holds its children too), stopped before
the program runs a single instruction of its own: a tiny ``/bin/sh`` shim stops
itself with ``SIGSTOP`` and only then ``exec``\\ s the program. ``resume()``
sends ``SIGCONT`` to the group and arms a timer for the bubble's expected end;
the timer or ``suspend()`` sends ``SIGSTOP`` to the group. ``SIGSTOP`` cannot be
caught, so stopping never waits for the program (a Python-level handler would
wait for the current C call to return).

The deadline timer is a ``timerfd`` watched by the event loop, so it fires with
microsecond precision; ``loop.call_at`` (millisecond granularity under uvloop and
the selector loops) is the fallback where ``timerfd`` is unavailable.

The stop latency (deadline or ``suspend()`` call to the program observed in state
``T``) is measured by re-reading ``/proc/<pid>/stat`` of the group leader right
after the signal, for at most :data:`SPIN_BUDGET_NS`, then by polling from the
loop. It is an upper bound: a program that is waiting for a CPU when the signal
comes runs no more of its code, but only shows ``T`` once it is scheduled.

Each program has a watchdog: a ``/bin/sh`` in its own session blocked reading a
pipe whose other end only this process holds. If the runtime dies without
calling :meth:`ImperativeProcess.terminate`, the pipe closes and the watchdog
kills the program's group, so no stopped program outlives the runtime.
(A process forked, not spawned, by the runtime would inherit that pipe end and
delay this until it exits.)

With a :class:`~freeride.host.cgroup.TaskCgroup` the stopped shim is moved into it
before the program starts: every process the program makes is then signalled
with its group, one that called ``setsid`` included, and killed with it; the
cgroup also caps their memory together, by what they use. Without one a
``setsid`` child escapes SIGSTOP and SIGKILL (only the watchdog's process group
is reached).

Memory on a CPU device without a memory cgroup is capped with ``RLIMIT_AS``
applied to the stopped shim before the program starts (loose: address space,
not memory in use). Never cap a CUDA program that way: CUDA reserves a
huge virtual range at init and fails with out-of-memory under a small
``RLIMIT_AS``; on a GPU the cap is MPS's (see :mod:`freeride.gpu.mps`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import shutil
import signal
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from freeride.admission import latest_end_ns
from freeride.host.cgroup import TaskCgroup
from freeride.host.procs import RESET_SIGNALS, SHELL, DeadlineTimer, group_members, read_state, spawn_watchdog

__all__ = ["SPIN_BUDGET_NS", "ExitInfo", "ImperativeProcess", "sync_every_env"]

logger = logging.getLogger(__name__)

SPIN_BUDGET_NS = 500_000
"""How long a stop is confirmed in place (blocking the loop) before polling from the loop."""
_SPIN_NS = 50_000
_NAP_S = 20e-6

_SHIM = 'cd -- "$1" || exit 126; shift; kill -STOP $$; exec "$@"'
_LATENCY_SAMPLES = 65536
_SYNC_DIR = Path(__file__).with_name("_torchsync")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExitInfo:
    """How an imperative program ended."""

    returncode: int
    """Exit status, or minus the signal number when a signal killed it."""
    signal: int | None
    """Signal that killed the program, ``None`` when it exited."""
    user_s: float
    """User CPU time of the program and the children it waited for."""
    system_s: float
    """System CPU time of the program and the children it waited for."""
    max_rss_kb: int
    """Peak resident set size in KiB."""


def sync_every_env(env: Mapping[str, str], sync_every: int) -> dict[str, str]:
    """Environment that makes a PyTorch program synchronize every ``sync_every`` optimizer steps.

    Prepends a directory holding a ``sitecustomize`` module to ``PYTHONPATH``; it
    registers a global optimizer step hook that calls ``torch.cuda.synchronize()``
    every ``sync_every`` calls of ``Optimizer.step`` once CUDA is initialised, so at
    most that many steps of kernels are queued when the program is stopped. The
    hook does nothing in programs that never initialise CUDA.

    Args:
        env: The program's environment.
        sync_every: Steps between synchronizations; 0 returns ``env`` unchanged.

    Returns:
        A new environment.

    Raises:
        ValueError: If ``sync_every`` is negative.
    """
    if sync_every < 0:
        raise ValueError(f"sync_every must be >= 0, got {sync_every}")
    out = dict(env)
    if sync_every:
        old = out.get("PYTHONPATH", "")
        out["PYTHONPATH"] = str(_SYNC_DIR) + (os.pathsep + old if old else "")
        out["FREERIDE_SYNC_EVERY"] = str(sync_every)
    return out


class ImperativeProcess:
    """An unmodified program that runs only between :meth:`resume` and the next stop.

    All methods must be called from the event loop thread that ran :meth:`start`.

    Args:
        argv: Command line; ``argv[0]`` is looked up on ``env["PATH"]``.
        env: The program's complete environment (nothing is inherited).
        log_dir: Where ``<name>.out`` and ``<name>.err`` are appended to.
        name: Short name for logs and log files.
        cpu_affinity: Cores to pin the program to; empty keeps the parent's.
        memory_limit: ``RLIMIT_AS`` cap in bytes, -1 for none. CPU programs only.
        margin_ns: The deadline timer stops the program this long before the deadline.
        sync_every: For PyTorch programs, synchronize CUDA every this many
            optimizer steps (see :func:`sync_every_env`); 0 leaves the program alone.
        cwd: Working directory; None keeps the parent's.
        cgroup: The program's cgroup (empty, made for it), removed at :meth:`terminate`; None for none.

    Raises:
        ValueError: On an invalid argument (the message names it).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        log_dir: Path,
        name: str,
        cpu_affinity: Sequence[int] = (),
        memory_limit: int = -1,
        margin_ns: int = 0,
        sync_every: int = 0,
        cwd: Path | None = None,
        cgroup: TaskCgroup | None = None,
    ) -> None:
        if not argv or not argv[0]:
            raise ValueError("argv must be a non-empty command line")
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"name must be a plain file name, got {name!r}")
        if memory_limit != -1 and memory_limit <= 0:
            raise ValueError(f"memory_limit must be -1 or positive, got {memory_limit}")
        if margin_ns < 0:
            raise ValueError(f"margin_ns must be >= 0, got {margin_ns}")
        if any(c < 0 for c in cpu_affinity):
            raise ValueError(f"cpu_affinity must hold core numbers, got {list(cpu_affinity)}")
        self.argv = list(argv)
        self.env = sync_every_env(env, sync_every)
        self.log_dir, self.name = Path(log_dir), name
        self.cpu_affinity = tuple(cpu_affinity)
        self.memory_limit, self.margin_ns = memory_limit, margin_ns
        self.cwd = cwd
        self.cgroup = cgroup
        self.pid = -1
        """Process id of the program (and id of its process group); -1 before start."""
        self.busy_ns = 0
        """Total time between resumes and stops."""
        self.stop_latencies_ns: deque[int] = deque(maxlen=_LATENCY_SAMPLES)
        """Deadline or ``suspend()`` call to the program observed stopped, most recent last."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit: asyncio.Future[ExitInfo] | None = None
        self._timer: DeadlineTimer | None = None
        self._stat_fd = self._pidfd = -1
        self._watchdog: tuple[int, int] | None = None
        self._resumed_ns: int | None = None
        self._pending: tuple[int, asyncio.TimerHandle] | None = None

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        """Spawn the program stopped, pinned and capped; it runs from the first :meth:`resume`.

        Raises:
            RuntimeError: If already started.
            FileNotFoundError: If ``argv[0]`` is not found.
            OSError: If spawning, pinning or capping fails (the child is killed).
        """
        if self._loop is not None:
            raise RuntimeError(f"{self.name}: already started")
        program = self.argv[0]
        if "/" in program and self.cwd is not None:
            program = os.path.join(self.cwd, program)
        if shutil.which(program, path=self.env.get("PATH", os.defpath)) is None:
            raise FileNotFoundError(f"{self.name}: command not found: {self.argv[0]!r}")
        loop = self._loop = asyncio.get_running_loop()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = os.open(self.log_dir / f"{self.name}.out", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        err = os.open(self.log_dir / f"{self.name}.err", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            cwd = str(self.cwd) if self.cwd is not None else os.getcwd()
            self.pid = os.posix_spawn(
                SHELL,
                [self.argv[0], "-c", _SHIM, self.argv[0], cwd, *self.argv],
                dict(self.env),
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, out, 1),
                    (os.POSIX_SPAWN_DUP2, err, 2),
                ],
                setsid=True,
                setsigdef=RESET_SIGNALS,
                setsigmask=(),
            )
        finally:
            os.close(out)
            os.close(err)
        self._exit = loop.create_future()
        try:
            self._stat_fd = os.open(f"/proc/{self.pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
            self._pidfd = os.pidfd_open(self.pid)
            self._watchdog = spawn_watchdog(self.pid, self.cgroup.kill_file() if self.cgroup else "")
            if await self._until_shim_stopped():
                if self.cgroup is not None:
                    self.cgroup.add(self.pid)
                if self.cpu_affinity:
                    os.sched_setaffinity(self.pid, self.cpu_affinity)
                if self.memory_limit > 0:
                    limit = (self.memory_limit, self.memory_limit)
                    resource.prlimit(self.pid, resource.RLIMIT_AS, limit)
        except BaseException:
            self._kill_group(signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self._close_fds()
            self._retire_watchdog()
            if self.cgroup is not None:
                self.cgroup.remove()
            raise
        self._timer = DeadlineTimer(loop, self._on_deadline)
        loop.add_reader(self._pidfd, self._reap)
        logger.info("[imperative] %s: started pid=%d argv=%s (stopped)", self.name, self.pid, self.argv)

    async def _until_shim_stopped(self, timeout_s: float = 10.0) -> bool:
        """Wait for the launcher to stop itself; False if it exited instead (wait() reports it)."""
        deadline = time.monotonic() + timeout_s
        delay = 0.0002
        while True:
            info = os.waitid(os.P_PID, self.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT | os.WNOHANG)
            if info is not None:
                return info.si_code == os.CLD_STOPPED
            if time.monotonic() > deadline:
                raise OSError(f"{self.name}: launcher did not stop within {timeout_s}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.01)

    # ------------------------------------------------------------ run / stop

    @property
    def running(self) -> bool:
        """Whether the program has been resumed and not stopped since."""
        return self._resumed_ns is not None

    @property
    def exited(self) -> bool:
        """Whether the program has exited and been reaped."""
        return self._exit is not None and self._exit.done()

    def resume(self, deadline_ns: int, *, margin_ns: int | None = None) -> None:
        """Continue the program now; stop it at ``deadline_ns - margin_ns`` unless stopped earlier.

        A deadline already past leaves the program stopped (or stops it). Calling
        it while running moves the deadline. Does nothing once the program has
        exited.

        Args:
            deadline_ns: Expected end of the bubble on the ``time.monotonic_ns()`` clock.
            margin_ns: This grant's margin (None: the process's own).

        Raises:
            RuntimeError: If the process has not been started.
        """
        if self._timer is None:
            raise RuntimeError(f"{self.name}: resume() before start()")
        if self.exited:
            return
        stop_at = latest_end_ns(deadline_ns, self.margin_ns if margin_ns is None else margin_ns)
        now = time.monotonic_ns()
        if stop_at <= now:
            logger.debug("[imperative] %s: deadline already passed, not running", self.name)
            self._stop(now)
            return
        self._timer.arm(stop_at)
        if self._resumed_ns is None:
            self._flush_pending(now)
            self._resumed_ns = now
            self._kill_group(signal.SIGCONT)

    def suspend(self) -> None:
        """Stop the whole process group now (idempotent; cancels the deadline timer)."""
        self._stop(time.monotonic_ns())

    def _on_deadline(self, when_ns: int) -> None:
        self._stop(when_ns)

    def _stop(self, since_ns: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._resumed_ns is None:
            return
        self._kill_group(signal.SIGSTOP)
        now = time.monotonic_ns()
        self.busy_ns += now - self._resumed_ns
        self._resumed_ns = None
        self._confirm_stop(since_ns, now + SPIN_BUDGET_NS)

    def _confirm_stop(self, since_ns: int, check_until_ns: int) -> None:
        """Record ``since_ns`` -> observed stopped; check briefly here, then poll from the loop.

        The first checks spin (a program on another core stops within tens of
        microseconds); later ones sleep a few microseconds so that a program
        sharing this core gets the CPU it needs to act on the signal.
        """
        self._pending = None
        nap_after = time.monotonic_ns() + _SPIN_NS
        while True:
            state = read_state(self._stat_fd)
            now = time.monotonic_ns()
            if state in "TtXZ":
                if state in "Tt":
                    self.stop_latencies_ns.append(max(0, now - since_ns))
                return
            if now >= check_until_ns:
                break
            if now >= nap_after:
                time.sleep(_NAP_S)
        assert self._loop is not None
        handle = self._loop.call_later(0.0005, self._confirm_stop, since_ns, 0)
        self._pending = (since_ns, handle)

    def _cancel_pending(self) -> None:
        if self._pending is not None:
            self._pending[1].cancel()
            self._pending = None

    def _flush_pending(self, now_ns: int) -> None:
        """Settle a stop still unconfirmed when the program is resumed again.

        ``SIGCONT`` discards a ``SIGSTOP`` not yet acted on, so a stop that is not
        observed now never happens: count it as having taken until now rather than
        drop the slowest samples.
        """
        if self._pending is None:
            return
        since_ns = self._pending[0]
        self._cancel_pending()
        self.stop_latencies_ns.append(max(0, now_ns - since_ns))

    def _kill_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)
        if self.cgroup is not None:  # after the group: its stop is the one timed
            self.cgroup.signal(sig, skip_group=self.pid)

    def _members(self) -> bool:
        """Whether any process of the program is left (its group, or its cgroup)."""
        return bool(group_members(self.pid)) or (self.cgroup is not None and bool(self.cgroup.pids()))

    # -------------------------------------------------------------- exit

    def _reap(self) -> None:
        try:
            pid, status, usage = os.wait4(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status, usage = self.pid, 0, None
            logger.warning("[imperative] %s: pid %d was reaped elsewhere", self.name, self.pid)
        if pid == 0:
            return
        if self._resumed_ns is not None:
            self.busy_ns += time.monotonic_ns() - self._resumed_ns
            self._resumed_ns = None
        self._cancel_pending()
        if self._timer is not None:
            self._timer.close()
        assert self._loop is not None and self._exit is not None
        self._loop.remove_reader(self._pidfd)
        self._close_fds()
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        info = ExitInfo(
            returncode=os.waitstatus_to_exitcode(status),
            signal=sig,
            user_s=usage.ru_utime if usage else 0.0,
            system_s=usage.ru_stime if usage else 0.0,
            max_rss_kb=usage.ru_maxrss if usage else 0,
        )
        logger.info("[imperative] %s: pid %d exited %s", self.name, self.pid, info)
        if not self._members():  # nothing left for the watchdog to kill
            self._retire_watchdog()
        if not self._exit.done():
            self._exit.set_result(info)

    def _close_fds(self) -> None:
        for fd in (self._stat_fd, self._pidfd):
            if fd >= 0:
                os.close(fd)
        self._stat_fd = self._pidfd = -1

    async def wait(self) -> ExitInfo:
        """Wait for the program to exit.

        Returns:
            Exit status and resource usage.

        Raises:
            RuntimeError: If the process has not been started.
        """
        if self._exit is None:
            raise RuntimeError(f"{self.name}: wait() before start()")
        return await asyncio.shield(self._exit)

    async def terminate(self, timeout_s: float = 5.0) -> ExitInfo:
        """End the program and everything in its process group (idempotent).

        Sends ``SIGTERM`` then ``SIGCONT`` to the group, waits up to ``timeout_s``
        for the program and its group to go, then ``SIGKILL``\\ s what is left.

        Args:
            timeout_s: Grace period before ``SIGKILL``.

        Returns:
            How the program ended (also when it had already exited).

        Raises:
            RuntimeError: If the process has not been started.
        """
        if self._exit is None:
            raise RuntimeError(f"{self.name}: terminate() before start()")
        if self._timer is not None:
            self._timer.cancel()
        if self.exited and not self._members():
            self._retire_watchdog()
            if self.cgroup is not None:
                self.cgroup.remove()
            return self._exit.result()
        if self._resumed_ns is not None:
            self.busy_ns += time.monotonic_ns() - self._resumed_ns
            self._resumed_ns = None
        self._kill_group(signal.SIGTERM)
        self._kill_group(signal.SIGCONT)
        if not await self._group_gone(time.monotonic() + timeout_s):
            logger.warning("[imperative] %s: still alive %.1fs after SIGTERM, killing", self.name, timeout_s)
            self._kill_group(signal.SIGKILL)
            if self.cgroup is not None:
                self.cgroup.kill()
            if not await self._group_gone(time.monotonic() + 10.0):
                logger.error("[imperative] %s: group %d survived SIGKILL", self.name, self.pid)
        self._retire_watchdog()
        if self.cgroup is not None:
            self.cgroup.remove()
        return await asyncio.shield(self._exit)

    def _retire_watchdog(self) -> None:
        if self._watchdog is None:
            return
        pid, write_end = self._watchdog
        self._watchdog = None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        os.close(write_end)

    async def _group_gone(self, deadline: float) -> bool:
        assert self._exit is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._exit), max(0.0, deadline - time.monotonic()))
        delay = 0.002
        while self._members():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self._exit.done()
