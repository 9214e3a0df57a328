"""GPU plumbing: the MPS daemon, NVML readings, side-task memory caps, the bubble gate and steps as CUDA graphs."""

__all__: list[str] = []
