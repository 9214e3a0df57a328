"""What the manager knows and decides, without a socket: the ranks, the schedulers, the side tasks.

:class:`ManagerCore` is fed what arrives (a rank's events through
:meth:`~ManagerCore.on_event`, control requests through
:meth:`~ManagerCore.on_control`, worker messages through its supervisor) and
answers with grants (through the ``send`` function it is given), replies and
status. :class:`~freeride.serve.manager.Manager` adds the sockets, the loops
that read them, NVML and MPS; tests drive the core directly.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import assert_never

import msgspec

from freeride import protocol as p
from freeride.observe.base import Observers
from freeride.observe.stats import LatencyRecorder
from freeride.serve.config import ServeConfig
from freeride.serve.costs import TrainingCosts
from freeride.serve.gates import GatePages
from freeride.serve.nobubbles import waiting_on_device
from freeride.serve.ranks import DeviceInfo, Ranks
from freeride.serve.runners import SendFn
from freeride.serve.scheduler import DeviceScheduler
from freeride.serve.supervisor import Supervisor
from freeride.serve.tasks import TaskRecord
from freeride.transport import BadFrame, bubbles_endpoint

__all__ = ["GOODBYE_WAIT_NS", "ManagerCore", "sampled"]

logger = logging.getLogger(__name__)

GOODBYE_WAIT_NS = 500_000_000
"""How long a rank's goodbye waits for its last bubble end, which comes on another socket (the
rank's publisher lingers up to 200 ms to send it); taken by :meth:`ManagerCore.finish_goodbyes`."""


def _gate_directory(config: ServeConfig) -> Path | None:
    """Where the devices' gate pages go: beside the manager's ipc sockets (None: no device gate)."""
    events = config.endpoints.events
    if not config.device_gate or not events.startswith("ipc://"):
        return None  # off, or the ranks are remote: only a rank on this node can open a page here
    return Path(events[6:]).parent


def sampled(count: int) -> bool:
    """Whether the ``count``-th rejection is logged: a misbehaving sender must not flood the log."""
    return count <= 10 or count % 1000 == 0


class ManagerCore:
    """One node's state and decisions, fed by the manager's loops (or a test)."""

    def __init__(self, config: ServeConfig, *, send: SendFn) -> None:
        self.config = config
        self.schedulers: dict[str, DeviceScheduler] = {}
        """One per device, created when :attr:`ranks` first knows the device."""
        self.latency = LatencyRecorder()
        self.events = 0
        self.rejected_frames = 0
        self.ranks = Ranks(listener=self, backend_timeout_s=config.backend_timeout_s)
        self._started_ns = time.monotonic_ns()
        self.observers = Observers()
        """Trace writers and metrics exporters; see :mod:`freeride.observe.base`."""
        self.costs = TrainingCosts(config.holdback, budget=config.slowdown_budget, on_pair=self.observers.training_cost)
        """Each job's measured cost and slowdown budget: what the schedulers may grant."""
        self._following: set[str] = set()
        """The ranks' bubble publishers the core asked to follow (see :meth:`follow_bubbles`)."""
        self._answered: set[str] = set()
        """The ranks' bubble publishers the core asked to answer (see :meth:`answer_hellos`)."""
        self._goodbyes: dict[int, tuple[p.Goodbye, int]] = {}
        """Goodbyes waiting for their rank's last bubble end, with the time they are taken regardless."""
        self.gates = GatePages(_gate_directory(config))
        """The devices' bubble gate pages (``serve --device-gate``)."""
        self.supervisor = Supervisor(
            config,
            devices=self.ranks.devices,
            schedulers=self.schedulers,
            send=send,
            observers=self.observers,
            gates=self.gates,
        )

    @property
    def devices(self) -> dict[str, DeviceInfo]:
        """Every known device, by name (read only: :attr:`ranks` writes it)."""
        return self.ranks.devices

    # -- backend events -------------------------------------------------------

    def on_event(self, event: p.BackendEvent | BadFrame) -> None:
        """One message from a training rank (or a frame that could not be read)."""
        self.events += 1
        if not isinstance(event, BadFrame):
            self.observers.backend_event(event)
        match event:
            case BadFrame(reason=reason, size=size):
                self.rejected_frames += 1
                if sampled(self.rejected_frames):
                    logger.warning(
                        "[events] rejected a %d-byte frame (%d so far): %s", size, self.rejected_frames, reason
                    )
                return
            case p.Hello():
                if not self.ranks.hello(event):
                    self.rejected_frames += 1
                    return
                self.costs.hello(event.rank, event.job)
                if (scheduler := self.schedulers.get(event.device)) is not None:
                    scheduler.follow_rank(self._bubbles_endpoint(event))
                self.refresh_following()
            # Bubble events are handled here, on the events loop, not through a queue: a
            # queue hop costs a loop iteration on the bubble-start -> step path.
            case p.BubbleStarted():
                info = self.ranks.bubble(event)
                if info is not None:
                    self.schedulers[info.name].on_bubble_started(event)
            case p.BubbleEnded():
                info = self.ranks.bubble(event)
                if info is not None:
                    scheduler = self.schedulers[info.name]
                    scheduler.on_bubble_ended(event)
                    if self._goodbyes and event.rank in self._goodbyes:
                        goodbye, _ = self._goodbyes[event.rank]
                        if goodbye.last_bubble == (event.step, event.index):
                            self._goodbye(goodbye)
                    elif not scheduler.wants_bubbles and scheduler.bubbles_endpoint in self._following:
                        self.refresh_following()  # learned, and nothing here to grant: stop at once
            case p.StepFinished(rank=rank, step=step, duration_ns=duration, bubble_ns=bubble):
                info = self.ranks.step_finished(rank, duration_ns=duration, bubble_ns=bubble)
                self.costs.step_finished(rank, step, duration)
                scheduler = self.schedulers.get(info.name) if event.unpublished and info is not None else None
                if scheduler is not None and scheduler.bubbles_endpoint in self._following:
                    # a held-back step's bubbles, which its rank announced to no one: counted as if followed
                    scheduler.ledger.unpublished(event.unpublished, event.unpublished_ns)
            case p.Heartbeat(rank=rank):
                self.ranks.heartbeat(rank)
            case p.Goodbye():
                if self._last_end_on_its_way(event):
                    self.ranks.leaving(event.rank)
                    self._goodbyes[event.rank] = (event, time.monotonic_ns() + GOODBYE_WAIT_NS)
                else:
                    self._goodbye(event)
            case _:
                assert_never(event)

    def _last_end_on_its_way(self, goodbye: p.Goodbye) -> bool:
        """Whether ``goodbye`` came ahead of its rank's last bubble end, which this manager follows."""
        if goodbye.last_bubble is None or self.ranks.last_end(goodbye.rank) == goodbye.last_bubble:
            return False
        return bubbles_endpoint(self.config.endpoints.events, goodbye.rank) in self._following

    def _goodbye(self, goodbye: p.Goodbye) -> None:
        self._goodbyes.pop(goodbye.rank, None)
        self.ranks.goodbye(goodbye.rank, goodbye.dropped)
        self.refresh_following()

    def finish_goodbyes(self) -> None:
        """Take the goodbyes whose rank's last bubble end did not come in time (called each second)."""
        now = time.monotonic_ns()
        for goodbye, due_ns in list(self._goodbyes.values()):
            if now >= due_ns:
                logger.debug("[events] rank %d: its last bubble end did not come", goodbye.rank)
                self._goodbye(goodbye)

    def _bubbles_endpoint(self, hello: p.Hello) -> str:
        """Where the rank publishes its bubble starts: only the address derived here is followed.

        So an armed worker only ever connects inside this manager's private runtime directory.
        """
        expected = bubbles_endpoint(self.config.endpoints.events, hello.rank)
        if hello.bubbles_endpoint and hello.bubbles_endpoint != expected:
            self.event_refused(f"rank {hello.rank} publishes bubbles on {hello.bubbles_endpoint!r}, not {expected!r}")
            return ""
        return hello.bubbles_endpoint

    # -- whose bubbles are followed --------------------------------------------

    def bubbles_wanted(self) -> set[str]:
        """The bubble publishers to follow: of each device where side work is placed, or whose bubbles are not learned.

        A rank that publishes its bubbles (an ipc rank, the usual case) sends them
        only to those who follow it, so a device without side work costs the
        manager no wake-up per bubble (decision D50); placing a task waiting for a
        device needs none (its rank's step reports tell the device's bubble share).
        Every rank is followed while the manager writes a trace.
        """
        every = self.config.trace is not None
        return {
            s.bubbles_endpoint for s in self.schedulers.values() if s.bubbles_endpoint and (every or s.wants_bubbles)
        }

    def edges_due(self) -> bool:
        """Whether the ranks' events must be read as they come: a decision waits on a bubble's start or end.

        Where side work runs and no device has such a decision (every bubble
        is an armed worker's that hears its rank: see
        :attr:`~freeride.serve.scheduler.DeviceScheduler.edge_due`), the
        manager reads them in batches, and is woken by its workers' reports
        instead of by every bubble's start and end. With no side work placed
        anywhere they are read as they come: few come (decision D50).
        """
        schedulers = self.schedulers.values()
        return not any(s.in_use for s in schedulers) or any(s.edge_due for s in schedulers)

    def refresh_following(self) -> None:
        """Follow exactly :meth:`bubbles_wanted` (called as ranks, tasks and bubbles come and go, and each second).

        Every rank that publishes its bubbles is answered, followed or not (:meth:`answer_hellos`).
        """
        known = {s.bubbles_endpoint for s in self.schedulers.values() if s.bubbles_endpoint}
        if known != self._answered:
            self._answered = known
            self.answer_hellos(known)
        wanted = self.bubbles_wanted()
        if wanted == self._following:
            return
        for scheduler in self.schedulers.values():
            if scheduler.bubbles_endpoint in wanted - self._following:
                scheduler.followed_again()
        self._following = wanted
        self.follow_bubbles(wanted)

    def follow_bubbles(self, endpoints: set[str]) -> None:
        """Follow the ranks publishing on ``endpoints``, and no other (the manager's SUB; nothing here)."""

    def answer_hellos(self, endpoints: set[str]) -> None:
        """Tell the ranks publishing on ``endpoints``, and no other, that their Hello was taken (nothing here)."""

    # -- what the ranks tell (RankListener) -----------------------------------

    def device_added(self, info: DeviceInfo) -> None:
        self.schedulers[info.name] = DeviceScheduler(
            info.name,
            latency=self.latency,
            margin_ns=self.config.margin_ns,
            interference_target=self.config.interference_target,
            charge_stage_waits=self.config.side_priority == "same",
            observers=self.observers,
            costs=self.costs,
            gate=self.gates.open(info.name),
        )

    def device_lost(self, name: str) -> None:
        scheduler = self.schedulers.get(name)
        if scheduler is not None:
            scheduler.backend_lost()

    def rank_ready(self, info: DeviceInfo) -> None:
        self.supervisor.place_pending()

    def device_in_use(self, name: str) -> bool:
        scheduler = self.schedulers.get(name)
        return scheduler is not None and scheduler.in_use

    def device_removed(self, name: str) -> None:
        self.schedulers.pop(name, None)
        self.gates.close(name)

    def event_refused(self, reason: str) -> None:
        self.rejected_frames += 1
        if sampled(self.rejected_frames):
            logger.warning("[events] refused an event (%d rejected so far): %s", self.rejected_frames, reason)

    def read_queued_events(self) -> None:
        """Handle the ranks' events received and not yet read (the manager's sockets; none here)."""

    def gpu_uuid(self, device: str) -> str:
        """The UUID of a device's GPU; "" where none is known (the manager asks NVML)."""
        return ""

    def declare_device(self, name: str, *, stage: int, spare_memory: int, cpu_affinity: list[int]) -> None:
        """Make a device known before its rank reports (from a profile, or by a launcher).

        Side tasks can then be placed on it and set up before training starts.
        """
        self.ranks.declare(name, stage=stage, spare_memory=spare_memory, cpu_affinity=cpu_affinity)

    def live_backends(self) -> list[int]:
        """Ranks currently reporting to this manager."""
        return self.ranks.live()

    # -- side tasks -------------------------------------------------------------

    @property
    def tasks(self) -> dict[int, TaskRecord]:
        return self.supervisor.tasks

    def submit(self, spec: p.TaskSpec) -> p.Submitted | p.Rejected:
        """Validate, record and place a side task (its device's bubbles are followed from now on)."""
        reply = self.supervisor.submit(spec)
        self.refresh_following()
        return reply

    async def cancel(self, task_id: int) -> p.Cancelled | p.Rejected:
        """Stop a side task; it checkpoints first, so submitting it again resumes it."""
        return await self.supervisor.cancel(task_id)

    def on_control(self, req: p.ControlRequest | BadFrame) -> p.ControlReply:
        """One control client's request (or a frame that could not be read), answered at once."""
        match req:
            case BadFrame(reason=reason):
                self.rejected_frames += 1
                return p.Rejected(reason=f"malformed request: {reason}")
            case p.Submit(spec=spec):
                return self.submit(spec)
            case p.Cancel(task_id=task_id):
                return self.supervisor.cancel_nowait(task_id)  # the stop goes on in the background
            case p.StatusRequest():
                return self.status()
            case _:
                assert_never(req)

    def _task_status(self, task: TaskRecord) -> p.TaskStatus:
        scheduler = self.schedulers.get(task.device)
        if scheduler is None:
            return task.status()
        no_fit, why = scheduler.no_fit(task.task_id)
        idle = "" if task.state in p.TERMINAL_STATES else waiting_on_device(task.device, self.devices.get(task.device))
        return msgspec.structs.replace(
            task.status(),
            interference_ns=scheduler.task_interference_ns(task.task_id),
            no_fit=no_fit,
            no_fit_reason=why,
            pending_reason=idle or task.status().pending_reason,
        )

    def _device_status(self, name: str, info: DeviceInfo) -> p.DeviceStatus:
        status = self.schedulers[name].status(info, gpu_uuid=self.gpu_uuid(name))
        gate = self.gates.get(name)
        return status if gate is None else msgspec.structs.replace(status, gate=gate.describe())

    def status(self) -> p.StatusReply:
        p50, p99, worst = self.latency.summary()
        return p.StatusReply(
            devices=[self._device_status(name, info) for name, info in self.devices.items()],
            tasks=[self._task_status(t) for t in self.tasks.values()],
            latency=p.LatencySummary(count=self.latency.count, p50_ns=p50, p99_ns=p99, max_ns=worst),
            events=self.events,
            rejected_frames=self.rejected_frames,
            uptime_ns=time.monotonic_ns() - self._started_ns,
            costs=self.costs.status(),
        )
