"""Compatibility fix for the Triton interpreter (``TRITON_INTERPRET=1``, the CPU test path).

The interpreter holds every scalar as a shape-(1,) numpy array and, while a kernel runs, patches
``tl.tensor.__index__`` so that ``range(lo, hi)`` with runtime bounds can turn them into ints.
Triton 3.6 patches it to ``int(self.handle.data)``, which numpy deprecated for arrays with
ndim > 0 (1.25) and refuses since 2.4 ("only 0-dimensional arrays can be converted to Python
scalars"), so our kernels' ``for ... in range(runtime bounds)`` loops fail there. Triton 3.9
uses ``int(self.handle.data.squeeze())`` and is left alone. The loops stay as they are (runtime
bounds are what the compiler software-pipelines); only the interpreter's patch is amended, and
only when the installed one fails (or warns) on a shape-(1,) array. The compiled GPU path never
runs this code.
"""
from __future__ import annotations

import functools
import inspect
import types
import warnings

import numpy as np

__all__ = ["fix_interpreter_index"]


def _index_of_one_element_array_fails(patch, scope_cls) -> bool:
    """Apply ``patch`` to a throwaway class and ask its ``__index__`` for a shape-(1,) scalar."""

    class Probe:
        pass

    scope = scope_cls()
    patch(Probe, scope)
    try:
        probe = Probe()
        probe.handle = types.SimpleNamespace(data=np.array([3], dtype=np.int32))
        with warnings.catch_warnings():
            # numpy 1.25 - 2.3 only warn (DeprecationWarning): fix those too, it is the same call
            warnings.simplefilter("error", DeprecationWarning)
            return Probe.__index__(probe) != 3
    except (TypeError, DeprecationWarning):
        return True
    finally:
        scope.restore()


def fix_interpreter_index() -> bool:
    """Make the interpreter's ``tensor.__index__`` accept shape-(1,) arrays; True if patched.

    Idempotent, and a no-op when the interpreter's internals are not the expected ones (a
    future Triton) or when its own ``__index__`` already works with the installed numpy.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    scope_cls = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_cls is None or getattr(original, "_fastspec_index_fix", False):
        return False
    try:
        if list(inspect.signature(original).parameters) != ["tensor", "scope"]:
            return False
        if not _index_of_one_element_array_fails(original, scope_cls):
            return False
    except Exception:  # internals changed shape: leave the interpreter alone
        return False

    @functools.wraps(original)
    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        # set after the original's __index__, so the scope (which restores in reverse order)
        # puts the original back first and then the class's own attribute
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_lang_tensor._fastspec_index_fix = True
    # _patch_lang looks the function up in the module's globals at each kernel launch
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
