"""The one rule for whole-number and number arguments (toyllm/checks.py)."""
import math

import numpy as np
import pytest

from toyllm.checks import check_int, check_number, is_int, is_number

# The library alone: no exercise runs here (tests/conftest.py checks it), so the student edition leaves it out.
pytestmark = pytest.mark.library


@pytest.mark.timeout(10)
def test_a_bool_is_neither_a_whole_number_nor_a_number():
    assert not is_int(True) and not is_number(False)
    assert is_int(3) and is_int(np.int64(3)) and not is_int(3.0) and not is_int("3")
    assert is_number(2.5) and is_number(np.float32(2.5)) and is_number(math.nan) and not is_number("2.5")


@pytest.mark.timeout(10)
def test_check_int_returns_a_python_int_or_says_what_was_allowed_in_the_callers_words():
    value = check_int(np.int64(4), "rounds must be an int >= 1", 1)
    assert value == 4 and type(value) is int
    assert check_int(-7, "an offset must be an integer") == -7             # no lower bound unless given
    for bad in (0, True, 2.0, "2", None):
        with pytest.raises(ValueError, match=rf"^rounds must be an int >= 1, got {bad!r}$"):
            check_int(bad, "rounds must be an int >= 1", 1)


@pytest.mark.timeout(10)
def test_check_number_wants_a_number_above_zero():
    assert check_number(2, "timeout_s must be a positive number of seconds") == 2.0
    assert check_number(math.inf, "timeout_s must be a positive number of seconds") == math.inf
    for bad in (0, -1.5, math.nan, True, "1"):
        with pytest.raises(ValueError, match=r"^timeout_s must be a positive number of seconds, got "):
            check_number(bad, "timeout_s must be a positive number of seconds")
