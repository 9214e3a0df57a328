"""The interference target from the command line to the config, and the guard's state out to status and metrics."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from freeride import protocol as p
from freeride.cli.demo import DemoOptions, DemoReport
from freeride.cli.main import build_parser
from freeride.cli.serve import serve_config
from freeride.cli.status import WARM_UP, format_status
from freeride.observe.metrics import StatusCollector
from freeride.serve.config import ServeConfig
from freeride.transport import Endpoints
from freeride.units import parse_share


@pytest.mark.parametrize(("text", "share"), [("0.5%", 0.005), ("2 %", 0.02), ("0.005", 0.005), ("1e-3", 0.001)])
def test_parse_share(text: str, share: float) -> None:
    assert parse_share(text) == pytest.approx(share)


@pytest.mark.parametrize("text", ["", "half", "0.5%%", "-1%"])
def test_parse_share_refuses_what_is_not_a_share(text: str) -> None:
    with pytest.raises(ValueError, match="not a share"):
        parse_share(text)


def test_the_interference_target_flag_reaches_the_config(tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "--runtime-dir", str(tmp_path), "--interference-target", "1%"])
    assert serve_config(args).interference_target == pytest.approx(0.01)
    default = build_parser().parse_args(["serve", "--runtime-dir", str(tmp_path)])
    assert serve_config(default).interference_target == pytest.approx(0.005)


@pytest.mark.parametrize("target", [0.0, 1.0, 50.0])
def test_a_target_that_is_not_a_share_names_the_field(target: float) -> None:
    with pytest.raises(ValueError, match=r"interference_target .*0\.5 %"):
        ServeConfig(endpoints=Endpoints.ipc(Path("/tmp/fr")), state_dir=Path("/tmp/fr/s"), interference_target=target)


def _status(**guard: object) -> p.StatusReply:
    device = p.DeviceStatus(
        device="cpu:0",
        stage=0,
        rank=0,
        framework="sim",
        alive=True,
        bubbles=400,
        bubble_ns=10**9,
        used_ns=8 * 10**8,
        overruns=3,
        overrun_ns=10**6,
        spare_memory=-1,
        steps=10,
        **guard,  # type: ignore[arg-type]
    )
    return p.StatusReply(
        devices=[device],
        tasks=[],
        latency=p.LatencySummary(count=0, p50_ns=0, p99_ns=0, max_ns=0),
        events=0,
        rejected_frames=0,
        uptime_ns=0,
    )


def test_status_shows_each_devices_margin_factor_and_reason() -> None:
    reason = "widened: interference 0.90% > target 0.50% over last 20 bubbles"
    text = format_status(_status(margin_ns=600_000, prediction_factor=0.9, guard_reason=reason), verbose=True)
    assert f"cpu:0      guard: margin 0.60 ms, bubbles predicted x0.90 ({reason})" in text.splitlines()


def test_status_shows_the_bubbles_a_guard_leaves_out() -> None:
    reason = "short bubbles left out: interference 0.67% > target 0.50% over last 50 bubbles"
    status = _status(margin_ns=500_000, prediction_factor=1.0, guard_reason=reason, min_bubble_ns=4_000_000, left_out=9)
    line = f"cpu:0      guard: margin 0.50 ms, bubbles predicted x1.00, bubbles under 4 ms left out (9) ({reason})"
    assert line in format_status(status, verbose=True).splitlines()
    assert "guard:" not in format_status(status)  # internals only with -v
    families = {f.name: f for f in StatusCollector(lambda: status, dict).collect()}
    [shortest] = families["freeride_min_bubble_seconds"].samples
    assert shortest.value == pytest.approx(0.004)
    assert [s.value for s in families["freeride_bubbles_left_out"].samples if s.name.endswith("_total")] == [9]


def test_status_shows_the_typical_bubble_that_tasks_size_their_steps_for() -> None:
    lines = format_status(_status(typical_bubble_ns=30_000_000), verbose=True).splitlines()
    assert any(line.startswith("cpu:0      typical bubble: 30.0 ms (half the bubble time") for line in lines)
    assert "typical bubble" not in format_status(_status(), verbose=True)  # not known yet: nothing shown


def test_status_of_a_manager_without_a_guard_shows_no_guard_line() -> None:
    assert "guard:" not in format_status(_status(), verbose=True)


def test_metrics_export_margin_and_factor_per_device() -> None:
    status = _status(margin_ns=600_000, prediction_factor=0.9, guard_reason="x")
    families = {f.name: f for f in StatusCollector(lambda: status, dict, hostname="node7").collect()}
    [margin] = families["freeride_margin_seconds"].samples
    [factor] = families["freeride_prediction_factor"].samples
    where = {"device": "cpu:0", "stage": "0", "gpu_uuid": "", "hostname": "node7"}
    assert margin.labels == where and margin.value == pytest.approx(0.0006)
    assert factor.value == pytest.approx(0.9)


def test_the_demo_report_shows_what_each_guard_settled_on() -> None:
    reason = "narrowed: interference 0.00% < target 0.50% over last 50 bubbles"
    report = DemoReport(
        options=DemoOptions(), status=_status(margin_ns=270_000, prediction_factor=1.0, guard_reason=reason)
    )
    assert f"guard cpu:0: margin 0.27 ms, bubbles predicted x1.00 ({reason})" in report.text().splitlines()


def test_status_says_why_a_rank_in_its_first_step_has_announced_no_bubble() -> None:
    """The first step is warm-up (the adapters measure its waits and announce none): status says so, where a user
    would otherwise see a live rank and no bubble, and not once a bubble came or a step beyond the first."""

    def shown(**fields: object) -> bool:
        status = _status()
        device = msgspec.structs.replace(status.devices[0], **fields)
        return f"cpu:0      {WARM_UP}" in format_status(msgspec.structs.replace(status, devices=[device])).splitlines()

    assert shown(bubbles=0, bubble_ns=0, used_ns=0, steps=0)
    assert shown(bubbles=0, bubble_ns=0, used_ns=0, steps=1)
    assert not shown(bubbles=0, bubble_ns=0, used_ns=0, steps=2)
    assert not shown(steps=0)  # bubbles came
    assert not shown(bubbles=0, bubble_ns=0, used_ns=0, steps=0, alive=False)
    assert not shown(bubbles=0, bubble_ns=0, used_ns=0, steps=0, no_bubbles="no pipeline bubbles: pipeline size 1")
