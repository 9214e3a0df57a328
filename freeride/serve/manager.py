"""The manager behind ``freeride serve``: one event loop per node.

Usage::

    async with Manager(config) as manager:
        await manager.run(stop_event)

Three sockets, each owned by one object and read by one task: backend events
(PULL), side-task workers (ROUTER) and control clients (ROUTER). Each device
gets a :class:`~freeride.serve.scheduler.DeviceScheduler` coroutine that hands its
bubbles to the side tasks placed there. Everything runs in one TaskGroup; on
exit every side task is asked to checkpoint and stop, then terminated if it
does not, and every socket is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from types import TracebackType
from typing import assert_never

import msgspec

from freeride import protocol as p
from freeride.auth import CurveServerKeys, ServeLock, ensure_private_dir, is_loopback_endpoint, load_server_keys
from freeride.gpu.mps import MpsDaemon
from freeride.gpu.nvml import NvmlMonitor
from freeride.observe.base import Observers
from freeride.observe.stats import LatencyRecorder
from freeride.serve.config import ServeConfig
from freeride.serve.costs import TrainingCosts
from freeride.serve.nobubbles import waiting_on_device
from freeride.serve.ranks import DeviceInfo, Ranks
from freeride.serve.scheduler import DeviceScheduler
from freeride.serve.supervisor import Supervisor
from freeride.serve.tasks import TaskRecord
from freeride.transport import (
    BadFrame,
    ControlServer,
    EventReceiver,
    WorkerHub,
    ZapHandler,
    bubbles_endpoint,
    new_async_context,
)

__all__ = ["Manager"]

logger = logging.getLogger(__name__)

_BATCH = 64
"""Messages one loop handles before the others get a turn (about half a millisecond of events)."""


def _sampled(count: int) -> bool:
    """Whether the ``count``-th rejection is logged: a misbehaving sender must not flood the log."""
    return count <= 10 or count % 1000 == 0


class _Stop(Exception):
    """Raised inside the TaskGroup to end :meth:`Manager.run`."""


class Manager:
    """Serves one node: backends' bubbles in, side-task grants out."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.schedulers: dict[str, DeviceScheduler] = {}
        """One per device, created when :attr:`ranks` first knows the device."""
        self.latency = LatencyRecorder()
        self.events = 0
        self.rejected_frames = 0
        self.ranks = Ranks(listener=self, backend_timeout_s=config.backend_timeout_s)
        self._started_ns = time.monotonic_ns()
        self._tg: asyncio.TaskGroup | None = None
        self._ctx = new_async_context()
        self._receiver: EventReceiver | None = None
        self._hub: WorkerHub | None = None
        self._control: ControlServer | None = None
        self._closed = False
        self._lock: ServeLock | None = None
        self._zap: ZapHandler | None = None
        self._nvml: NvmlMonitor | None = None
        self._mps: MpsDaemon | None = None
        self.observers = Observers()
        self.metrics_port: int | None = None
        """The port the Prometheus metrics are served on, once bound (None: not served)."""
        """Trace writers and metrics exporters; see :mod:`freeride.observe.base`."""
        self.costs = TrainingCosts(config.holdback, budget=config.slowdown_budget, on_pair=self.observers.training_cost)
        """Each job's measured cost and slowdown budget: what the schedulers may grant."""
        self.supervisor = Supervisor(
            config,
            devices=self.ranks.devices,
            schedulers=self.schedulers,
            send=self._send,
            observers=self.observers,
        )

    @property
    def devices(self) -> dict[str, DeviceInfo]:
        """Every known device, by name (read only: :attr:`ranks` writes it)."""
        return self.ranks.devices

    # -- lifetime -------------------------------------------------------------

    def _claim_dirs(self) -> CurveServerKeys | None:
        """Private socket directories and the serve lock, before any socket file is touched.

        See docs/security.md: a directory planted by another user is refused,
        and so is a runtime directory another manager serves.
        """
        for i, d in enumerate(self.config.endpoints.socket_dirs()):
            ensure_private_dir(d)
            if i == 0:
                self._lock = ServeLock(d)
                self._lock.acquire()
        ensure_private_dir(self.config.state_dir, what="state dir", strict=False)
        for d in (self.config.log_dir, self.config.checkpoint_dir):
            d.mkdir(parents=True, exist_ok=True)
        for addr in (self.config.endpoints.events, self.config.endpoints.control, self.config.endpoints.workers):
            if addr.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(addr[6:])  # stale socket file of a manager that died (we hold the lock)
        if self.config.endpoints.tcp_endpoints() and self.config.keys_dir is not None:
            return load_server_keys(self.config.keys_dir)
        return None

    async def __aenter__(self) -> Manager:
        try:
            curve = self._claim_dirs()
            # the handler first: libzmq lets connections in unchecked while none is bound
            self._zap = ZapHandler(self._ctx, curve_clients=curve.clients if curve else frozenset())
            self._receiver = EventReceiver(self._ctx, self.config.endpoints.events, curve=curve)
            self._hub = WorkerHub(self._ctx, self.config.endpoints.workers)
            self._control = ControlServer(self._ctx, self.config.endpoints.control, curve=curve)
            if self.config.trace is not None:
                from freeride.observe.trace import TraceWriter

                self.observers.add(TraceWriter(self.config.trace))
            if self.config.metrics_port is not None:
                from freeride.observe.metrics import MetricsExporter

                host = self.config.metrics_host
                if not is_loopback_endpoint(f"tcp://{host}:0"):
                    logger.warning(
                        "[metrics] bound to %s: other hosts can read them (no authentication; counters only)", host
                    )
                exporter = MetricsExporter(
                    port=self.config.metrics_port, addr=host, status=self.status, gpu_uuid=self.gpu_uuid
                )
                self.observers.add(exporter)
                self.metrics_port = exporter.port
        except Exception:
            await self.aclose()
            raise
        if self.config.profile is not None:
            self.ranks.load_profile(self.config.profile)
        self._nvml = NvmlMonitor.open()  # None on machines without NVIDIA's driver
        if self.config.mps:
            self._mps = MpsDaemon(self.config.state_dir / "mps", self.config.log_dir / "mps")
            try:
                await self._mps.start()
            except Exception:
                await self.aclose()
                raise
            self.supervisor.mps_pipe_dir = self._mps.pipe_dir
        logger.info(
            "[startup] manager: events=%s control=%s workers=%s",
            self.config.endpoints.events,
            self.config.endpoints.control,
            self.config.endpoints.workers,
        )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop every side task and close every socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.supervisor.stop()
        await self.supervisor.stop_all()
        self.ranks.close()
        self.observers.close()
        if self._mps is not None:
            await self._mps.quit()
        if self._nvml is not None:
            self._nvml.close()
        for owner in (self._receiver, self._hub, self._control, self._zap):
            if owner is not None:
                owner.close()
        self._ctx.term()
        if self._lock is not None:
            self._lock.release()
        logger.info("[shutdown] manager: closed")

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Serve until ``stop`` is set (forever if ``None``)."""
        stop = stop or asyncio.Event()
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                if self._zap is not None:
                    tg.create_task(self._zap.serve(), name="manager-zap")
                tg.create_task(self._events_loop(), name="manager-events")
                tg.create_task(self._workers_loop(), name="manager-workers")
                tg.create_task(self._control_loop(), name="manager-control")
                tg.create_task(self._watchdog(), name="manager-watchdog")
                tg.create_task(self._until(stop), name="manager-stop")
                self.supervisor.start(lambda coro, name: tg.create_task(coro, name=name))
        except* _Stop:
            pass
        finally:
            self.supervisor.stop()
            self._tg = None

    @staticmethod
    async def _until(stop: asyncio.Event) -> None:
        await stop.wait()
        raise _Stop

    # -- backend events -------------------------------------------------------

    async def _events_loop(self) -> None:
        assert self._receiver is not None
        while True:
            for event in await self._receiver.recv_batch(_BATCH):
                self.events += 1
                self._on_event(event)
            # A socket with messages queued answers an await at once, without yielding:
            # read one by one, a flood of events would keep control and workers waiting.
            await asyncio.sleep(0)

    def _on_event(self, event: p.BackendEvent | BadFrame) -> None:
        if not isinstance(event, BadFrame):
            self.observers.backend_event(event)
        match event:
            case BadFrame(reason=reason, size=size):
                self.rejected_frames += 1
                if _sampled(self.rejected_frames):
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
            # Bubble events are handled here, on the events loop, not through a queue: a
            # queue hop costs a loop iteration on the bubble-start -> step path.
            case p.BubbleStarted():
                info = self.ranks.bubble(event)
                if info is not None:
                    self.schedulers[info.name].on_bubble_started(event)
            case p.BubbleEnded():
                info = self.ranks.bubble(event)
                if info is not None:
                    self.schedulers[info.name].on_bubble_ended(event)
            case p.StepFinished(rank=rank, step=step, duration_ns=duration, bubble_ns=bubble):
                self.ranks.step_finished(rank, duration_ns=duration, bubble_ns=bubble)
                self.costs.step_finished(rank, step, duration)
            case p.Heartbeat(rank=rank):
                self.ranks.heartbeat(rank)
            case p.Goodbye(rank=rank, dropped=dropped):
                self.ranks.goodbye(rank, dropped)
            case _:
                assert_never(event)

    def _bubbles_endpoint(self, hello: p.Hello) -> str:
        """Where the rank publishes its bubble starts: only the address derived here is followed.

        So an armed worker only ever connects inside this manager's private runtime directory.
        """
        expected = bubbles_endpoint(self.config.endpoints.events, hello.rank)
        if hello.bubbles_endpoint and hello.bubbles_endpoint != expected:
            self.event_refused(f"rank {hello.rank} publishes bubbles on {hello.bubbles_endpoint!r}, not {expected!r}")
            return ""
        return hello.bubbles_endpoint

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

    def event_refused(self, reason: str) -> None:
        self.rejected_frames += 1
        if _sampled(self.rejected_frames):
            logger.warning("[events] refused an event (%d rejected so far): %s", self.rejected_frames, reason)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.backend_timeout_s / 4))
            self._poll_nvml()
            self.ranks.check_silence()

    def _poll_nvml(self) -> None:
        """Free memory per GPU and memory per side-task process, for placement and status."""
        if self._nvml is None:
            return
        free = {d.index: d.free for d in self._nvml.devices()}
        self.ranks.note_free_memory(free)
        used: dict[int, int] = {}
        for index in free:
            used.update(self._nvml.process_memory(index))
        self.supervisor.note_process_memory(used)

    def gpu_uuid(self, device: str) -> str:
        """NVML's UUID of a device (see :meth:`~freeride.gpu.nvml.NvmlMonitor.uuid_of`); "" without NVML."""
        return self._nvml.uuid_of(device) if self._nvml is not None else ""

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
        """Validate, record and place a side task."""
        return self.supervisor.submit(spec)

    async def cancel(self, task_id: int) -> p.Cancelled | p.Rejected:
        """Stop a side task; it checkpoints first, so submitting it again resumes it."""
        return await self.supervisor.cancel(task_id)

    def _send(self, ident: bytes, msg: p.ManagerToWorker) -> bool:
        return self._hub is not None and self._hub.send_nowait(ident, msg)

    async def _workers_loop(self) -> None:
        assert self._hub is not None
        while True:
            for ident, msg in await self._hub.recv_batch(_BATCH):
                if isinstance(msg, BadFrame):
                    self.rejected_frames += 1
                    if _sampled(self.rejected_frames):
                        logger.warning("[workers] rejected a frame from %r: %s", ident, msg.reason)
                else:
                    self.supervisor.on_worker(ident, msg)
            await asyncio.sleep(0)  # see _events_loop

    # -- control --------------------------------------------------------------

    async def _control_loop(self) -> None:
        assert self._control is not None
        while True:
            for ident, req in await self._control.recv_batch(_BATCH):
                reply = await self._on_control(req)
                try:
                    self._control.reply_nowait(ident, reply)
                except (OverflowError, msgspec.EncodeError):
                    # a value no check caught must cost this reply, not the manager
                    logger.exception("[control] cannot encode the reply to %s", type(req).__name__)
                    self._control.reply_nowait(ident, p.Rejected(reason="the manager could not encode its reply"))
            await asyncio.sleep(0)  # see _events_loop

    async def _on_control(self, req: p.ControlRequest | BadFrame) -> p.ControlReply:
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

    def status(self) -> p.StatusReply:
        p50, p99, worst = self.latency.summary()
        return p.StatusReply(
            devices=[
                self.schedulers[name].status(info, gpu_uuid=self.gpu_uuid(name)) for name, info in self.devices.items()
            ],
            tasks=[self._task_status(t) for t in self.tasks.values()],
            latency=p.LatencySummary(count=self.latency.count, p50_ns=p50, p99_ns=p99, max_ns=worst),
            events=self.events,
            rejected_frames=self.rejected_frames,
            uptime_ns=time.monotonic_ns() - self._started_ns,
            costs=self.costs.status(),
        )
