"""The manager side: ``freeride serve``, one process per node.

:mod:`~freeride.serve.manager` owns the sockets and the loops; beneath it the
socket-free core, :mod:`~freeride.serve.core`, holds :mod:`~freeride.serve.ranks`
(who trains where), one :mod:`~freeride.serve.scheduler` per device (who gets
each bubble) and the :mod:`~freeride.serve.supervisor` (side tasks from submit
to exit). docs/design/layout.md lists every module of the package.
"""

__all__: list[str] = []
