"""Scalar pushes raise instead of rounding information away (issue 23 item 11).

A float32 tape stored push(1e300) as inf; an int64 tape truncated
np.float32(1.5), Decimal('2.7') and Fraction(7, 2).  The rule for int64 tapes:
integers only (int, NumPy integers, __index__), as range() takes them; a float
is refused even when integral, so a value computed in floating point never
slips onto an integer tape.
"""
import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

from adtape import Tape

FLT_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize("value", [1e300, -1e300, 2 * FLT_MAX, Decimal("1e39"), 10 ** 40])
def test_float32_tape_refuses_overflow(value):
    with Tape(np.float32) as t:
        with pytest.raises(OverflowError, match="float32"):
            t.push(value)
        assert len(t) == 0


def test_float32_tape_keeps_inf_nan_and_the_largest_values():
    with Tape(np.float32) as t:
        for v in (math.inf, -math.inf, math.nan, FLT_MAX, -FLT_MAX, 1.5, 0.1):
            t.push(v)
        got = [t.pop() for _ in range(7)][::-1]
        assert got[:2] == [math.inf, -math.inf] and math.isnan(got[2])
        assert got[3:6] == [FLT_MAX, -FLT_MAX, 1.5]
        assert got[6] == float(np.float32(0.1))


@pytest.mark.parametrize("value", [np.float32(1.5), Decimal("2.7"), Fraction(7, 2), 1.5, 3.0,
                                   np.float64(4.0), "5", 2 + 0j])
def test_int64_tape_refuses_non_integers(value):
    with Tape(np.int64) as t:
        with pytest.raises(TypeError, match="int64 tape takes integers"):
            t.push(value)
        assert len(t) == 0


def test_int64_tape_takes_integers_exactly():
    values = [3, -7, np.int32(3), np.uint8(200), np.int64(-2 ** 63), 2 ** 63 - 1, True]
    with Tape(np.int64) as t:
        for v in values:
            t.push(v)
        assert [t.pop() for _ in values][::-1] == [int(v) for v in values]
        with pytest.raises(OverflowError):
            t.push(2 ** 63)
        assert len(t) == 0


def test_push_many_converts_nothing():
    with Tape(np.int64) as t:
        with pytest.raises(TypeError, match="does not match"):
            t.push_many(np.array([1.5, 2.0]))
    with Tape(np.float32) as t:
        with pytest.raises(TypeError, match="does not match"):
            t.push_many(np.array([1e300]))
        assert len(t) == 0
