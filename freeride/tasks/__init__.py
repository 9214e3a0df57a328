"""Side tasks by name: the catalog registered by entry point, and how any task name resolves to a class."""

from freeride.tasks.targets import catalog, load, program_command, programs, resolve

__all__ = ["catalog", "load", "program_command", "programs", "resolve"]
