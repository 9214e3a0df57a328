"""Backend adapters: hook a training framework's pipeline schedule and emit bubble events."""

__all__: list[str] = []
