"""CUDA MPS: a private control daemon for side tasks, and their client environment.

FreeRide runs its own ``nvidia-cuda-mps-control`` daemon with a private pipe
directory. A process becomes an MPS client only if its ``CUDA_MPS_PIPE_DIRECTORY``
reaches a daemon, so side tasks (given :func:`client_env`) are clients of this
daemon with a pinned device-memory limit and low priority, while the training
process, which never sees that directory, keeps its own CUDA context outside MPS
and is not taken down when a side task faults. See ``docs/gpu.md``.

Everything goes through the control binary: ``-d`` to start the daemon, one
command per invocation on its stdin (``get_server_list``, ``get_client_list``,
``terminate_client``, ``quit``), the same two environment variables each time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

__all__ = [
    "CONTROL_BINARY",
    "MpsDaemon",
    "MpsError",
    "MpsUnavailable",
    "client_env",
    "torch_memory_fraction",
]

logger = logging.getLogger(__name__)

CONTROL_BINARY = "nvidia-cuda-mps-control"
"""Name of NVIDIA's MPS control program, looked up on ``PATH``."""

_PID_FILE = "nvidia-cuda-mps-control.pid"
_MIB = 1 << 20
_MIN_HEADROOM = 64 * _MIB


class MpsError(RuntimeError):
    """The MPS control daemon failed or answered something unexpected."""


class MpsUnavailable(MpsError):
    """MPS cannot be used on this machine (the control binary is missing)."""


def torch_memory_fraction(limit_bytes: int, total_bytes: int) -> float:
    """Fraction for ``torch.cuda.set_per_process_memory_fraction`` just under an MPS cap.

    The MPS limit also counts CUDA's own device allocations (cuBLAS workspaces
    and the like), so PyTorch's caching allocator is held ``max(64 MiB, 5 %)``
    below it and fails cleanly before the driver does.

    Args:
        limit_bytes: The pinned device-memory limit of the client.
        total_bytes: Total memory of the device as PyTorch sees it.

    Returns:
        A fraction in ``[0, 1]``.

    Raises:
        ValueError: If an argument is not positive.
    """
    if limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be positive, got {limit_bytes}")
    if total_bytes <= 0:
        raise ValueError(f"total_bytes must be positive, got {total_bytes}")
    headroom = max(_MIN_HEADROOM, limit_bytes // 20)
    return min(1.0, max(0.0, (limit_bytes - headroom) / total_bytes))


def _device_id(device: str | int) -> str:
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device must be an ordinal >= 0 or a UUID, got {device}")
        return str(device)
    device = device.strip()
    if not device or any(c in device for c in ",= "):
        raise ValueError(f"device must be an ordinal or a UUID such as GPU-..., got {device!r}")
    return device


def client_env(
    device: str | int,
    limit_bytes: int,
    priority: int = 1,
    *,
    pipe_dir: Path,
    total_bytes: int = -1,
) -> dict[str, str]:
    """Environment that makes a process a capped, low-priority client of an MPS daemon.

    Args:
        device: The device as the client sees it: a CUDA ordinal, or better its
            UUID (``GPU-...``), which does not depend on ``CUDA_VISIBLE_DEVICES``.
        limit_bytes: Device memory the client may allocate, rounded down to MiB.
            Fixed for the life of the process.
        priority: MPS client priority, 0 (normal) or 1 (below normal).
        pipe_dir: The daemon's ``CUDA_MPS_PIPE_DIRECTORY``.
        total_bytes: Total device memory; when given, also sets
            ``FREERIDE_TORCH_MEMORY_FRACTION`` (see :func:`torch_memory_fraction`).

    Returns:
        Variables to add to the client's environment. ``FREERIDE_MEMORY_LIMIT``
        always carries ``limit_bytes``.

    Raises:
        ValueError: On an invalid argument (the message names it).
    """
    dev = _device_id(device)
    if limit_bytes < _MIB:
        raise ValueError(f"limit_bytes must be at least 1 MiB, got {limit_bytes}")
    if priority not in (0, 1):
        raise ValueError(f"priority must be 0 or 1, got {priority}")
    env = {
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{dev}={limit_bytes // _MIB}M",
        "CUDA_MPS_CLIENT_PRIORITY": str(priority),
        "FREERIDE_MEMORY_LIMIT": str(limit_bytes),
    }
    if total_bytes > 0:
        env["FREERIDE_TORCH_MEMORY_FRACTION"] = f"{torch_memory_fraction(limit_bytes, total_bytes):.6f}"
    return env


def _pids(reply: str, what: str) -> list[int]:
    tokens = reply.split()
    if not all(t.isdigit() for t in tokens):
        raise MpsError(f"unexpected reply to {what}: {reply!r}")
    return [int(t) for t in tokens]


class MpsDaemon:
    """Starts, or joins, an MPS control daemon on a private pipe directory.

    Use as ``async with MpsDaemon(pipe_dir, log_dir) as mps: ...``. A daemon that
    is already serving ``pipe_dir`` is joined and left running at exit; one this
    object started is told to ``quit``.

    Args:
        pipe_dir: ``CUDA_MPS_PIPE_DIRECTORY``; keep it short (it holds UNIX sockets)
            and node-local.
        log_dir: ``CUDA_MPS_LOG_DIRECTORY`` (``control.log``, ``server.log``).
        binary: Control program name or path.
        env: Base environment for the daemon (e.g. ``CUDA_VISIBLE_DEVICES``); the
            current environment when None.
        timeout_s: Deadline for starting the daemon and for each command.

    Raises:
        ValueError: If ``timeout_s`` is not positive.
    """

    def __init__(
        self,
        pipe_dir: Path,
        log_dir: Path,
        *,
        binary: str = CONTROL_BINARY,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.pipe_dir, self.log_dir = Path(pipe_dir), Path(log_dir)
        self.binary, self.timeout_s = binary, timeout_s
        self._base_env = dict(env) if env is not None else None
        self._path: str | None = None
        self._owned = False
        self._lock = asyncio.Lock()

    @property
    def env(self) -> dict[str, str]:
        """Environment every invocation of the control program gets."""
        base = self._base_env if self._base_env is not None else dict(os.environ)
        return {
            **base,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }

    @property
    def joined(self) -> bool:
        """Whether :meth:`start` found a daemon already running (it is not quit at exit)."""
        return self._path is not None and not self._owned

    def _resolve(self) -> str:
        path = shutil.which(self.binary, path=self.env.get("PATH", os.defpath))
        if path is None:
            raise MpsUnavailable(
                f"{self.binary} not found on PATH: run without --mps or install the NVIDIA driver utilities"
            )
        return path

    def daemon_pid(self) -> int | None:
        """Process id of the daemon serving :attr:`pipe_dir`, None if none is alive."""
        try:
            pid = int((self.pipe_dir / _PID_FILE).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # alive, owned by someone else
        return pid

    async def start(self) -> None:
        """Start the daemon, or join the one already serving :attr:`pipe_dir`.

        Raises:
            MpsUnavailable: If the control program is not installed.
            MpsError: If the daemon does not come up within ``timeout_s``.
        """
        path = self._resolve()
        for d in (self.pipe_dir, self.log_dir):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        if len(str(self.pipe_dir)) > 80:
            logger.warning("[mps] pipe directory %s is long; UNIX socket paths may not fit", self.pipe_dir)
        if (pid := self.daemon_pid()) is not None:
            self._path = path
            logger.info("[mps] joined control daemon pid=%d on %s", pid, self.pipe_dir)
            return
        done = await self._call(path, ["-d"], None, "-d")
        if done.returncode != 0:
            said = (done.stderr or done.stdout).decode(errors="replace").strip()
            raise MpsError(f"{self.binary} -d exited {done.returncode}: {said} (see {self.log_dir / 'control.log'})")
        deadline = time.monotonic() + self.timeout_s
        while (pid := self.daemon_pid()) is None:
            if time.monotonic() > deadline:
                raise MpsError(f"MPS control daemon did not start within {self.timeout_s}s (see {self.log_dir})")
            await asyncio.sleep(0.01)
        self._path, self._owned = path, True
        logger.info("[mps] started control daemon pid=%d on %s", pid, self.pipe_dir)

    async def _call(
        self, path: str, args: list[str], data: bytes | None, what: str
    ) -> subprocess.CompletedProcess[bytes]:
        """Run the control program once, in a thread: ``subprocess`` closes every other descriptor in it.

        Not the loop's own subprocess support: uvloop's children (``freeride serve`` runs on uvloop)
        keep copies of their stdout pipe at other descriptors, and the daemon ``-d`` leaves behind
        holds them, so its output never ends.
        """
        try:
            return await asyncio.to_thread(
                subprocess.run,
                [path, *args],
                input=data,
                stdin=None if data is not None else subprocess.DEVNULL,
                capture_output=True,
                env=self.env,
                timeout=self.timeout_s,
                close_fds=True,
            )
        except subprocess.TimeoutExpired:
            raise MpsError(f"{self.binary} {what!r} timed out after {self.timeout_s}s") from None

    async def command(self, line: str) -> str:
        """Send one control command and return its reply, stripped.

        Raises:
            RuntimeError: If the daemon was not started or joined.
            MpsError: If the control program fails.
        """
        if self._path is None:
            raise RuntimeError("MpsDaemon.command() before start()")
        async with self._lock:
            done = await self._call(self._path, [], f"{line}\n".encode(), line)
        reply = done.stdout.decode(errors="replace").strip()
        if done.returncode != 0:
            detail = done.stderr.decode(errors="replace").strip() or reply
            raise MpsError(f"{self.binary} {line!r} exited {done.returncode}: {detail}")
        logger.debug("[mps] %s -> %r", line, reply)
        return reply

    async def get_server_list(self) -> list[int]:
        """Process ids of the MPS servers of this daemon."""
        return _pids(await self.command("get_server_list"), "get_server_list")

    async def get_client_list(self, server_pid: int) -> list[int]:
        """Process ids of the clients of one MPS server."""
        return _pids(await self.command(f"get_client_list {int(server_pid)}"), "get_client_list")

    async def terminate_client(self, server_pid: int, client_pid: int) -> None:
        """Tear down a client's CUDA contexts, even while busy, without disturbing other clients.

        Afterwards the client can be killed safely.

        Raises:
            MpsError: If the daemon does not confirm (reply other than ``0``).
        """
        reply = await self.command(f"terminate_client {int(server_pid)} {int(client_pid)}")
        if reply != "0":
            raise MpsError(f"terminate_client {server_pid} {client_pid} failed: {reply!r}")

    async def quit(self) -> None:
        """Stop the daemon if this object started it (idempotent; a joined daemon is left alone)."""
        if self._path is None:
            return
        owned, self._owned = self._owned, False
        pid = self.daemon_pid()
        try:
            if owned and pid is not None:
                await self.command("quit")
                deadline = time.monotonic() + self.timeout_s
                while self.daemon_pid() is not None:
                    if time.monotonic() > deadline:
                        logger.warning("[mps] control daemon pid=%d still alive after quit", pid)
                        break
                    await asyncio.sleep(0.01)
                else:
                    logger.info("[mps] control daemon pid=%d quit", pid)
        finally:
            self._path = None

    async def __aenter__(self) -> MpsDaemon:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.quit()

    def client_env(
        self, device: str | int, limit_bytes: int, priority: int = 1, *, total_bytes: int = -1
    ) -> dict[str, str]:
        """:func:`client_env` for this daemon's pipe directory."""
        return client_env(device, limit_bytes, priority, pipe_dir=self.pipe_dir, total_bytes=total_bytes)
