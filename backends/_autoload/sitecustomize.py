"""Loaded at interpreter start in processes run under ``freeride launch``.

Activates FreeRide's framework hooks, then runs any ``sitecustomize`` this one
shadows so the user's environment behaves as it did without FreeRide.
"""

import importlib.util
import os
import sys

try:
    from freeride.backends import autoload

    autoload.activate()
except Exception as exc:  # never stop the user's program from starting
    print(f"freeride: hooks not installed ({exc!r}); training runs without FreeRide", file=sys.stderr)


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_freeride_chained_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_chain()
