"""Jobs signed with a secret the cluster's submitters and nodes share: a node runs only jobs its holders queued.

Ray lets any driver that reaches the cluster call the queue. A node whose keys
directory holds ``cluster.secret`` (``freeride keys --cluster``) therefore runs
a leased job only if it carries an HMAC-SHA256 of its spec under that secret;
``freeride cluster submit`` signs with the same file. A driver without the
secret can still queue jobs, but no such node runs them: they fail with that
reason. The signature covers the whole spec (command line, environment,
options), so none of it can be changed in the queue either.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

import msgspec

from freeride import protocol as p
from freeride.auth import KeysMissing, UnsafeDirectory, ensure_private_dir, write_private

__all__ = ["SECRET_FILE", "create_secret", "load_secret", "sign", "verify"]

SECRET_FILE = "cluster.secret"
"""The shared secret's file in a keys directory: 64 hex digits, mode 0600."""

_DOMAIN = b"freeride-cluster-job-v1\0"
"""Prefixed to what is signed, so a signature means nothing in any other use of the secret."""
_encoder = msgspec.msgpack.Encoder()


def create_secret(keys_dir: Path, *, force: bool = False) -> Path:
    """Write a new random secret into ``keys_dir`` (made private if need be); the file's path.

    Raises:
        FileExistsError: there is one already and ``force`` is not set.
        UnsafeDirectory: ``keys_dir`` is another user's or open to others.
    """
    ensure_private_dir(keys_dir, what="keys dir")
    path = keys_dir / SECRET_FILE
    if force:
        path.unlink(missing_ok=True)
    write_private(path, secrets.token_hex(32) + "\n")
    return path


def load_secret(keys_dir: Path) -> bytes | None:
    """The secret in ``keys_dir``, or ``None`` if there is none.

    Raises:
        UnsafeDirectory: the file is another user's, or others may read it.
        KeysMissing: the file is there but holds no secret.
    """
    path = keys_dir / SECRET_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:  # a link (followed by no one), or no right to read it
        raise UnsafeDirectory(f"{path} cannot be read as a file of yours: {exc.strerror}; make it one") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise UnsafeDirectory(
                f"{path} must be yours and private (mode 0600), is uid {st.st_uid} mode "
                f"{stat.S_IMODE(st.st_mode):04o}; run `chmod 600 {path}`"
            )
        text = f.read(1024).strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise KeysMissing(f"{path} holds no secret; make one with `freeride keys --cluster --force`")
    return secret


def sign(spec: p.TaskSpec, secret: bytes) -> str:
    """The signature of ``spec`` under ``secret`` (hex)."""
    return hmac.new(secret, _DOMAIN + _encoder.encode(spec), hashlib.sha256).hexdigest()


def verify(spec: p.TaskSpec, signature: str, secret: bytes) -> bool:
    """Whether ``signature`` is ``spec``'s under ``secret`` (in constant time)."""
    return hmac.compare_digest(sign(spec, secret), signature)
