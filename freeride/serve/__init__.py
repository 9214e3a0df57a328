"""The manager side: ``freeride serve``, one process per node.

:mod:`~freeride.serve.manager` owns the sockets and the loops; beneath it a
socket-free core: :mod:`~freeride.serve.ranks` (who trains where),
:mod:`~freeride.serve.scheduler` (who gets each bubble),
:mod:`~freeride.serve.supervisor` (side tasks from submit to exit) and
:mod:`~freeride.serve.runners` (how a task is handed a bubble).
"""

__all__: list[str] = []
