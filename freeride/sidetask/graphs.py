"""A side task's step as a captured CUDA graph: launched in one call, its device time its own.

On a fast GPU an eager side step is launch-bound: each of its small kernels
costs a few microseconds of host time to launch, often more than the kernel
runs, and the host's estimate of the step is mostly Python. A CUDA graph
records the step's kernels once and launches them all with one call
(``replay``), so the step's time is the device's and the bubble gets more of
it.

:class:`StepGraph` wraps one kind of step, ``work``: device work only, on
tensors that keep their storage from one step to the next (results written in
place, no host reads, no shapes that change). It runs ``work`` eagerly a few
times first (on a side stream, as capture requires: lazy initialisation,
library workspaces), then captures it and from then on replays the graph. On a
CPU device it always runs ``work`` eagerly. Where capture fails (an operation a
graph cannot hold: a host synchronisation, a CPU tensor, a library call that
is not capture-safe), the step runs eagerly from then on and the task's log
says why, once.

The CUDA calls are gathered in :class:`GraphApi`; :func:`torch_graph_api` binds
them to ``torch.cuda``, and tests on machines without CUDA pass a stand-in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:  # the task API imports no torch of its own: a task that uses this has it loaded
    import torch

__all__ = ["WARMUP_RUNS", "CapturedGraph", "GraphApi", "StepGraph", "torch_graph_api"]

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2
"""Eager runs before capture (CUDA's own advice: a few, on a side stream)."""

Mode = Literal["warming", "graph", "eager"]


class CapturedGraph(Protocol):
    """What is used of a ``torch.cuda.CUDAGraph``."""

    def replay(self) -> None: ...


class GraphApi(Protocol):
    """The CUDA calls a :class:`StepGraph` makes (a stand-in replaces them on machines without CUDA)."""

    def warm(self, work: Callable[[], None]) -> None:
        """Run ``work`` once on a side stream, ordered after what the current stream queued, and it before."""

    def capture(self, work: Callable[[], None]) -> CapturedGraph:
        """Record ``work``'s kernels into a graph (nothing runs), or raise why it cannot."""


class _TorchGraphs:
    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream: Any = None

    def warm(self, work: Callable[[], None]) -> None:
        import torch

        cuda: Any = torch.cuda
        if self._stream is None:
            self._stream = cuda.Stream(self._device)
        current = cuda.current_stream(self._device)
        self._stream.wait_stream(current)
        with cuda.stream(self._stream):
            work()
        current.wait_stream(self._stream)

    def capture(self, work: Callable[[], None]) -> CapturedGraph:
        import torch

        cuda: Any = torch.cuda
        cuda.synchronize(self._device)
        graph = cuda.CUDAGraph()
        # a private memory pool per graph: graphs of one task replay in any order, which a shared pool forbids
        with cuda.device(self._device), cuda.graph(graph, capture_error_mode="thread_local"):
            work()
        captured: CapturedGraph = graph
        return captured


def torch_graph_api(device: torch.device) -> GraphApi:
    """The real calls, through ``torch.cuda``, for ``device``."""
    return _TorchGraphs(device)


class StepGraph:
    """One kind of step's device work, run eagerly first, then as a captured CUDA graph (module docstring).

    Args:
        work: The step's device work: in place on tensors that keep their storage, no host reads.
        device: Where it runs; on a CPU it always runs eagerly.
        name: Names the step in the log line that says why it runs eagerly.
        warmup: Eager runs before capture.
        api: The CUDA calls (:func:`torch_graph_api` for ``device`` by default).
    """

    def __init__(
        self,
        work: Callable[[], None],
        *,
        device: torch.device,
        name: str,
        warmup: int = WARMUP_RUNS,
        api: GraphApi | None = None,
    ) -> None:
        self._work = work
        self.name = name
        self._left = max(0, warmup)
        self._graph: CapturedGraph | None = None
        self._api = api
        self.mode: Mode = "warming"
        """``warming`` (eager runs before capture), ``graph`` (replayed) or ``eager`` (for good: see :attr:`why`)."""
        self.why = ""
        """Why the step runs eagerly for good ("" otherwise)."""
        if api is None:
            if device.type != "cuda":
                self._eager("not a CUDA device")
            else:
                self._api = torch_graph_api(device)

    def run(self) -> None:
        """Run the step once: eagerly, or by one launch of its graph."""
        if self._graph is not None:
            self._graph.replay()
            return
        api = self._api
        if self.mode == "eager" or api is None:
            self._work()
            return
        if self._left > 0:
            self._left -= 1
            api.warm(self._work)
            return
        try:
            graph = api.capture(self._work)
        except Exception as exc:  # any failure to capture leaves the step to run as it always could
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self._eager(f"capture failed: {type(exc).__name__}: {reason[:300]}")
            logger.warning("[graphs] %s runs eagerly: %s", self.name, self.why)
            self._work()
            return
        self._graph, self.mode = graph, "graph"
        logger.info("[graphs] %s runs as a CUDA graph", self.name)
        graph.replay()  # capture records the kernels without running them: this step runs now

    def _eager(self, why: str) -> None:
        self.mode, self.why = "eager", why
