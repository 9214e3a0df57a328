"""An update run in row slices of its parameters equals the optimizer's one full step, checkpoints included."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from freeride.partition import update as update_module
from freeride.partition.update import MIN_SLICE_ELEMENTS, ChunkedUpdate

Make = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Make] = {
    "sgd-dampened": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=1e-2),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-3),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-3, amsgrad=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-3, foreach=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, eps=1e-3),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, eps=1e-3),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "adadelta": lambda ps: torch.optim.Adadelta(ps),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=1.0),
}


@pytest.fixture(autouse=True)
def small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """These parameters are tiny: let a slice be one row (the floor has a test of its own)."""
    monkeypatch.setattr(update_module, "MIN_SLICE_ELEMENTS", 1)


def _params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(3)
    shapes = [(13, 5), (7,), (), (9, 2, 3)]
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _grads(step: int, params: list[nn.Parameter]) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _full(make: Make, steps: int) -> list[torch.Tensor]:
    params = _params()
    opt = make(params)
    for s in range(steps):
        _grads(s, params)
        opt.step()
    return [p.detach() for p in params]


def _sliced(update: ChunkedUpdate) -> None:
    # every parameter with 2+ rows in 3 slices: a cost of 3 targets each
    pieces_costs = update.split([3.0] * len(update.params), 1.0)
    assert len(pieces_costs) == len(update.pieces)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sliced_updates_equal_full_steps(name: str) -> None:
    params = _params()
    update = ChunkedUpdate(OPTIMIZERS[name](params))
    _sliced(update)
    assert sum(not piece.whole for piece in update.pieces) == 9  # three parameters in three slices
    for s in range(3):  # the first from no state, then from state
        _grads(s, params)
        for piece in update.pieces:
            update.step(piece.lo, piece.hi)
        assert update.pending() is None
    for got, want in zip(params, _full(OPTIMIZERS[name], 3), strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["sgd-dampened", "adam", "adamw-amsgrad", "nadam"])
@pytest.mark.parametrize("first_update", [True, False])
def test_a_checkpoint_between_slices_of_one_parameter_restores_exactly(name: str, first_update: bool) -> None:
    params = _params()
    opt = OPTIMIZERS[name](params)
    update = ChunkedUpdate(opt)
    _sliced(update)
    steps = 1 if first_update else 2
    for s in range(steps - 1):
        _grads(s, params)
        update.step(0, update.rows)
    _grads(steps - 1, params)
    cut = update.pieces[1].hi  # after two of the first parameter's three slices
    update.step(0, cut)
    saved = (
        [p.detach().clone() for p in params],
        [p.grad.clone() for p in params if p.grad is not None],
        torch.optim.Optimizer.state_dict(opt),
        update.pending(),
    )
    assert saved[3] is not None and saved[3]["fresh"] is first_update
    if first_update:  # the new state so far: the rows two slices wrote, and zeros (not stale memory) after them
        written = saved[3]["written"]
        assert 0 < written < _rows_of(params[0])
        for v in saved[3]["partial"].values():
            if isinstance(v, torch.Tensor) and v.dim() >= 1:
                assert not torch.any(v[written:]) and torch.any(v[:written])

    # a new process: new parameters and optimizer, loaded from what was saved
    values, grads, state, pending = saved
    fresh = _params()
    with torch.no_grad():
        for p, v, g in zip(fresh, values, grads, strict=True):
            p.copy_(v)
            p.grad = g
    opt2 = OPTIMIZERS[name](fresh)
    opt2.load_state_dict(state)
    restored = ChunkedUpdate(opt2)
    restored.split([5.0] * len(fresh), 1.0)  # sliced otherwise than before: positions are rows all the same
    restored.load_pending(pending)
    restored.step(cut, restored.rows)
    for got, want in zip(fresh, _full(OPTIMIZERS[name], steps), strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=1e-6, atol=1e-7)


def _rows_of(p: torch.Tensor) -> int:
    return int(p.shape[0]) if p.dim() else 1


def test_a_large_parameters_new_state_is_not_written_whole_by_its_first_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its first slice allocates the state, and writes only its own rows (VGG-19: a 412 MB momentum buffer)."""
    allocated: list[str] = []
    real_zeros = torch.zeros

    def zeros(*args: object, **kwargs: object) -> torch.Tensor:
        allocated.append("zeros")
        return real_zeros(*args, **kwargs)  # type: ignore[call-overload,no-any-return]

    params = _params()
    update = ChunkedUpdate(OPTIMIZERS["sgd-dampened"](params))
    _sliced(update)
    _grads(0, params)
    monkeypatch.setattr(torch, "zeros", zeros)
    update.step(0, update.pieces[0].hi)
    assert allocated == []


def test_slices_only_for_element_by_element_optimizers() -> None:
    params = _params()
    adafactor = ChunkedUpdate(torch.optim.Adafactor(params))
    assert not adafactor.sliceable
    adafactor.split([3.0] * len(params), 1.0)
    assert all(piece.whole for piece in adafactor.pieces) and len(adafactor.pieces) == len(params)

    class MySGD(torch.optim.SGD):  # a subclass may update otherwise: not sliced
        pass

    assert not ChunkedUpdate(MySGD(_params(), lr=0.1)).sliceable


def test_slices_follow_the_cost_and_never_exceed_the_rows() -> None:
    params = _params()
    update = ChunkedUpdate(torch.optim.SGD(params, lr=0.1))
    costs = update.split([2.5, 100.0, 9.0, 0.5], 1.0)
    per_param = [sum(1 for piece in update.pieces if piece.param == i) for i in range(len(params))]
    assert per_param == [3, 7, 1, 1]  # ceil(2.5); 7 rows at most; a 0-d parameter; under the target
    assert sum(costs) == pytest.approx(2.5 + 100.0 + 9.0 + 0.5)
    assert [piece.lo for piece in update.pieces][:4] == [0, 4, 8, 13]  # rows counted over all parameters
    assert update.pieces[-1].hi == update.rows == 13 + 7 + 1 + 9


def test_slices_keep_enough_elements_to_be_worth_a_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(update_module, "MIN_SLICE_ELEMENTS", MIN_SLICE_ELEMENTS)
    big = nn.Parameter(torch.zeros(64, 4 * MIN_SLICE_ELEMENTS // 64))  # room for 4 slices at the floor
    small = nn.Parameter(torch.zeros(1000, 3))  # under the floor: one piece however slow
    update = ChunkedUpdate(torch.optim.SGD([big, small], lr=0.1))
    update.split([100.0, 100.0], 1.0)
    assert [sum(1 for piece in update.pieces if piece.param == i) for i in (0, 1)] == [4, 1]
