"""GPU plumbing: the MPS daemon, NVML readings, side-task memory caps and the bubble gate."""

__all__: list[str] = []
