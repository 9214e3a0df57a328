"""The interference guard of one device, driven bubble by bubble on virtual time.

Each test feeds the guard what a device's scheduler would: the interference it
settles, and every bubble's end with its measured and predicted lengths, on a
:class:`~freeride.clock.ManualClock` that stands for the training's time line.
"""

from __future__ import annotations

from typing import Any

import pytest

from freeride.clock import ManualClock
from freeride.serve.guard import GuardConfig, InterferenceGuard

MS = 1_000_000
US = 1_000
PERIOD = 20 * MS
"""A bubble ends every 20 ms of training."""
BUBBLE = 5 * MS


class Feed:
    """Plays a run of bubbles into a guard."""

    def __init__(self, guard: InterferenceGuard) -> None:
        self.guard = guard
        self.clock = ManualClock()

    def bubbles(
        self, n: int, *, interference_ns: int = 0, duration_ns: int = BUBBLE, predicted_ns: int = BUBBLE
    ) -> None:
        """``n`` bubbles, each with ``interference_ns`` of side work past its end."""
        for _ in range(n):
            self.clock.advance(PERIOD)
            self.guard.add_interference(interference_ns)
            self.guard.bubble_ended(self.clock.now_ns(), duration_ns, predicted_ns)


def guard(*, margin_cap_ns: int = 20 * MS, min_bubble_ns: int = 0) -> InterferenceGuard:
    """A guard with round steps (x2 out, x0.9 in, 20 bubbles to widen, 50 to narrow) that the figures below follow.

    It grants every bubble from the start (the default leaves the shortest out: see
    :func:`test_the_shortest_bubbles_are_left_out_from_the_start_and_come_back_when_quiet`).
    """
    return InterferenceGuard(
        GuardConfig(
            margin_ns=300 * US,
            margin_cap_ns=margin_cap_ns,
            min_bubble_ns=min_bubble_ns,
            widen_after=20,
            narrow_after=50,
            widen_by=2.0,
            widen_factor_by=0.9,
            narrow_by=0.9,
            factor_min=0.5,
            factor_step=0.02,
        )
    )


def test_it_learns_before_it_changes_anything() -> None:
    g = guard()
    feed = Feed(g)
    feed.bubbles(g.config.widen_after - 1, interference_ns=PERIOD // 10)  # 10 %: far above target
    assert (g.margin_ns, g.factor) == (300 * US, 1.0)
    assert g.reason == f"learning: {g.config.widen_after - 1} of {g.config.widen_after} bubbles seen"


def test_it_widens_fast_when_interference_is_above_target() -> None:
    g = guard()
    feed = Feed(g)
    feed.bubbles(g.config.widen_after, interference_ns=PERIOD // 100)  # 1 % of training time
    assert g.margin_ns == 600 * US
    assert g.factor == 1.0  # the bubbles lasted what was predicted: the margin alone widens
    # 20 x 0.2 ms over 19 periods and the first bubble itself (where the guard's time line starts)
    assert g.reason == "widened: interference 1.04% > target 0.50% over last 20 bubbles"
    # it waits for the new setting to show before it widens again
    feed.bubbles(g.config.widen_after - 1, interference_ns=PERIOD // 100)
    assert g.margin_ns == 600 * US
    feed.bubbles(1, interference_ns=PERIOD // 100)
    assert (g.margin_ns, g.widenings) == (1_200 * US, 2)


def test_where_bubbles_end_before_their_deadline_widening_also_shortens_the_prediction() -> None:
    g = guard()
    feed = Feed(g)
    feed.bubbles(g.config.widen_after, interference_ns=PERIOD // 100, duration_ns=BUBBLE * 8 // 10)
    assert (g.margin_ns, g.factor) == (600 * US, pytest.approx(0.9))
    assert g.reason.endswith("; 100% of bubbles ended before their deadline")
    # at 0.9 they still end early (0.8): the next widening shortens it again
    feed.bubbles(g.config.widen_after, interference_ns=PERIOD // 100, duration_ns=BUBBLE * 8 // 10)
    assert (g.margin_ns, g.factor) == (1_200 * US, pytest.approx(0.81))


def test_it_narrows_slowly_while_well_below_target_and_not_below_half() -> None:
    g = guard()
    feed = Feed(g)
    feed.bubbles(g.config.narrow_after - 1)
    assert g.margin_ns == 300 * US  # not yet: too few bubbles to trust
    feed.bubbles(1)
    assert g.margin_ns == 270 * US
    assert g.reason == "narrowed: interference 0.00% < target 0.50% over last 50 bubbles"
    # between half the target and the target it holds
    feed.bubbles(g.config.narrow_after, interference_ns=PERIOD * 4 // 1000)  # 0.4 %
    assert g.margin_ns == 270 * US
    assert g.reason == "holding: interference 0.40% near target 0.50% over last 50 bubbles"


def test_the_margin_stays_between_its_floor_and_its_cap() -> None:
    g = guard(margin_cap_ns=2 * MS)
    feed = Feed(g)
    feed.bubbles(20 * g.config.widen_after, interference_ns=PERIOD // 10)
    assert g.margin_ns == 2 * MS
    assert g.factor == g.config.factor_min
    assert g.reason.endswith("(margin at its cap, factor at its floor)")
    feed.bubbles(200 * g.config.narrow_after)
    assert g.margin_ns == g.config.margin_floor_ns
    assert g.factor == 1.0  # bubbles last what they were predicted to: no later deadline
    assert g.reason.startswith("narrowest: interference 0.00% < target 0.50%")
    assert g.reason.endswith("(margin at its floor)")


def test_a_margin_configured_below_the_floor_is_never_raised_by_narrowing() -> None:
    g = InterferenceGuard(GuardConfig(margin_ns=0))
    Feed(g).bubbles(10 * g.config.narrow_after)
    assert g.margin_ns == 0


def test_it_settles_where_the_margin_keeps_interference_under_target() -> None:
    """A device whose side steps spill 2 ms past each bubble's end, less what the margin keeps free."""
    g = guard()
    feed = Feed(g)
    changes: list[int] = []
    for _ in range(200):
        spill = max(0, 2 * MS - g.margin_ns)
        before = g.margin_ns
        feed.bubbles(g.config.widen_after, interference_ns=spill)
        changes.append(int(g.margin_ns != before))
    spill = max(0, 2 * MS - g.margin_ns)
    assert spill / PERIOD <= g.config.target
    # settled: it changes seldom (a narrowing now and then, which the next widening takes back)
    assert sum(changes[-100:]) <= 40
    assert g.widenings >= 3


def test_bubbles_that_reliably_last_longer_than_predicted_move_the_deadline_later() -> None:
    g = guard()
    feed = Feed(g)
    feed.bubbles(4 * g.config.narrow_after, duration_ns=BUBBLE * 12 // 10)  # each lasts 1.2x its prediction
    assert 1.0 < g.factor <= 1.2
    assert g.expected_ns(BUBBLE) == round(BUBBLE * g.factor)
    assert "bubbles last >= 1.20x their prediction in 90 %" in g.reason
    feed.bubbles(20 * g.config.narrow_after, duration_ns=BUBBLE * 12 // 10)
    assert g.factor == pytest.approx(1.2)  # never past what they last


def test_a_later_deadline_is_pulled_back_once_bubbles_end_before_it() -> None:
    g = guard()
    feed = Feed(g)
    feed.bubbles(20 * g.config.narrow_after, duration_ns=BUBBLE * 12 // 10)
    assert g.factor == pytest.approx(1.2)
    feed.bubbles(g.config.window // 5, duration_ns=BUBBLE)  # the training got faster
    assert g.factor == 1.0
    assert g.reason.startswith("prediction pulled back:")
    assert g.reason.endswith("of bubbles ended before their deadline")


def test_bubbles_shorter_than_predicted_without_interference_keep_the_factor() -> None:
    """Ending early is harmless while the margin absorbs it: only interference lowers the factor."""
    g = guard()
    Feed(g).bubbles(4 * g.config.narrow_after, duration_ns=BUBBLE // 2)
    assert g.factor == 1.0


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"target": 0.0}, "target"),
        ({"target": 1.0}, "target"),
        ({"margin_ns": -1}, "margin_ns"),
        ({"margin_floor_ns": 3 * MS, "margin_cap_ns": 2 * MS}, "margin_floor_ns"),
        ({"factor_min": 1.1}, "factor_min"),
        ({"factor_step": 0.0}, "factor_step"),
        ({"widen_after": 0}, "widen_after"),
    ],
)
def test_bad_config_names_its_field(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        GuardConfig(**kw)


def test_bubbles_nobody_was_granted_do_not_narrow_the_margin() -> None:
    """Without side work there is no evidence that a narrower margin would hold."""
    g = guard()
    feed = Feed(g)
    for _ in range(4 * g.config.narrow_after):
        feed.clock.advance(PERIOD)
        g.bubble_ended(feed.clock.now_ns(), BUBBLE, BUBBLE, granted=False)
    assert g.margin_ns == 300 * US


def test_by_default_a_noisy_stretch_does_not_leave_the_margin_wide() -> None:
    """One stretch above target widens the margin; as many bubbles back under it bring it back.

    With x2 out and x0.9 in, a DeepSpeed job ended its run at a 6-10 ms margin (0.3 ms
    configured) with 0.2 % interference over the run, using a third of its bubble time.
    """
    g = InterferenceGuard(GuardConfig(margin_ns=300 * US))
    feed = Feed(g)
    feed.bubbles(g.config.widen_after, interference_ns=PERIOD // 100)  # 1 %: twice the target
    wide = g.margin_ns
    assert wide > 300 * US
    feed.bubbles(2 * g.config.widen_after)  # as long again, under target
    assert g.margin_ns <= 300 * US
    assert g.factor == 1.0


def mixed_bubbles(
    feed: Feed, n: int, *, short_ns: int, long_ns: int, short_taken_ns: int, long_taken_ns: int, short_used: bool = True
) -> None:
    """``n`` pairs of a short and a long bubble, each grant settled with what it used (half of it) and cost."""
    for _ in range(n):
        for length, taken in ((short_ns, short_taken_ns), (long_ns, long_taken_ns)):
            feed.clock.advance(PERIOD)
            feed.guard.settled(length, length // 2 if short_used or length == long_ns else 0, taken)
            feed.guard.add_interference(taken)
            feed.guard.bubble_ended(feed.clock.now_ns(), length, length)


def test_short_bubbles_that_cost_far_more_per_ms_used_are_left_out_instead_of_widening() -> None:
    g = guard()
    feed = Feed(g)
    # 3 ms bubbles: 1.5 ms used for 0.5 ms of interference (0.33 per ms); 40 ms ones: 20 ms for 0.1 ms (0.005)
    mixed_bubbles(feed, 10, short_ns=3 * MS, long_ns=40 * MS, short_taken_ns=500 * US, long_taken_ns=100 * US)
    assert g.min_bubble_ns == 4 * MS  # the 2-4 ms class is out
    assert g.margin_ns == 300 * US and g.factor == 1.0  # and nothing else moved
    assert g.reason.startswith("short bubbles left out")
    assert "2-4 ms" in g.reason
    assert not g.grants(3 * MS) and g.grants(4 * MS) and g.grants(40 * MS)


def test_short_bubbles_that_cost_about_what_long_ones_do_are_kept_and_the_margin_widens() -> None:
    g = guard()
    feed = Feed(g)
    # per ms used: 0.2 / 1.5 = 0.13 in short bubbles, 2 / 20 = 0.1 in long ones: not 3x
    mixed_bubbles(feed, 10, short_ns=3 * MS, long_ns=40 * MS, short_taken_ns=200 * US, long_taken_ns=2 * MS)
    assert g.min_bubble_ns == 0
    assert g.margin_ns == 600 * US
    assert g.reason.startswith("widened")


def test_a_class_is_judged_only_on_enough_grants() -> None:
    g = guard()
    feed = Feed(g)
    # the costly short class has only 5 grants: the guard widens as before
    mixed_bubbles(feed, 5, short_ns=3 * MS, long_ns=40 * MS, short_taken_ns=500 * US, long_taken_ns=100 * US)
    feed.bubbles(15, interference_ns=1 * MS, duration_ns=40 * MS, predicted_ns=40 * MS)
    assert g.min_bubble_ns == 0
    assert g.margin_ns == 600 * US


def test_short_bubbles_come_back_once_nothing_else_is_left_to_narrow() -> None:
    g = guard()
    feed = Feed(g)
    mixed_bubbles(feed, 10, short_ns=3 * MS, long_ns=40 * MS, short_taken_ns=500 * US, long_taken_ns=100 * US)
    assert g.min_bubble_ns == 4 * MS
    margins = []
    while g.min_bubble_ns == 4 * MS:  # no interference: the margin narrows first, to its floor
        margins.append(g.margin_ns)
        feed.bubbles(50, duration_ns=40 * MS, predicted_ns=40 * MS)
    assert margins[0] == 300 * US and margins[-1] == g.margin_ns == 100 * US and g.factor == 1.0
    assert g.min_bubble_ns == 2 * MS  # then the class left out last comes back, one class at a time
    assert g.reason.startswith("bubbles expected at 2-4 ms let back in")


def test_the_shortest_bubbles_are_left_out_from_the_start_and_come_back_when_quiet() -> None:
    default = InterferenceGuard()
    assert default.min_bubble_ns == 4 * MS and not default.grants(3 * MS) and default.grants(4 * MS)
    g = guard(min_bubble_ns=4 * MS)
    feed = Feed(g)
    assert g.reason.startswith("learning") and not g.grants(3 * MS)
    while g.min_bubble_ns == 4 * MS:  # no interference: the margin narrows to its floor first
        feed.bubbles(50, duration_ns=40 * MS, predicted_ns=40 * MS)
    assert g.margin_ns == 100 * US and g.min_bubble_ns == 2 * MS and g.grants(3 * MS)
    assert g.reason.startswith("bubbles expected at 2-4 ms let back in")


def test_short_bubbles_that_gave_no_work_at_all_are_left_out_and_said_so() -> None:
    g = guard()
    feed = Feed(g)
    # steps too long for 3 ms bubbles: only probes ran there, each past the bubble's end
    mixed_bubbles(
        feed, 10, short_ns=3 * MS, long_ns=40 * MS, short_taken_ns=500 * US, long_taken_ns=100 * US, short_used=False
    )
    assert g.min_bubble_ns == 4 * MS
    assert "2-4 ms cost interference and gave no work" in g.reason


def test_the_share_over_a_full_window_is_what_its_bubbles_sum_to() -> None:
    # The guard keeps its window's sums as bubbles come and go: what it reports is
    # the sum over the bubbles still in the window, each from the end before it.
    window = 8
    guard = InterferenceGuard(GuardConfig(window=window, widen_after=window, narrow_after=window, target=0.9))
    spans: list[tuple[int, int]] = []  # (span, interference) per bubble
    end = 0
    for k in range(3 * window + 3):
        gap, taken = 10 * MS + k * MS, (k % 3) * 100_000
        end += gap
        guard.add_interference(taken)
        guard.bubble_ended(end, 2 * MS, 2 * MS, granted=False)  # nothing granted: the margin never narrows
        spans.append((gap if k else 2 * MS, taken))
        last = spans[-window:]
        assert guard.share() == pytest.approx(sum(t for _, t in last) / sum(s for s, _ in last))
