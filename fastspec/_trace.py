"""Marks for ``torch.compile`` that cost nothing at import (no ``torch._dynamo`` import)."""
from __future__ import annotations


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo``.

    The public decorator imports torch._dynamo (about a second, Triton included) only to set
    ``fn._dynamo_marked_constant = True``, which dynamo reads when tracing meets a call of ``fn``:
    it then *runs* ``fn`` at trace time and uses the result as a constant. The mark has to be in
    place before the first trace, and that first trace may well be the first call of ``fn``, so
    decorating lazily on first use cannot work. So the attribute is set here directly;
    tests/test_imports.py checks that torch's decorator still marks functions exactly this way
    and that a ``fullgraph`` compile traces through a marked function.

    Used for the CUDA device count of the native eigensolver (a pybind11 call dynamo cannot
    trace) and for the probe's trace-time allocation of streaming state (``probe/routing.py``).
    """
    fn._dynamo_marked_constant = True
    return fn
