"""The adapter side of a training rank: numbers bubbles and emits events.

Framework adapters (DeepSpeed, Megatron, the simulator) call a
:class:`BackendSession` from inside the training step. Every method is cheap,
synchronous and never raises: a missing or dead manager costs the training job
one failed non-blocking send per event.

Each session writes one line to stderr when it starts (the rank attached):
framework, rank, stage, device and whether a manager is there, whatever the
training script did to logging (the ``freeride.backends.attach`` logger has a handler of
its own and does not propagate; set its level to WARNING to silence it).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

import msgspec

from freeride import protocol as p
from freeride.holdback import HoldbackSchedule
from freeride.host.schedstat import ThreadRunDelay
from freeride.transport import BubblePublisher, Endpoints, EventEmitter, bubbles_endpoint, default_runtime_dir

__all__ = [
    "ENV_EVENTS",
    "ENV_JOB",
    "HELLO_EVERY_NS",
    "HELLO_RETRY_NS",
    "REPORTS_EVERY_NS",
    "BackendConfig",
    "BackendSession",
    "attach_logger",
    "events_endpoint_from_env",
    "job_from_env",
    "manager_reachable",
]

logger = logging.getLogger(__name__)


class _Stderr(logging.Handler):
    """Writes to the ``sys.stderr`` of the moment (a handler bound at import would miss a redirect)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # never into training
            self.handleError(record)


def attach_logger() -> logging.Logger:
    """The logger of the one line per rank at attach: INFO to stderr unless configured otherwise."""
    attach = logging.getLogger("freeride.backends.attach")
    if not attach.handlers:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("freeride: %(message)s"))
        attach.addHandler(handler)
        attach.propagate = False  # one line, also where the script's root logger prints INFO
        if attach.level == logging.NOTSET:
            attach.setLevel(logging.INFO)
    return attach


def manager_reachable(sent: int, endpoint: str) -> bool:
    """Whether a manager took an event (``sent``), or (ipc) its events socket exists."""
    if sent > 0:
        return True
    return endpoint.startswith("ipc://") and os.path.exists(endpoint.removeprefix("ipc://"))


HELLO_EVERY_NS = 5_000_000_000
"""How often a rank repeats its Hello (a manager may start after the job)."""
HELLO_RETRY_NS = 250_000_000
"""How often a rank that publishes its bubbles repeats its Hello until the manager acknowledges it."""
REPORTS_EVERY_NS = 1_000_000_000
"""While a rank publishes its bubbles, how often its step reports go to the manager, together (decision D50)."""
_REPORTS_QUEUED = 256
"""Step reports kept for the next send at most (a job of very short steps sends them sooner)."""
CONNECT_WAIT_MS = 100
"""At attach, once: how long a rank waits for its connection to a manager whose socket exists, so that its
first Hello is not dropped (the manager then knows the job from its first step)."""

ENV_EVENTS = "FREERIDE_EVENTS"
"""Environment variable `freeride launch` sets to the manager's events endpoint."""


def events_endpoint_from_env(environ: dict[str, str] | None = None) -> str:
    """The endpoint set by the launcher, else the default runtime dir's socket."""
    env = os.environ if environ is None else environ
    endpoint = env.get(ENV_EVENTS)
    if endpoint:
        return endpoint
    return Endpoints.ipc(default_runtime_dir()).events


ENV_JOB = "FREERIDE_JOB"
"""Environment variable naming the training job, where the launcher's own names do not serve."""

_JOB_VARIABLES = (ENV_JOB, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID", "FLUX_JOB_ID")
"""Names a launcher gives a job, the same in every rank of it on every node; the first one set is taken."""


def job_from_env(environ: dict[str, str] | None = None) -> str:
    """The training job's name, the same in all its ranks: from the launcher, else its rendezvous address.

    torchrun sets ``TORCHELASTIC_RUN_ID`` (``none`` unless ``--rdzv-id`` is given: then
    the rendezvous address names it); Slurm ``SLURM_JOB_ID`` (with ``SLURM_STEP_ID``);
    DeepSpeed's launcher and most others ``MASTER_ADDR``/``MASTER_PORT``. "" if none is set.
    """
    env = os.environ if environ is None else environ
    for name in _JOB_VARIABLES:
        value = env.get(name, "")
        if value and value != "none":
            step = env.get("SLURM_STEP_ID", "") if name == "SLURM_JOB_ID" else ""
            return f"{value}.{step}"[:256] if step else value[:256]
    addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    return f"{addr}:{port}"[:256] if addr or port else ""


@dataclass(frozen=True, kw_only=True, slots=True)
class BackendConfig:
    """Who a training rank is."""

    endpoint: str
    """Events endpoint of the manager (``ipc://...`` or ``tcp://...``)."""
    rank: int
    """Global rank of the process."""
    stage: int
    """Pipeline stage of the rank."""
    num_stages: int
    device: str
    """Device name, e.g. ``cuda:0``; on CPU ``cpu:<core>``."""
    framework: str
    spare_memory: int = -1
    """Device memory the stage leaves free, in bytes (-1 unknown)."""
    device_memory: int = -1
    min_bubble_ns: int = 1_000_000
    """Bubbles expected to be shorter than this are not announced."""
    publish_bubbles: bool = True
    """Publish bubble events (ipc endpoints only): armed side-task workers take the starts (one hop), and the
    manager follows them only while side work may run on this device (decision D50). Without it they go to the
    manager over the events socket."""
    job: str = ""
    """The training job's name, the same on all its ranks ("": from the environment, see :func:`job_from_env`)."""

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        if not 0 <= self.stage < self.num_stages:
            raise ValueError(f"stage must be in [0, {self.num_stages}), got {self.stage}")
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if self.min_bubble_ns < 0:
            raise ValueError(f"min_bubble_ns must be >= 0, got {self.min_bubble_ns}")


class BackendSession:
    """Emits the events of one training rank.

    Call :meth:`bubble_started` right before the rank waits and
    :meth:`bubble_ended` right after; :meth:`step_finished` at the end of each
    training step. :meth:`close` (also run at exit) sends ``Goodbye``.
    """

    def __init__(
        self,
        config: BackendConfig,
        *,
        emitter: EventEmitter | None = None,
        publisher: BubblePublisher | None = None,
        run_delay: ThreadRunDelay | None = None,
    ) -> None:
        """``emitter``, ``publisher``: a test's, instead of real sockets (with an emitter and no publisher,
        bubble events go through the emitter)."""
        self.config = config
        self._emitter = emitter if emitter is not None else EventEmitter(config.endpoint)
        self._publisher: BubblePublisher | None = publisher
        publish = config.publish_bubbles and emitter is None and publisher is None
        self._publish_to = bubbles_endpoint(config.endpoint, config.rank) if publish else ""
        """Where to publish bubble starts; "" once that is settled (bound, or not to be)."""
        self._run_delay = run_delay if run_delay is not None else ThreadRunDelay()
        """The training thread's wait for its core (read at a host-timed bubble's start and end)."""
        self._delay_at_start = -1
        self.last_waited_runnable_ns = 0
        """How long the stage waited for its core at the end of the last bubble (see :class:`BubbleEnded`)."""
        self._open: p.BubbleStarted | None = None
        self._step_reports: list[p.StepFinished] = []
        """Step reports not sent yet (see :meth:`step_finished`)."""
        self._reports_sent_ns = time.monotonic_ns()
        self._step = -1
        self._index = 0
        self._step_bubble_ns = 0
        self._held: tuple[p.Holdback, HoldbackSchedule] | None = None
        """The manager's rule of held-back steps for this rank's job, as last built."""
        self._held_step: tuple[int, bool] = (-1, False)
        """(step, held) of the last step asked about."""
        self._open_unpublished = False
        """The open bubble is in a held-back step: announced to no one."""
        self._step_unpublished = (0, 0)
        """(bubbles, ns) of this step announced to no one."""
        self._closed = False
        self.bubbles = 0
        self._last_published: tuple[int, int] | None = None
        """(step, index) of the last bubble end published (for the goodbye)."""
        self._hello_sent_ns = 0
        self._hello = p.Hello(
            protocol_version=p.PROTOCOL_VERSION,
            rank=config.rank,
            stage=config.stage,
            num_stages=config.num_stages,
            device=config.device,
            framework=config.framework,
            pid=os.getpid(),
            cpu_affinity=sorted(os.sched_getaffinity(0)),
            device_memory=config.device_memory,
            t_ns=time.monotonic_ns(),
            job=config.job or job_from_env(),
        )
        self._emitter.wait_connected(CONNECT_WAIT_MS)
        self._maybe_hello(time.monotonic_ns())
        atexit.register(self.close)
        self._log_attached()

    def _log_attached(self) -> None:
        c = self.config
        try:
            from freeride.backends.launch import read_mode  # imports this module: read at run time

            mode = read_mode()[0]
            there = (
                f"manager reachable at {c.endpoint}"
                if manager_reachable(self.sent, c.endpoint)
                else f"no manager at {c.endpoint} (events are dropped until one starts)"
            )
            alone = ", pipeline size 1: no pipeline bubbles" if c.num_stages == 1 else ""
            attach_logger().info(
                "[attach] %s rank %d stage %d/%d on %s%s, %s mode: %s",
                c.framework, c.rank, c.stage, c.num_stages, c.device, alone, mode, there,
            )  # fmt: skip
        except Exception:
            logger.debug("[attach] cannot write the attach line", exc_info=True)

    def _maybe_hello(self, now: int) -> None:
        # With nothing queued for absent peers, a Hello sent before the connection
        # is up is dropped: retry until one goes out. A manager that took it
        # subscribes to the rank's publisher (HELLO_ACK); until then the Hello goes
        # again every HELLO_RETRY_NS, after that every HELLO_EVERY_NS, so that a
        # manager started (or restarted) after the training job learns who we are.
        # A rank without a publisher cannot be answered: every HELLO_EVERY_NS.
        sent = self._hello_sent_ns
        if sent and now - sent <= HELLO_RETRY_NS:
            return
        publisher = self._publisher
        if sent and now - sent <= HELLO_EVERY_NS and (publisher is None or publisher.acknowledged()):
            return
        if publisher is not None:
            publisher.acknowledged(look=True)  # a manager that went away is looked for again at the fast pace
        if self._emitter.emit(self._hello):
            self._hello_sent_ns = now
            if self._publish_to:
                self._start_publishing()

    def _start_publishing(self) -> None:
        # Once, after the first Hello went out: the manager is up, so its runtime
        # directory exists. A bind costs a few syscalls, once; then the Hello says where.
        endpoint, self._publish_to = self._publish_to, ""
        publisher = BubblePublisher(endpoint)
        if not publisher.bound:
            return
        self._publisher = publisher
        self._hello = msgspec.structs.replace(self._hello, bubbles_endpoint=endpoint)
        if self._emitter.emit(self._hello):
            self._hello_sent_ns = time.monotonic_ns()

    @property
    def hello_acknowledged(self) -> bool:
        """Whether a manager has said it knows this rank (a rank without a bubble publisher is never told)."""
        return self._publisher is not None and self._publisher.acknowledged()

    @property
    def dropped(self) -> int:
        """Events the emitter could not deliver."""
        return self._emitter.dropped

    @property
    def sent(self) -> int:
        return self._emitter.sent

    @property
    def open_since_ns(self) -> int:
        """Start (monotonic ns) of the bubble announced and not yet ended, else 0."""
        return self._open.t_ns if self._open is not None else 0

    def bubble_started(
        self, step: int, expected_ns: int, *, spare_memory: int | None = None, t_ns: int | None = None
    ) -> bool:
        """Announce a bubble of ``expected_ns`` starting now (or at ``t_ns``, the device's start).

        Returns:
            Whether the bubble was announced (long enough, none open).
        """
        if self._open is not None or expected_ns < self.config.min_bubble_ns:
            return False
        self._maybe_hello(time.monotonic_ns())
        if step != self._step:
            self._step, self._index, self._step_bubble_ns, self._step_unpublished = step, 0, 0, (0, 0)
        event = p.BubbleStarted(
            rank=self.config.rank,
            stage=self.config.stage,
            device=self.config.device,
            step=step,
            index=self._index,
            t_ns=time.monotonic_ns() if t_ns is None else t_ns,
            expected_ns=expected_ns,
            spare_memory=self.config.spare_memory if spare_memory is None else spare_memory,
            thread=threading.get_native_id(),
        )
        self._open = event
        self._index += 1
        self._open_unpublished = self._publisher is not None and self.held(step)
        if self._open_unpublished:
            self._send_step_reports(due_after_ns=REPORTS_EVERY_NS)  # no one takes a held-back bubble: none wakes
        elif self._publisher is not None:
            self._publisher.publish(event)  # to armed workers, and to the manager while it follows this rank
            self._send_step_reports(due_after_ns=REPORTS_EVERY_NS)
        else:
            self._emitter.emit(event)
            self._send_step_reports()  # the manager wakes once for both, while this stage waits
        # Read last, as the rank is about to block (the worker the announcement woke on this core lets it
        # block first: freeride.worker.courtesy). A bubble timed on the device ends on the device's
        # clock: the host thread's waits do not apply.
        self._delay_at_start = self._run_delay.ns() if t_ns is None else -1
        return True

    def bubble_ended(self, *, t_ns: int | None = None) -> int:
        """Close the open bubble, if any, now (or at ``t_ns``, the device's end).

        Returns:
            Its measured duration in ns (0 if none was open).
        """
        start = self._open
        if start is None:
            return 0
        self._open = None
        now = time.monotonic_ns() if t_ns is None else t_ns
        duration = max(0, now - start.t_ns)
        waited = 0
        if self._delay_at_start >= 0 and t_ns is None:
            waited = min(duration, max(0, self._run_delay.ns() - self._delay_at_start))
        self._delay_at_start = -1
        self.last_waited_runnable_ns = waited
        self._step_bubble_ns += duration
        self.bubbles += 1
        event = p.BubbleEnded(
            rank=start.rank,
            stage=start.stage,
            device=start.device,
            step=start.step,
            index=start.index,
            t_ns=now,
            duration_ns=duration,
            waited_runnable_ns=waited,
        )
        if self._open_unpublished:
            self._open_unpublished = False
            if start.step == self._step:
                n, ns = self._step_unpublished
                self._step_unpublished = (n + 1, min(p.I64_MAX, ns + duration))
        elif self._publisher is not None:
            self._publisher.publish(event)
            self._last_published = (start.step, start.index)
        else:
            self._emitter.emit(event)
        return duration

    def held(self, step: int) -> bool:
        """Whether the manager holds ``step`` back to measure the job's cost (its bubbles then go to no one).

        The rule comes with the manager's acknowledgement of this rank's
        ``Hello``, its job's name from the ``Hello``; without either, no step is held.
        """
        if self._held_step[0] == step:
            return self._held_step[1]
        rule = self._publisher.holdback if self._publisher is not None else None
        held = False
        if rule is not None:
            if self._held is None or self._held[0] is not rule:
                self._held = (rule, HoldbackSchedule(msgspec.structs.replace(rule, job=self._hello.job)))
            held = self._held[1].held(step)
        self._held_step = (step, held)
        return held

    def step_finished(self, step: int, duration_ns: int) -> None:
        """Report the end of training step ``step``.

        The report never goes out alone as the next step's compute begins: such
        a message wakes the manager on a core the stage needs (on CPU, where a
        core stands in for the device, that is training time). While the rank
        publishes its bubbles (decision D50), its reports go together about once
        a second, as a bubble starts; otherwise each goes with the rank's next
        event (the next bubble's start, as this stage begins to wait, or the next
        step's report; decision D48). A heartbeat or the rank's goodbye sends
        them too.
        """
        self.bubble_ended()
        self._maybe_hello(time.monotonic_ns())
        bubble_ns = self._step_bubble_ns if step == self._step else 0
        unpublished, unpublished_ns = self._step_unpublished if step == self._step else (0, 0)
        if self._publisher is None:
            self._send_step_reports()  # a step without bubbles: the last one's report goes now
        else:
            self._send_step_reports(due_after_ns=2 * REPORTS_EVERY_NS)  # steps without bubbles: now and then
        self._step_reports.append(
            p.StepFinished(
                rank=self.config.rank,
                stage=self.config.stage,
                step=step,
                t_ns=time.monotonic_ns(),
                duration_ns=duration_ns,
                bubble_ns=bubble_ns,
                unpublished=unpublished,
                unpublished_ns=unpublished_ns,
            )
        )

    def _send_step_reports(self, *, due_after_ns: int = 0) -> None:
        """Send the reports kept, if any, and if ``due_after_ns`` passed since the last send (or too many wait)."""
        reports = self._step_reports
        if not reports:
            return
        now = time.monotonic_ns()
        if due_after_ns and now - self._reports_sent_ns < due_after_ns and len(reports) < _REPORTS_QUEUED:
            return
        self._step_reports = []
        self._reports_sent_ns = now
        for report in reports:  # queued together: libzmq writes them at once and the manager reads them in one wake-up
            self._emitter.emit(report)

    def heartbeat(self) -> None:
        self._maybe_hello(time.monotonic_ns())
        self._send_step_reports()
        self._emitter.emit(p.Heartbeat(rank=self.config.rank, t_ns=time.monotonic_ns()))

    def close(self) -> None:
        """Send ``Goodbye`` and release the socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self.bubble_ended()
        self._send_step_reports()
        goodbye = p.Goodbye(
            rank=self.config.rank,
            t_ns=time.monotonic_ns(),
            dropped=self._emitter.dropped,
            last_bubble=self._last_published,
        )
        if self._publisher is not None:
            self._publisher.close()  # lingers a moment: the last bubble end goes out before the goodbye
        self._emitter.close(goodbye)
        self._run_delay.close()
