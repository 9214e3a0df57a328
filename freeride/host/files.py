"""Files written whole: a reader sees the old file or the new one, and nothing planted is followed."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["replace_atomically"]


def replace_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write ``path`` through a new temporary file beside it, then rename that into place.

    The temporary file is created anew under a random name (``O_EXCL``), so a
    link another user planted under a predictable name in a shared directory
    (a checkpoint directory on shared storage) is never written through; the
    rename replaces ``path`` itself, a link there included, never what a link
    points to. A crash mid-write leaves the previous file.

    Raises:
        OSError: the directory or the file could not be written.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a partial file would only fill the disk further
            os.unlink(tmp)
        raise
