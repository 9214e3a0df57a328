"""The worker side: the process that runs one iterative side task (``python -m freeride.worker``)."""

__all__: list[str] = []
