"""The ``freeride`` command: one module per command, what they share in :mod:`freeride.cli.common`."""

from freeride.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
