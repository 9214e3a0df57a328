"""GPU plumbing: the MPS daemon, NVML readings and side-task memory caps."""

__all__: list[str] = []
