"""The node's manager for ``freeride launch``: found if one serves the runtime directory, else started.

One manager per node (per runtime directory), however many launches start at
once there (Slurm starts one ``freeride launch`` per task): every launch takes
:class:`~freeride.host.jobs.LaunchLock` and, holding it, asks the manager named by
the serve lock (``RUNTIME_DIR/serve.lock``, the pid the running manager wrote)
for its status, the way ``freeride status`` does. A manager that answers is
used; one whose pid is gone (a crash leaves its pid and socket files behind)
is replaced, with one line saying so; with none, one is started.

A started manager runs detached from the launch (its own session, reparented
to init, so neither a terminal's Ctrl-C nor the training command's exit kills
it), logs to ``RUNTIME_DIR/manager.log`` and is started with ``serve
--exit-with-jobs``: it exits, after checkpointing its side tasks, once every
job registered with it (:mod:`freeride.host.jobs`) has ended, unless a launch asked
to keep it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from freeride import protocol as p
from freeride.auth import ServeLock, ensure_private_dir
from freeride.host.jobs import JOBS_DIR, KEEP, Job, LaunchLock, keep_manager, register_job
from freeride.transport import ControlClient, Endpoints, ManagerUnreachable, nobody_listens

__all__ = ["LOG_NAME", "ManagerNotStarted", "NodeManager", "StartOptions", "ensure_manager", "serve_lock_pid"]

LOG_NAME = "manager.log"
"""The log of a manager that a launch started, in the runtime directory."""
_SERVE_LOCK = "serve.lock"  # written by freeride.auth.ServeLock: the running manager's pid

Connect = Callable[[float], ControlClient]
"""A control client of the node's manager with the given timeout (ipc, or tcp with CURVE keys)."""


class ManagerNotStarted(Exception):
    """No manager could be found or started; the message says why and where to look."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StartOptions:
    """How ``freeride launch`` finds or starts the node's manager."""

    endpoints: Endpoints
    """The manager's endpoints (those ``freeride status`` would use)."""
    runtime_dir: Path
    """The manager's runtime directory: serve lock, jobs, log."""
    serve_argv: tuple[str, ...]
    """The whole ``freeride serve ...`` command line a new manager runs (with ``--exit-with-jobs`` unless kept)."""
    keep: bool = False
    """Keep the manager after the job (``--keep-manager``)."""
    start_timeout_s: float = 60.0
    """How long a starting manager may take to answer."""
    probe_timeout_s: float = 1.0
    """How long one status request to a running manager may take."""
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    """The started manager's environment."""

    def __post_init__(self) -> None:
        if not self.serve_argv:
            raise ValueError("serve_argv: the command that starts a manager is empty")
        if self.start_timeout_s <= 0 or self.probe_timeout_s <= 0:
            raise ValueError(
                f"start_timeout_s and probe_timeout_s must be > 0, got {self.start_timeout_s}, {self.probe_timeout_s}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeManager:
    """The manager a launch uses."""

    pid: int | None
    """Its pid, as its serve lock says (``None``: none written yet)."""
    started: bool
    """Whether this launch started it."""
    notes: tuple[str, ...] = ()
    """What the launch should tell the user (a stale manager replaced)."""
    log: Path | None = None
    """Its log, if this launch started it."""


def serve_lock_pid(runtime_dir: Path) -> int | None:
    """The pid the manager serving ``runtime_dir`` wrote into its serve lock (it empties it at a clean exit)."""
    try:
        text = (runtime_dir / _SERVE_LOCK).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _pid_alive(pid: int) -> bool:
    # a zombie counts as dead: a crashed manager's parent may not have reaped it (init in a container)
    return Job.of(pid) is not None


def _answers(connect: Connect, timeout_s: float) -> bool:
    try:
        with connect(timeout_s) as client:
            return isinstance(client.request(p.StatusRequest()), p.StatusReply)
    except ManagerUnreachable:
        return False


def _wait_answering(connect: Connect, pid: int, timeout_s: float, probe_s: float) -> bool:
    """Whether manager ``pid`` answers within ``timeout_s``; False at once if it exits."""
    deadline = time.monotonic() + timeout_s
    while _pid_alive(pid):
        probed = time.monotonic()
        if _answers(connect, min(probe_s, max(deadline - probed, 0.05))):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(max(0.0, min(0.05, probed + 0.05 - time.monotonic())))  # no socket yet: a probe fails at once
    return False


def _spawn_detached(argv: Sequence[str], env: Mapping[str, str], log: Path) -> int:
    """Start ``argv`` in a session of its own whose parent exits at once (init reaps it); its pid."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked child, which only starts the manager
        code = 1
        try:
            os.close(read_end)
            os.setsid()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            os.write(fd, f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} started by freeride launch\n".encode())
            proc = subprocess.Popen(
                list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, close_fds=True
            )
            os.write(write_end, str(proc.pid).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        text = pipe.read().decode()
    os.waitpid(child, 0)
    if not text.isdigit():
        raise ManagerNotStarted(f"could not start `{' '.join(argv)}` (see {log})")
    return int(text)


def _log_tail(log: Path, lines: int = 3) -> str:
    try:
        tail = log.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return " | ".join(line.strip() for line in tail)


def ensure_manager(options: StartOptions, connect: Connect) -> NodeManager:
    """Find the node's manager, or start one, and register this process as one of its jobs.

    This process must be the job itself (``freeride launch`` calls it right
    before it ``exec``s the training command, which keeps the pid).

    Raises:
        ManagerNotStarted: a manager holds the runtime directory but does not
            answer, or a new one exited or did not answer in time.
        freeride.auth.Refused: the runtime directory is unsafe.
    """
    runtime_dir = options.runtime_dir
    ensure_private_dir(runtime_dir)
    with LaunchLock(runtime_dir) as lock:
        try:
            # a manager closing after its last job holds the lock while its side tasks checkpoint
            lock.acquire(options.start_timeout_s)
        except TimeoutError as exc:
            raise ManagerNotStarted(f"{exc}: another launch or a closing manager is stuck") from None
        notes: list[str] = []
        recorded = serve_lock_pid(runtime_dir)
        # a pid in the lock file whose lock nobody holds is a dead manager's, perhaps reused by another process
        holder = recorded if ServeLock.held(runtime_dir) else None
        # one that answers is the truth (its pid may live in another pid namespace, a pod's other container)
        found = not nobody_listens(options.endpoints.control) and _answers(connect, options.probe_timeout_s)
        if not found and holder is not None and _pid_alive(holder):
            # still starting (a `freeride serve` begun a moment ago), or stuck
            found = _wait_answering(connect, holder, options.start_timeout_s, options.probe_timeout_s)
            if not found and _pid_alive(holder):
                raise ManagerNotStarted(
                    f"the manager (pid {holder}) of {runtime_dir} does not answer on {options.endpoints.control};"
                    " stop it, or pass another --runtime-dir"
                )
            if not found:
                notes.append(f"the manager (pid {holder}) of {runtime_dir} exited while starting; starting a new one")
        elif not found and recorded is not None:  # a clean exit empties the lock: this one died, leaving its files
            notes.append(f"the manager (pid {recorded}) of {runtime_dir} is gone; starting a new one")
        if found:
            register_job(runtime_dir)
            if options.keep:
                keep_manager(runtime_dir)
            return NodeManager(pid=holder, started=False)
        register_job(runtime_dir)  # before the manager starts: it exits when it finds no job
        if options.keep:
            keep_manager(runtime_dir)
        else:  # a keep left by an earlier launch is not this job's wish
            with contextlib.suppress(FileNotFoundError):
                os.unlink(runtime_dir / JOBS_DIR / KEEP)
        log = runtime_dir / LOG_NAME
        pid = _spawn_detached(options.serve_argv, options.env, log)
        if not _wait_answering(connect, pid, options.start_timeout_s, options.probe_timeout_s):
            what = f"did not answer within {options.start_timeout_s:g}s" if _pid_alive(pid) else "exited"
            tail = _log_tail(log)
            raise ManagerNotStarted(f"the manager (pid {pid}) {what} (log {log}{': ' + tail if tail else ''})")
        return NodeManager(pid=pid, started=True, notes=tuple(notes), log=log)
