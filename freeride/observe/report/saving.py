"""FreeRide's cost-saving formula and the GPU prices it takes.

::

    saving = (sum_i W_i / R_i / k - (T_fr - T_van)) / T_van

with W_i the work (steps) task i did, R_i its throughput (steps/s) alone on the
cheap GPU, k the price of the training GPUs over the price of one cheap GPU,
and T_fr / T_van the training time with FreeRide and without.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Prices", "cost_saving", "price_ratio"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Prices:
    """GPU prices of the cost-saving formula."""

    train_gpu_per_hour: float = 3.96
    """Price of one training GPU per hour."""
    side_gpu_per_hour: float = 0.18
    """Price per hour of the cheap GPU the side tasks would otherwise run on."""
    train_gpus: int = 0
    """Training GPUs of the job; 0: the devices in the trace."""

    def __post_init__(self) -> None:
        for name in ("train_gpu_per_hour", "side_gpu_per_hour"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive price, got {value}")
        if self.train_gpus < 0:
            raise ValueError(f"train_gpus must be >= 0, got {self.train_gpus}")


def price_ratio(prices: Prices, train_gpus: int) -> float:
    """``k`` of the formula: the price of ``train_gpus`` training GPUs over the price of one cheap GPU."""
    return prices.train_gpu_per_hour * max(train_gpus, 1) / prices.side_gpu_per_hour


def cost_saving(*, side_value_s: float, k: float, training_s: float, vanilla_s: float) -> float | None:
    """FreeRide's cost saving, as a fraction of the training cost without FreeRide.

    Args:
        side_value_s: ``sum_i W_i / R_i``, the cheap-GPU seconds the side work would have taken.
        k: See :func:`price_ratio`.
        training_s: ``T_fr``, the training time with side tasks.
        vanilla_s: ``T_van``, the same training without them.

    Returns:
        The saving, or None when ``vanilla_s`` is not positive.
    """
    if vanilla_s <= 0:
        return None
    return (side_value_s / k - (training_s - vanilla_s)) / vanilla_s
