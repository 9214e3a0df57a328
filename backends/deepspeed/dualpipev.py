"""DeepSpeed's DualPipeV instruction lists as a FreeRide schedule, and the waits they imply.

Pure: no DeepSpeed, no torch. Its input is what
:func:`freeride.backends.deepspeed._compat.instruction_rows` reads off a
``DualPipeVSchedule``: per pipeline rank, the instructions of one batch as
``(class name, keyword arguments)``.

DualPipeV puts two stages on every rank in a V: rank ``r`` runs stage ``r``
(phase 0, activations flow towards the last rank) and stage ``2p - 1 - r``
(phase 1, back towards rank 0, which computes the loss). Its instructions carry
``buffer_id = phase * m + micro_batch`` and ``phase``; a pass becomes the
:class:`~freeride.backends.schedule.Action` ``rank kind micro_batch c<phase>``. Sends and
receives only queue work; ``CommitP2P`` launches the queue as one batch and
waits for all of it, so the commits are where a rank idles. A commit's place is
the compute action that follows it (``"1F3c1"``) when it receives, and
``send:<action>`` (``send:tail`` after the last pass) when it only sends, as a
blocking send is keyed under 1F1B; a commit with nothing queued returns at once
and is no wait.

:func:`wait_priors` predicts every place's wait by replaying all ranks'
instruction lists with given compute times: a commit returns once each of its
sends and receives has been posted by the peer (gloo hands a tensor over only to
a posted receive) plus one hop of latency. That replay follows the V, the
unequal phases and the commits exactly, where :func:`freeride.backends.schedule.simulate`
(loop placement, one pass per hop) cannot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from freeride.backends.schedule import Action, Durations, Kind, Schedule

__all__ = [
    "SCHEDULE_NAME",
    "Instruction",
    "Launch",
    "commit_key",
    "commit_launches",
    "commit_places",
    "to_schedule",
    "wait_priors",
]

SCHEDULE_NAME = "dualpipev"

Launch = Literal["", "send", "recv"]
"""What a commit launches: nothing, only sends, or receives (and maybe sends)."""

Instruction = tuple[str, Mapping[str, int]]
"""One instruction: class name and keyword arguments (``buffer_id``, ``phase``)."""

_PASSES: dict[str, Kind] = {"ForwardPass": "F", "BackwardPass": "B"}
_COMMIT = "CommitP2P"
_P2P = frozenset({"SendActivation", "RecvActivation", "SendGrad", "RecvGrad"})


def _action(rank: int, name: str, kwargs: Mapping[str, int], micro_batches: int) -> Action:
    buffer_id, phase = int(kwargs["buffer_id"]), int(kwargs.get("phase", 0))
    if phase not in (0, 1) or buffer_id // micro_batches != phase:
        raise ValueError(f"rank {rank}: {name}(buffer_id={buffer_id}, phase={phase}) is not a DualPipeV buffer")
    return Action(rank, _PASSES[name], buffer_id % micro_batches, phase)


def to_schedule(rows: Sequence[Sequence[Instruction]], micro_batches: int) -> Schedule:
    """The passes of every rank, in the order its instructions run them.

    Raises:
        ValueError: A pass names a buffer that is not its phase's, or a rank does
            not run every (micro-batch, phase) forward and backward exactly once.
    """
    actions = tuple(
        tuple(_action(rank, name, kw, micro_batches) for name, kw in row if name in _PASSES)
        for rank, row in enumerate(rows)
    )
    return Schedule(SCHEDULE_NAME, len(rows), micro_batches, 2, actions)


def commit_key(launch: Launch, before: Action | None) -> str:
    """Place key of a commit that launches ``launch`` before the pass ``before`` (None: after the last)."""
    if launch == "recv":
        return "recv:tail" if before is None else str(before)  # no receive follows the last pass
    return "send:tail" if before is None else f"send:{before}"


def commit_launches(row: Sequence[Instruction]) -> tuple[Launch, ...]:
    """Per ``CommitP2P`` of ``row``, what it launches."""
    launches: list[Launch] = []
    queued: Launch = ""
    for name, _ in row:
        if name == _COMMIT:
            launches.append(queued)
            queued = ""
        elif name in _P2P and queued != "recv":
            queued = "recv" if name.startswith("Recv") else "send"
    return tuple(launches)


def commit_places(row: Sequence[Instruction], rank: int, micro_batches: int) -> list[str]:
    """The place key of each ``CommitP2P`` of ``row``, in order (see :func:`commit_key`)."""
    launches = iter(commit_launches(row))
    places: list[str] = []
    pending: list[Launch] = []
    for name, kw in row:
        if name == _COMMIT:
            pending.append(next(launches))
        elif name in _PASSES and pending:
            before = _action(rank, name, kw, micro_batches)
            places += [commit_key(launch, before) for launch in pending]
            pending = []
    return places + [commit_key(launch, None) for launch in pending]


@dataclass(slots=True)
class _Rank:
    row: Sequence[Instruction]
    places: list[str]
    cursor: int = 0
    t: float = 0.0
    queued: list[tuple[str, tuple[int, int, str, int]]] = field(default_factory=list)
    """(side, (src, dst, what, micro-batch)) of the sends and receives not yet committed."""
    commit: tuple[float, list[tuple[str, tuple[int, int, str, int]]]] | None = None
    """The commit this rank is blocked in: when it started and what it launched."""
    commits: int = 0
    waits: dict[str, float] = field(default_factory=dict)


def _message(rank: int, name: str, kwargs: Mapping[str, int], p: int, m: int) -> tuple[str, tuple[int, int, str, int]]:
    phase = int(kwargs.get("phase", 0))
    micro_batch = int(kwargs["buffer_id"]) % m
    down = rank + 1 if phase == 0 else rank - 1  # where this phase's activations go
    up = rank - 1 if phase == 0 else rank + 1
    peer = {"SendActivation": down, "RecvActivation": up, "SendGrad": up, "RecvGrad": down}[name]
    if not 0 <= peer < p:
        raise ValueError(f"rank {rank}: {name} in phase {phase} has no peer")
    what = "act" if name.endswith("Activation") else "grad"
    side = "send" if name.startswith("Send") else "recv"
    src, dst = (rank, peer) if side == "send" else (peer, rank)
    return side, (src, dst, what, micro_batch)


def wait_priors(
    rows: Sequence[Sequence[Instruction]],
    stage: int,
    durations: Durations,
    *,
    micro_batches: int,
    tail_key: str,
    merge_tail: bool,
) -> dict[str, int]:
    """Expected idle ns of ``stage`` at each of its places in one step.

    Args:
        rows: Every rank's instructions (see :func:`to_schedule`).
        stage: The rank to predict.
        durations: Per-rank forward and backward times (per phase) and one hop's latency.
        micro_batches: ``m``.
        tail_key: Place of the end-of-step sync (the gradient-norm all-reduce), where
            a rank waits for the slowest; with ``merge_tail`` that wait lands in the
            next step's first commit instead.
        merge_tail: No sync ends the step.

    Raises:
        ValueError: The rows do not pair up (the replay deadlocks) or a p2p
            instruction has no peer.
    """
    p, m = len(rows), micro_batches
    if len(durations.forward) != p:
        raise ValueError(f"durations list {len(durations.forward)} ranks, the rows {p}")
    ranks = [_Rank(row, commit_places(row, r, m)) for r, row in enumerate(rows)]
    posted: dict[tuple[str, tuple[int, int, str, int]], float] = {}
    while True:
        progressed = False
        for r, st in enumerate(ranks):
            while st.cursor < len(st.row):
                name, kw = st.row[st.cursor]
                if name == _COMMIT:
                    if st.commit is None:
                        st.commit = (st.t, st.queued)
                        for side, msg in st.queued:
                            posted[(side, msg)] = st.t
                        st.queued = []
                        progressed = True
                    start, ops = st.commit
                    peers = [posted.get(("recv" if side == "send" else "send", msg)) for side, msg in ops]
                    if any(t is None for t in peers):
                        break
                    end = max([start, *(t + durations.comm for t in peers if t is not None)])
                    place = st.places[st.commits]
                    st.waits[place] = st.waits.get(place, 0.0) + end - start
                    st.t, st.commit = end, None
                    st.commits += 1
                elif name in _PASSES:
                    st.t += durations.cost(r, _PASSES[name])
                elif name in _P2P:
                    st.queued.append(_message(r, name, kw, p, m))
                st.cursor += 1
                progressed = True
        if all(st.cursor == len(st.row) for st in ranks):
            break
        if not progressed:
            stuck = [f"rank {r} at {st.cursor}" for r, st in enumerate(ranks) if st.cursor < len(st.row)]
            raise ValueError(f"the DualPipeV rows deadlock: {stuck}")
    waits = ranks[stage].waits
    tail = max(st.t for st in ranks) - ranks[stage].t
    if tail > 0:
        # without a sync at the end of the step the tail lands in the first commit that waits
        launches = commit_launches(rows[stage])
        launching = [place for place, ops in zip(ranks[stage].places, launches, strict=True) if ops]
        place = launching[0] if merge_tail and launching else tail_key
        waits[place] = waits.get(place, 0.0) + tail
    return {place: round(s * 1e9) for place, s in waits.items()}
