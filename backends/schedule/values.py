"""Schedules as plain values: one rank's action in the ``2F0`` notation, and a whole step's schedule.

An :class:`Action` is written ``2F0`` (rank 2, forward, micro-batch 0; a model
chunk other than 0 is appended as ``c1``). Zero-bubble schedules split a
backward in two: ``2B0`` computes the input gradient that rank 1 waits for and
``2W0`` the weight gradient that nobody waits for. A :class:`Schedule` lists
each rank's actions in execution order and round-trips through CSV.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["Action", "Kind", "Schedule", "check_sizes"]

Kind = Literal["F", "B", "W"]
"""Forward, backward (input gradient only when the schedule has a W for it), weight gradient."""

_KINDS: tuple[Kind, ...] = ("F", "B", "W")
_ACTION_RE = re.compile(r"(\d+)([FBW])(\d+)(?:c(\d+))?")


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """One compute action of one pipeline rank.

    Attributes:
        stage: Pipeline rank, ``0..p-1``.
        kind: ``"F"`` (forward), ``"B"`` (backward) or ``"W"`` (weight gradient). When the
            schedule also has the ``W`` of the same stage, micro-batch and chunk, ``B`` is
            only the input-gradient part of the backward (as in zero-bubble schedules).
        microbatch: Micro-batch id, ``0..m-1``.
        chunk: Model chunk of interleaved schedules; the virtual stage is ``chunk * p + stage``.
    """

    stage: int
    kind: Kind
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        for field_name in ("stage", "microbatch", "chunk"):
            if getattr(self, field_name) < 0:
                raise ValueError(f"Action.{field_name} must be >= 0, got {getattr(self, field_name)}")
        if self.kind not in _KINDS:
            raise ValueError(f"Action.kind must be one of {_KINDS}, got {self.kind!r}")

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind}{self.microbatch}"
        return f"{text}c{self.chunk}" if self.chunk else text

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the ``2F0`` / ``2F0c1`` / ``2W0`` notation.

        Raises:
            ValueError: ``text`` is not an action.
        """
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"not an action in 2F0 notation: {text!r}")
        stage, kind, microbatch, chunk = match.groups()
        return cls(int(stage), _KINDS["FBW".index(kind)], int(microbatch), int(chunk or 0))


@dataclass(frozen=True, slots=True)
class Schedule:
    """The per-rank execution order of one training step.

    Attributes:
        name: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or any label of a hand-written schedule.
        num_stages: Pipeline ranks ``p``.
        num_microbatches: Micro-batches ``m`` per step.
        num_chunks: Model chunks per rank ``v`` (1 unless interleaved).
        actions: ``actions[rank]`` in execution order; each rank runs one forward and one
            backward of every (micro-batch, chunk), and at most one weight-gradient pass.
        forward_only: The step only runs forwards (evaluation, inference): each rank runs
            one forward of every (micro-batch, chunk) and nothing else.
    """

    name: str
    num_stages: int
    num_microbatches: int
    num_chunks: int
    actions: tuple[tuple[Action, ...], ...]
    forward_only: bool = False

    def __post_init__(self) -> None:
        check_sizes(num_stages=self.num_stages, num_microbatches=self.num_microbatches, num_chunks=self.num_chunks)
        if len(self.actions) != self.num_stages:
            raise ValueError(f"actions: {len(self.actions)} ranks listed for num_stages={self.num_stages}")
        places = [(mb, chunk) for mb in range(self.num_microbatches) for chunk in range(self.num_chunks)]
        kinds = ("F",) if self.forward_only else ("B", "F")
        expected = sorted((kind, *place) for kind in kinds for place in places)
        for rank, row in enumerate(self.actions):
            wrong = [str(a) for a in row if a.stage != rank]
            if wrong:
                raise ValueError(f"actions: rank {rank} lists actions of other ranks: {wrong}")
            passes = sorted((a.kind, a.microbatch, a.chunk) for a in row if a.kind != "W")
            weights = [(a.microbatch, a.chunk) for a in row if a.kind == "W"]
            if passes != expected or len(set(weights)) != len(weights) or not set(weights) <= set(places):
                what = "F" if self.forward_only else "F and B"
                raise ValueError(
                    f"actions: rank {rank} must run {what} of each of {self.num_microbatches} "
                    f"micro-batches x {self.num_chunks} chunks exactly once (and W at most once)"
                )
            if self.forward_only and weights:
                raise ValueError(f"actions: rank {rank} of a forward-only schedule lists W passes")

    def to_csv(self) -> str:
        """One line per rank, its actions in ``2F0`` notation separated by commas."""
        return "".join(",".join(map(str, row)) + "\n" for row in self.actions)

    @property
    def has_weight_passes(self) -> bool:
        """Whether any rank runs a separate weight-gradient pass (``W``)."""
        return any(a.kind == "W" for row in self.actions for a in row)

    @classmethod
    def from_csv(cls, text: str, *, name: str, num_microbatches: int, num_chunks: int = 1) -> Schedule:
        """Read a schedule written by :meth:`to_csv` (row ``r`` holds rank ``r``'s actions).

        Raises:
            ValueError: A cell is not an action, or the rows are not a complete schedule.
        """
        rows = [line for line in text.splitlines() if line.strip()]
        actions = tuple(tuple(Action.parse(cell) for cell in row.split(",") if cell.strip()) for row in rows)
        return cls(name, len(actions), num_microbatches, num_chunks, actions)


def check_sizes(**sizes: int) -> None:
    """Check that every named size is at least 1.

    Raises:
        ValueError: A size is below 1; the message names it.
    """
    for field_name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{field_name} must be >= 1, got {value}")
