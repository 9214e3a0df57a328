"""Who may reach a manager: private directories, one manager per runtime directory, CURVE keys.

The security model is written in ``docs/security.md``; this module enforces
the parts that live in the file system:

* :func:`ensure_private_dir`: the runtime directory (sockets, lock) is created
  ``0700`` or, if it exists, must be a directory of the user's own that no one
  else can enter; the state directory (checkpoints, logs, task work
  directories) must at least be the user's and writable by no one else.
* :class:`ServeLock`: a second ``freeride serve`` on a runtime directory in use
  is refused, naming the running manager, before it could take the sockets.
* CURVE keys for tcp endpoints (:func:`create_keys`, :func:`load_server_keys`,
  :func:`load_client_keys`), in a keys directory as ZeroMQ certificate files.

It does not import ``zmq`` (only :mod:`freeride.transport` does): key pairs are
made by a function handed in, and keys travel as their Z85 text.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "KEYS_ENV",
    "CurveClientKeys",
    "CurveServerKeys",
    "KeysMissing",
    "ManagerRunning",
    "Refused",
    "ServeLock",
    "UnsafeDirectory",
    "check_ipc_socket",
    "check_private_dir",
    "create_keys",
    "default_keys_dir",
    "ensure_private_dir",
    "is_loopback_endpoint",
    "shared_dir_problem",
    "load_client_keys",
    "load_server_keys",
]

KEYS_ENV = "FREERIDE_KEYS_DIR"
"""Environment variable naming the keys directory (read when keys are needed, never at import)."""

_SERVER = "server"
_CLIENT = "client"
_AUTHORIZED = "authorized"
_LOCK = "serve.lock"
_KEY_RE = re.compile(r'^\s*(public|secret)-key\s*=\s*"([^"]{40})"\s*$', re.MULTILINE)

KeypairFn = Callable[[], tuple[bytes, bytes]]
"""Makes one CURVE key pair, ``(public, secret)`` as 40-byte Z85 text."""


class Refused(Exception):
    """A setup that would let another local user in; the message says what to do instead."""


class UnsafeDirectory(Refused):
    """A directory FreeRide keeps private is someone else's, or open to others."""


class ManagerRunning(Refused):
    """Another manager already serves this runtime directory."""


class KeysMissing(Refused):
    """A tcp endpoint needs CURVE keys that are not there (or not private)."""


# --------------------------------------------------------------------------
# private directories
# --------------------------------------------------------------------------


def ensure_private_dir(path: Path, *, what: str = "runtime dir", strict: bool = True) -> Path:
    """Create ``path`` with mode 0700, or check that an existing one is safe to use.

    Args:
        path: The directory.
        what: How the error message names it (and the option that moves it).
        strict: Refuse any access for group and others (sockets, keys); when
            False, refuse only their write access (a state directory may be
            readable by others).

    Returns:
        ``path``.

    Raises:
        UnsafeDirectory: ``path`` is not a directory, is owned by another user
            (a directory created in advance by someone else), or is open to
            others.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    _check_parent(path, what)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    else:
        os.chmod(path, 0o700)  # mkdir's mode passes through the umask; say it exactly
        return path
    return _check_existing(path, what=what, strict=strict)


def check_private_dir(path: Path, *, what: str = "runtime dir", strict: bool = True) -> Path:
    """Check, without creating anything, that the existing directory ``path`` is safe to use.

    What a client checks before it talks to whatever listens in a runtime
    directory: the rules of :func:`ensure_private_dir`.

    Raises:
        UnsafeDirectory: as :func:`ensure_private_dir` says.
        FileNotFoundError: ``path`` does not exist.
    """
    _check_parent(path, what)
    return _check_existing(path, what=what, strict=strict)


def _check_existing(path: Path, *, what: str, strict: bool) -> Path:
    """The checks of :func:`check_private_dir` on ``path`` itself (its parent checked already)."""
    uid = os.getuid()
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid != uid:
        raise UnsafeDirectory(
            f"{what} {path} is a symlink owned by uid {link.st_uid}, not you (uid {uid}); remove it or choose another"
        )
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{what} {path} exists and is not a directory; remove it or choose another")
    if st.st_uid != uid:
        raise UnsafeDirectory(
            f"{what} {path} is owned by uid {st.st_uid}, not you (uid {uid}); someone else may have planted it: "
            "remove it or choose another"
        )
    open_bits = stat.S_IMODE(st.st_mode) & (0o077 if strict else 0o022)
    if open_bits:
        want = "0700" if strict else "no write access for group and others"
        raise UnsafeDirectory(
            f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o} ({want} required); "
            f"run `chmod 700 {path}` or choose another"
        )
    return path


def _check_parent(path: Path, what: str) -> None:
    """Refuse a directory whose parent others may write without the sticky bit: they could replace it."""
    try:
        st = os.stat(path.parent)
    except FileNotFoundError:
        return
    if stat.S_IMODE(st.st_mode) & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise UnsafeDirectory(
            f"{what} {path}: its parent {path.parent} is writable by others (mode {stat.S_IMODE(st.st_mode):04o},"
            " no sticky bit), who could replace it; choose a directory under a private one"
        )


def check_ipc_socket(path: Path) -> None:
    """Refuse to connect to the socket ``path`` if it, or its directory, may be another user's.

    Nothing is checked where the directory does not exist yet (nothing listens there).

    Raises:
        UnsafeDirectory: the socket's directory is another user's or writable by others, or the socket is
            owned by another user.
    """
    if not path.parent.exists():
        return
    # the user's and writable by no one else: nobody else can have put a socket there (reading it is harmless,
    # and the manager checks every peer's uid)
    check_private_dir(path.parent, strict=False)
    try:
        owner = os.lstat(path).st_uid
    except FileNotFoundError:
        return
    if owner != os.getuid():
        raise UnsafeDirectory(
            f"socket {path} is owned by uid {owner}, not you (uid {os.getuid()}); someone else may have planted it"
        )


def shared_dir_problem(path: Path, *, what: str = "checkpoint_dir") -> str:
    """Why the existing directory ``path`` is unsafe to write a task's files into, or an empty string.

    A directory on shared storage may be open to others, as ``/tmp`` is: it is
    accepted when it is ours or root's and, if others may write it, has the
    sticky bit (no one else can rename, remove or replace the files we put
    there). Without the sticky bit, or owned by another user, anyone able to
    write it could swap a checkpoint for their own between a save and a load.
    """
    uid = os.getuid()
    try:
        link = os.lstat(path)
        st = os.stat(path)
    except OSError as exc:
        return f"{what} {path} cannot be read: {exc.strerror}"
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (uid, 0):
        return (
            f"{what} {path} is a symlink owned by uid {link.st_uid}, not you (uid {uid}) or root;"
            " use the directory itself"
        )
    if not stat.S_ISDIR(st.st_mode):
        return f"{what} {path} is not a directory"
    if st.st_uid not in (uid, 0):
        return (
            f"{what} {path} is owned by uid {st.st_uid}, not you (uid {uid}) or root, who could replace its files;"
            " use a directory of your own"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022 and not mode & stat.S_ISVTX:
        return (
            f"{what} {path} is writable by others without the sticky bit (mode {mode:04o}), who could replace "
            f"its files; run `chmod +t {path}` (as /tmp is) or `chmod go-w {path}`, or use a directory of your own"
        )
    return ""


# --------------------------------------------------------------------------
# one manager per runtime directory
# --------------------------------------------------------------------------


class ServeLock:
    """An exclusive ``flock`` on ``RUNTIME_DIR/serve.lock`` for a manager's life.

    The kernel drops the lock when the holder dies, so a crashed manager never
    leaves a stale lock behind (only its socket files, which the next one
    removes once it holds the lock). The file is opened close-on-exec: side
    tasks never inherit it.
    """

    def __init__(self, runtime_dir: Path) -> None:
        self.path = runtime_dir / _LOCK
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock and write our pid into it.

        Raises:
            ManagerRunning: another process holds it.
        """
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ManagerRunning(
                f"a manager (pid {holder}) already serves {self.path.parent}; "
                "stop it first or pass another --runtime-dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    @staticmethod
    def held(runtime_dir: Path) -> bool:
        """Whether a live process holds the serve lock of ``runtime_dir`` (its pid file alone proves nothing:
        the pid of a manager that died may have been given to another process)."""
        try:
            fd = os.open(runtime_dir / _LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # drops the probe's shared lock, if it got one
        return False

    @property
    def holding(self) -> bool:
        """Whether this object holds the lock now."""
        return self._fd is not None

    def release(self) -> None:
        """Give the lock up (idempotent); the file stays, its content is stale from now on."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> ServeLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# --------------------------------------------------------------------------
# CURVE keys
# --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class CurveServerKeys:
    """What a manager needs to serve tcp endpoints with CURVE."""

    public: bytes
    """The server's public key (Z85), which clients must know."""
    secret: bytes
    """The server's secret key (Z85)."""
    clients: frozenset[bytes]
    """Public keys (Z85) of the clients allowed in; anyone else's handshake is refused."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CurveClientKeys:
    """What a control client or backend emitter needs to reach a CURVE server."""

    public: bytes
    """This client's public key (Z85): listed in the server's ``authorized/``."""
    secret: bytes
    """This client's secret key (Z85)."""
    server: bytes
    """The server's public key (Z85): a client talks only to the holder of its secret."""


def default_keys_dir() -> Path:
    """``$FREERIDE_KEYS_DIR``, else ``$XDG_CONFIG_HOME/freeride/keys``, else ``~/.config/freeride/keys``."""
    env = os.environ.get(KEYS_ENV)
    if env:
        return Path(env)
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "freeride" / "keys"


def _write_cert(path: Path, public: bytes, secret: bytes | None) -> None:
    # the format of pyzmq's zmq.auth.create_certificates, so either tool reads the other's files
    lines = [
        "#   ****  Generated by freeride keys  ****",
        "#   ZeroMQ CURVE " + ("**Secret** Certificate" if secret else "Public Certificate"),
        "#   " + ("DO NOT PROVIDE THIS FILE TO OTHER USERS." if secret else "Exchange securely."),
        "metadata",
        "curve",
        f'    public-key = "{public.decode()}"',
    ]
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    write_private(path, "\n".join(lines) + "\n")


def write_private(path: Path, text: str) -> None:
    """Create ``path`` (mode 0600) holding ``text``; never through a link, never over a file already there.

    Raises:
        FileExistsError: ``path`` exists (a file or a link).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _read_cert(path: Path) -> dict[str, bytes]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise KeysMissing(
            f"no CURVE key {path}; run `freeride keys --keys-dir {path.parent}` (tcp endpoints need keys)"
        ) from None
    return {kind: key.encode() for kind, key in _KEY_RE.findall(text)}


def create_keys(keys_dir: Path, *, keypair: KeypairFn, force: bool = False) -> list[Path]:
    """Make a server and a client key pair in ``keys_dir`` and authorize the client.

    Layout (ZeroMQ certificate files, as ``zmq.auth`` writes them)::

        server.key, server.key_secret    the manager's pair; clients need server.key
        client.key, client.key_secret    a client's pair (CLI, backends)
        authorized/client.key            public keys the manager lets in

    Args:
        keys_dir: Created 0700 if missing; must be private if it exists.
        keypair: Makes one key pair (:func:`freeride.transport.curve_keypair`).
        force: Replace existing keys (every client must then get the new ones).

    Returns:
        The files written.

    Raises:
        Refused: keys exist already and ``force`` is False, or the directory is unsafe.
    """
    ensure_private_dir(keys_dir, what="keys dir")
    authorized = ensure_private_dir(keys_dir / _AUTHORIZED, what="keys dir")
    files = [keys_dir / f"{n}{s}" for n in (_SERVER, _CLIENT) for s in (".key", ".key_secret")]
    files.append(authorized / f"{_CLIENT}.key")
    if any(f.exists() for f in files):
        if not force:
            raise Refused(f"keys exist in {keys_dir}; pass --force to replace them (clients then need the new ones)")
        for f in files:
            f.unlink(missing_ok=True)
    for name in (_SERVER, _CLIENT):
        public, secret = keypair()
        _write_cert(keys_dir / f"{name}.key", public, None)
        _write_cert(keys_dir / f"{name}.key_secret", public, secret)
        if name == _CLIENT:
            _write_cert(authorized / f"{name}.key", public, None)
    return files


def _private_keys_dir(keys_dir: Path) -> Path:
    if not keys_dir.is_dir():
        raise KeysMissing(f"no keys dir {keys_dir}; run `freeride keys` first (tcp endpoints need CURVE keys)")
    try:
        return ensure_private_dir(keys_dir, what="keys dir")
    except UnsafeDirectory as exc:
        raise KeysMissing(str(exc)) from None


def load_server_keys(keys_dir: Path) -> CurveServerKeys:
    """The manager's key pair and the public keys of the clients it lets in.

    Raises:
        KeysMissing: no keys (run ``freeride keys``), an unsafe keys directory,
            or no authorized client.
    """
    _private_keys_dir(keys_dir)
    cert = _read_cert(keys_dir / f"{_SERVER}.key_secret")
    if "secret" not in cert or "public" not in cert:
        raise KeysMissing(f"{keys_dir / (_SERVER + '.key_secret')} holds no key pair; recreate it with `freeride keys`")
    authorized = keys_dir / _AUTHORIZED
    clients = frozenset(
        key for f in sorted(authorized.glob("*.key")) if (key := _read_cert(f).get("public")) is not None
    )
    if not clients:
        raise KeysMissing(f"no client keys in {authorized}; put the clients' public *.key files there")
    return CurveServerKeys(public=cert["public"], secret=cert["secret"], clients=clients)


def load_client_keys(keys_dir: Path) -> CurveClientKeys:
    """A client's key pair and the server's public key.

    Raises:
        KeysMissing: no keys (run ``freeride keys`` or copy the manager's keys
            directory here) or an unsafe keys directory.
    """
    _private_keys_dir(keys_dir)
    cert = _read_cert(keys_dir / f"{_CLIENT}.key_secret")
    server = _read_cert(keys_dir / f"{_SERVER}.key").get("public")
    if "secret" not in cert or "public" not in cert or server is None:
        raise KeysMissing(f"incomplete CURVE keys in {keys_dir}; recreate them with `freeride keys`")
    return CurveClientKeys(public=cert["public"], secret=cert["secret"], server=server)


def is_loopback_endpoint(endpoint: str) -> bool:
    """Whether a ``tcp://HOST:PORT`` endpoint is reachable only from this host (``ipc://`` counts as local)."""
    if endpoint.startswith("ipc://"):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # '*', an interface or host name: may be reachable from elsewhere
        return False
