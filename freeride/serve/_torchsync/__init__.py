"""Launcher support for PyTorch imperative side tasks.

This directory is prepended to a side task's ``PYTHONPATH`` (see
:func:`freeride.serve.imperative.sync_every_env`) so that its ``sitecustomize`` module
runs at interpreter start-up. Nothing here is imported by FreeRide itself.
"""

__all__: list[str] = []
