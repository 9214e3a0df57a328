"""The public API for iterative side tasks.

An iterative side task is async Python that does its work in steps and lets
the runtime decide when each step may start::

    class PiEstimate(IterativeTask):
        step_time = 0.002           # seconds; a hint until steps are measured

        def __init__(self, *, batch: int = 100_000) -> None:
            self.batch, self.hits, self.total = batch, 0, 0

        def step(self) -> None:
            xy = torch.rand(self.batch, 2)
            self.hits += int((xy.square().sum(1) <= 1).sum())
            self.total += self.batch

        def metrics(self) -> dict[str, float]:
            return {"pi": 4 * self.hits / max(self.total, 1)}

        def state_dict(self) -> dict[str, object]:
            return {"hits": self.hits, "total": self.total}

        def load_state_dict(self, state: dict[str, object]) -> None:
            self.hits, self.total = int(state["hits"]), int(state["total"])

The default :meth:`IterativeTask.run` loops ``async with gate.step(): self.step()``
until :meth:`IterativeTask.done`. ``gate.step()`` is the cooperative yield: it
returns only when a bubble is granted to the task *and* the task's estimated
step time (the hint, then a high percentile of the recently measured steps of
the same kind, see :meth:`IterativeTask.step_kind`) fits in what is left of it
minus a safety margin; otherwise the task is parked. Tasks
with their own loop override :meth:`IterativeTask.run` and call ``gate.step()``
around each unit of work.

State returned by :meth:`IterativeTask.state_dict` is checkpointed (with
``torch.save``) between steps and when the task is stopped, and handed to
:meth:`IterativeTask.load_state_dict` when a cancelled, crashed or preempted
task starts again.

The lifecycle, in the order the runtime calls a task (one worker process)::

    __init__(**options)            options checked against its signature at submit
    setup(ctx)                     build models and data on ctx.torch_device
    load_state_dict(state)         only when a checkpoint exists: after setup, so
                                   the state has something to load into
    ( on_resume()                  a grant starts: the device is the task's
      steps ...                    each one inside the grant, if it fits
      on_pause() )*                the grant ends (the bubble is over)
    state_dict()                   at periodic checkpoints and at stop, whenever
                                   can_checkpoint() says the state is consistent
    teardown()                     once, however the task ends

An exception in ``__init__`` or ``setup`` fails the task for good (a restart
would raise it again); one in a step fails it and restarts it from its last
checkpoint. At a stop, a task whose :meth:`IterativeTask.can_checkpoint` says no
runs on (inside bubbles) to its next consistent point while the stop timeout
allows; past that, the last checkpoint is kept and the status says so.

A task that waits for its own input (a spool directory, a queue, a socket)
waits through the gate, ``item = await gate.wait_for(queue.get())`` or
``async for item in gate.idle_until(source):``: meanwhile it gives every
bubble back, still answers a stop (it is checkpointed, not killed) and keeps
its status fresh. ``gate.remaining()`` says how much of the current grant is
left, and ``gate.report(loss=...)`` publishes metrics between checkpoints.

On a GPU, a step whose kernels are small and many can run as one captured
CUDA graph: :class:`StepGraph` wraps its device work, captures it after two
eager runs and replays it, and runs it eagerly (saying why) where capture fails.

The modules: :mod:`~freeride.sidetask.task` (the task, its gate and context),
:mod:`~freeride.sidetask.estimates` (step-time estimates),
:mod:`~freeride.sidetask.alone` (running a task without a manager) and
:mod:`~freeride.sidetask.graphs` (steps as CUDA graphs).
"""

from freeride.sidetask.alone import UnboundedGate, run_alone
from freeride.sidetask.estimates import StepCost, StepEstimates, StepEstimator
from freeride.sidetask.graphs import GraphApi, StepGraph
from freeride.sidetask.task import IterativeTask, StepGate, TaskContext, TaskStopped

__all__ = [
    "GraphApi",
    "IterativeTask",
    "StepCost",
    "StepEstimates",
    "StepEstimator",
    "StepGate",
    "StepGraph",
    "TaskContext",
    "TaskStopped",
    "UnboundedGate",
    "run_alone",
]
