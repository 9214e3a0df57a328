"""What a GPU check run is given, how it runs a section and a command, and what it writes.

Shared by ``check.py`` (the sections and the report) and ``_check_sharing.py``
(the sections on how side work shares the device).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ROOT", "STAGE", "CheckConfig", "Report", "cuda_available", "run_command"]

ROOT = Path(__file__).resolve().parents[2]
STAGE = Path(__file__).resolve().parent / "stage.py"
"""A real pipeline stage with emulated neighbours."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckConfig:
    """What the check runs."""

    dry_run: bool
    """On CPU: the same path, short, with what needs a GPU reported as not available."""
    out: Path
    """Where the markdown report goes."""
    workloads: tuple[str, ...]
    pairs: int
    """Alone/with pairs per workload."""
    controls: int
    """A/A pairs (the noise floor), run with the first workload measured and shown with every workload."""
    steps: int
    releases: tuple[str, ...]
    """How side work is released in (a): ``host`` and/or ``gate`` (``serve --device-gate``), each workload in turn."""
    budget_s: float
    """Sections of (a) that would start after this many seconds are skipped."""
    two_gpu: bool
    stage_args: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.pairs < 1 or self.controls < 0 or self.steps < 5 or self.budget_s <= 0:
            raise ValueError("pairs must be >= 1, controls >= 0, steps >= 5 and budget_s > 0")


@dataclass(slots=True)
class Report:
    started: float = field(default_factory=time.monotonic)
    sections: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    mps_missing: str | None = None
    """Why MPS cannot run here ("" where it runs), once a section found out; None until then."""

    def run(self, title: str, fn: Callable[[], str]) -> None:
        """Run one section; a failure is written into the report and the check goes on."""
        t0 = time.monotonic()
        print(f"[check] {title} ...", file=sys.stderr, flush=True)
        try:
            body = fn()
        except Exception as exc:
            self.failures.append(title)
            body = f"**FAILED**: {type(exc).__name__}: {exc}\n\n```\n{traceback.format_exc()[-3000:]}\n```"
        self.sections.append(f"## {title}\n\n{body}\n\n_{time.monotonic() - t0:.0f} s_\n")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def run_command(cmd: list[str], *, env: dict[str, str] | None = None, timeout_s: float = 300) -> str:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited with {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout
