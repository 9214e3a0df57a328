"""The ``freeride`` command: one module per command, what they share in :mod:`freeride.cli.common`, the parser
and exit statuses in :mod:`freeride.cli.main`."""
