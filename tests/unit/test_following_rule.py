"""Whose bubbles the manager follows: a device's rank while its bubbles are learned, then only while side work is
there (decision D50). Socket-free: the core is fed events and requests directly and tells what it would follow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from freeride import protocol as p
from freeride.serve import core
from freeride.serve.config import ServeConfig
from freeride.serve.core import ManagerCore
from freeride.serve.ledger import MIN_BUBBLES_SEEN
from freeride.transport import Endpoints, bubbles_endpoint

MS = 1_000_000


class Following(ManagerCore):
    """The core, with what it asks the manager's SUB to follow recorded instead of connected."""

    def __init__(self, tmp_path: Path, **config: Any) -> None:
        settings = ServeConfig(endpoints=Endpoints.ipc(tmp_path), state_dir=tmp_path / "state", **config)
        super().__init__(settings, send=lambda ident, msg: True)
        self.followed: set[str] = set()
        self.changes = 0

    def follow_bubbles(self, endpoints: set[str]) -> None:
        self.followed = set(endpoints)
        self.changes += 1

    def rank(self, rank: int) -> str:
        """Rank ``rank`` says hello on cpu:<rank>, publishing its bubbles; its endpoint."""
        endpoint = bubbles_endpoint(self.config.endpoints.events, rank)
        self.on_event(
            p.Hello(
                protocol_version=p.PROTOCOL_VERSION, rank=rank, stage=rank, num_stages=2, device=f"cpu:{rank}",
                framework="sim", pid=1000 + rank, t_ns=0, bubbles_endpoint=endpoint, job="job",
            )
        )  # fmt: skip
        return endpoint

    def bubbles(self, rank: int, count: int, *, t0_ns: int = 0) -> None:
        for i in range(count):
            t = t0_ns + (i + 1) * 100 * MS
            kw = {"rank": rank, "stage": rank, "device": f"cpu:{rank}", "step": i, "index": 0}
            self.on_event(p.BubbleStarted(**kw, t_ns=t, expected_ns=20 * MS, spare_memory=-1))
            self.on_event(p.BubbleEnded(**kw, t_ns=t + 20 * MS, duration_ns=20 * MS))


def test_a_rank_is_followed_until_its_bubbles_are_learned_then_only_while_side_work_is_placed_there(
    tmp_path: Path,
) -> None:
    mgr = Following(tmp_path)
    ep0, ep1 = mgr.rank(0), mgr.rank(1)
    assert mgr.followed == {ep0, ep1}  # what the first bubbles last tells the first task its typical bubble
    mgr.bubbles(0, MIN_BUBBLES_SEEN - 1)
    assert mgr.followed == {ep0, ep1}
    mgr.bubbles(0, 1, t0_ns=10**10)
    assert mgr.followed == {ep1}, "learned, nothing placed there: left at once, not at the next second's check"
    assert mgr.status().devices[0].typical_bubble_ns == 20 * MS
    reply = mgr.on_control(p.Submit(spec=p.IterativeSpec(target="pagerank", device="cpu:0")))
    assert isinstance(reply, p.Submitted) and reply.device == "cpu:0"
    assert mgr.followed == {ep0, ep1}, "a task placed there: followed again as it is submitted"
    mgr.bubbles(0, 4, t0_ns=2 * 10**10)
    assert mgr.followed == {ep0, ep1}, "kept while the task is there"
    task = mgr.tasks[reply.task_id]
    task.cancel()
    mgr.schedulers["cpu:0"].on_task_changed(task)
    mgr.refresh_following()  # the manager's watchdog, each second
    assert mgr.followed == {ep1}
    mgr.on_event(p.Goodbye(rank=1, t_ns=1, dropped=0))
    assert mgr.followed == set(), "a rank that left is not followed (libzmq would retry its socket file)"


def test_a_rank_that_does_not_publish_is_never_followed_and_a_trace_follows_every_rank(tmp_path: Path) -> None:
    plain = Following(tmp_path / "a")
    plain.on_event(
        p.Hello(
            protocol_version=p.PROTOCOL_VERSION, rank=0, stage=0, num_stages=2, device="cpu:0", framework="sim",
            pid=1000, t_ns=0, job="job",
        )
    )  # fmt: skip
    assert plain.followed == set() and plain.changes == 0  # its events come over the events socket, as before
    traced = Following(tmp_path / "b", trace=tmp_path / "trace.json")
    ep0 = traced.rank(0)
    traced.bubbles(0, 2 * MIN_BUBBLES_SEEN)
    assert traced.followed == {ep0}, "a trace shows every bubble"


def test_a_device_followed_again_starts_the_guards_span_anew(tmp_path: Path) -> None:
    """The time no bubble was followed (no side work there) is not a stretch of training the guard judged."""
    mgr = Following(tmp_path)
    mgr.rank(0)
    mgr.bubbles(0, MIN_BUBBLES_SEEN)
    guard = mgr.schedulers["cpu:0"].guard
    mgr.on_control(p.Submit(spec=p.IterativeSpec(target="pagerank", device="cpu:0")))
    guard.add_interference(2 * MS)  # taken from the training after the next bubble to end
    mgr.bubbles(0, 1, t0_ns=3600 * 10**9)  # an hour later
    # 2 ms over this bubble's 20 ms: not over the hour in between, nor over the bubbles learned before
    # any side work was here (the guard judges side work, and saw none of them)
    assert guard.share() == 2 * MS / (20 * MS)


def test_a_goodbye_ahead_of_its_ranks_last_bubble_end_waits_for_it(tmp_path: Path) -> None:
    # The rank publishes its bubble ends on a socket of its own and says goodbye on the
    # events socket: the goodbye may come first. The job's last bubble is still counted.
    mgr = Following(tmp_path)
    ep0 = mgr.rank(0)
    mgr.bubbles(0, 3)
    last = {"rank": 0, "stage": 0, "device": "cpu:0", "step": 3, "index": 0}
    mgr.on_event(p.BubbleStarted(**last, t_ns=10**9, expected_ns=20 * MS, spare_memory=-1))
    mgr.on_event(p.Goodbye(rank=0, t_ns=10**9 + 30 * MS, dropped=0, last_bubble=(3, 0)))
    assert mgr.live_backends() == [0] and mgr.followed == {ep0}, "waits for the end on its way"
    mgr.finish_goodbyes()  # the watchdog's second, within the wait
    assert mgr.live_backends() == [0]
    mgr.on_event(p.BubbleEnded(**last, t_ns=10**9 + 20 * MS, duration_ns=20 * MS))
    assert mgr.live_backends() == [] and mgr.followed == set()
    (device,) = mgr.status().devices
    assert device.bubbles == 4 and device.bubble_ns == 4 * 20 * MS


def test_a_goodbye_is_taken_at_once_when_no_bubble_end_is_on_its_way(tmp_path: Path) -> None:
    mgr = Following(tmp_path)
    mgr.rank(0)
    mgr.bubbles(0, 3)  # the last is steps 2, index 0
    mgr.on_event(p.Goodbye(rank=0, t_ns=10**9, dropped=0, last_bubble=(2, 0)))
    assert mgr.live_backends() == [], "its last end came first"
    mgr.rank(1)
    mgr.bubbles(1, MIN_BUBBLES_SEEN)  # learned, no task there: not followed
    assert mgr.followed == set()
    mgr.on_event(p.Goodbye(rank=1, t_ns=10**10, dropped=0, last_bubble=(99, 0)))
    assert mgr.live_backends() == [], "a rank not followed: nothing to wait for"


def test_a_goodbye_whose_bubble_end_never_comes_is_taken_after_a_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = Following(tmp_path)
    mgr.rank(0)
    mgr.bubbles(0, 3)
    monkeypatch.setattr(core, "GOODBYE_WAIT_NS", 0)  # the wait, over at once
    mgr.on_event(p.Goodbye(rank=0, t_ns=10**9, dropped=0, last_bubble=(3, 0)))  # its end was dropped
    assert mgr.live_backends() == [0], "taken by the watchdog"
    mgr.finish_goodbyes()
    assert mgr.live_backends() == [] and mgr.followed == set()


def test_the_bubbles_of_a_held_back_step_count_from_its_report_where_the_rank_is_followed(tmp_path: Path) -> None:
    """A rank publishes no bubble of a held-back step (tests/unit/test_session_holdback.py): its step report
    says how many there were and how long, and the manager counts them as it would have counted them seen."""
    mgr = Following(tmp_path)
    ep0, ep1 = mgr.rank(0), mgr.rank(1)
    mgr.bubbles(0, MIN_BUBBLES_SEEN + 1)  # learned, nothing placed: rank 0 no longer followed
    assert mgr.followed == {ep1} and ep0
    before = {d.device: d for d in mgr.status().devices}

    def held_step(rank: int) -> None:
        mgr.on_event(
            p.StepFinished(rank=rank, stage=rank, step=50, t_ns=1, duration_ns=100 * MS, bubble_ns=30 * MS,
                           unpublished=2, unpublished_ns=30 * MS)
        )  # fmt: skip

    held_step(0)
    held_step(1)
    after = {d.device: d for d in mgr.status().devices}
    assert (after["cpu:1"].bubbles, after["cpu:1"].bubble_ns, after["cpu:1"].held_back_ns) == (
        before["cpu:1"].bubbles + 2,
        before["cpu:1"].bubble_ns + 30 * MS,
        before["cpu:1"].held_back_ns + 30 * MS,
    )
    assert after["cpu:0"].bubbles == before["cpu:0"].bubbles, "not followed: its bubbles are not counted at all"
    assert after["cpu:0"].held_back_ns == before["cpu:0"].held_back_ns
