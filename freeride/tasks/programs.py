"""What an imperative task's program is given: its directory, its environment, its progress source.

The client (``freeride submit --imperative``) and the manager check a program's
spec with the same function, :func:`spec_problem`, so a bad option fails at
submit with the same words on both sides.

The environment. A program does not inherit the manager's environment: the
manager may run under another shell, with other credentials, long before the
program is submitted. It gets a small base taken from the manager
(:data:`BASE_ENV_KEYS`: ``PATH``, ``HOME``, the locale, ...), then the
variables the submission carries (``ProgramSpec.env``), then FreeRide's own
(its device's GPU alone, thread counts, memory caps, ``sync_every``). The CLI sends the submitting
shell's environment by default, as a program started from that shell would see
it, with ``--env K=V`` over it; ``--clean-env`` sends only the ``--env``
variables, for a shell that holds secrets the program need not see. What is sent
crosses the manager's control socket (owner-only, see docs/security.md), is
kept in the manager's memory while the task is listed and is never shown by
``freeride status`` nor logged.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

from freeride import protocol as p

__all__ = ["BASE_ENV_KEYS", "MAX_SYNC_EVERY", "device_env", "parse_env", "program_env", "spec_problem"]

BASE_ENV_KEYS = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
)
"""The manager's variables every program starts from (when the manager has them)."""

_MAX_NAME, _MAX_VALUE = 256, 64 * 1024  # the wire's bounds (protocol.Name, protocol.Text)

MAX_SYNC_EVERY = 1_000_000
"""Largest ``sync_every`` (the wire's bound)."""


def parse_env(pairs: Sequence[str]) -> dict[str, str]:
    """``K=V`` strings as a mapping.

    Raises:
        ValueError: On a pair without ``=`` or with an invalid name (the message names it).
    """
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--env expects NAME=VALUE, got {pair!r}")
        env[key] = value
    problem = _env_problem(env)
    if problem:
        raise ValueError(problem)
    return env


def program_env(spec_env: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """The program's environment before FreeRide's own variables: the base from ``environ``, then ``spec_env``."""
    base = {k: environ[k] for k in BASE_ENV_KEYS if k in environ}
    base.setdefault("PATH", os.defpath)
    return {**base, **spec_env}


def device_env(device: str) -> dict[str, str]:
    """The GPU a program on ``device`` sees, as the task's worker would: ``cuda:N`` alone, none on a CPU device.

    Set over the submitted environment: a ``CUDA_VISIBLE_DEVICES`` from the submitting shell
    names the shell's GPUs, not the one placement chose.
    """
    kind, _, index = device.partition(":")
    return {"CUDA_VISIBLE_DEVICES": index if kind == "cuda" and index.isdigit() else ""}


def _env_problem(env: Mapping[str, str]) -> str:
    for key, value in env.items():
        if not key or "=" in key or "\0" in key or len(key) > _MAX_NAME:
            return f"environment variable name {key[:64]!r} is invalid (no '=' or NUL, not empty, {_MAX_NAME} at most)"
        if "\0" in value:
            return f"environment variable {key} holds a NUL byte"
        if len(value) > _MAX_VALUE:
            return f"environment variable {key} is longer than {_MAX_VALUE} characters (--clean-env leaves it out)"
    return ""


def spec_problem(spec: p.ProgramSpec) -> str:
    """Why an imperative task's options cannot work, or an empty string (no file system access)."""
    if spec.cwd and not os.path.isabs(spec.cwd):
        return f"cwd must be an absolute path, got {spec.cwd!r} (the client resolves a relative one)"
    if "\0" in spec.cwd or "\0" in spec.progress_file:
        return "cwd and progress_file must not hold a NUL byte"
    problem = _env_problem(spec.env)
    if problem:
        return problem
    if not 0 <= spec.sync_every <= MAX_SYNC_EVERY:
        return f"sync_every must be in 0..{MAX_SYNC_EVERY}, got {spec.sync_every}"
    if spec.progress_file and spec.progress_pattern:
        return "give a progress file or a progress pattern, not both"
    if spec.progress_pattern:
        try:
            pattern = re.compile(spec.progress_pattern)
        except re.error as exc:
            return f"progress pattern {spec.progress_pattern!r} is not a regular expression: {exc}"
        if not pattern.groupindex:
            return (
                f"progress pattern {spec.progress_pattern!r} has no named group; "
                r"name what it reads, e.g. 'step (?P<step>\d+) loss (?P<loss>[\d.]+)'"
            )
    return ""
