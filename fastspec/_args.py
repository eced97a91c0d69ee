"""Argument checks of the public API: one rule per kind of argument, one message format.

Every check takes the argument's ``name`` and its ``value`` and returns the value in its plain
Python form, or raises with a one-line message ``"{name}: expected ..., got {value!r}"``:

* :func:`flag`: ``True``/``False``, also NumPy bools (``np.bool_``, e.g. read from a config
  array); not ``0``/``1``, not strings.
* :func:`integer`: anything with ``__index__`` (Python ints, NumPy ints such as a step from
  ``np.arange``), returned as an ``int``; not bools (a bool is a flag, not a count; NumPy bools
  have no ``__index__``), not floats (``2.0`` is not silently truncated).
* :func:`real`: a finite real number (Python/NumPy ints and floats, ``numbers.Real``), returned
  as a ``float``; not bools.
* :func:`choice`: one of a fixed tuple of options (compared with ``==``).
* :func:`text`: a non-empty ``str``.

Errors: a value of the wrong *type* raises :class:`ArgumentTypeError`, which is both a
``TypeError`` and a ``ValueError``: fastspec used to raise one or the other depending on the
function, and code catching either keeps working. A value of the right type outside its range
(``every=0``, ``precision="double"``) raises ``ValueError``.

Pure Python: no torch or NumPy import, so the torch-free modules (``analysis``, the
integrations' alerts) use it too.
"""
from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable
from typing import Any

__all__ = ["ArgumentTypeError", "choice", "flag", "index", "integer", "real", "text"]


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a ``TypeError``, and a ``ValueError`` for compatibility)."""


def _is_bool(value: Any) -> bool:
    """A Python or NumPy bool (NumPy 2 names its type ``bool``, NumPy 1 ``bool_``), without importing NumPy."""
    t = type(value)
    return t is bool or (t.__module__ == "numpy" and t.__name__ in ("bool", "bool_"))


def _or_none(optional: bool) -> str:
    return " or None" if optional else ""


def flag(name: str, value: Any) -> bool:
    """``value`` as a ``bool``: Python and NumPy bools only."""
    if not _is_bool(value):
        raise ArgumentTypeError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


def index(value: Any) -> int:
    """``value`` as an ``int`` via ``operator.index`` (Python and NumPy ints), bools refused.
    Raises a plain ``TypeError`` without a name: for callers that build their own message
    (e.g. a shape, where one bad entry condemns the whole argument)."""
    if type(value) is int:  # the common case, and the one a traced update sees
        return value
    if _is_bool(value):
        raise TypeError(f"a bool is not an int: {value!r}")
    return operator.index(value)


def integer(name: str, value: Any, *, minimum: int | None = None, optional: bool = False) -> int | None:
    """``value`` as an ``int`` (:func:`index`) that is ``>= minimum`` if given; ``optional``: None passes."""
    if value is None and optional:
        return None
    try:
        number = index(value)
    except TypeError:
        raise ArgumentTypeError(_int_message(name, value, minimum, optional)) from None
    if minimum is not None and number < minimum:
        raise ValueError(_int_message(name, number, minimum, optional))
    return number


def _int_message(name: str, value: Any, minimum: int | None, optional: bool) -> str:
    # built only on failure: integer() runs on every covariance update
    return f"{name}: expected an int{'' if minimum is None else f' >= {minimum}'}{_or_none(optional)}, got {value!r}"


def real(name: str, value: Any, expected: str, ok: Callable[[float], bool] | None = None, *,
         optional: bool = False) -> float | None:
    """``value`` as a finite ``float`` for which ``ok(value)`` holds (e.g. ``lambda b: 0 < b < 1``);
    ``optional``: None passes. ``expected`` says what is accepted, in words, for the message
    (e.g. ``"a fraction in (0, 1) or None"``)."""
    if value is None and optional:
        return None
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name}: expected {expected}, got {value!r}")
    if not math.isfinite(value) or (ok is not None and not ok(value)):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return float(value)


def choice(name: str, value: Any, options: tuple) -> Any:
    """``value`` if it is one of ``options``."""
    try:
        found = value in options
    except (TypeError, ValueError):  # e.g. an array, whose == is elementwise: not one of the options
        found = False
    if not found:
        raise ValueError(f"{name}: expected one of {options}, got {value!r}")
    return value


def text(name: str, value: Any, *, optional: bool = False) -> str | None:
    """``value`` if it is a non-empty ``str``; ``optional``: None passes."""
    if value is None and optional:
        return None
    message = f"{name}: expected a non-empty str{_or_none(optional)}, got {value!r}"
    if not isinstance(value, str):
        raise ArgumentTypeError(message)
    if not value:
        raise ValueError(message)
    return value
