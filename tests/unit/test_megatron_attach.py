"""Attaching to megatron: what gets patched, idempotence, and never breaking the training script.

Stand-in modules replace megatron's schedules and p2p modules, so nothing in
the real megatron-core (shared by other tests in this process) is patched.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from freeride.backends import megatron
from freeride.backends.megatron import _compat
from freeride.backends.megatron.adapter import reset_adapter

FLAG = "__freeride_megatron__"


class FakeWork:
    def __init__(self) -> None:
        self.waited = 0

    def wait(self) -> bool:
        self.waited += 1
        return True


def _fake_p2p() -> ModuleType:
    module = ModuleType("fake_p2p")

    class P2PCommunicator:
        pass

    for method in _compat.RECEIVING_METHODS:
        setattr(P2PCommunicator, method, lambda self, *a, _m=method, **k: (_m, a, k))

    def _p2p_ops(**kwargs: Any) -> dict[str, FakeWork]:
        return {"recv_prev": FakeWork(), "send_next": FakeWork()}

    module.P2PCommunicator = P2PCommunicator  # type: ignore[attr-defined]
    module._p2p_ops = _p2p_ops  # type: ignore[attr-defined]
    return module


def _fake_schedules() -> ModuleType:
    module = ModuleType("fake_schedules")
    for name in (*_compat.SCHEDULE_FUNCTIONS, *_compat.STEP_FUNCTIONS):
        setattr(module, name, lambda *a, _n=name, **k: (_n, a, k))
    return module


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ModuleType, ModuleType]]:
    p2p, schedules = _fake_p2p(), _fake_schedules()
    monkeypatch.setattr(_compat, "p2p_module", lambda: p2p)
    monkeypatch.setattr(_compat, "p2p_class", lambda: p2p.P2PCommunicator)
    monkeypatch.setattr(_compat, "SCHEDULES_MODULE", "fake_schedules")
    monkeypatch.setitem(sys.modules, "fake_schedules", schedules)
    reset_adapter()
    yield p2p, schedules
    reset_adapter()


def test_on_import_patches_schedules_compute_and_p2p(fakes: tuple[ModuleType, ModuleType]) -> None:
    p2p, schedules = fakes
    megatron.on_import(schedules)
    assert getattr(schedules, FLAG)
    # also p = 1's function: it has no bubbles, but its rank says hello with num_stages=1
    for name in (*_compat.SCHEDULE_FUNCTIONS, *_compat.STEP_FUNCTIONS):
        assert getattr(getattr(schedules, name), FLAG, False), name
    for method in _compat.RECEIVING_METHODS:
        assert getattr(getattr(p2p.P2PCommunicator, method), FLAG, False), method
    assert getattr(p2p._p2p_ops, FLAG, False)
    before = {name: getattr(schedules, name) for name in _compat.SCHEDULE_FUNCTIONS}
    megatron.on_import(schedules)  # idempotent
    assert before == {name: getattr(schedules, name) for name in _compat.SCHEDULE_FUNCTIONS}


def test_patched_functions_pass_calls_through_when_no_step_is_tracked(
    fakes: tuple[ModuleType, ModuleType],
) -> None:
    p2p, schedules = fakes
    megatron.on_import(schedules)
    assert schedules.forward_step(1, x=2) == ("forward_step", (1,), {"x": 2})
    comm = p2p.P2PCommunicator()
    assert comm.recv_forward([1], False) == ("recv_forward", ([1], False), {})
    reqs = p2p._p2p_ops(tensor_recv_prev=None)
    assert type(reqs["recv_prev"]) is FakeWork  # handles are only wrapped inside a tracked step


def test_a_schedule_call_freeride_cannot_read_runs_untouched(
    fakes: tuple[ModuleType, ModuleType], caplog: pytest.LogCaptureFixture
) -> None:
    _, schedules = fakes
    megatron.on_import(schedules)
    model = object()  # no megatron config: FreeRide cannot tell the schedule
    with caplog.at_level(logging.ERROR):
        out = schedules.forward_backward_pipelining_without_interleaving(model=model, num_microbatches=4)
        again = schedules.forward_backward_pipelining_without_interleaving(model=model, num_microbatches=4)
    assert out == again == (_compat.PLAIN_SCHEDULE, (), {"model": model, "num_microbatches": 4})
    assert caplog.text.count("training continues without FreeRide") == 1  # logged once, then off


def test_schedules_module_without_the_expected_names_is_left_alone(
    fakes: tuple[ModuleType, ModuleType], caplog: pytest.LogCaptureFixture
) -> None:
    _, schedules = fakes
    del schedules.backward_step
    with caplog.at_level(logging.WARNING):
        megatron.on_import(schedules)
    assert "FreeRide stays off" in caplog.text
    assert not getattr(schedules, FLAG, False)
    assert not getattr(schedules.forward_step, FLAG, False)


def test_on_import_never_raises(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(module: ModuleType) -> bool:
        raise RuntimeError("boom")

    import freeride.backends.megatron.patches as patches

    monkeypatch.setattr(patches, "patch_schedules", broken)
    with caplog.at_level(logging.ERROR):
        megatron.on_import(ModuleType("anything"))
    assert "boom" in caplog.text


def test_attach_wraps_a_held_schedule_function_once(fakes: tuple[ModuleType, ModuleType]) -> None:
    _, schedules = fakes

    def forward_backward_pipelining_with_interleaving(**kwargs: Any) -> str:
        return "ran"

    wrapped = megatron.attach(forward_backward_pipelining_with_interleaving)
    assert wrapped is not forward_backward_pipelining_with_interleaving
    assert wrapped.__name__ == "forward_backward_pipelining_with_interleaving"
    assert megatron.attach(wrapped) is wrapped
    assert getattr(schedules, FLAG)  # the module is patched as well
    assert megatron.attach() is None
