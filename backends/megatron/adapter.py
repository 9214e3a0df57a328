"""The Megatron-core adapter of one training process.

The patches of :mod:`freeride.backends.megatron.patches` report every
``forward_backward`` call, compute action and receive wait of the process to
one :class:`MegatronAdapter`, which keeps a :class:`~freeride.backends.tracker.StepTracker`
(each wait's place is the next action of megatron's schedule, see
:mod:`freeride.backends.megatron.plan`) and a :class:`~freeride.backends.session.BackendSession`
(and, in profile mode, the :class:`~freeride.backends.observations.ObservationLog`
``freeride profile`` reads).

On a GPU whose p2p goes through NCCL the receives return to the host before
the device has waited (``_p2p_ops`` without ``batch_p2p_sync``): bubbles are
then timed on the device's timeline (:mod:`freeride.backends.cuda_timing`); with host
timing on a GPU (forced, or gloo) the tracker synchronises the stream around
each announced wait instead. ``FREERIDE_BUBBLE_TIMING`` forces either.

Forward-only calls (evaluation, inference) are tracked with their own plan
(:func:`freeride.backends.schedule.forward_only`) and are left out of the profile,
which describes training steps. With a ``finalize_model_grads_func`` the
rank's tail is the wait inside that call (its gradient all-reduces hold the
rank until the last stage it syncs with is done), announced at the plan's
tail place. A rank without a pipeline (``pp=1``) says hello with
``num_stages=1`` and logs that it has no bubbles; nothing is tracked and each
of its steps costs the wrapper a clock read.

Nothing here may break training: every FreeRide error is logged and turns the
adapter off; the wrapped megatron call always runs.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from freeride.backends.cuda_timing import DeviceTimeline, Timing, track_steps
from freeride.backends.device_clock import DeviceApi
from freeride.backends.launch import read_mode
from freeride.backends.megatron import _compat
from freeride.backends.megatron._device import RankDevice
from freeride.backends.megatron.plan import iterations, megatron_schedule
from freeride.backends.observations import ObservationLog
from freeride.backends.schedule import Kind
from freeride.backends.session import BackendConfig, BackendSession, events_endpoint_from_env
from freeride.backends.tracker import StepPlan, StepTracker
from freeride.profile import RankObservations, StepRecord, write_observations

__all__ = ["MegatronAdapter", "current_adapter", "reset_adapter"]

logger = logging.getLogger(__name__)

_HEARTBEAT_NS = 1_000_000_000
"""How often a rank without a pipeline, which sends nothing else, says it is alive."""
_FIRST_BEAT_NS = 100_000_000
"""Until its first Hello went out (a manager connects after the job starts)."""


class MegatronAdapter:
    """Turns the calls of one process's megatron schedules into bubble events.

    Args:
        timing: Forces host or device timing; None reads ``FREERIDE_BUBBLE_TIMING``.
        device_api: The CUDA calls of a device timeline (tests pass a stand-in).
    """

    def __init__(self, *, timing: Timing | None = None, device_api: DeviceApi | None = None) -> None:
        self._timing = timing
        self._device_api = device_api
        self._timeline: DeviceTimeline | None = None
        self._session: BackendSession | None = None
        self._tracker: StepTracker | None = None
        self._device: RankDevice | None = None
        self._disabled = False
        self._warned: set[str] = set()
        self._depth = 0
        self._plans: dict[tuple[object, ...], StepPlan] = {}
        self._mode, self._profile_dir = read_mode()
        self._log: ObservationLog | None = None
        self._last_spare = -1
        self._forward_only = False
        self._single: BackendSession | None = None
        """The session of a rank without a pipeline (pp=1)."""
        self._next_beat = 0
        self.tracking = False
        """Inside a tracked ``forward_backward`` call."""

    # ------------------------------------------------------------ guards
    def _warn_once(self, what: str, msg: str, *args: object) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(msg, *args)

    def _fail(self, where: str) -> None:
        logger.exception("[attach] megatron adapter failed in %s; training continues without FreeRide", where)
        self._disabled = True
        self.tracking = False

    # ------------------------------------------------------------- steps
    def step_begin(self, fn_name: str, kwargs: dict[str, Any]) -> bool:
        """Start tracking a ``forward_backward`` call; False to run it untracked."""
        if self._disabled:
            return False
        try:
            return self._begin(fn_name, kwargs)
        except Exception:
            self._fail("step_begin")
            return False

    def _begin(self, fn_name: str, kwargs: dict[str, Any]) -> bool:
        if self._single is not None:  # no pipeline: nothing to track, only stay known
            self._beat(self._single)
            return False
        info = _compat.call_info(kwargs)
        if info.num_stages < 2:
            self._beat(self._start_single(info))
            return False
        if info.combined_1f1b and not info.forward_only:  # megatron runs forward-only calls unfused
            self._warn_once("moe", "[attach] overlap_moe_expert_parallel_comm runs a fused schedule; not tracked")
            return False
        name = _compat.CHUNK_SCHEDULE.get(fn_name) or ("interleaved" if info.num_chunks > 1 else "1f1b")
        key: tuple[object, ...] = (name, info.num_stages, info.num_microbatches, info.num_chunks)
        key += (info.group_size, info.stage, info.overlap_p2p_comm, info.has_finalize, info.forward_only)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(name, info)
        tracker = self._tracker or self._start(info, name)
        if info.has_finalize and not info.forward_only:
            from freeride.backends.megatron.patches import wrap_finalize

            wrap_finalize(info.config)
        self._forward_only = info.forward_only
        device = self._device
        if device is not None and (device.cuda or tracker.steps % 10 == 0):
            self._last_spare = device.spare_memory()  # /proc/meminfo is read only every 10 steps
        tracker.begin_step(plan, spare_memory=self._last_spare)
        self.tracking = True
        return True

    @staticmethod
    def _plan(name: str, info: _compat.CallInfo) -> StepPlan:
        p, group = info.num_stages, info.group_size
        schedule = megatron_schedule(
            name, p, info.num_microbatches, info.num_chunks, group, forward_only=info.forward_only
        )
        groups = tuple(
            iterations(schedule, s, overlap_p2p_comm=info.overlap_p2p_comm, group_size=group) for s in range(p)
        )
        # A forward-only call ends with no sync, but its tail is no wait of this rank: a stage
        # sends its last output and returns (only the next call's first receive may wait longer).
        merge_tail = not info.has_finalize and not info.forward_only
        return StepPlan(schedule=schedule, stage=info.stage, merge_tail=merge_tail, groups=groups)

    def _config(self, info: _compat.CallInfo) -> tuple[BackendConfig, RankDevice]:
        import torch.distributed as dist

        version = _compat.megatron_version()
        if version not in _compat.TESTED_VERSIONS:
            self._warn_once(
                "version", "[attach] megatron-core %s is untested (tested: %s)", version, _compat.TESTED_VERSIONS
            )
        device = RankDevice()
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))
        config = BackendConfig(
            endpoint=events_endpoint_from_env(),
            rank=rank,
            stage=info.stage,
            num_stages=info.num_stages,
            device=device.name,
            framework="megatron",
            spare_memory=device.spare_memory(),
            device_memory=device.memory,
        )
        return config, device

    def _start_single(self, info: _compat.CallInfo) -> BackendSession:
        """A rank without a pipeline: say so once, and say hello with ``num_stages=1``."""
        config, _ = self._config(info)
        self._single = BackendSession(config)  # its attach line says: pipeline size 1, no pipeline bubbles
        if self._mode == "profile" and self._profile_dir is not None:  # `freeride profile` learns there is
            observations = RankObservations(  # nothing to measure, and stops the job
                framework="megatron",
                rank=config.rank,
                stage=0,
                num_stages=1,
                device=config.device,
                num_microbatches=info.num_microbatches,
                schedule="no-pipelining",
            )
            try:
                write_observations(observations, self._profile_dir)
            except OSError:
                logger.exception("[profile] rank %d: cannot write to %s", config.rank, self._profile_dir)
        logger.debug(
            "[attach] megatron rank %d on %s: pipeline size 1, so no pipeline bubbles; nothing to announce",
            config.rank,
            config.device,
        )
        return self._single

    def _beat(self, session: BackendSession) -> None:
        now = time.monotonic_ns()
        if now >= self._next_beat:
            session.heartbeat()  # also repeats the Hello until one went out
            self._next_beat = now + (_HEARTBEAT_NS if session.sent else _FIRST_BEAT_NS)

    def _on_step(self, record: StepRecord) -> None:
        if self._log is not None and not self._forward_only:  # the profile describes training steps
            self._log.add(record)

    def _start(self, info: _compat.CallInfo, schedule: str) -> StepTracker:
        config, device = self._config(info)
        self._device, rank = device, config.rank
        self._session = BackendSession(config)
        if self._mode == "profile":
            base = RankObservations(
                framework="megatron",
                rank=rank,
                stage=info.stage,
                num_stages=info.num_stages,
                device=device.name,
                num_microbatches=info.num_microbatches,
                schedule=schedule,
                device_memory=device.memory,
            )
            self._log = ObservationLog(base, self._profile_dir, spare_memory=device.spare_memory)
        self._timeline, self._tracker = track_steps(
            self._session,
            device_type="cuda" if device.cuda else "cpu",
            timing=self._timing,
            api=self._device_api,
            min_bubble_ns=config.min_bubble_ns,
            # host timing on a GPU: wait for the queued kernels, so the host's wait is the device's
            settle=device.settle if device.cuda else None,
            on_step=self._on_step if self._log is not None else None,
        )
        logger.debug(  # the session wrote the attach line; these are the details
            "[attach] megatron rank %d stage %d/%d on %s (%s mode)",
            rank,
            info.stage,
            info.num_stages,
            device.name,
            self._mode,
        )
        return self._tracker

    def step_end(self, ok: bool) -> None:
        """The tracked call returned (``ok``) or raised."""
        self.tracking = False
        self._depth = 0
        tracker = self._tracker
        if tracker is None or self._disabled:
            return
        try:
            if ok:
                tracker.end_step()
            else:
                tracker.abandon_step()
        except Exception:
            self._fail("step_end")

    # ----------------------------------------------------------- compute
    def compute_begin(self, kind: Kind) -> Any:
        tracker, device = self._tracker, self._device
        if tracker is None or device is None:
            return None
        try:
            tracker.action_started(kind)
            return device.start()
        except Exception:
            self._fail("compute_begin")
            return None

    def compute_end(self, kind: Kind, started: Any) -> None:
        tracker, device = self._tracker, self._device
        if tracker is None or device is None or started is None:
            return
        try:
            for k, ns in device.stop(kind, started):
                tracker.record_compute(k, ns)
        except Exception:
            self._fail("compute_end")

    # ------------------------------------------------------------- waits
    @property
    def in_wait(self) -> bool:
        return self._depth > 0

    def wait_begin(self) -> None:
        self._depth += 1
        if self._depth == 1 and self._tracker is not None:
            try:
                self._tracker.wait_started()
            except Exception:
                self._fail("wait_begin")

    def wait_end(self) -> None:
        self._depth = max(self._depth - 1, 0)
        if self._depth == 0 and self._tracker is not None:
            try:
                self._tracker.wait_ended()
            except Exception:
                self._fail("wait_end")

    def stats(self) -> dict[str, int]:
        """Steps tracked and events sent and dropped so far."""
        session, tracker = self._session or self._single, self._tracker
        return {
            "steps": tracker.steps if tracker is not None else 0,
            "sent": session.sent if session is not None else 0,
            "dropped": session.dropped if session is not None else 0,
        }

    def close(self) -> None:
        """Write observations and say goodbye (idempotent)."""
        if self._log is not None:
            self._log.close()
        if self._timeline is not None:
            self._timeline.close()
        elif self._session is not None:
            self._session.close()
        if self._single is not None:
            self._single.close()


_adapter: MegatronAdapter | None = None


def current_adapter() -> MegatronAdapter:
    """The process's adapter (created on first use)."""
    global _adapter
    if _adapter is None:
        _adapter = MegatronAdapter()
    return _adapter


def reset_adapter() -> None:
    """Close and forget the process's adapter (tests)."""
    global _adapter
    if _adapter is not None:
        _adapter.close()
    _adapter = None
