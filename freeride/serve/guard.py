"""The interference guard of one device: a margin and a prediction factor that follow what side work costs.

A fixed margin is either too wide (bubble time left unused) or too narrow
(side work spills past bubble ends: interference) and which one depends on the
workload, the machine and the load on it. The guard closes the loop: after
every bubble it compares the interference measured since its last change, as
a share of the training time that passed, with a target, and

* widens when above the target over enough bubbles that one spike does not
  count: the margin grows by half, and where more than a tenth of the bubbles
  ended before the deadline said (or the margin is at its cap) the prediction
  factor (applied to each bubble's expected length when a grant's deadline is
  set) drops by a twentieth;
* narrows while well below it (half the target or less, over bubbles that
  side work was granted in): the margin shrinks by a quarter, and the factor rises by a step, but
  never past what bubbles reliably last (the low decile of their measured
  length over their prediction), so a deadline only moves later where bubbles
  have kept ending later still;
* pulls a factor above 1 back as soon as bubbles stop lasting that long
  (more than a tenth of the window ended before the deadline said);
* starts with the shortest bubbles (under :attr:`GuardConfig.min_bubble_ns`)
  left out;
* leaves the shortest bubbles out instead of widening, where they cost far
  more interference per millisecond they give than the rest. A bubble that
  ends while a step runs costs about the same (the rest of the step, and on
  CPU the stage's wait for its core) whatever its length, while what it gives
  is its length (decision D40). Grants are grouped by their bubble's expected length in
  classes that double (1-2 ms, 2-4 ms, ...); when the guard would widen and
  the shortest class still granted took more than :data:`COSTLY_RATIO` times
  the interference per used millisecond of all longer classes together while
  giving at most :data:`SMALL_SHARE` of the used time, that class is no
  longer granted (:attr:`InterferenceGuard.min_bubble_ns`). The second
  condition stops the classes going one after the other: each is long next to
  the one below it and short next to the one above. A
  margin at its floor with a factor of 1 or more, well below the target, lets
  the longest class left out back in.

A wait of tens of bubbles between two changes makes it settle instead of
hunting; narrowing is as quick as widening, so one noisy stretch does not leave
the margin wide for the rest of a run (D40). The margin stays within a floor and
a cap, the factor within ``[factor_min, factor_max]``. Every change leaves a
one-line reason that ``freeride status`` shows.

Pure: it is fed by the device's scheduler (interference as it is settled,
each bubble's end with its measured and predicted lengths) and reads no clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from freeride import protocol as p
from freeride.units import format_ns

__all__ = [
    "COSTLY_RATIO",
    "DEFAULT_TARGET",
    "SMALL_SHARE",
    "GuardConfig",
    "InterferenceGuard",
    "class_floor_ns",
    "describe",
    "length_class",
]

DEFAULT_TARGET = 0.005
"""Interference the guard aims below: 0.5 % of training time."""

_MIN_WIDENED_NS = 10_000
"""A margin of 0 widens to this (doubling 0 would not widen it)."""

COSTLY_RATIO = 3.0
"""A class of short bubbles is left out where its interference per used ns is this many times the longer ones'..."""

SMALL_SHARE = 0.25
"""...and it gave at most this share of the used time: a class that gives much is kept, and the margin widens."""

_CLASS_GRANTS = 10
"""Grants of a class (and of the longer ones) needed before it can be judged."""

_SETTLED_WINDOW = 400
"""Settled grants whose use and interference the classes are judged on."""

_RELIABLE_QUANTILE = 0.1
"""A bubble length "reliably" reached is one at least this share of bubbles fell short of."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GuardConfig:
    """Bounds and pace of one device's guard."""

    target: float = DEFAULT_TARGET
    """Interference share of training time aimed below (0.005: 0.5 %)."""
    margin_ns: int = 300_000
    """Margin to start from (the configured one)."""
    margin_floor_ns: int = 100_000
    """The margin never narrows below this (nor below the starting margin, if that is lower)."""
    margin_cap_ns: int = 20_000_000
    """The margin never widens past this (nor past the starting margin, if that is higher)."""
    min_bubble_ns: int = 4_000_000
    """Bubbles expected under this are left out from the start. In every 200-step run of the DeepSpeed CPU job
    the guard ended up leaving out bubbles under 2-16 ms, and until its first judgement (``widen_after``
    bubbles) the shortest ones, at a twentieth of the work, made half the interference. They come back as
    any class left out does: once the margin is at its floor with a factor of 1 or more, well under target."""
    factor_min: float = 0.7
    """Lowest prediction factor: a grant's deadline is at least this share of the expected bubble."""
    factor_max: float = 1.5
    """Highest prediction factor (reached only where bubbles reliably last that long)."""
    factor_step: float = 0.05
    """How much the factor rises per narrowing."""
    widen_by: float = 1.5
    """What the margin is multiplied by when the guard widens (the factor by ``widen_factor_by``)."""
    widen_factor_by: float = 0.95
    narrow_by: float = 0.75
    """What the margin is multiplied by when the guard narrows."""
    widen_after: int = 50
    """Bubbles since the last change before the guard may widen again: fewer let one spike widen it."""
    narrow_after: int = 30
    """Bubbles with side work since the last change, all well below target, before the guard narrows."""
    window: int = 200
    """Bubbles whose lengths (and, at most, interference) the guard looks back on."""

    def __post_init__(self) -> None:
        if not 0 < self.target < 1:
            raise ValueError(f"target must be in (0, 1), got {self.target}")
        if self.margin_ns < 0:
            raise ValueError(f"margin_ns must be >= 0, got {self.margin_ns}")
        if not 0 <= self.margin_floor_ns <= self.margin_cap_ns:
            raise ValueError(
                f"margin_floor_ns and margin_cap_ns must satisfy 0 <= floor <= cap, got "
                f"{self.margin_floor_ns} and {self.margin_cap_ns}"
            )
        if not 0 < self.factor_min <= 1 <= self.factor_max:
            raise ValueError(
                "factor_min and factor_max must satisfy 0 < min <= 1 <= max, got"
                f" {self.factor_min} and {self.factor_max}"
            )
        if self.min_bubble_ns < 0:
            raise ValueError(f"min_bubble_ns must be >= 0, got {self.min_bubble_ns}")
        if self.factor_step <= 0:
            raise ValueError(f"factor_step must be > 0, got {self.factor_step}")
        if not (1 <= self.widen_after <= self.window and 1 <= self.narrow_after <= self.window):
            raise ValueError(
                "widen_after and narrow_after must be in 1..window, got "
                f"{self.widen_after}, {self.narrow_after} and {self.window}"
            )
        if not (self.widen_by > 1 and 0 < self.widen_factor_by < 1 and 0 < self.narrow_by < 1):
            raise ValueError(
                "widen_by must be > 1, widen_factor_by and narrow_by in (0, 1), got "
                f"{self.widen_by}, {self.widen_factor_by} and {self.narrow_by}"
            )


def length_class(expected_ns: int) -> int:
    """The class of a bubble expected to last ``expected_ns``: k for [2^k, 2^(k+1)) ms, -1 below 1 ms."""
    return max(-1, (max(0, expected_ns) // 1_000_000).bit_length() - 1)


def class_floor_ns(k: int) -> int:
    """The shortest expected length of class ``k`` (0 for -1)."""
    return 0 if k < 0 else (1 << k) * 1_000_000


@dataclass(slots=True)
class _Settled:
    length_class: int
    used_ns: int
    interference_ns: int


@dataclass(slots=True)
class _Bubble:
    since_ns: int
    """The end of the bubble before (or this one's start, for the first)."""
    end_ns: int
    interference_ns: int
    """Interference settled since the bubble before ended."""
    granted: bool
    """Side work was granted in it (a bubble nobody used says nothing about the margin)."""


class _Epoch:
    """The bubbles since the guard's last change (the latest ``window``), with their sums kept as they come and go.

    The guard reads the sums at every bubble's end, on the manager's loop: summing
    the window there each time was a pass over up to ``window`` bubbles per bubble.
    """

    def __init__(self, window: int) -> None:
        self._bubbles: deque[_Bubble] = deque()
        self._window = window
        self.span_ns = 0
        """Training time the bubbles span, each from the end of the one before it."""
        self.taken_ns = 0
        """Interference settled in that time."""
        self.granted = 0
        """Bubbles side work was granted in."""

    def __len__(self) -> int:
        return len(self._bubbles)

    def append(self, bubble: _Bubble) -> None:
        if len(self._bubbles) == self._window:
            self._count(self._bubbles.popleft(), -1)
        self._bubbles.append(bubble)
        self._count(bubble, 1)

    def clear(self) -> None:
        self._bubbles.clear()
        self.span_ns = self.taken_ns = self.granted = 0

    def _count(self, b: _Bubble, sign: int) -> None:
        self.span_ns += sign * (b.end_ns - b.since_ns)
        self.taken_ns += sign * b.interference_ns
        self.granted += sign * b.granted


class InterferenceGuard:
    """Keeps one device's margin and prediction factor where interference stays under the target."""

    def __init__(self, config: GuardConfig | None = None) -> None:
        self.config = c = config if config is not None else GuardConfig()
        self._floor = min(c.margin_floor_ns, c.margin_ns)
        self._cap = max(c.margin_cap_ns, c.margin_ns)
        self.margin_ns = c.margin_ns
        """The margin grants carry now."""
        self.factor = 1.0
        """What each bubble's expected length is multiplied by when a grant's deadline is set."""
        self.reason = f"learning: 0 of {c.widen_after} bubbles seen"
        """Why the margin and factor are what they are (one line)."""
        self.min_bubble_ns = c.min_bubble_ns
        """Bubbles expected (with the factor applied) to last less than this get no grant."""
        self.widenings = 0
        self.narrowings = 0
        self._settled: deque[_Settled] = deque(maxlen=_SETTLED_WINDOW)
        self._epoch = _Epoch(c.window)
        """Bubbles since the last change (at most a window of them)."""
        self._ratios: deque[float] = deque(maxlen=c.window)
        """Measured length over predicted length of the last bubbles."""
        self._pending_ns = 0
        self._last_end_ns = 0

    # -- feeding -------------------------------------------------------------

    def unseen(self) -> None:
        """Bubbles were not followed for a while (no side work here): the next one starts a span of its own."""
        self._last_end_ns = 0

    def add_interference(self, ns: int) -> None:
        """Side work ran ``ns`` past a bubble's end (counted with the next bubble that ends)."""
        self._pending_ns += max(0, ns)

    def settled(self, expected_ns: int, used_ns: int, interference_ns: int) -> None:
        """A grant in a bubble expected (factor applied) to last ``expected_ns`` used ``used_ns`` and cost
        ``interference_ns`` (also given to :meth:`add_interference`): what judges short bubbles."""
        self._settled.append(_Settled(length_class(expected_ns), max(0, used_ns), max(0, interference_ns)))

    def grants(self, expected_ns: int) -> bool:
        """Whether a bubble expected (factor applied) to last ``expected_ns`` gets a grant."""
        return expected_ns >= self.min_bubble_ns

    def expected_ns(self, predicted_ns: int) -> int:
        """The bubble length a grant's deadline is set by, for a bubble predicted to last ``predicted_ns``."""
        return max(0, round(predicted_ns * self.factor))

    def bubble_ended(self, end_ns: int, duration_ns: int, predicted_ns: int, *, granted: bool = True) -> None:
        """A bubble predicted to last ``predicted_ns`` ended at ``end_ns`` after ``duration_ns``.

        ``duration_ns`` is how long the stage was free, without the time it then
        waited for side work to let go of its core. ``granted``: side work was
        granted in the bubble; only such bubbles count toward narrowing.
        """
        since = self._last_end_ns or end_ns - max(0, duration_ns)
        self._last_end_ns = max(self._last_end_ns, end_ns)
        self._epoch.append(_Bubble(since_ns=since, end_ns=end_ns, interference_ns=self._pending_ns, granted=granted))
        self._pending_ns = 0
        if predicted_ns > 0:
            self._ratios.append(max(0, duration_ns) / predicted_ns)
        self._decide()

    # -- views ----------------------------------------------------------------

    def share(self) -> float:
        """Interference since the last change, as a share of the training time it spans (0 with none)."""
        span = self._epoch.span_ns  # each bubble's from the end before it: no unseen gap
        return self._epoch.taken_ns / span if span > 0 else 0.0

    def reliable_ratio(self) -> float | None:
        """What bubbles last, over their prediction, in all but the shortest tenth (None: too few seen)."""
        if len(self._ratios) < self.config.widen_after:
            return None
        ordered = sorted(self._ratios)
        return ordered[int(len(ordered) * _RELIABLE_QUANTILE)]

    def early_share(self) -> float:
        """Share of the last bubbles that ended before the deadline the current factor sets."""
        if not self._ratios:
            return 0.0
        return sum(1 for r in self._ratios if r < self.factor) / len(self._ratios)

    # -- deciding -------------------------------------------------------------

    def _decide(self) -> None:
        c = self.config
        seen = len(self._epoch)
        share = self.share()
        over = f"interference {share:.2%} {{}} target {c.target:.2%} over last {seen} bubbles"
        if self.factor > 1.0 and self.early_share() > _RELIABLE_QUANTILE:
            early = self.early_share()
            self._change(margin_ns=self.margin_ns, factor=max(1.0, self.reliable_ratio() or 1.0))
            self.reason = f"prediction pulled back: {early:.0%} of bubbles ended before their deadline"
            return
        if share > c.target and seen >= c.widen_after:
            costly = self._costly_class()
            if costly is not None:
                k, taken, used, rest = costly
                self._leave_out_below(class_floor_ns(k + 1))
                self.widenings += 1
                cost = f"{taken / used:.3f} ms of interference per ms used" if used else "interference and gave no work"
                self.reason = (
                    f"short bubbles left out: {over.format('>')}; bubbles expected at {_class_name(k)} cost"
                    f" {cost}, the longer ones {rest:.3f}"
                )
                return
            margin = min(self._cap, max(round(c.widen_by * self.margin_ns), _MIN_WIDENED_NS))
            # The deadline moves earlier only where bubbles often end before it (or the margin can
            # widen no more): a factor costs a share of every bubble, the margin a fixed slice.
            early = self.early_share()
            factor = self.factor
            if early > _RELIABLE_QUANTILE or margin == self.margin_ns:
                factor = max(c.factor_min, c.widen_factor_by * self.factor)
            shortened = f"; {early:.0%} of bubbles ended before their deadline" if factor < self.factor else ""
            self._change(margin_ns=margin, factor=factor)
            self.widenings += 1
            self.reason = f"widened: {over.format('>')}{shortened}{self._bounds()}"
            return
        used = self._epoch.granted
        if share <= c.target / 2 and used >= c.narrow_after:
            reliable = self.reliable_ratio() or 1.0
            factor = self.factor
            if factor < 1.0:
                factor = min(1.0, factor + c.factor_step)
            elif reliable > factor:
                factor = min(c.factor_max, factor + c.factor_step, reliable)
            margin = max(self._floor, round(c.narrow_by * self.margin_ns))
            if margin == self.margin_ns and factor == self.factor and self.min_bubble_ns > 0:
                k = length_class(self.min_bubble_ns) - 1
                self._leave_out_below(class_floor_ns(k))
                self.narrowings += 1
                self.reason = f"bubbles expected at {_class_name(k)} let back in: {over.format('<')}{self._bounds()}"
                return
            if margin == self.margin_ns and factor == self.factor:
                self.reason = f"narrowest: {over.format('<')}{self._bounds()}"
                self._epoch.clear()  # nothing to change: look at the next stretch on its own
                return
            self._change(margin_ns=margin, factor=factor)
            self.narrowings += 1
            lasts = f"; bubbles last >= {reliable:.2f}x their prediction in 90 %" if reliable > 1.0 else ""
            self.reason = f"narrowed: {over.format('<')}{lasts}{self._bounds()}"
            return
        if seen < c.widen_after:
            if self.reason.startswith("learning"):  # until a first judgement; then that one stands
                self.reason = f"learning: {seen} of {c.widen_after} bubbles seen"
            return
        if share > c.target / 2:
            self.reason = f"holding: {over.format('near')}"
        else:
            waits = f"{used} of {c.narrow_after} bubbles with side work before narrowing"
            self.reason = f"holding: {over.format('<')}; {waits}"

    def _costly_class(self) -> tuple[int, int, int, float] | None:
        """The shortest class still granted, if it is costly: its class, interference and use, and the
        interference per used ns of the longer classes."""
        by: dict[int, list[int]] = {}
        for g in self._settled:
            if class_floor_ns(g.length_class) >= self.min_bubble_ns:
                row = by.setdefault(g.length_class, [0, 0, 0])
                row[0] += 1
                row[1] += g.used_ns
                row[2] += g.interference_ns
        if len(by) < 2:
            return None
        k = min(by)
        n, used, taken = by[k]
        rest = [row for cls, row in by.items() if cls != k]
        rest_n, rest_used, rest_taken = (sum(row[i] for row in rest) for i in range(3))
        if n < _CLASS_GRANTS or rest_n < _CLASS_GRANTS or rest_used <= 0 or taken <= 0:
            return None
        rest_ratio = rest_taken / rest_used
        if taken <= COSTLY_RATIO * rest_ratio * used or used > SMALL_SHARE * (used + rest_used):
            return None
        return k, taken, used, rest_ratio

    def _change(self, *, margin_ns: int, factor: float) -> None:
        self.margin_ns, self.factor = margin_ns, factor
        self._epoch.clear()

    def _leave_out_below(self, min_bubble_ns: int) -> None:
        """Grant only bubbles expected to last ``min_bubble_ns`` or more; judge the new set afresh."""
        self.min_bubble_ns = min_bubble_ns
        self._settled.clear()
        self._epoch.clear()

    def _bounds(self) -> str:
        c = self.config
        parts = []
        if self.margin_ns >= self._cap:
            parts.append("margin at its cap")
        elif self.margin_ns <= self._floor:
            parts.append("margin at its floor")
        if self.factor <= c.factor_min:
            parts.append("factor at its floor")
        elif self.factor >= c.factor_max:
            parts.append("factor at its cap")
        return f" ({', '.join(parts)})" if parts else ""


def _class_name(k: int) -> str:
    return "under 1 ms" if k < 0 else f"{1 << k}-{1 << (k + 1)} ms"


def describe(d: p.DeviceStatus) -> str:
    """What a device's guard has set, as its status reports it (without the reason)."""
    left_out = f", bubbles under {d.min_bubble_ns / 1e6:g} ms left out ({d.left_out})" if d.min_bubble_ns > 0 else ""
    return f"margin {format_ns(d.margin_ns)}, bubbles predicted x{d.prediction_factor:.2f}{left_out}"
