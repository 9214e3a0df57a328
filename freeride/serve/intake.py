"""What the manager checks of a submitted task before it records it: the task can run here at all.

Each check answers with the reason a submission is refused (one line, the
fix in it) or an empty string.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from freeride import protocol as p
from freeride.auth import shared_dir_problem
from freeride.tasks.programs import program_env, spec_problem

__all__ = ["check_spec"]


def _checkpoint_dir_problem(checkpoint_dir: str) -> str:
    """Why a task's own checkpoint directory cannot be used, or an empty string."""
    if not checkpoint_dir:
        return ""
    if not os.path.isabs(checkpoint_dir) or "\0" in checkpoint_dir:
        return f"checkpoint_dir must be an absolute path, got {checkpoint_dir!r}"
    if not os.path.isdir(checkpoint_dir):
        return f"checkpoint_dir {checkpoint_dir!r} is not a directory here (create it; shared storage must be mounted)"
    return shared_dir_problem(Path(checkpoint_dir))


def check_spec(spec: p.TaskSpec) -> str:
    """Why ``spec`` cannot run, or an empty string."""
    if isinstance(spec, p.IterativeSpec):
        problem = _checkpoint_dir_problem(spec.checkpoint_dir)
        if problem:
            return problem
        from freeride.tasks.targets import resolve

        try:
            module = resolve(spec.target).rpartition(":")[0]
        except ValueError as exc:
            return str(exc)
        if module.endswith(".py"):
            return "" if os.path.isfile(module) else f"no such file {module!r} (give a path the manager can read)"
        try:
            # the top-level package only: finding a submodule imports its parents
            # (torch for torch.nn), which would stall the manager's loop
            found = importlib.util.find_spec(module.partition(".")[0])
        except (ImportError, ValueError):
            found = None
        if found is None:
            return f"cannot import module {module!r} (is it installed in the manager's environment?)"
        return ""
    problem = spec_problem(spec)
    if problem:
        return problem
    if spec.cwd and not os.path.isdir(spec.cwd):
        return f"working directory {spec.cwd!r} is not a directory here"
    program = spec.argv[0]
    if "/" in program and not os.path.isabs(program) and spec.cwd:
        program = os.path.join(spec.cwd, program)
    if shutil.which(program, path=program_env(spec.env, os.environ)["PATH"]) is None:
        return f"command {spec.argv[0]!r} not found on the program's PATH"
    return ""
