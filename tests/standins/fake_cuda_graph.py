"""A stand-in for CUDA graph capture and replay, because no CUDA exists on CPU machines.

``warm`` runs the work at once (a side stream is the current one here).
``capture`` runs nothing, as a real capture records kernels without running
them, and keeps the work; ``replay`` runs it again. Unlike a real graph, a
replay re-runs the work's Python, so Python state the work reads is read anew
at every replay rather than fixed at capture: only the order of warm-up,
capture and replay and the fallback are imitated. A real capture:
``tests/gpu/test_step_graph_cuda.py``.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["FakeGraphApi"]


class _Graph:
    def __init__(self, api: FakeGraphApi, work: Callable[[], None]) -> None:
        self._api, self._work = api, work

    def replay(self) -> None:
        self._api.calls.append("replay")
        self._work()


class FakeGraphApi:
    """Records its calls in :attr:`calls`; ``fail`` makes every capture raise it."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def warm(self, work: Callable[[], None]) -> None:
        self.calls.append("warm")
        work()

    def capture(self, work: Callable[[], None]) -> _Graph:
        self.calls.append("capture")
        if self.fail is not None:
            raise self.fail
        return _Graph(self, work)
