"""Scalar mode: derivatives of every scalar op, grad() on plain Python functions,
10^6 recorded operations in seconds, spilling under a budget, bad use."""
import math
import time

import numpy as np
import pytest

import adtape as ad
from adtape.scalar import Scalar, ScalarTape, cos_, exp_, log_, sin_, sqrt_, tan_, tanh_

CASES = [
    ("add", lambda x, y: x + y, (0.3, -1.2)),
    ("sub", lambda x, y: x - y, (0.3, -1.2)),
    ("mul", lambda x, y: x * y, (0.3, -1.2)),
    ("div", lambda x, y: x / y, (0.3, -1.2)),
    ("pow", lambda x, y: x ** y, (1.3, -1.2)),
    ("pow_const", lambda x: x ** 3, (-0.7,)),
    ("rpow", lambda x: 2.0 ** x, (-0.7,)),
    ("rsub_rdiv", lambda x: 1.0 - 2.0 / x, (0.7,)),
    ("neg_abs", lambda x: -abs(x) + abs(-x * 3.0), (-0.7,)),
    ("exp_log", lambda x: exp_(x) + log_(x), (0.7,)),
    ("trig", lambda x: sin_(x) * cos_(x) + tan_(x), (0.4,)),
    ("tanh_sqrt", lambda x: tanh_(x) * sqrt_(x), (0.4,)),
    ("adtape_dispatch", lambda x: ad.exp(x) * ad.tanh(x) - ad.log(x), (0.4,)),
    ("branch", lambda x, y: x * y if x < y else x - y, (0.2, 0.5)),
    ("loop", lambda x: _horner(x), (0.9,)),
]


def _horner(x):
    acc = 0.0
    for c in (1.0, -2.0, 0.5, 3.0):
        acc = acc * x + c
    return acc


@pytest.mark.parametrize("name,f,args", CASES, ids=[c[0] for c in CASES])
def test_scalar_ops_match_finite_differences(name, f, args):
    ad.check_grads(f, *args)


def test_known_derivatives():
    gx, gy = ad.grad(lambda x, y: x * sin_(y) + x ** 2 / y, (0, 1))(0.7, 1.3)
    assert gx == pytest.approx(math.sin(1.3) + 2 * 0.7 / 1.3, rel=1e-14)
    assert gy == pytest.approx(0.7 * math.cos(1.3) - 0.49 / 1.69, rel=1e-14)
    value, g = ad.value_and_grad(lambda x: x * x * x)(2.0)
    assert (value, g) == (8.0, 12.0)
    with pytest.warns(UserWarning, match="Output seems independent of input"):
        assert ad.grad(lambda x, y: y * 2.0, 0)(1.0, 3.0) == 0.0


def test_a_million_scalar_operations_in_seconds():
    n = 250_000

    def program(x, y):
        s = 0.0
        for _ in range(n):
            s = s + x * y - y / (x + 1.0)
        return s

    t0 = time.perf_counter()
    gx, gy = ad.grad(program, (0, 1))(0.5, 2.0)
    elapsed = time.perf_counter() - t0
    assert gx == pytest.approx(n * (2.0 + 2.0 / 2.25), rel=1e-9)
    assert gy == pytest.approx(n * (0.5 - 1.0 / 1.5), rel=1e-9)
    assert elapsed < 10.0, f"10^6 scalar ops took {elapsed:.1f} s"


def test_scalar_tape_spills_and_gives_the_same_gradient(tmp_path):
    def run(**kw):
        with ScalarTape(**kw) as st:
            x = st.variable(0.3)
            y = x
            for _ in range(100_000):
                y = y * 0.99999 + x * 1e-6
            stats = st.stats
            return st.gradient(y, [x])[0], stats

    g_full, _ = run()
    g_small, stats = run(memory_budget=256 << 10, spill_dir=tmp_path, slab_size=4096)
    assert stats["spills"] > 0 and stats["statements"] == 300_001
    assert g_small == g_full


def test_bad_use():
    with ScalarTape() as a, ScalarTape() as b:
        x, y = a.variable(1.0), b.variable(2.0)
        with pytest.raises(ValueError, match="two different ScalarTapes"):
            x * y
        with pytest.raises(ValueError, match="not a variable of this ScalarTape"):
            a.gradient(x * 2.0, [y])
        with pytest.raises(TypeError, match="must be Scalars"):
            a.gradient(x, [1.0])
        z = x * x
        a.gradient(z, [x])
        with pytest.raises(RuntimeError, match="already swept"):
            a.gradient(z, [x])
        with pytest.raises(RuntimeError, match="already swept"):
            x * 3.0
    with pytest.raises(ad.TapeClosedError):
        y + 1.0
    with pytest.raises(TypeError):
        Scalar(1.0) + "a"
    with pytest.raises(TypeError, match="must return a float"):
        ad.grad(lambda x: [x])(1.0)


def test_constants_do_not_record():
    with ScalarTape() as st:
        x = st.variable(2.0)
        c = Scalar(3.0) * Scalar(4.0) + 1.0
        assert c.index == 0 and c.value == 13.0
        assert len(st) == 1
        assert st.gradient(x * c, [x]) == [13.0]


def test_check_grads_in_scalar_mode_catches_a_wrong_derivative():
    def escapes_the_tape(x):
        # x.value leaves the tape: the value is sin(x), the recorded derivative is 1.
        value = getattr(x, "value", x)      # finite differences call it with floats
        return x - value + math.sin(value)
    with pytest.raises(AssertionError, match="argument 0"):
        ad.check_grads(escapes_the_tape, 0.3)
