"""A cluster-wide side-job queue on Ray: one queue for every node of a job (docs/cluster.md)."""

__all__: list[str] = []
