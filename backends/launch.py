"""Environment for ``freeride launch`` / ``freeride profile``: hooks in every rank.

The launcher only edits the environment and then ``exec``s the user's command
(``deepspeed``, ``torchrun``, ``python``...), which passes it on to every rank.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from freeride.backends.session import ENV_EVENTS

__all__ = ["ENV_MODE", "ENV_PROFILE_DIR", "CommandNotFound", "Mode", "find_command", "launch_env", "read_mode"]

ENV_MODE = "FREERIDE_MODE"
ENV_PROFILE_DIR = "FREERIDE_PROFILE_DIR"

Mode = Literal["emit", "profile"]

_SITE_DIR = Path(__file__).resolve().parent / "_autoload"


class CommandNotFound(Exception):
    """The command to launch cannot be run; ``exit_code`` is what a shell would exit with."""

    def __init__(self, message: str, *, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        """127 when there is no such command, 126 when it is not executable (as in a shell)."""


def find_command(name: str, env: Mapping[str, str]) -> str:
    """The executable that ``name`` (the first word of a command) runs, searched on ``env``'s PATH.

    Looked up before ``exec`` so that a typo gets one line naming what to check
    instead of a traceback from ``os.execvpe``.

    Raises:
        CommandNotFound: there is no such executable.
    """
    if os.sep in name:  # a path, as a shell takes it: not searched on PATH
        if not os.path.exists(name):
            raise CommandNotFound(f"command {name!r} not found; check the path", exit_code=127)
        if os.path.isdir(name) or not os.access(name, os.X_OK):
            raise CommandNotFound(f"command {name!r} is not executable; check its permissions", exit_code=126)
        return name
    found = shutil.which(name, path=env.get("PATH", os.defpath))
    if found is None:
        raise CommandNotFound(f"command {name!r} not found; check its spelling and that it is on PATH", exit_code=127)
    return found


def launch_env(
    base: Mapping[str, str], *, events: str, mode: Mode = "emit", profile_dir: Path | None = None
) -> dict[str, str]:
    """``base`` plus what activates FreeRide's hooks in child processes.

    Args:
        base: The environment to extend (usually ``os.environ``).
        events: The manager's events endpoint.
        mode: ``emit`` sends bubble events; ``profile`` also records them to
            ``profile_dir`` for ``freeride profile``.
        profile_dir: Where ranks write their observations in profile mode.
    """
    if mode == "profile" and profile_dir is None:
        raise ValueError("profile_dir is required in profile mode")
    env = dict(base)
    parts = [str(_SITE_DIR)] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env[ENV_EVENTS] = events
    env[ENV_MODE] = mode
    if profile_dir is not None:
        env[ENV_PROFILE_DIR] = str(profile_dir)
    return env


def read_mode(environ: Mapping[str, str] | None = None) -> tuple[Mode, Path | None]:
    """The mode and profile dir a launched rank runs in."""
    env = os.environ if environ is None else environ
    mode: Mode = "profile" if env.get(ENV_MODE) == "profile" else "emit"
    raw = env.get(ENV_PROFILE_DIR)
    return mode, Path(raw) if raw else None
