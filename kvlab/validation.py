"""Argument checks shared by every public entry point: one message style, one exception type.

Each ``check_*`` returns the value it accepted (normalised: NumPy integers become ``int``) or raises
``kvlab.InvalidArgumentError`` naming the argument, what is allowed and what it got. ``bool`` is never
accepted as a number (``True`` is an ``int`` in Python, but never what a caller meant).
"""

import math
import numbers
import os
from pathlib import Path

from kvlab.errors import InvalidArgumentError


def is_int(value) -> bool:
    """A Python or NumPy integer, not a bool."""
    # The exact-type test first: isinstance against the numbers ABC costs ~1 us, and this runs per call.
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def _range_text(minimum, maximum) -> str:
    if maximum is None:
        return f">= {minimum}"
    if minimum is None:
        return f"<= {maximum}"
    return f"in [{minimum}, {maximum}]"


def check_int(name: str, value, minimum=None, maximum=None) -> int:
    """An integer in ``[minimum, maximum]`` (either bound may be None)."""
    if not is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = "" if minimum is None and maximum is None else " " + _range_text(minimum, maximum)
        raise InvalidArgumentError(f"{name} must be an int{bounds}, got {value!r}")
    return int(value)


def check_number(name: str, value, minimum=None, maximum=None, *, min_open=False, max_open=False) -> float:
    """A finite real number between the bounds (closed unless ``min_open``/``max_open``)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value > minimum if min_open else value >= minimum
    if ok and maximum is not None:
        ok = value < maximum if max_open else value <= maximum
    if not ok:
        lo = "" if minimum is None else f"{'>' if min_open else '>='} {minimum}"
        hi = "" if maximum is None else f"{'<' if max_open else '<='} {maximum}"
        bounds = " and ".join(b for b in (lo, hi) if b)
        raise InvalidArgumentError(f"{name} must be a finite number{' ' + bounds if bounds else ''}, got {value!r}")
    return float(value)


def check_optional_int(name: str, value, minimum=None, maximum=None):
    """None, or an int as ``check_int`` accepts it."""
    return None if value is None else check_int(name, value, minimum, maximum)


def check_directory(name: str, value) -> Path:
    """A directory given as a non-empty str or an ``os.PathLike`` of one (``pathlib.Path``). An empty string
    is refused: ``Path("")`` is the current directory, so an unset ``$DIR`` would write there unasked."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise InvalidArgumentError(f"{name} must be a directory, as a str or pathlib.Path, got {value!r}")
    if not text:
        raise InvalidArgumentError(f"{name} must be a directory, got an empty string (pass '.' for the current one)")
    return Path(text)
