"""Jobs without pipeline bubbles are named as such (per device), and side tasks wait with that reason."""

from __future__ import annotations

import os

from freeride import protocol as p
from freeride.clock import ManualClock
from freeride.serve.capacity import Settling, bubble_share
from freeride.serve.nobubbles import NO_BUBBLE_STEPS, job_without_bubbles, no_bubbles, waiting_on_device
from freeride.serve.ranks import DeviceInfo, Ranks

S = 1_000_000_000


class _Listener:
    def device_added(self, info: DeviceInfo) -> None: ...
    def device_lost(self, name: str) -> None: ...
    def read_queued_events(self) -> None: ...
    def rank_ready(self, info: DeviceInfo) -> None: ...
    def device_in_use(self, name: str) -> bool:
        return False

    def device_removed(self, name: str) -> None: ...
    def event_refused(self, reason: str) -> None: ...


def _ranks() -> Ranks:
    return Ranks(listener=_Listener(), backend_timeout_s=60.0, clock=ManualClock())


def _hello(rank: int, num_stages: int) -> p.Hello:
    return p.Hello(
        protocol_version=p.PROTOCOL_VERSION, rank=rank, stage=rank, num_stages=num_stages, device=f"cpu:{rank}",
        framework="deepspeed", pid=os.getpid(),
    )  # fmt: skip


async def test_a_pipeline_of_one_stage_has_no_bubbles_from_its_hello() -> None:
    ranks = _ranks()
    ranks.hello(_hello(0, num_stages=1))
    info = ranks.devices["cpu:0"]
    assert no_bubbles(info) == "no pipeline bubbles: pipeline size 1"
    assert "the training job has no pipeline bubbles: pipeline size 1" in job_without_bubbles(ranks.devices.values())
    assert waiting_on_device("cpu:0", info).startswith("cpu:0 has no pipeline bubbles: pipeline size 1;")
    ranks.goodbye(0, dropped=0)
    assert no_bubbles(info) == "" and job_without_bubbles(ranks.devices.values()) == ""  # a gone job says nothing
    ranks.close()


async def test_steps_without_a_bubble_count_only_past_the_warm_up() -> None:
    ranks = _ranks()
    ranks.hello(_hello(0, num_stages=2))
    ranks.hello(_hello(1, num_stages=2))
    info = ranks.devices["cpu:0"]
    for _ in range(NO_BUBBLE_STEPS):
        ranks.step_finished(0, duration_ns=S, bubble_ns=0)
    assert no_bubbles(info) == ""  # the warm-up step plus too few others
    ranks.step_finished(0, duration_ns=S, bubble_ns=0)
    assert no_bubbles(info) == f"no pipeline bubbles: {NO_BUBBLE_STEPS + 1} training steps without a bubble"
    assert job_without_bubbles(ranks.devices.values()) == ""  # stage 1 may still have some
    ranks.step_finished(0, duration_ns=S, bubble_ns=S // 10)
    assert no_bubbles(info) == ""
    ranks.close()


async def test_unpinned_tasks_wait_with_the_reason_instead_of_being_placed_where_nothing_runs() -> None:
    ranks = _ranks()
    ranks.hello(_hello(0, num_stages=1))
    clock = ManualClock()
    settling = Settling(0.0, clock=clock)  # no settle time: only the missing bubbles keep the task waiting
    why = settling.waiting(ranks.devices, lambda info: bubble_share(info, None))
    assert why == "the training job has no pipeline bubbles: pipeline size 1; side tasks wait for a job with bubbles"
    ranks.close()
