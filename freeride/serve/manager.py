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
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import assert_never

from freeride import protocol as p
from freeride.gpu.mps import MpsDaemon
from freeride.gpu.nvml import NvmlMonitor
from freeride.observe.base import Observers
from freeride.observe.stats import LatencyRecorder
from freeride.serve.config import ServeConfig
from freeride.serve.scheduler import DeviceScheduler
from freeride.serve.supervisor import Supervisor
from freeride.serve.tasks import TaskRecord
from freeride.transport import (
    BadFrame,
    ControlServer,
    EventReceiver,
    WorkerHub,
    new_async_context,
)

__all__ = ["Manager"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Backend:
    rank: int
    device: str
    pid: int
    last_seen_ns: int
    watched: bool = False
    alive: bool = True


class _Stop(Exception):
    """Raised inside the TaskGroup to end :meth:`Manager.run`."""


class Manager:
    """Serves one node: backends' bubbles in, side-task grants out."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.devices: dict[str, DeviceScheduler] = {}
        self.latency = LatencyRecorder()
        self.events = 0
        self.rejected_frames = 0
        self._backends: dict[int, _Backend] = {}
        self._started_ns = time.monotonic_ns()
        self._tg: asyncio.TaskGroup | None = None
        self._ctx = new_async_context()
        self._receiver: EventReceiver | None = None
        self._hub: WorkerHub | None = None
        self._control: ControlServer | None = None
        self._closed = False
        self._nvml: NvmlMonitor | None = None
        self._mps: MpsDaemon | None = None
        self.observers = Observers()
        """Trace writers and metrics exporters; see :mod:`freeride.observe.base`."""
        self.supervisor = Supervisor(config, devices=self.devices, send=self._send, observers=self.observers)

    # -- lifetime -------------------------------------------------------------

    async def __aenter__(self) -> Manager:
        for d in (self.config.state_dir, self.config.log_dir, self.config.checkpoint_dir):
            d.mkdir(parents=True, exist_ok=True)
        for addr in (
            self.config.endpoints.events,
            self.config.endpoints.control,
            self.config.endpoints.workers,
        ):
            if addr.startswith("ipc://"):
                path = addr[6:]
                os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # stale socket file of a manager that died
        try:
            self._receiver = EventReceiver(self._ctx, self.config.endpoints.events)
            self._hub = WorkerHub(self._ctx, self.config.endpoints.workers)
            self._control = ControlServer(self._ctx, self.config.endpoints.control)
            if self.config.trace is not None:
                from freeride.observe.trace import TraceWriter

                self.observers.add(TraceWriter(self.config.trace))
            if self.config.metrics_port is not None:
                from freeride.observe.metrics import MetricsExporter

                self.observers.add(MetricsExporter(port=self.config.metrics_port, status=self.status))
        except Exception:
            await self.aclose()
            raise
        if self.config.profile is not None:
            self._load_profile(self.config.profile)
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
        self.observers.close()
        if self._mps is not None:
            await self._mps.quit()
        if self._nvml is not None:
            self._nvml.close()
        for owner in (self._receiver, self._hub, self._control):
            if owner is not None:
                owner.close()
        self._ctx.term()
        logger.info("[shutdown] manager: closed")

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Serve until ``stop`` is set (forever if ``None``)."""
        stop = stop or asyncio.Event()
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(self._events_loop(), name="manager-events")
                tg.create_task(self._workers_loop(), name="manager-workers")
                tg.create_task(self._control_loop(), name="manager-control")
                tg.create_task(self._watchdog(), name="manager-watchdog")
                tg.create_task(self._until(stop), name="manager-stop")
                for device in self.devices.values():
                    tg.create_task(device.run(), name=f"device-{device.device}")
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
            event = await self._receiver.recv()
            self.events += 1
            self._on_event(event)

    def _on_event(self, event: p.BackendEvent | BadFrame) -> None:
        now = time.monotonic_ns()
        if not isinstance(event, BadFrame):
            self.observers.backend_event(event)
        match event:
            case BadFrame(reason=reason, size=size):
                self.rejected_frames += 1
                # a misbehaving sender must not flood the log: the first ten, then one in a thousand
                if self.rejected_frames <= 10 or self.rejected_frames % 1000 == 0:
                    logger.warning(
                        "[events] rejected a %d-byte frame (%d so far): %s", size, self.rejected_frames, reason
                    )
                return
            case p.Hello():
                self._on_hello(event)
                return
            case (
                p.BubbleStarted(rank=rank, device=device, stage=stage)
                | p.BubbleEnded(rank=rank, device=device, stage=stage)
            ):
                if self._touch(rank, now):
                    # Handled here, not through the device's inbox: a queue hop costs a
                    # loop iteration (~0.1 ms here) on the bubble-start -> step path.
                    # Both bubble events take this path, so they stay in order.
                    self._device(device, stage=stage, rank=rank).handle(event)
            case p.StepFinished(rank=rank):
                if self._touch(rank, now):
                    backend = self._backends.get(rank)
                    if backend is not None:
                        self.devices[backend.device].train_steps += 1
            case p.Heartbeat(rank=rank):
                self._touch(rank, now)
            case p.Goodbye(rank=rank, dropped=dropped):
                backend = self._backends.pop(rank, None)
                if backend is not None:
                    logger.info("[events] rank %d said goodbye (%d events dropped)", rank, dropped)
                    scheduler = self.devices[backend.device]
                    scheduler.dropped += dropped
                    scheduler.backend_lost()
            case _:
                assert_never(event)

    def _touch(self, rank: int, now: int) -> bool:
        backend = self._backends.get(rank)
        if backend is None:
            return True  # a rank that started before this manager: serve it all the same
        if not backend.alive:
            return False
        backend.last_seen_ns = now
        return True

    def _on_hello(self, hello: p.Hello) -> None:
        if hello.protocol_version != p.PROTOCOL_VERSION:
            self.rejected_frames += 1
            logger.error(
                "[events] rank %d (pid %d) speaks protocol %d but this manager speaks %d; "
                "install the same FreeRide version in the training environment",
                hello.rank,
                hello.pid,
                hello.protocol_version,
                p.PROTOCOL_VERSION,
            )
            return
        known = self._backends.get(hello.rank)
        if known is not None and known.pid == hello.pid and known.alive:
            known.last_seen_ns = time.monotonic_ns()  # the periodic repeat
            return
        device = self._device(hello.device, stage=hello.stage, rank=hello.rank)
        device.framework = hello.framework
        device.cpu_affinity = list(hello.cpu_affinity)
        device.device_memory = hello.device_memory
        device.alive = True
        backend = _Backend(rank=hello.rank, device=hello.device, pid=hello.pid, last_seen_ns=time.monotonic_ns())
        self._backends[hello.rank] = backend
        backend.watched = self._watch_pid(backend)
        logger.info(
            "[events] %s rank %d (pid %d) stage %d/%d on %s",
            hello.framework,
            hello.rank,
            hello.pid,
            hello.stage,
            hello.num_stages,
            hello.device,
        )
        self.supervisor.place_pending()

    def _watch_pid(self, backend: _Backend) -> bool:
        try:
            fd = os.pidfd_open(backend.pid)
        except OSError:
            return False
        loop = asyncio.get_running_loop()

        def exited() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            if backend.alive and self._backends.get(backend.rank) is backend:
                self._lose_backend(backend, "its process exited without saying goodbye")

        loop.add_reader(fd, exited)
        return True

    def _lose_backend(self, backend: _Backend, why: str) -> None:
        backend.alive = False
        self._backends.pop(backend.rank, None)
        logger.warning("[events] rank %d (pid %d) on %s lost: %s", backend.rank, backend.pid, backend.device, why)
        device = self.devices.get(backend.device)
        if device is not None:
            device.backend_lost()

    async def _watchdog(self) -> None:
        timeout_ns = int(self.config.backend_timeout_s * 1e9)
        while True:
            await asyncio.sleep(min(1.0, self.config.backend_timeout_s / 4))
            self._poll_nvml()
            now = time.monotonic_ns()
            for backend in list(self._backends.values()):
                if not backend.watched and now - backend.last_seen_ns > timeout_ns:
                    self._lose_backend(backend, f"silent for {self.config.backend_timeout_s:g}s")

    def _poll_nvml(self) -> None:
        """Free memory per GPU and memory per side-task process, for placement and status."""
        if self._nvml is None:
            return
        free = {d.index: d.free for d in self._nvml.devices()}
        by_pid = {t.pid: t for t in self.tasks.values() if t.pid}
        for name, device in self.devices.items():
            kind, _, index = name.partition(":")
            if kind != "cuda" or not index.isdigit() or int(index) not in free:
                continue
            device.free_memory = free[int(index)]
            for pid, used in self._nvml.process_memory(int(index)).items():
                if pid in by_pid:
                    by_pid[pid].device_memory = used

    def _device(self, name: str, *, stage: int, rank: int) -> DeviceScheduler:
        device = self.devices.get(name)
        if device is None:
            device = DeviceScheduler(
                name, send=self._send, latency=self.latency, margin_ns=self.config.margin_ns, observers=self.observers
            )
            self.devices[name] = device
            if self._tg is not None:  # otherwise run() starts it
                self._tg.create_task(device.run(), name=f"device-{name}")
        device.stage, device.rank, device.alive = stage, rank, True
        return device

    def declare_device(self, name: str, *, stage: int, spare_memory: int, cpu_affinity: list[int]) -> None:
        """Make a device known before its rank reports (from a profile, or by a launcher).

        Side tasks can then be placed on it and set up before training starts.
        """
        device = self._device(name, stage=stage, rank=-1)
        device.alive = False
        device.spare_memory = spare_memory
        device.cpu_affinity = list(cpu_affinity)

    def _load_profile(self, path: Path) -> None:
        """Know every profiled device and its spare memory before any rank reports."""
        from freeride.profile import load_profile

        profile = load_profile(path)
        for stage in profile.stages:
            kind, _, index = stage.device.partition(":")
            cores = [int(index)] if kind == "cpu" and index.isdigit() else []
            self.declare_device(stage.device, stage=stage.stage, spare_memory=stage.spare_memory, cpu_affinity=cores)
        logger.info("[startup] profile %s: %d stage(s) on %s", path, len(profile.stages), ", ".join(profile.devices))

    def live_backends(self) -> list[int]:
        """Ranks currently reporting to this manager."""
        return [rank for rank, b in self._backends.items() if b.alive]

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

    def _send(self, task: TaskRecord, msg: p.ManagerToWorker) -> bool:
        return self._hub is not None and self._hub.send_nowait(task.ident, msg)

    async def _workers_loop(self) -> None:
        assert self._hub is not None
        while True:
            ident, msg = await self._hub.recv()
            if isinstance(msg, BadFrame):
                self.rejected_frames += 1
                logger.warning("[workers] rejected a frame from %r: %s", ident, msg.reason)
            else:
                self.supervisor.on_worker(ident, msg)

    # -- control --------------------------------------------------------------

    async def _control_loop(self) -> None:
        assert self._control is not None
        while True:
            ident, req = await self._control.recv()
            reply = await self._on_control(req)
            self._control.reply_nowait(ident, reply)

    async def _on_control(self, req: p.ControlRequest | BadFrame) -> p.ControlReply:
        match req:
            case BadFrame(reason=reason):
                self.rejected_frames += 1
                return p.Rejected(reason=f"malformed request: {reason}")
            case p.Submit(spec=spec):
                return self.submit(spec)
            case p.Cancel(task_id=task_id):
                return await self.cancel(task_id)
            case p.StatusRequest():
                return self.status()
            case _:
                assert_never(req)

    def status(self) -> p.StatusReply:
        p50, p99, worst = self.latency.summary()
        return p.StatusReply(
            devices=[d.status() for d in self.devices.values()],
            tasks=[t.status() for t in self.tasks.values()],
            latency=p.LatencySummary(count=self.latency.count, p50_ns=p50, p99_ns=p99, max_ns=worst),
            events=self.events,
            rejected_frames=self.rejected_frames,
            uptime_ns=time.monotonic_ns() - self._started_ns,
        )
