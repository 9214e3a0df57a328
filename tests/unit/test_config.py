"""Configuration is validated once, with errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from freeride.backends.session import BackendConfig
from freeride.backends.sim import SimConfig
from freeride.serve.config import ServeConfig
from freeride.transport import Endpoints
from freeride.units import format_bytes, format_ns, parse_bytes, parse_duration_ns


def test_ipc_endpoints_live_in_the_runtime_dir() -> None:
    ep = Endpoints.ipc(Path("/tmp/fr"))
    assert (ep.events, ep.control, ep.workers) == (
        "ipc:///tmp/fr/events",
        "ipc:///tmp/fr/control",
        "ipc:///tmp/fr/workers",
    )


def test_tcp_endpoints_keep_workers_local() -> None:
    ep = Endpoints.tcp("10.0.0.1", 5555, Path("/tmp/fr"))
    assert ep.events == "tcp://10.0.0.1:5555" and ep.control == "tcp://10.0.0.1:5556"
    assert ep.workers.startswith("ipc://")


def test_long_ipc_paths_are_refused_with_advice() -> None:
    with pytest.raises(ValueError, match=r"endpoints\.events.*--runtime-dir"):
        Endpoints.ipc(Path("/tmp/" + "x" * 120))


def test_bad_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match=r"endpoints\.control"):
        Endpoints(events="ipc:///a", control="http://x", workers="ipc:///b")


@pytest.mark.parametrize(
    ("field", "value"),
    [("margin_ns", -1), ("checkpoint_every_s", 0), ("backend_timeout_s", -2.0), ("stop_timeout_s", 0)],
)
def test_serve_config_names_the_bad_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        ServeConfig(endpoints=Endpoints.ipc(Path("/tmp/fr")), state_dir=Path("/tmp/fr/s"), **{field: value})  # type: ignore[arg-type]


def test_serve_config_checks_the_profile_exists(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="profile"):
        ServeConfig(endpoints=Endpoints.ipc(tmp_path), state_dir=tmp_path, profile=tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"num_stages": 0}, "num_stages"), ({"stage": 2, "num_stages": 2}, "stage"), ({"rank": -1}, "rank")],
)
def test_backend_config_validation(kwargs: dict[str, int], field: str) -> None:
    base = {"endpoint": "ipc:///x", "rank": 0, "stage": 0, "num_stages": 2, "device": "cpu:0", "framework": "sim"}
    with pytest.raises(ValueError, match=field):
        BackendConfig(**{**base, **kwargs})  # type: ignore[arg-type]


def test_sim_config_validation() -> None:
    with pytest.raises(ValueError, match="steps"):
        SimConfig(endpoint="ipc:///x", steps=0)
    with pytest.raises(ValueError, match="forward_s"):
        SimConfig(endpoint="ipc:///x", forward_s=-1)
    with pytest.raises(ValueError):
        SimConfig(endpoint="ipc:///x", schedule="zigzag")


@pytest.mark.parametrize(("text", "value"), [("512M", 512 << 20), ("2G", 2 << 30), ("1.5GiB", 3 << 29), ("100", 100)])
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize(
    ("text", "value"), [("5ms", 5_000_000), ("0.3ms", 300_000), ("2", 2_000_000_000), ("7us", 7000)]
)
def test_parse_duration(text: str, value: int) -> None:
    assert parse_duration_ns(text) == value


@pytest.mark.parametrize("bad", ["", "fast", "5 parsecs", "-1s"])
def test_bad_units_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not a"):
        parse_duration_ns(bad)
    with pytest.raises(ValueError, match="not a"):
        parse_bytes(bad)


def test_formatting() -> None:
    assert format_bytes(3 << 30) == "3.0 GiB"
    assert format_bytes(-1) == "?"
    assert format_ns(2_500_000) == "2.50 ms"
