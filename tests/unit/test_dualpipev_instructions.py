"""DeepSpeed's DualPipeV instruction lists: translation, commit places, the replay, and the adapter on them.

The instruction lists are DeepSpeed's own (``DualPipeVSchedule.steps()``). The
adapter test drives a stand-in engine that executes them as
``PipelineEngine._exec_schedule`` does, on a virtual clock: passes take fixed
times and each ``CommitP2P`` waits as long as an independent replay, written
here, of all ranks' lists says. No sockets, no processes.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Sequence
from types import MethodType
from typing import Any, ClassVar, cast

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed.comm
import torch
from deepspeed.runtime.pipe import schedule as ds_schedule

from freeride import protocol as p
from freeride.backends import session as session_mod
from freeride.backends.deepspeed import _compat, dualpipev
from freeride.backends.deepspeed.adapter import TAIL_LOSS, DeepSpeedAdapter, reduce_key, tail_key
from freeride.backends.schedule import Action, Durations
from freeride.backends.session import BackendConfig, BackendSession
from freeride.transport import EventEmitter

MS = 1_000_000
T_F, T_B = 10 * MS, 20 * MS
SHAPES = [(2, 4), (2, 7), (3, 6), (4, 8), (4, 11)]


def _rows(stages: int, m: int) -> tuple[tuple[_compat.Instruction, ...], ...]:
    return _compat.instruction_rows(ds_schedule.DualPipeVSchedule(micro_batches=m, stages=stages, stage_id=0))


def _durations(stages: int) -> Durations:
    return Durations.uniform(stages, T_F / 1e9, T_B / 1e9)


@pytest.mark.parametrize(("stages", "m"), SHAPES)
def test_passes_become_actions_in_deepspeeds_order(stages: int, m: int) -> None:
    rows = _rows(stages, m)
    schedule = dualpipev.to_schedule(rows, m)  # validates: every (micro-batch, phase) F and B once
    assert (schedule.name, schedule.num_stages, schedule.num_microbatches, schedule.num_chunks) == (
        "dualpipev",
        stages,
        m,
        2,
    )
    for rank, row in enumerate(rows):
        passes = [(name, kw) for name, kw in row if name in ("ForwardPass", "BackwardPass")]
        assert [str(a) for a in schedule.actions[rank]] == [
            f"{rank}{name[0]}{kw['buffer_id'] % m}" + ("c1" if kw["phase"] else "") for name, kw in passes
        ]
        # each phase runs its micro-batches in order, forward before backward
        for kind in ("F", "B"):
            for chunk in (0, 1):
                mbs = [a.microbatch for a in schedule.actions[rank] if (a.kind, a.chunk) == (kind, chunk)]
                assert mbs == list(range(m))
    # the V: rank 0 loads phase 0 first; the last rank turns each micro-batch around on the spot
    assert schedule.actions[0][0] == Action(0, "F", 0)
    last = schedule.actions[-1]
    assert last[:2] == (Action(stages - 1, "F", 0), Action(stages - 1, "F", 0, 1))


@pytest.mark.parametrize(("stages", "m"), SHAPES)
def test_every_commit_is_placed_before_the_pass_it_feeds(stages: int, m: int) -> None:
    rows = _rows(stages, m)
    for rank, row in enumerate(rows):
        places = dualpipev.commit_places(row, rank, m)
        launches = dualpipev.commit_launches(row)
        assert len(places) == len(launches) == sum(name == "CommitP2P" for name, _ in row)
        actions = [str(a) for a in dualpipev.to_schedule(rows, m).actions[rank]]
        receiving = [place for place, launch in zip(places, launches, strict=True) if launch == "recv"]
        sending = [place for place, launch in zip(places, launches, strict=True) if launch == "send"]
        assert set(receiving) <= set(actions) and set(sending) <= {f"send:{a}" for a in [*actions, "tail"]}
        # one receiving commit per place: a wait is never announced twice before one pass
        assert len(set(receiving)) == len(receiving)
        assert len(set(sending)) == len(sending)
        # DeepSpeed queues a receive a step ahead: the first forward that needs a neighbour's data waits
        if rank:
            assert receiving[0] == f"{rank}F0"
    assert dualpipev.commit_key("", None) == "send:tail"


@pytest.mark.parametrize(("stages", "m"), SHAPES)
def test_replay_accounts_for_the_whole_step(stages: int, m: int) -> None:
    rows = _rows(stages, m)
    busy = 2 * m * (T_F + T_B)
    totals = []
    for rank in range(stages):
        waits = dualpipev.wait_priors(
            rows, rank, _durations(stages), micro_batches=m, tail_key="tail:opt0", merge_tail=False
        )
        assert all(ns >= 0 for ns in waits.values())
        totals.append(busy + sum(waits.values()))
        # the last rank waits for the first micro-batch to cross every rank before it
        if rank == stages - 1:
            assert waits[f"{rank}F0"] == (stages - 1) * T_F
    # every rank's passes plus its waits (tail included) span the same step
    assert max(totals) - min(totals) <= stages
    # DualPipeV fills the pipeline better than 1F1B would with the same passes on 2p stages
    one_f_one_b_bubble = (2 * stages - 1) * (T_F + T_B)
    assert totals[0] - busy < one_f_one_b_bubble


def test_replay_merges_the_tail_without_an_end_of_step_sync() -> None:
    rows = _rows(2, 4)
    kept = dualpipev.wait_priors(rows, 1, _durations(2), micro_batches=4, tail_key="tail:opt0", merge_tail=False)
    merged = dualpipev.wait_priors(rows, 1, _durations(2), micro_batches=4, tail_key="tail:opt0", merge_tail=True)
    assert kept["tail:opt0"] > 0 and "tail:opt0" not in merged
    launches = dualpipev.commit_launches(rows[1])
    first = next(
        place for place, launch in zip(dualpipev.commit_places(rows[1], 1, 4), launches, strict=True) if launch
    )
    assert merged[first] == kept[first] + kept["tail:opt0"]


def test_bad_rows_are_rejected() -> None:
    rows = [list(row) for row in _rows(2, 4)]
    wrong = [(name, {**kw, "phase": 1}) if name == "ForwardPass" else (name, kw) for name, kw in rows[0]]
    with pytest.raises(ValueError, match="not a DualPipeV buffer"):
        dualpipev.to_schedule([wrong, rows[1]], 4)
    unpaired = [row[:] for row in rows]
    unpaired[0].remove(next(ins for ins in unpaired[0] if ins[0] == "SendActivation"))
    with pytest.raises(ValueError, match="deadlock"):
        dualpipev.wait_priors(unpaired, 0, _durations(2), micro_batches=4, tail_key="tail:opt0", merge_tail=False)
    with pytest.raises(ValueError, match="ranks"):
        dualpipev.wait_priors(rows, 0, _durations(3), micro_batches=4, tail_key="tail:opt0", merge_tail=False)


# ------------------------------------------------------------------ the adapter


def _true_commit_waits(
    rows: Sequence[Sequence[_compat.Instruction]], stage: int, m: int
) -> tuple[list[int | None], int]:
    """Per commit of ``stage``, how long it blocks (None: it has nothing to launch), and how long
    before the slowest rank it finishes: a replay of its own (each op waits for its peer's commit)."""
    p_ = len(rows)
    cursor, t = [0] * p_, [0] * p_
    queued: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(p_)]
    launched: dict[tuple[str, tuple[int, ...]], int] = {}
    open_: list[tuple[int, list[tuple[str, tuple[int, ...]]]] | None] = [None] * p_
    waits: list[list[int | None]] = [[] for _ in range(p_)]
    while any(cursor[r] < len(rows[r]) for r in range(p_)):
        for r in range(p_):
            while cursor[r] < len(rows[r]):
                name, kw = rows[r][cursor[r]]
                if name == "CommitP2P":
                    if open_[r] is None:
                        open_[r] = (t[r], queued[r])
                        launched.update({op: t[r] for op in queued[r]})
                        queued[r] = []
                    start, ops = cast(tuple[int, list[tuple[str, tuple[int, ...]]]], open_[r])
                    other = [("recv" if side == "send" else "send", msg) for side, msg in ops]
                    if any(op not in launched for op in other):
                        break
                    t[r] = max([start, *(launched[op] for op in other)])
                    waits[r].append(t[r] - start if ops else None)
                    open_[r] = None
                elif name in ("ForwardPass", "BackwardPass"):
                    t[r] += T_F if name == "ForwardPass" else T_B
                elif name in ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad"):
                    down = r + 1 if kw["phase"] == 0 else r - 1
                    up = 2 * r - down
                    peer = down if name in ("SendActivation", "RecvGrad") else up
                    src, dst = (r, peer) if name.startswith("Send") else (peer, r)
                    side = "send" if name.startswith("Send") else "recv"
                    queued[r].append((side, (src, dst, "Activation" in name, kw["buffer_id"] % m)))
                cursor[r] += 1
    return waits[stage], max(t) - t[stage]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000 * MS

    def monotonic_ns(self) -> int:
        return self.now


class Recorder:
    """Stands in for EventEmitter: keeps what would have been sent."""

    def __init__(self) -> None:
        self.events: list[p.BackendEvent] = []
        self.dropped = 0
        self.sent = 0

    def wait_connected(self, timeout_ms: int) -> bool:

        return True

    def emit(self, event: p.BackendEvent) -> bool:
        self.events.append(event)
        return True

    def close(self, goodbye: p.Goodbye | None = None, *, linger_ms: int = 200) -> None:
        if goodbye is not None:
            self.events.append(goodbye)


class FakeDualPipeVEngine:
    """Executes DualPipeVSchedule like DeepSpeed's engine; instructions advance a virtual clock."""

    TYPE_NAME = "DualPipeVEngine"

    def __init__(self, clock: Clock, *, stage: int, stages: int, micro_batches: int) -> None:
        self.clock = clock
        self.global_rank = self.stage_id = self.local_rank = stage
        self.num_stages = stages
        self.micro_batches = micro_batches
        self.device = torch.device("cpu")
        self.global_steps = 0
        self.commit_waits, self.tail_ns = _true_commit_waits(_rows(stages, micro_batches), stage, micro_batches)
        self._commit = 0
        self.sync_ns = 0
        """How long the data-parallel gradient all-reduce waits (a slower replica)."""

    def gradient_clipping(self) -> float:
        return 0.0

    def train_batch(self) -> None:
        sched = ds_schedule.DualPipeVSchedule(
            micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id
        )
        self._commit = 0
        self._exec_schedule(sched)
        self._aggregate_total_loss()

    def _exec_schedule(self, sched: Any) -> None:
        for cmds in sched:
            for cmd in cmds:
                MethodType(self._INSTRUCTION_MAP[type(cmd)], self)(**cmd.kwargs)

    def _aggregate_total_loss(self) -> None:
        self.clock.now += MS // 10

    def _commit_p2p(self) -> None:
        self.clock.now += self.commit_waits[self._commit] or 0
        self._commit += 1

    def _reduce_grads(self) -> None:
        deepspeed.comm.all_reduce(torch.zeros(1))

    def _step(self) -> None:
        self.global_steps += 1

    _INSTRUCTION_MAP: ClassVar[dict[type[Any], Callable[..., None]]] = {
        ds_schedule.ForwardPass: lambda self, buffer_id, phase: setattr(self.clock, "now", self.clock.now + T_F),
        ds_schedule.BackwardPass: lambda self, buffer_id, phase: setattr(self.clock, "now", self.clock.now + T_B),
        ds_schedule.RecvActivation: lambda self, buffer_id, phase: None,
        ds_schedule.RecvGrad: lambda self, buffer_id, phase: None,
        ds_schedule.SendActivation: lambda self, buffer_id, phase: None,
        ds_schedule.SendGrad: lambda self, buffer_id, phase: None,
        ds_schedule.CommitP2P: lambda self: self._commit_p2p(),
        ds_schedule.LoadMicroBatch: lambda self, buffer_id: None,
        ds_schedule.ReduceGrads: lambda self: self._reduce_grads(),
        ds_schedule.ReduceTiedGrads: lambda self: None,
        ds_schedule.OptimizerStep: lambda self: self._step(),
    }


def _run(
    monkeypatch: pytest.MonkeyPatch, *, stage: int, stages: int, m: int, steps: int, sync_ns: int = 0
) -> tuple[FakeDualPipeVEngine, DeepSpeedAdapter, Recorder]:
    clock = Clock()
    monkeypatch.setattr(session_mod, "time", types.SimpleNamespace(monotonic_ns=clock.monotonic_ns))
    engine = FakeDualPipeVEngine(clock, stage=stage, stages=stages, micro_batches=m)

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        clock.now += sync_ns

    monkeypatch.setattr(deepspeed.comm, "all_reduce", all_reduce)
    recorder = Recorder()
    config = BackendConfig(
        endpoint="ipc:///nonexistent",
        rank=stage,
        stage=stage,
        num_stages=stages,
        device=f"cpu:{stage}",
        framework="deepspeed",
    )
    session = BackendSession(config, emitter=cast(EventEmitter, recorder))
    adapter = DeepSpeedAdapter(engine, session=session, mode="emit", clock=clock.monotonic_ns)
    original_exec = FakeDualPipeVEngine._exec_schedule
    original_loss = FakeDualPipeVEngine._aggregate_total_loss
    monkeypatch.setattr(engine, "_exec_schedule", lambda sched: adapter.run_schedule(original_exec, engine, sched))
    monkeypatch.setattr(engine, "_aggregate_total_loss", lambda: adapter.run_aggregate_loss(original_loss, engine))
    for _ in range(steps):
        engine.train_batch()
    adapter.close()
    return engine, adapter, recorder


@pytest.mark.parametrize(("stages", "m"), [(2, 4), (3, 6), (4, 9)])
def test_adapter_announces_the_commits_where_the_instruction_lists_put_them(
    monkeypatch: pytest.MonkeyPatch, stages: int, m: int
) -> None:
    rows = _rows(stages, m)
    for stage in range(stages):
        engine, adapter, recorder = _run(monkeypatch, stage=stage, stages=stages, m=m, steps=3)
        assert adapter.tracker.last_step is not None
        # every commit that launches p2p is a wait at its place; sends and receives only queue, and are none
        places = dualpipev.commit_places(rows[stage], stage, m)
        truth: dict[str, int] = {}
        for place, ns in zip(places, engine.commit_waits, strict=True):
            if ns is not None:
                truth[place] = truth.get(place, 0) + ns
        waits = {w.key: w.duration_ns for w in adapter.tracker.last_step.waits}
        assert {k: v for k, v in waits.items() if not k.startswith("tail:")} == truth
        assert [k for k in waits if k.startswith("tail:")] == [
            reduce_key("ReduceGrads", 0),
            TAIL_LOSS,
        ]
        # step 1 is announced from the replay of the instruction lists, exactly (a virtual clock);
        # without clipping nothing syncs the step's end, so the tail is expected at the first commit
        started = [e for e in recorder.events if isinstance(e, p.BubbleStarted)]
        ended = [e for e in recorder.events if isinstance(e, p.BubbleEnded)]
        assert not [e for e in started if e.step == 0]  # warm-up
        first = next(place for place, ns in zip(places, engine.commit_waits, strict=True) if ns is not None)
        replayed = {**truth, first: truth[first] + engine.tail_ns}
        assert sorted(e.expected_ns for e in started if e.step == 1) == sorted(v for v in replayed.values() if v >= MS)
        # then from what was measured (here the stand-in engine does not carry the tail over)
        long_waits = sorted(ns for ns in truth.values() if ns >= MS)
        assert sorted(e.expected_ns for e in started if e.step == 2) == long_waits
        for step in (1, 2):
            assert sorted(e.duration_ns for e in ended if e.step == step) == long_waits


def test_data_parallel_waits_are_announced_once_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    _, adapter, recorder = _run(monkeypatch, stage=0, stages=2, m=4, steps=4, sync_ns=7 * MS)
    assert adapter.tracker.last_step is not None
    dp = [w for w in adapter.tracker.last_step.waits if w.key == reduce_key("ReduceGrads", 0)]
    assert [w.duration_ns for w in dp] == [7 * MS]
    started = [e for e in recorder.events if isinstance(e, p.BubbleStarted)]
    assert 7 * MS not in [e.expected_ns for e in started if e.step == 1]  # not in the instruction lists: learnt
    assert 7 * MS in [e.expected_ns for e in started if e.step == 3]
    assert tail_key(0) not in {w.key for w in adapter.tracker.last_step.waits}  # no clipping: no norm all-reduce
