"""Environment for ``freeride launch`` / ``freeride profile``: hooks in every rank.

The launcher only edits the environment and then ``exec``s the user's command
(``deepspeed``, ``torchrun``, ``python``...), which passes it on to every rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from backends.session import ENV_EVENTS

__all__ = ["ENV_MODE", "ENV_PROFILE_DIR", "Mode", "launch_env", "read_mode"]

ENV_MODE = "FREERIDE_MODE"
ENV_PROFILE_DIR = "FREERIDE_PROFILE_DIR"

Mode = Literal["emit", "profile"]

_SITE_DIR = Path(__file__).resolve().parent / "_autoload"


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
