"""A simulated pipeline-parallel job: real processes, real waits, no framework.

Each stage is a process that runs its rank's actions of a GPipe, 1F1B or
interleaved schedule (see :mod:`freeride.backends.schedule`) in real time. A forward
waits for the activation message of the previous stage and a backward for the
gradient message of the next, over pipes, so bubbles emerge the way they do in
a real job: a stage blocked in a receive leaves its core idle. A barrier ends
every step, as the gradient-norm all-reduce of the optimizer step does.
Compute is ``sleep`` (deterministic timing) or ``spin`` (burns the stage's
pinned core, so side tasks sharing the core slow the stage down if they
overrun).

Each stage announces its bubbles exactly like a framework adapter: the
expected duration comes from the simulated schedule, then from the durations
measured in earlier steps. Under ``freeride profile`` (profile mode in the
environment) each stage also records every wait of every step, as the
framework adapters do, so ``freeride profile -- freeride sim ...`` profiles it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from typing import Any, Literal

from freeride.backends.launch import read_mode
from freeride.backends.observations import ObservationLog
from freeride.backends.predict import BubblePredictor
from freeride.backends.schedule import Action, Durations, bubbles, build_schedule, simulate
from freeride.backends.session import BackendConfig, BackendSession
from freeride.backends.tracker import TAIL_KEY
from freeride.host.procs import bind_to_parent
from freeride.profile import RankObservations, StepRecord, WaitRecord

__all__ = ["SimConfig", "SimPipeline", "StageResult", "run_stage"]

logger = logging.getLogger(__name__)

_GIB = 1 << 30

Message = tuple[str, int, int]
"""(kind, micro-batch, virtual stage of the sender)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    """A simulated job."""

    endpoint: str
    """Events endpoint of the manager."""
    schedule: str = "1f1b"
    """``gpipe``, ``1f1b`` or ``interleaved``."""
    num_stages: int = 2
    num_microbatches: int = 4
    num_chunks: int = 1
    """Model chunks per rank (interleaved only)."""
    forward_s: float = 0.005
    """One micro-batch forward on one stage (per chunk when interleaved)."""
    backward_s: float = 0.010
    steps: int = 20
    compute: Literal["sleep", "spin", "cpu"] = "sleep"
    """``sleep``; ``spin``: burn the core until a wall-clock deadline; ``cpu``: burn it until the stage
    has had the compute time (a GPU-faithful stand-in: a side task sharing the core at the stage's
    priority delays it, as a side kernel holds up a GPU's training kernels)."""
    device_prefix: str = "cpu"
    """Devices are named ``<prefix>:<core>``."""
    pin: bool = True
    """Pin stage ``s`` to core ``s % nproc`` (its device)."""
    spare_memory: int = 4 * _GIB
    """Spare device memory each stage reports."""
    rank_offset: int = 0
    """Added to stage numbers to form ranks (to run several jobs beside one manager)."""
    min_bubble_s: float = 0.001

    def __post_init__(self) -> None:
        build_schedule(self.schedule, self.num_stages, self.num_microbatches, self.num_chunks)  # validates
        for name in ("forward_s", "backward_s", "min_bubble_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.compute not in ("sleep", "spin", "cpu"):
            raise ValueError(f"compute must be 'sleep', 'spin' or 'cpu', got {self.compute!r}")

    def core(self, stage: int) -> int:
        return stage % (os.cpu_count() or 1)

    def device(self, stage: int) -> str:
        return f"{self.device_prefix}:{self.core(stage)}"


@dataclass(slots=True)
class StageResult:
    """What one stage measured."""

    stage: int
    step_ns: list[int] = field(default_factory=list)
    cpu_ns: list[int] = field(default_factory=list)
    """The stage process's CPU time per step."""
    bubble_ns: list[int] = field(default_factory=list)
    """Per step, the measured duration of the announced bubbles."""
    wait_ns: list[int] = field(default_factory=list)
    """Per step, all time spent waiting (announced or not)."""
    announced: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    """(step, index, start monotonic ns, expected ns, measured ns) of every announced bubble."""
    sent: int = 0
    dropped: int = 0


def _compute(seconds: float, mode: str) -> None:
    if mode == "sleep":
        time.sleep(seconds)
        return
    if mode == "cpu":
        until = time.thread_time() + seconds
        while time.thread_time() < until:
            pass
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _Links:
    """Receives messages in the order the schedule needs them, stashing early ones."""

    def __init__(self, prev: Connection | None, nxt: Connection | None) -> None:
        self.prev, self.next = prev, nxt
        self._stash: set[Message] = set()

    def recv(self, want: Message) -> None:
        while want not in self._stash:
            conns = [c for c in (self.prev, self.next) if c is not None]
            ready = mp.connection.wait(conns)
            for conn in ready:
                assert isinstance(conn, Connection)
                self._stash.add(conn.recv())
        self._stash.discard(want)


def run_stage(
    config: SimConfig,
    stage: int,
    prev: Connection | None,
    nxt: Connection | None,
    barrier: Any,
    results: Any,
) -> None:
    """Body of one stage process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the process that started the stages
    bind_to_parent(f"freeride-sim{stage}")
    if config.pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {config.core(stage)})
    p, m, v = config.num_stages, config.num_microbatches, config.num_chunks
    schedule = build_schedule(config.schedule, p, m, v)
    timeline = simulate(schedule, Durations.uniform(p, config.forward_s, config.backward_s))
    windows = bubbles(timeline)[stage]
    predictor = BubblePredictor()
    for w in windows:
        predictor.set_prior(w.before, int(w.duration * 1e9))
    session = BackendSession(
        BackendConfig(
            endpoint=config.endpoint,
            rank=config.rank_offset + stage,
            stage=stage,
            num_stages=p,
            device=config.device(stage),
            framework="sim",
            spare_memory=config.spare_memory,
            min_bubble_ns=int(config.min_bubble_s * 1e9),
        )
    )
    links = _Links(prev, nxt)
    num_virtual = p * v
    result = StageResult(stage=stage)
    log = _observation_log(config, stage)
    waits_of_step: list[WaitRecord] = []
    passes: dict[str, list[int]] = {"F": [], "B": []}

    def waited(step: int, key: Action | None, wait: Callable[[], None]) -> int:
        expected = predictor.expect(key)
        opened = session.bubble_started(step, expected) if expected > 0 else False
        t0 = session.open_since_ns or time.monotonic_ns()
        wait()
        measured = time.monotonic_ns() - t0
        if opened:
            measured = session.bubble_ended()
            result.announced.append((step, session.bubbles - 1, t0, expected, measured))
            # the stage's wait for a side step to let go of its core was not part of the bubble
            predictor.observe(key, measured - session.last_waited_runnable_ns)
        else:
            predictor.observe(key, measured)
        if log is not None:
            key_text = TAIL_KEY if key is None else str(key)
            offset = t0 - t_step
            waits_of_step.append(WaitRecord(key=key_text, offset_ns=offset, duration_ns=measured, expected_ns=expected))
        return measured if opened else 0

    try:
        t_step = 0
        for step in range(config.steps):
            t_step = time.monotonic_ns()
            cpu_step = time.process_time_ns()
            waits_of_step = []
            passes = {"F": [], "B": []}
            announced = waits = 0
            for action in schedule.actions[stage]:
                virtual = action.chunk * p + stage
                need: Message | None = None
                if action.kind == "F" and virtual > 0:
                    need = ("F", action.microbatch, virtual - 1)
                elif action.kind == "B" and virtual < num_virtual - 1:
                    need = ("B", action.microbatch, virtual + 1)
                if need is not None:
                    t0 = time.monotonic_ns()
                    announced += waited(step, action, partial(links.recv, need))
                    waits += time.monotonic_ns() - t0
                t_pass = time.monotonic_ns()
                _compute(config.forward_s if action.kind == "F" else config.backward_s, config.compute)
                passes[action.kind].append(time.monotonic_ns() - t_pass)
                if action.kind == "F" and virtual < num_virtual - 1:
                    assert links.next is not None
                    links.next.send(("F", action.microbatch, virtual))
                elif action.kind == "B" and virtual > 0:
                    assert links.prev is not None
                    links.prev.send(("B", action.microbatch, virtual))
            t0 = time.monotonic_ns()
            announced += waited(step, None, barrier.wait)
            waits += time.monotonic_ns() - t0
            duration = time.monotonic_ns() - t_step
            session.step_finished(step, duration)
            if log is not None:
                log.add(
                    StepRecord(
                        step=step,
                        duration_ns=duration,
                        waits=waits_of_step,
                        forward_ns=passes["F"],
                        backward_ns=passes["B"],
                    )
                )
            result.step_ns.append(duration)
            result.cpu_ns.append(time.process_time_ns() - cpu_step)
            result.bubble_ns.append(announced)
            result.wait_ns.append(waits)
    except (EOFError, BrokenPipeError, OSError, threading.BrokenBarrierError) as exc:
        logger.warning("[sim] stage %d lost a neighbour (%s); stopping", stage, exc)
    finally:
        result.sent, result.dropped = session.sent, session.dropped
        if log is not None:
            log.close()
        session.close()
        results.put(result)


def _observation_log(config: SimConfig, stage: int) -> ObservationLog | None:
    """Profile mode's record of this stage (None outside profile mode)."""
    mode, directory = read_mode()
    if mode != "profile":
        return None
    base = RankObservations(
        framework="sim",
        rank=config.rank_offset + stage,
        stage=stage,
        num_stages=config.num_stages,
        device=config.device(stage),
        num_microbatches=config.num_microbatches,
        schedule=config.schedule if config.num_chunks == 1 else f"{config.schedule}x{config.num_chunks}",
        spare_memory=config.spare_memory,
    )
    return ObservationLog(base, directory, spare_memory=lambda: config.spare_memory)


class SimPipeline:
    """Runs a :class:`SimConfig` as one process per stage.

    Usage::

        with SimPipeline(config) as sim:
            results = sim.join()
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        ctx = mp.get_context("spawn")
        p = config.num_stages
        ring = config.num_chunks > 1 and p > 1
        pipes = [ctx.Pipe(duplex=True) for _ in range(p if ring else max(p - 1, 0))]
        self._results: Any = ctx.Queue()
        step_s = simulate(
            build_schedule(config.schedule, p, config.num_microbatches, config.num_chunks),
            Durations.uniform(p, config.forward_s, config.backward_s),
        ).makespan
        self._barrier = barrier = ctx.Barrier(p, timeout=max(10.0, 20 * step_s))
        self._pipes = pipes
        self.processes: list[mp.process.BaseProcess] = []
        for s in range(p):
            prev = pipes[(s - 1) % p][1] if (s > 0 or ring) else None
            nxt = pipes[s][0] if (s < p - 1 or ring) else None
            self.processes.append(
                ctx.Process(
                    target=run_stage,
                    args=(config, s, prev, nxt, barrier, self._results),
                    name=f"freeride-sim-stage{s}",
                    daemon=True,
                )
            )

    def start(self) -> SimPipeline:
        """Start the stages. They ignore SIGINT: a terminal's Ctrl-C reaches the whole
        process group, and the process that started them stops them (``terminate``)."""
        # Blocked while the stages start, so that one still importing inherits it across
        # exec; a Ctrl-C meanwhile is delivered here once unblocked, not lost.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for proc in self.processes:
                proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for a, b in self._pipes:  # the stages hold their ends; a neighbour's death must read as EOF
            a.close()
            b.close()
        return self

    def join(self, timeout_s: float | None = None) -> list[StageResult]:
        """Wait for every stage; return what the stages that finished measured, by stage.

        Raises:
            TimeoutError: stages still running after ``timeout_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        results: list[StageResult] = []
        while len(results) < len(self.processes):
            try:
                results.append(self._results.get(timeout=0.2))
            except queue.Empty:
                if not any(proc.is_alive() for proc in self.processes):
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"simulated job still running after {timeout_s}s") from None
        for proc in self.processes:
            proc.join(5)
        return sorted(results, key=lambda r: r.stage)

    def terminate(self) -> None:
        for proc in self.processes:
            if proc.is_alive():
                proc.kill()
            proc.join(5)

    def __enter__(self) -> SimPipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.terminate()
