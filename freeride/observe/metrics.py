"""Prometheus metrics of ``freeride serve --metrics-port``.

:class:`MetricsExporter` is an :class:`~freeride.observe.Observer` and serves
``/metrics`` over HTTP from a thread of its own. Most numbers are read from the
manager's :meth:`~freeride.serve.manager.Manager.status` at scrape time (a custom
collector, so they are never out of date and cost nothing between scrapes);
what status does not keep, the latency histogram and the recent throughput of
each task, is recorded from the observer calls.

Every per-device series carries ``hostname`` and ``gpu_uuid`` (NVML's
``GPU-...``; empty on a CPU device or without NVML) beside FreeRide's own
``device`` name, so that it joins with other exporters' GPU metrics (DCGM's
``UUID``). A value that is not known is left out, never exported as a
sentinel; ``freeride_build_info{version}`` is 1.

``status`` reads state owned by the manager's event loop, so a scrape asks the
loop to call it (``call_soon_threadsafe``) and waits for the answer; a scrape
while the loop is stuck returns only the observer-recorded metrics.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import get_args
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from freeride import __version__
from freeride import protocol as p
from freeride.observe.base import Observer

__all__ = ["LATENCY_BUCKETS_S", "MetricsExporter", "StatusCollector"]

logger = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 100e-3, float("inf"))
"""Buckets of the bubble start -> first side-task step histogram (seconds)."""

StatusFn = Callable[[], p.StatusReply]


def _no_gpu(device: str) -> str:
    return ""


class StatusCollector:
    """Prometheus collector reading a ``status()`` callable at every scrape.

    Args:
        status: Returns the manager's current status; ``None`` return or an
            exception leaves the status metrics out of this scrape.
        throughput: Steps per second of each task over a recent window,
            keyed by task id.
        hostname: The ``hostname`` label (default: this host's name).
    """

    def __init__(
        self,
        status: Callable[[], p.StatusReply | None],
        throughput: Callable[[], dict[int, float]],
        *,
        hostname: str | None = None,
    ) -> None:
        self._status = status
        self._throughput = throughput
        self._hostname = socket.gethostname() if hostname is None else hostname

    def collect(self) -> Iterator[Metric]:
        try:
            status = self._status()
        except Exception:
            logger.exception("[metrics] status failed")
            return
        if status is None:
            return
        yield from _device_metrics(status, self._hostname)
        yield from _task_metrics(status, self._throughput(), self._hostname)
        yield from _manager_metrics(status)
        yield from _cost_metrics(status)


def _device_metrics(status: p.StatusReply, hostname: str) -> Iterator[Metric]:
    labels = ["device", "stage", "gpu_uuid", "hostname"]
    families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
        "bubble": CounterMetricFamily("freeride_bubble_seconds", "Measured bubble time seen per device", labels=labels),
        "used": CounterMetricFamily(
            "freeride_bubble_used_seconds", "Side-task compute inside bubbles per device", labels=labels
        ),
        "interference": CounterMetricFamily(
            "freeride_interference_seconds",
            "Side-task compute after bubble ends per device (what a GPU would take from training)",
            labels=labels,
        ),
        "train": CounterMetricFamily(
            "freeride_training_seconds", "Wall time the stage has trained (first to last bubble event)", labels=labels
        ),
        "bubbles": CounterMetricFamily("freeride_bubbles", "Bubbles announced per device", labels=labels),
        "overruns": CounterMetricFamily(
            "freeride_overruns", "Side-task steps that ran past a bubble's end", labels=labels
        ),
        "overrun_s": CounterMetricFamily(
            "freeride_overrun_seconds", "Time side-task steps ran past bubble ends", labels=labels
        ),
        "steps": CounterMetricFamily("freeride_training_steps", "Training steps finished per device", labels=labels),
        "dropped": CounterMetricFamily(
            "freeride_dropped_events", "Bubble events a rank could not send (manager away or slow)", labels=labels
        ),
        "alive": GaugeMetricFamily("freeride_device_alive", "1 while a training rank reports", labels=labels),
        "spare": GaugeMetricFamily(
            "freeride_spare_memory_bytes", "Device memory the stage leaves free (absent while unknown)", labels=labels
        ),
        "margin": GaugeMetricFamily(
            "freeride_margin_seconds", "Safety margin grants carry now (set by the interference guard)", labels=labels
        ),
        "factor": GaugeMetricFamily(
            "freeride_prediction_factor",
            "What bubbles' expected lengths are multiplied by when a grant's deadline is set",
            labels=labels,
        ),
        "min_bubble": GaugeMetricFamily(
            "freeride_min_bubble_seconds",
            "Bubbles expected to be shorter get no grant: the interference guard left them out (0: none)",
            labels=labels,
        ),
        "left_out": CounterMetricFamily(
            "freeride_bubbles_left_out", "Bubbles the interference guard left out as too short", labels=labels
        ),
        "held_back": CounterMetricFamily(
            "freeride_bubble_held_back_seconds",
            "Bubble time held back from side work to measure the training job's cost",
            labels=labels,
        ),
        "backed_off": CounterMetricFamily(
            "freeride_bubble_backed_off_seconds",
            "Bubble time left out to keep the job's measured cost within the slowdown budget",
            labels=labels,
        ),
    }
    for d in status.devices:
        values: dict[str, float | None] = {
            "bubble": d.bubble_ns / 1e9,
            "used": d.used_ns / 1e9,
            "interference": d.interference_ns / 1e9,
            "train": d.train_ns / 1e9,
            "bubbles": d.bubbles,
            "overruns": d.overruns,
            "overrun_s": d.overrun_ns / 1e9,
            "steps": d.steps,
            "dropped": d.dropped,
            "alive": float(d.alive),
            "spare": d.spare_memory if d.spare_memory >= 0 else None,
            "margin": d.margin_ns / 1e9 if d.margin_ns >= 0 else None,
            "factor": d.prediction_factor,
            "min_bubble": d.min_bubble_ns / 1e9,
            "left_out": d.left_out,
            "held_back": d.held_back_ns / 1e9,
            "backed_off": d.backed_off_ns / 1e9,
        }
        key_labels = [d.device, _stage(d.stage), d.gpu_uuid, hostname]
        for key, family in families.items():
            value = values[key]
            if value is not None:
                family.add_metric(key_labels, float(value))
    yield from families.values()


def _stage(stage: int) -> str:
    return str(stage) if stage >= 0 else ""


def _task_metrics(status: p.StatusReply, throughput: dict[int, float], hostname: str) -> Iterator[Metric]:
    labels = ["task", "name", "device", "gpu_uuid", "hostname"]
    uuids = {d.device: d.gpu_uuid for d in status.devices}
    steps = CounterMetricFamily("freeride_side_task_steps", "Steps a side task has done", labels=labels)
    busy = CounterMetricFamily("freeride_side_task_busy_seconds", "Time a side task spent in steps", labels=labels)
    interference = CounterMetricFamily(
        "freeride_side_task_interference_seconds", "A side task's compute after bubble ends", labels=labels
    )
    rate = GaugeMetricFamily(
        "freeride_side_task_throughput_steps_per_second", "Side-task steps per second, recent window", labels=labels
    )
    state = GaugeMetricFamily("freeride_side_task_state", "1 for the task's current state", labels=[*labels, "state"])
    user = GaugeMetricFamily("freeride_side_task_metric", "Numbers a side task reports", labels=[*labels, "metric"])
    by_state: collections.Counter[str] = collections.Counter()
    for t in status.tasks:
        key = [str(t.task_id), t.name, t.device, uuids.get(t.device, ""), hostname]
        steps.add_metric(key, float(t.steps))
        busy.add_metric(key, t.busy_ns / 1e9)
        interference.add_metric(key, t.interference_ns / 1e9)
        rate.add_metric(key, throughput.get(t.task_id, 0.0))
        state.add_metric([*key, t.state], 1.0)
        for name, value in sorted(t.metrics.items()):
            user.add_metric([*key, name], float(value))
        by_state[t.state] += 1
    tasks = GaugeMetricFamily("freeride_tasks", "Side tasks by state", labels=["state"])
    for name in get_args(p.TaskState):
        tasks.add_metric([name], float(by_state[name]))
    pending = GaugeMetricFamily("freeride_pending_tasks", "Side tasks waiting for a device that fits")
    pending.add_metric([], float(by_state["pending"]))
    yield from (steps, busy, interference, rate, state, user, tasks, pending)


def _manager_metrics(status: p.StatusReply) -> Iterator[Metric]:
    events = CounterMetricFamily("freeride_events", "Backend events received")
    events.add_metric([], float(status.events))
    rejected = CounterMetricFamily("freeride_rejected_frames", "Malformed or incompatible frames rejected")
    rejected.add_metric([], float(status.rejected_frames))
    uptime = GaugeMetricFamily("freeride_uptime_seconds", "Time since the manager started")
    uptime.add_metric([], status.uptime_ns / 1e9)
    yield from (events, rejected, uptime)


def _cost_metrics(status: p.StatusReply) -> Iterator[Metric]:
    labels = ["job"]
    slowdown = GaugeMetricFamily(
        "freeride_training_cost_ratio",
        "Slowdown side work costs the training job, measured on its step times: the median and the ends of its"
        " interval (bound: median, low, high); absent until a pair of held-back and harvested steps is measured",
        labels=[*labels, "bound"],
    )
    coverage = GaugeMetricFamily(
        "freeride_training_cost_coverage",
        "Guaranteed coverage of the interval (below 0.95 until 6 pairs)",
        labels=labels,
    )
    pairs = GaugeMetricFamily("freeride_training_cost_pairs", "Held-back / harvested pairs behind it", labels=labels)
    harvest = GaugeMetricFamily(
        "freeride_harvest_share",
        "Share of bubbles granted (below 1 while the slowdown budget backs off)",
        labels=labels,
    )
    budget = GaugeMetricFamily("freeride_slowdown_budget_ratio", "The slowdown a job may pay", labels=labels)
    for c in status.costs:
        if c.pairs:
            for bound, value in (("median", c.slowdown), ("low", c.low), ("high", c.high)):
                slowdown.add_metric([c.job, bound], value)
            coverage.add_metric([c.job], c.coverage)
        pairs.add_metric([c.job], float(c.pairs))
        harvest.add_metric([c.job], c.harvest_share)
        budget.add_metric([c.job], c.budget)
    yield from (slowdown, coverage, pairs, harvest, budget)


class MetricsExporter(Observer):
    """Observer serving Prometheus metrics on ``http://ADDR:PORT/metrics``.

    Args:
        port: TCP port; 0 picks a free one (see :attr:`port`); None serves no
            HTTP at all (the metrics are then read from :attr:`registry`).
        status: The manager's ``status`` method.
        addr: Address to listen on.
        loop: Event loop that owns the state ``status`` reads; by default the
            running loop when constructed (none: ``status`` is called from the
            HTTP thread).
        throughput_window_s: Window of the throughput gauge.
        status_timeout_s: How long a scrape waits for the loop.
        hostname: The ``hostname`` label (default: this host's name).
        gpu_uuid: The ``gpu_uuid`` of a device name, for the metrics recorded
            from observer calls (called on the loop; default: none known).

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(
        self,
        *,
        port: int | None,
        status: StatusFn,
        addr: str = "127.0.0.1",
        loop: asyncio.AbstractEventLoop | None = None,
        throughput_window_s: float = 10.0,
        status_timeout_s: float = 2.0,
        hostname: str | None = None,
        gpu_uuid: Callable[[str], str] = _no_gpu,
    ) -> None:
        if port is not None and not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        if throughput_window_s <= 0:
            raise ValueError(f"throughput_window_s must be > 0, got {throughput_window_s}")
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        self._status = status
        self._loop = loop
        self._timeout_s = status_timeout_s
        self._window_ns = int(throughput_window_s * 1e9)
        self._lock = threading.Lock()
        self._recent: dict[int, collections.deque[tuple[int, int]]] = {}
        self._closed = False
        self._hostname = socket.gethostname() if hostname is None else hostname
        self._gpu_uuid = gpu_uuid
        self.registry = CollectorRegistry(auto_describe=False)
        Info("freeride_build", "The FreeRide version serving these metrics", registry=self.registry).info(
            {"version": __version__}
        )
        self._latency = Histogram(
            "freeride_bubble_start_to_step_seconds",
            "Bubble start to the first side-task step start, per grant",
            ["device", "gpu_uuid", "hostname"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._grants = Counter(
            "freeride_grants",
            "Grants given back by side tasks, by reason",
            ["device", "gpu_uuid", "hostname", "reason"],
            registry=self.registry,
        )
        self.registry.register(StatusCollector(self._fetch_status, self._throughput, hostname=self._hostname))
        self._http: tuple[WSGIServer, threading.Thread] | None = None
        self.port: int | None = None
        """The port actually bound (None: no HTTP)."""
        if port is not None:
            self._http = start_http_server(port, addr=addr, registry=self.registry)
            self.port = self._http[0].server_port
            logger.info("[metrics] serving http://%s:%d/metrics", addr, self.port)

    # -- observer -------------------------------------------------------------

    def backend_event(self, event: p.BackendEvent) -> None:
        pass  # everything per device is in status

    def grant_done(self, device: str, task_id: int, task_name: str, done: p.GrantDone) -> None:
        where = (device, self._gpu_uuid(device), self._hostname)
        self._grants.labels(*where, done.reason).inc()
        if done.first_step_delay_ns >= 0:
            self._latency.labels(*where).observe(done.first_step_delay_ns / 1e9)
        if done.steps > 0:
            now = time.monotonic_ns()
            with self._lock:
                recent = self._recent.setdefault(task_id, collections.deque())
                recent.append((now, done.steps))
                while recent and recent[0][0] < now - self._window_ns:
                    recent.popleft()

    def task_status(self, status: p.TaskStatus) -> None:
        if status.state in p.TERMINAL_STATES:
            with self._lock:
                self._recent.pop(status.task_id, None)

    def close(self) -> None:
        """Stop the HTTP server and wait for its thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._http is None:
            return
        server, thread = self._http
        server.shutdown()
        server.server_close()
        thread.join(5.0)
        logger.info("[metrics] stopped")

    # -- scrape side (HTTP thread) --------------------------------------------

    def _throughput(self) -> dict[int, float]:
        cutoff = time.monotonic_ns() - self._window_ns
        with self._lock:
            return {
                task_id: sum(n for t, n in recent if t >= cutoff) / (self._window_ns / 1e9)
                for task_id, recent in self._recent.items()
            }

    def _fetch_status(self) -> p.StatusReply | None:
        loop = self._loop
        if loop is None:
            return self._status()
        try:
            if asyncio.get_running_loop() is loop:
                return self._status()
        except RuntimeError:
            pass  # the usual case: a scrape on the HTTP thread
        if loop.is_closed():
            return None
        answer: concurrent.futures.Future[p.StatusReply] = concurrent.futures.Future()

        def call() -> None:
            try:
                answer.set_result(self._status())
            except Exception as exc:
                answer.set_exception(exc)

        try:
            loop.call_soon_threadsafe(call)
            return answer.result(timeout=self._timeout_s)
        except (RuntimeError, concurrent.futures.TimeoutError):
            logger.warning("[metrics] the manager's loop did not answer within %gs", self._timeout_s)
            return None
