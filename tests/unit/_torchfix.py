"""A fixture for tests that compare torch results bit for bit (import it into the test module)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

__all__ = ["deterministic_one_thread"]


@pytest.fixture(autouse=True)
def deterministic_one_thread() -> Iterator[None]:
    """One torch thread and deterministic kernels for each test of the importing module, restored afterwards."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(deterministic)
    torch.set_num_threads(threads)
