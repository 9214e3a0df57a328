"""Addresses: a manager's three endpoints, where its sockets live, and whether anyone listens there."""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MAX_IPC_PATH",
    "RUNTIME_DIR_ENV",
    "Endpoints",
    "bubbles_endpoint",
    "default_runtime_dir",
    "nobody_listens",
    "refused_at",
]

MAX_IPC_PATH = 100
"""Longest ipc:// socket path we accept (the kernel's limit is 107 bytes)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Endpoints:
    """The three addresses of one manager."""

    events: str
    """Backends push bubble events here."""
    control: str
    """CLI and API clients submit, cancel and query here."""
    workers: str
    """Side-task workers connect here (always node-local)."""

    def __post_init__(self) -> None:
        for name in ("events", "control", "workers"):
            addr = getattr(self, name)
            if not addr.startswith(("ipc://", "tcp://")):
                raise ValueError(f"endpoints.{name}: expected ipc:// or tcp://, got {addr!r}")
            if addr.startswith("ipc://") and len(addr[6:].encode()) > MAX_IPC_PATH:
                raise ValueError(
                    f"endpoints.{name}: ipc path {addr[6:]!r} is {len(addr[6:].encode())} bytes; "
                    f"sockets need <= {MAX_IPC_PATH}. Choose a shorter --runtime-dir."
                )

    @classmethod
    def ipc(cls, runtime_dir: Path) -> Endpoints:
        """Endpoints as socket files in ``runtime_dir``."""
        return cls(
            events=f"ipc://{runtime_dir}/events",
            control=f"ipc://{runtime_dir}/control",
            workers=f"ipc://{runtime_dir}/workers",
        )

    @classmethod
    def tcp(cls, host: str, port: int, runtime_dir: Path) -> Endpoints:
        """Events on ``port`` and control on ``port + 1``; workers stay on ipc."""
        return cls(
            events=f"tcp://{host}:{port}",
            control=f"tcp://{host}:{port + 1}",
            workers=f"ipc://{runtime_dir}/workers",
        )

    def tcp_endpoints(self) -> list[str]:
        """The endpoints on tcp: these need CURVE keys."""
        return [a for a in (self.events, self.control, self.workers) if a.startswith("tcp://")]

    def socket_dirs(self) -> list[Path]:
        """Directories of the ipc socket files (kept private); the workers' first, where the serve lock lives."""
        dirs: list[Path] = []
        for addr in (self.workers, self.events, self.control):
            if addr.startswith("ipc://") and (d := Path(addr[6:]).parent) not in dirs:
                dirs.append(d)
        return dirs


def bubbles_endpoint(events: str, rank: int) -> str:
    """Where rank ``rank`` publishes its bubble starts, next to an ipc events socket ("" for tcp).

    The manager derives the same address and honours only a rank that announces
    exactly it: an armed worker connects only inside the manager's private directory.
    """
    if not events.startswith("ipc://"):
        return ""  # a remote rank: its workers keep the two-hop path
    path = f"{Path(events[6:]).parent}/bubbles-{rank}"
    return f"ipc://{path}" if len(path.encode()) <= MAX_IPC_PATH else ""


RUNTIME_DIR_ENV = "FREERIDE_RUNTIME_DIR"


def nobody_listens(endpoint: str) -> bool:
    """Whether nothing can be listening on ``endpoint``: an ipc one whose socket file does not exist.

    A tcp endpoint may always have a listener; only a reply can tell.
    """
    return endpoint.startswith("ipc://") and not os.path.exists(endpoint[6:])


def refused_at(path: str) -> bool:
    """Whether the unix socket file ``path`` refuses a connection: nothing listens there any more.

    What a manager that has gone (killed, say) leaves behind. A knock only: the
    connection is closed before anything is said on it.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as knock:
        knock.settimeout(1.0)
        try:
            knock.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return True
        except OSError:  # a full backlog, or no right to it: something may be there
            return False
    return False


def default_runtime_dir() -> Path:
    """Where a manager's sockets live unless ``--runtime-dir`` says.

    ``$FREERIDE_RUNTIME_DIR`` if set, else ``$XDG_RUNTIME_DIR/freeride`` if that
    exists, else ``<tmp>/freeride-<uid>``.
    """
    given = os.environ.get(RUNTIME_DIR_ENV)
    if given:
        return Path(given).expanduser()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        return Path(xdg) / "freeride"
    return Path(tempfile.gettempdir()) / f"freeride-{os.getuid()}"
