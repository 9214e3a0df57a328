"""The manager behind ``freeride serve``: one event loop per node.

Usage::

    async with Manager(config) as manager:
        await manager.run(stop_event)

Four sockets, each owned by one object and read by one task: backend events
(PULL), the bubbles of the ranks where side work may run (SUB, see
:meth:`~freeride.serve.core.ManagerCore.bubbles_wanted`), side-task workers
(ROUTER) and control clients (ROUTER). While no decision waits on a bubble's
edge, the first two are read in batches instead, every :data:`RELAXED_READ_S`
and before what the other two bring (:meth:`Manager._catch_up`). What arrives
is handed to the socket-free core (:class:`~freeride.serve.core.ManagerCore`:
the ranks, one :class:`~freeride.serve.scheduler.DeviceScheduler` per device,
called synchronously on each bubble event, and the supervisor). Everything runs
in one TaskGroup; on exit every side task is asked to checkpoint and stop, then
terminated if it does not, and every socket is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from types import TracebackType

import msgspec

from freeride import protocol as p
from freeride.auth import CurveServerKeys, ServeLock, ensure_private_dir, is_loopback_endpoint, load_server_keys
from freeride.gpu.mps import MpsDaemon
from freeride.gpu.nvml import NvmlMonitor
from freeride.host.owncores import OwnCores
from freeride.serve.config import ServeConfig
from freeride.serve.core import ManagerCore, sampled
from freeride.transport import (
    BadFrame,
    BubbleFollower,
    ControlServer,
    EventReceiver,
    HelloAcks,
    WorkerHub,
    ZapHandler,
    hello_ack_topic,
    new_async_context,
)

__all__ = ["Manager"]

logger = logging.getLogger(__name__)

_BATCH = 64
"""Messages one loop handles before the others get a turn (about half a millisecond of events)."""

RELAXED_READ_S = 0.1
"""How often the ranks' events are read while no decision waits on them (see :meth:`ManagerCore.edges_due`)."""

_CATCH_UP = 1024
"""Most events one catch-up reads from each socket before the other loops get a turn (a flood must not hold
them up)."""


class _Stop(Exception):
    """Raised inside the TaskGroup to end :meth:`Manager.run`."""


class Manager(ManagerCore):
    """Serves one node: backends' bubbles in, side-task grants out."""

    def __init__(self, config: ServeConfig) -> None:
        self._hub: WorkerHub | None = None  # before the core, which is given _send
        super().__init__(config, send=self._send)
        self._tg: asyncio.TaskGroup | None = None
        self._ctx = new_async_context()
        self._receiver: EventReceiver | None = None
        self._follower: BubbleFollower | None = None
        self._acks: HelloAcks | None = None
        self._control: ControlServer | None = None
        self._closed = False
        self._lock: ServeLock | None = None
        self._zap: ZapHandler | None = None
        self._nvml: NvmlMonitor | None = None
        self._mps: MpsDaemon | None = None
        self._edges = asyncio.Event()
        """Set once a decision waits on a bubble's edge: the events are read as they come again."""
        self._batching = asyncio.Event()
        """Set while the ranks' events are read in batches (no decision waits on them): wakes :meth:`_batches_loop`."""
        self._own = OwnCores()
        """Keeps the manager's own threads off the ranks' cores where some are spare (freeride.host.owncores)."""

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
        self._remove_socket_files()  # stale ones of a manager that died (we hold the lock)
        if self.config.endpoints.tcp_endpoints() and self.config.keys_dir is not None:
            return load_server_keys(self.config.keys_dir)
        return None

    def _remove_socket_files(self) -> None:
        """Remove the files of this manager's ipc sockets, if there (only while it holds the serve lock)."""
        for addr in (self.config.endpoints.events, self.config.endpoints.control, self.config.endpoints.workers):
            if addr.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(addr[6:])

    async def __aenter__(self) -> Manager:
        try:
            curve = self._claim_dirs()
            # the handler first: libzmq lets connections in unchecked while none is bound
            self._zap = ZapHandler(self._ctx, curve_clients=curve.clients if curve else frozenset())
            self._receiver = EventReceiver(self._ctx, self.config.endpoints.events, curve=curve)
            self._follower = BubbleFollower(self._ctx)
            # with the rule of the held-back steps: the ranks publish none of their bubbles (unless tracing,
            # where every bubble is drawn)
            held = self.config.holdback if self.config.trace is None else None
            self._acks = HelloAcks(self._ctx, topic=hello_ack_topic(held))
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
        self.gates.close_all()  # after the workers: none waits on a page that is gone
        self.ranks.close()
        self.observers.close()
        if self._mps is not None:
            await self._mps.quit()
        if self._nvml is not None:
            self._nvml.close()
        for owner in (self._receiver, self._follower, self._acks, self._hub, self._control, self._zap):
            if owner is not None:
                owner.close()
        self._ctx.term()
        if self._lock is not None and self._lock.holding:
            # libzmq leaves the socket files; a client that found them would wait for a reply
            # from nobody. Ours to remove while we hold the lock (a manager refused the lock
            # must not touch another's).
            self._remove_socket_files()
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
                tg.create_task(self._bubbles_loop(), name="manager-bubbles")
                tg.create_task(self._batches_loop(), name="manager-batches")
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
                self.on_event(event)
            # A socket with messages queued answers an await at once, without yielding:
            # read one by one, a flood of events would keep control and workers waiting.
            await asyncio.sleep(0)
            await self._unless_edges_due(self._receiver)

    async def _bubbles_loop(self) -> None:
        assert self._follower is not None
        while True:
            for event in await self._follower.recv_batch(_BATCH):
                self.on_event(event)
            await asyncio.sleep(0)  # see _events_loop
            await self._unless_edges_due(self._follower)

    async def _unless_edges_due(self, owner: EventReceiver | BubbleFollower) -> None:
        """While no decision waits on a bubble's edge, leave ``owner``'s events to :meth:`_batches_loop`."""
        if self.edges_due():
            return
        owner.pause()
        while not self.edges_due():
            self._batching.set()  # again on every wake: the batches' loop may have just left off
            self._edges.clear()
            await self._edges.wait()

    async def _batches_loop(self) -> None:
        """Reads the ranks' events every RELAXED_READ_S while no decision waits on them.

        Read in batches, the bubbles of a rank whose side work is an armed
        worker's (it starts and stops on the rank's own events, and reports)
        wake the manager ten times a second, not at every start and end: on a
        machine without spare cores each wake-up is taken from training. A
        worker's report or a control request reads what is queued first
        (:meth:`_catch_up`), so that everything is handled in order.
        """
        while True:
            await self._batching.wait()
            while not self.edges_due():
                self._edges.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(RELAXED_READ_S):
                        await self._edges.wait()
                while self._catch_up():
                    await asyncio.sleep(0)
            self._batching.clear()
            self._edges.set()  # the events' loops read as they come again

    def read_queued_events(self) -> None:
        """Handle the ranks' events already received, read in batches or not (a rank's process exited).

        One round of at most _CATCH_UP a socket: a flood must not hold the loop.
        """
        self._catch_up(always=True)

    def _catch_up(self, *, always: bool = False) -> bool:
        """Handle the ranks' events already queued, up to _CATCH_UP a socket; whether more may be queued.

        Only while they are read in batches (or ``always``): otherwise their own loops read them as they come.
        """
        if not (always or self._batching.is_set()):
            return False
        more = False
        for owner in (self._receiver, self._follower):
            if owner is not None:
                events = owner.drain_nowait(_CATCH_UP)
                for event in events:
                    self.on_event(event)
                more = more or len(events) == _CATCH_UP
        return more

    def _note_edges(self) -> None:
        """Wake the event loops if a decision now waits on a bubble's edge."""
        if self.edges_due():
            self._edges.set()

    def follow_bubbles(self, endpoints: set[str]) -> None:
        follower = self._follower
        if follower is None:
            return
        follower.follow_exactly(endpoints)
        logger.debug("[events] following the bubbles of %d ranks", len(endpoints))

    def answer_hellos(self, endpoints: set[str]) -> None:
        if self._acks is not None:
            self._acks.answer_exactly(endpoints)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.backend_timeout_s / 4))
            self._poll_nvml()
            self.ranks.check_silence()
            self.finish_goodbyes()
            self.refresh_following()  # tasks placed, finished or gone since
            self._note_edges()
            if self.config.own_process:
                self._own.update(frozenset(c for d in self.devices.values() if d.alive for c in d.cpu_affinity))

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

    def status(self) -> p.StatusReply:
        return msgspec.structs.replace(super().status(), manager_cores=self._own.placement.reason)

    def gpu_uuid(self, device: str) -> str:
        """NVML's UUID of a device (see :meth:`~freeride.gpu.nvml.NvmlMonitor.uuid_of`); "" without NVML."""
        return self._nvml.uuid_of(device) if self._nvml is not None else ""

    def _send(self, ident: bytes, msg: p.ManagerToWorker) -> bool:
        return self._hub is not None and self._hub.send_nowait(ident, msg)

    async def _workers_loop(self) -> None:
        assert self._hub is not None
        while True:
            batch = await self._hub.recv_batch(_BATCH)
            self._catch_up()  # a report after the bubble events before it
            for ident, msg in batch:
                if isinstance(msg, BadFrame):
                    self.rejected_frames += 1
                    if sampled(self.rejected_frames):
                        logger.warning("[workers] rejected a frame from %r: %s", ident, msg.reason)
                else:
                    self.supervisor.on_worker(ident, msg)
            self._note_edges()
            await asyncio.sleep(0)  # see _events_loop

    # -- control --------------------------------------------------------------

    async def _control_loop(self) -> None:
        assert self._control is not None
        while True:
            batch = await self._control.recv_batch(_BATCH)
            self._catch_up()  # status counts every event come so far
            for ident, req in batch:
                reply = self.on_control(req)
                try:
                    self._control.reply_nowait(ident, reply)
                except (OverflowError, msgspec.EncodeError):
                    # a value no check caught must cost this reply, not the manager
                    logger.exception("[control] cannot encode the reply to %s", type(req).__name__)
                    self._control.reply_nowait(ident, p.Rejected(reason="the manager could not encode its reply"))
            self._note_edges()
            await asyncio.sleep(0)  # see _events_loop
