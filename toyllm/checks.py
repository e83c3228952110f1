"""Argument checks the library shares: what counts as a whole number and as a number.

One rule everywhere: a bool is neither (``True`` is an int to Python, but never a count
of processes, tokens or rounds), and an integer may be a Python int or a NumPy one. The
caller passes the words of its error message, so each message still names its own
argument and what it allows.
"""
from __future__ import annotations

import numbers


def is_int(value) -> bool:
    """True for an integer (Python or NumPy), False for a bool, a float, a string or anything else."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """True for a real number (int or float, Python or NumPy; nan and inf included), False for a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(value, words: str, low: int | None = None) -> int:
    """``value`` as a Python int when it is an integer (``is_int``) and at least ``low``.

    Otherwise ValueError("<words>, got <repr(value)>"), for example
    ``check_int(0, "rounds must be an int >= 1", 1)``: "rounds must be an int >= 1, got 0".
    """
    if not is_int(value) or (low is not None and value < low):
        raise ValueError(f"{words}, got {value!r}")
    return int(value)


def check_number(value, words: str) -> float:
    """``value`` as a float when it is a number (``is_number``) above zero (nan is not; inf is).

    Otherwise ValueError("<words>, got <repr(value)>"), for example
    ``check_number(0, "timeout_s must be a positive number of seconds")``.
    """
    if not is_number(value) or not value > 0:
        raise ValueError(f"{words}, got {value!r}")
    return float(value)
