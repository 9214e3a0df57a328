"""The torch internals that keep ``nn.Transformer*`` modules from being traced, traced as single calls.

``nn.TransformerEncoder`` and ``nn.TransformerEncoderLayer`` check their
inputs in Python before computing (is the mask floating point, is the input
nested, is this mask causal, may the fused fast path run). Those checks read
tensor values, which ``torch.fx`` cannot do symbolically. While a model is
traced, the helpers holding the checks are recorded as one call each (run for
real, with real tensors, when the piece runs) and the fast path is reported
off, so the traced code is the plain path: the one training takes anyway, and
in inference the same arithmetic without the fused kernel. Names missing
from another torch version are skipped; the module then stays whole.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx
from torch.nn.modules import transformer

__all__ = ["traceable_torch"]

_HELPERS: tuple[tuple[ModuleType, str], ...] = (
    (F, "_canonical_mask"),
    (F, "_none_or_dtype"),
    (transformer, "_get_seq_len"),
    (transformer, "_detect_is_causal_mask"),
)


def _recorded(tracer: fx.Tracer, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, fx.Proxy) for a in itertools.chain(args, kwargs.values())):
            return tracer.create_proxy("call_function", original, args, kwargs)
        return original(*args, **kwargs)

    return wrapper


@contextmanager
def traceable_torch(tracer: fx.Tracer) -> Iterator[None]:
    """While tracing with ``tracer``: the helpers recorded as calls, the fused fast path off."""
    saved = [(module, name, getattr(module, name)) for module, name in _HELPERS if hasattr(module, name)]
    mha = getattr(torch.backends, "mha", None)
    fastpath = mha.get_fastpath_enabled() if mha is not None else None
    try:
        for module, name, original in saved:
            setattr(module, name, _recorded(tracer, original))
        if mha is not None:
            mha.set_fastpath_enabled(False)
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
        if mha is not None and fastpath is not None:
            mha.set_fastpath_enabled(fastpath)
