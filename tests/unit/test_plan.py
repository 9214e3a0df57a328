"""freeride plan: the bubble model at a job's size and at scale, the formula, the inputs, the errors."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from freeride.cli.main import main
from freeride.observe.report import Prices
from freeride.planning.measured import MEASURED, MeasuredUse, measured_for
from freeride.planning.model import JobShape, PlanOptions, TaskShare, make_plan, stage_shares
from freeride.profile import BubbleProfile, Profile, StageProfile, write_profile
from freeride.tasks.estimates import EstimatesKey, KindTimes, save_estimates
from freeride.tasks.targets import resolve

MS = 1_000_000
USE = MeasuredUse(task="t", use=0.5, interference=0.01, job="j", steps=1, source="s")


def _shape(**kw: object) -> JobShape:
    base: dict[str, object] = {"gpus": 4, "pp": 4, "microbatches": 8, "forward": (1.0,) * 4, "backward": (2.0,) * 4}
    base.update(kw)
    return JobShape(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 8), (8, 3)])
def test_one_f_one_b_share_is_the_textbook_one(p: int, m: int) -> None:
    # uniform stages: every stage idles (p-1)(F+B) of a (m+p-1)(F+B) step
    _, stages = stage_shares(_shape(gpus=p, pp=p, microbatches=m, forward=(1.0,) * p, backward=(2.0,) * p))
    for stage in stages:
        assert stage.bubble_share == pytest.approx((p - 1) / (m + p - 1))


def test_interleaving_shrinks_the_bubble() -> None:
    plain = make_plan(_shape(), (), PlanOptions(scale=()))
    inter = make_plan(
        _shape(schedule="interleaved", chunks=2, forward=(0.5,) * 4, backward=(1.0,) * 4), (), PlanOptions(scale=())
    )
    assert inter.job.bubble_share < plain.job.bubble_share
    assert plain.job.bubble_share == pytest.approx(3 / 11)


def test_time_outside_the_pipeline_counts_busy() -> None:
    # the schedule computes 11 x 3 s = 33 s; a measured 44 s step has 11 s of optimizer and all-reduce
    step, stages = stage_shares(_shape(step_time_s=44.0))
    assert step == pytest.approx(44.0)
    assert stages[0].bubble_share == pytest.approx(9.0 / 44.0)


def test_ratios_are_scaled_to_the_step_time() -> None:
    step, stages = stage_shares(_shape(forward=(1.0,) * 4, backward=(2.0,) * 4, absolute=False, step_time_s=3.3))
    assert step == pytest.approx(3.3)
    assert stages[0].bubble_share == pytest.approx(3 / 11)
    assert stages[0].longest_s > 0


def test_fixed_global_batch_grows_the_bubble_with_data_parallelism() -> None:
    shape = _shape(
        gpus=64,
        pp=8,
        tp=2,
        microbatches=16,
        forward=(1.0,) * 8,
        backward=(2.0,) * 8,
        global_batch=64,
        microbatch_size=1,
    )
    plan = make_plan(shape, (TaskShare(task="t", share=1.0, use=USE),), PlanOptions(scale=(64, 128, 256, 512, 1000)))
    rows = {r.gpus: r for r in plan.scale}
    assert [rows[n].microbatches for n in (64, 128, 256, 512)] == [16, 8, 4, 2]
    assert [rows[n].dp for n in (64, 128, 256, 512)] == [4, 8, 16, 32]
    shares = [rows[n].bubble_share for n in (64, 128, 256, 512)]
    assert shares == sorted(shares) and shares[0] == pytest.approx(7 / 23) and shares[-1] == pytest.approx(7 / 9)
    # harvested: GPUs x 24 h x bubble x use (every bubble long enough: no task step given)
    assert rows[128].harvested_gpu_h_day == pytest.approx(128 * 24 * (7 / 15) * 0.5)
    assert "multiple of pp x tp" in rows[1000].error
    # without a global batch, m is kept and so is the share
    kept = make_plan(_shape(), (), PlanOptions(scale=(1024, 2048)))
    assert [r.bubble_share for r in kept.scale] == pytest.approx([3 / 11, 3 / 11])


def test_saving_is_freerides_formula() -> None:
    prices = Prices(train_gpu_per_hour=4.0, side_gpu_per_hour=0.2)
    task = TaskShare(task="t", share=1.0, use=USE, step_s=0.01, cheap_rate=50.0)
    plan = make_plan(_shape(), (task,), PlanOptions(prices=prices, scale=()))
    # per day: side work = GPUs x day x bubble x use x (100 steps/s in bubbles / 50 alone) cheap-GPU seconds;
    # k = 4 x GPUs / 0.2; saving = work / k / day - interference
    expected = (3 / 11) * 0.5 * 2.0 * 0.2 / 4.0 - 0.01
    assert plan.job.saving == pytest.approx(expected)
    assert plan.job.interference == pytest.approx(0.01)


def test_bubbles_shorter_than_a_task_step_are_not_usable() -> None:
    # 1F1B p=2 m=2, F=1 B=2, a 9 s step: stage 0 idles 2 s (waiting for B0) and 1 s (for B1),
    # stage 1 1 s at the head and 2 s at the tail
    shape = _shape(gpus=2, pp=2, microbatches=2, forward=(1.0, 1.0), backward=(2.0, 2.0))
    _, stages = stage_shares(shape, (TaskShare(task="t", share=1.0, use=USE, step_s=1.5),))
    assert [s.bubble_share for s in stages] == pytest.approx([3 / 9, 3 / 9])
    assert [s.usable_share for s in stages] == pytest.approx([2 / 9, 2 / 9])
    _, stages = stage_shares(shape, (TaskShare(task="t", share=1.0, use=USE, step_s=2.5),))
    assert [s.usable_share for s in stages] == [0, 0]
    # a mix: each task fills its use of what its own steps fit in
    full = MeasuredUse(task="x", use=1.0, interference=0.0, job="", steps=1, source="")
    long_steps = TaskShare(task="a", share=0.5, use=full, step_s=1.5)
    short_steps = TaskShare(task="b", share=0.5, use=full)
    plan = make_plan(shape, (long_steps, short_steps), PlanOptions(scale=()))
    assert plan.job.harvested_gpu_h_day == pytest.approx(2 * 24 * (0.5 * 2 / 9 + 0.5 * 3 / 9))


def test_mix_shares_weigh_use_and_interference() -> None:
    a = TaskShare(
        task="a", share=0.25, use=MeasuredUse(task="a", use=0.8, interference=0.02, job="", steps=1, source="")
    )
    b = TaskShare(
        task="b", share=0.75, use=MeasuredUse(task="b", use=0.4, interference=0.0, job="", steps=1, source="")
    )
    plan = make_plan(_shape(), (a, b), PlanOptions(scale=()))
    assert plan.use == pytest.approx(0.5)
    assert plan.job.interference == pytest.approx(0.005)
    unknown = TaskShare(task="c", share=1.0, use=None)
    assert make_plan(_shape(), (unknown,), PlanOptions(scale=())).job.harvested_gpu_h_day == 0


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"gpus": 6}, "multiple of pp x tp"),
        ({"schedule": "interleaved", "chunks": 2, "microbatches": 6}, "multiple of pp"),
        ({"schedule": "interleaved", "chunks": 1}, "chunks must be >= 2"),
        ({"chunks": 2}, "chunks must be 1"),
        ({"forward": (1.0,) * 3}, "must list 4 stages"),
        ({"backward": (0.0,) * 4}, "positive"),
        ({"absolute": False}, "give the step time"),
        ({"global_batch": 64}, "both the global batch"),
        ({"global_batch": 64, "microbatch_size": 2}, "= 32 micro-batches, not 8"),
        ({"schedule": "zb"}, "schedule must be one of"),
    ],
)
def test_impossible_shapes_are_refused(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _shape(**kw)


def test_a_step_shorter_than_the_compute_is_refused() -> None:
    with pytest.raises(ValueError, match="shorter than the schedule's compute"):
        make_plan(_shape(step_time_s=10.0), (), PlanOptions(scale=()))


def test_measured_rows_cover_the_catalog_names() -> None:
    for row in MEASURED:
        resolve(row.task)  # a catalog name
        assert "docs/benchmarks.md" in row.source and "2026" in row.source
    assert measured_for("graph-sgd") is not None and measured_for("nope") is None


def test_cli_prints_the_plan_and_its_assumptions(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan",
        "--pp",
        "8",
        "--tp",
        "8",
        "--gpus",
        "1024",
        "--global-batch",
        "1536",
        "--micro-batch-size",
        "1",
        "--step-time",
        "20s",
        "--task",
        "resnet50-train=50%",
        "--task",
        "imaging",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "FreeRide plan: 1024 GPUs = pp 8 x tp 8 x dp 16, 1f1b, m=96" in out
    assert "16384" in out and "resnet50-train 50%, imaging 50%" in out
    assert "docs/benchmarks.md" in out and "global batch 1536 fixed" in out
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["microbatches"] for r in data["scale"]] == [96, 48, 24, 12, 6]
    assert data["scale"][-1]["bubble_share"] > data["scale"][0]["bubble_share"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--pp", "3", "--gpus", "8", "--micro-batches", "4", "--step-time", "1s"], "multiple of pp x tp"),
        (["--pp", "2", "--step-time", "1s"], "--micro-batches, or --global-batch"),
        (["--pp", "2", "--micro-batches", "4"], "give --step-time"),
        (["--pp", "2", "--micro-batches", "4", "--forward", "1ms"], "both --forward and --backward"),
        (["--micro-batches", "4"], "or --profile FILE"),
        (
            [
                "--pp",
                "2",
                "--micro-batches",
                "4",
                "--step-time",
                "1s",
                "--task",
                "imaging=70%",
                "--task",
                "pagerank=40%",
            ],
            "add up to",
        ),
        (
            ["--pp", "2", "--micro-batches", "4", "--step-time", "1s", "--task", "imaging", "--use", "pagerank=0.5"],
            "not in the mix",
        ),
    ],
)
def test_cli_errors_are_actionable(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", *extra]
    if "--task" not in argv:
        argv += ["--task", "imaging"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_needs_a_task(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--pp", "2", "--micro-batches", "4", "--step-time", "1s"]) == 2
    assert "--task NAME" in capsys.readouterr().err


def _stage(stage: int, share_ns: int) -> StageProfile:
    return StageProfile(
        stage=stage,
        rank=stage,
        device=f"cpu:{stage}",
        framework="deepspeed",
        num_stages=2,
        num_microbatches=4,
        steps=5,
        step_time_ns=200 * MS,
        bubble_ns=share_ns,
        forward_ns=10 * MS,
        backward_ns=20 * MS,
    )


def test_cli_reads_a_profile_and_estimates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "job.profile.json"
    write_profile(Profile(stages=[_stage(0, 40 * MS), _stage(1, 44 * MS)]), profile)
    key = EstimatesKey(target=resolve("graph-sgd"), options={}, device_kind="cpu test x1")
    estimates = tmp_path / "est.json"
    save_estimates(estimates, key, {"step": KindTimes(recent=[2 * MS, 3 * MS, 4 * MS])})
    argv = ["plan", "--profile", str(profile), "--task", "graph-sgd", "--estimates", str(estimates), "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["shape"]["pp"] == 2 and data["shape"]["gpus"] == 2 and data["shape"]["microbatches"] == 4
    # 1F1B p=2 m=4 with 10/20 ms is 150 ms of pipeline; the profile's 200 ms step has 50 ms outside it
    assert data["job"]["step_s"] == pytest.approx(0.2)
    assert [s["bubble_share"] for s in data["stages"]] == pytest.approx([30 / 200, 30 / 200])
    assert [s["measured_share"] for s in data["stages"]] == pytest.approx([0.2, 0.22])
    assert data["tasks"][0]["step_s"] == pytest.approx(0.003)
    assert main(["plan", "--profile", str(tmp_path / "missing.json"), "--task", "imaging"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_cli_takes_a_use_measured_elsewhere(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--pp", "2", "--micro-batches", "4", "--forward", "10ms", "--backward", "20ms", "--json"]
    assert main([*base, "--task", "graph-sgd", "--use", "graph-sgd=demo"]) == 0
    use = json.loads(capsys.readouterr().out)["tasks"][0]["use"]
    assert use["use"] == pytest.approx(0.847) and "the demo" in use["source"]
    assert main([*base, "--task", "my-task", "--use", "my-task=40%", "--interference", "my-task=1%"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["job"]["interference"] == pytest.approx(0.01)
    assert data["job"]["harvested_gpu_h_day"] == pytest.approx(2 * 24 * 0.2 * 0.4)
    assert main([*base, "--task", "imaging", "--interference", "imaging=2%"]) == 0
    assert json.loads(capsys.readouterr().out)["job"]["interference"] == pytest.approx(0.02)


def test_p2p_latency_comes_from_the_profile_or_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # stage 1 first waits 12 ms for stage 0's 10 ms forward: 2 ms per hand-over
    head = BubbleProfile(index=0, key="1F0", offset_ns=0, duration_ns=12 * MS, p5_ns=0, p95_ns=0, count=5)
    stage1 = msgspec.structs.replace(_stage(1, 44 * MS), bubbles=[head])
    profile = tmp_path / "job.profile.json"
    write_profile(Profile(stages=[_stage(0, 40 * MS), stage1]), profile)
    assert main(["plan", "--profile", str(profile), "--task", "imaging", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["shape"]["comm_s"] == pytest.approx(0.002)
    # 1F1B p=2 m=4 with 10/20 ms: 150 ms of compute; latency adds idle, the 200 ms step stays
    assert all(s["bubble_share"] > 30 / 200 for s in data["stages"])
    base = ["plan", "--pp", "2", "--micro-batches", "4", "--forward", "10ms", "--backward", "20ms", "--task", "imaging"]
    assert main([*base, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["job"]
    assert main([*base, "--p2p-latency", "2ms", "--json"]) == 0
    slow = json.loads(capsys.readouterr().out)["job"]
    assert slow["step_s"] > plain["step_s"] and slow["bubble_share"] > plain["bubble_share"]
