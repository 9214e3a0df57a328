"""Configuration of ``freeride serve``: built once by the CLI, read-only after."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

from freeride import protocol as p
from freeride.transport import Endpoints

__all__ = ["DEFAULT_METRICS_PORT", "ServeConfig"]

DEFAULT_METRICS_PORT = 6968
"""The metrics port of ``freeride serve --metrics-port`` given without a number.

No exporter common on GPU nodes listens there (node-exporter 9100,
process-exporter 9256, dcgm-exporter 9400, nvidia_gpu_exporter 9835, Prometheus
itself 9090-9094), nor Ray (6379, 8265, workers 10002-19999) or torchrun
(29400, 29500); it lies below the kernel's ephemeral range and outside
9100-9999, which Prometheus's port list has handed out in full to exporters.
"""


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeConfig:
    """Everything the manager needs to know, validated at construction."""

    endpoints: Endpoints
    """Where backends, control clients and side-task workers connect."""
    state_dir: Path
    """Logs, checkpoints and step-time estimates of side tasks live here."""
    margin_ns: int = 300_000
    """Time kept free before a bubble's expected end, to start with: each device's interference guard adapts it."""
    checkpoint_every_s: float = 30.0
    """How often a running iterative task saves its state (between steps, inside bubbles)."""
    backend_timeout_s: float = 30.0
    """A rank whose process cannot be watched is taken for dead after this much silence."""
    stop_timeout_s: float = 10.0
    """How long a side task gets to checkpoint and exit before it is terminated."""
    profile: Path | None = None
    """Bubble profile written by ``freeride profile``: spare memory per stage before ranks report."""
    python: str = field(default=sys.executable)
    """Interpreter for side-task worker processes."""
    mps: bool = False
    """Run side tasks as MPS clients with memory caps (GPU only)."""
    device_gate: bool = False
    """Let the devices release side work (GPU only, ipc endpoints): a gate page per CUDA device, which the
    ranks' compute streams open at bubbles and armed workers queue their next step behind
    (:mod:`freeride.serve.gates`). Off: every bubble reaches side work through the host."""
    trace: Path | None = None
    """Write a Chrome/Perfetto trace of bubbles and side-task work here."""
    own_process: bool = False
    """The manager has its process to itself (``freeride serve``): it moves its threads off the training ranks'
    cores where some are spare (:mod:`freeride.host.owncores`). A manager run inside another program (a test,
    an embedding) leaves that program's cores alone."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (of ``metrics_host``); 0 picks a free one. The documented port is
    :data:`DEFAULT_METRICS_PORT`; None serves none."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics bind: loopback unless told otherwise (read-only, but unauthenticated)."""
    side_priority: p.SidePriority = "low"
    """CPU priority of side tasks: ``low`` (nice 19, the default) or ``same`` as the stage (GPU-faithful on CPU)."""
    keys_dir: Path | None = None
    """CURVE keys of ``freeride keys``; required when an endpoint is tcp (see docs/security.md)."""
    hang_after_s: float = 10.0
    """A grant not given back this long after its bubble's end (and ``hang_factor`` step estimates) is a slow
    step, or a hung one (see :mod:`freeride.serve.liveness`)."""
    hang_factor: float = 10.0
    """A step is hung only once it ran this many times its estimate past its bubble's end."""
    restart_backoff_s: float = 1.0
    """Delay before the first restart after a crash; it doubles with each restart."""
    restart_backoff_max_s: float = 60.0
    """The longest delay between two restarts."""
    max_loss_s: float = 120.0
    """Step time a crash may lose: past it a checkpoint is forced even when none fits a bubble (0: no bound)."""
    max_loss_steps: int = 0
    """Steps a crash may lose, likewise (0: no bound)."""
    settle_s: float = 10.0
    """An unpinned task submitted before every stage reported and showed its bubbles waits this long at most."""
    move_gain: float = 1.5
    """A task moves to another device only if it gets this many times its bubble time there."""
    move_every_s: float = 60.0
    """A task moves at most once in this many seconds (its first move may come as soon as it is set up)."""
    interference_target: float = 0.005
    """Share of training time side work may take past bubble ends (0.005: 0.5 %); each device's guard
    widens its margin above it and narrows it well below."""
    holdback: p.Holdback = field(default_factory=p.Holdback)
    """Which steps of each job get no side work, so that its step times measure what side work costs it
    (``every=0``: none, and no cost is measured; the job's name comes from its ranks)."""
    slowdown_budget: float = 0.005
    """The slowdown side work may cost a job, measured on its step times (0.005: 0.5 %): past it, harvesting
    backs off (0: no budget; the cost is still measured)."""

    def __post_init__(self) -> None:
        if self.margin_ns < 0:
            raise ValueError(f"margin_ns must be >= 0, got {self.margin_ns}")
        if self.checkpoint_every_s <= 0:
            raise ValueError(f"checkpoint_every_s must be > 0, got {self.checkpoint_every_s}")
        if self.backend_timeout_s <= 0:
            raise ValueError(f"backend_timeout_s must be > 0, got {self.backend_timeout_s}")
        if self.stop_timeout_s <= 0:
            raise ValueError(f"stop_timeout_s must be > 0, got {self.stop_timeout_s}")
        for name in ("hang_after_s", "hang_factor", "restart_backoff_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError(f"restart_backoff_max_s must be >= restart_backoff_s, got {self.restart_backoff_max_s}")
        if self.max_loss_s < 0:
            raise ValueError(f"max_loss_s must be >= 0, got {self.max_loss_s}")
        if self.settle_s < 0:
            raise ValueError(f"settle_s must be >= 0, got {self.settle_s}")
        if self.move_gain < 1:
            raise ValueError(f"move_gain must be >= 1 (a move must pay for its restart), got {self.move_gain}")
        if self.move_every_s < 0:
            raise ValueError(f"move_every_s must be >= 0, got {self.move_every_s}")
        if not 0 < self.interference_target < 1:
            raise ValueError(
                f"interference_target must be a share of training time in (0, 1) (0.005 is 0.5 %),"
                f" got {self.interference_target}"
            )
        if not 0 <= self.slowdown_budget < 1:
            raise ValueError(
                f"slowdown_budget must be a share of step time in [0, 1) (0.005 is 0.5 %), got {self.slowdown_budget}"
            )
        if self.max_loss_steps < 0:
            raise ValueError(f"max_loss_steps must be >= 0, got {self.max_loss_steps}")
        if self.keys_dir is None and self.endpoints.tcp_endpoints():
            raise ValueError(
                f"keys_dir: {', '.join(self.endpoints.tcp_endpoints())} need CURVE keys (any local user can reach a tcp"
                " port); run `freeride keys` and pass its directory"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if not self.metrics_host:
            raise ValueError("metrics_host must be an address, e.g. 127.0.0.1 or 0.0.0.0")
        if self.side_priority not in get_args(p.SidePriority):
            raise ValueError(f"side_priority must be one of {get_args(p.SidePriority)}, got {self.side_priority!r}")
        if self.profile is not None and not self.profile.is_file():
            raise ValueError(f"profile: no such file {self.profile}")

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def checkpoint_dir(self) -> Path:
        return self.state_dir / "checkpoints"

    @property
    def estimates_dir(self) -> Path:
        """Step-time estimates of side tasks, kept across runs (``freeride profile-task`` writes them too)."""
        return self.state_dir / "estimates"
