"""nn.lora_linear against the unfused NumPy formula in float64 (the adapters added into
their strided output columns, dropout on the adapters' input as peft's), and what it
keeps for the backward: the float32 input, x @ A^T and dropout's byte mask, never the
base's input again (nor a bf16 base's copy of it)."""
import numpy as np
import pytest

import adtape as ad
from adtape import nn
from adtape.tensor import Tensor
from kernels import bf16 as kbf16
from kernels import lora as lora_kernels

SPLITS = [(0, 24), (40, 8), (48, 8)]        # q|k|v-like, columns 24:40 not adapted
B, T, C, OC, R = 2, 9, 20, 56, 4
SCALE = 2.0


def _round(x):
    out = np.empty(x.shape, np.uint16)
    kbf16.to_bf16(out, np.ascontiguousarray(x, np.float32))
    return out


def _widen(u):
    out = np.empty(u.shape, np.float32)
    kbf16.from_bf16(out, u)
    return out


def _reference(x, w, bias, a, b, g, mask, base_bf16):
    """(out, dx, da, db) in float64; mask None or the float32 dropout mask."""
    f = lambda v: np.asarray(v, np.float64)  # noqa: E731
    x2, g2 = f(x.reshape(-1, C)), f(g.reshape(-1, OC))
    xb = f(_widen(_round(x)).reshape(-1, C)) if base_bf16 else x2
    gb = f(_widen(_round(g)).reshape(-1, OC)) if base_bf16 else g2
    m = np.ones_like(x2) if mask is None else f(mask)
    xl = x2 * m
    out = xb @ f(w).T + f(bias)
    dx = gb @ f(w)
    da, db = np.zeros(a.shape), np.zeros(b.shape)
    rows = 0
    for j, (start, n) in enumerate(SPLITS):
        aj, bj = f(a[j * R:(j + 1) * R]), f(b[rows:rows + n])
        xa = SCALE * xl @ aj.T
        out[:, start:start + n] += xa @ bj.T
        gj = g2[:, start:start + n]
        db[rows:rows + n] = gj.T @ xa
        dxa = SCALE * gj @ bj
        da[j * R:(j + 1) * R] = dxa.T @ xl
        dx += (dxa @ aj) * m
        rows += n
    return out, dx, da, db


def rel_err(actual, expected):
    scale = max(float(np.abs(expected).max()), 1e-30)
    return float(np.abs(np.asarray(actual, np.float64) - expected).max()) / scale


@pytest.mark.parametrize("residuals", ["tape", "reference"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("base", ["fp32", "bf16"])
def test_lora_linear_is_the_unfused_formula_and_keeps_only_the_adapters_inputs(
        residuals, dropout, base):
    rng = np.random.default_rng(11)
    x0 = rng.standard_normal((B, T, C)).astype(np.float32)
    w0 = (0.3 * rng.standard_normal((OC, C))).astype(np.float32)
    bias = rng.standard_normal(OC).astype(np.float32)
    a0 = (0.3 * rng.standard_normal((len(SPLITS) * R, C))).astype(np.float32)
    b0 = (0.3 * rng.standard_normal((sum(n for _, n in SPLITS), R))).astype(np.float32)
    g = rng.standard_normal((B, T, OC)).astype(np.float32)
    w = _round(w0) if base == "bf16" else w0
    wf = _widen(w) if base == "bf16" else w0
    mask = None
    if dropout:
        # One key from the Generator, the draws from it (kernels.lora.uniforms).
        u = np.empty((B * T, C), np.float32)
        lora_kernels.uniforms(u, np.random.default_rng(3).integers(0, 1 << 64, dtype=np.uint64))
        mask = (u >= dropout).astype(np.float32) * np.float32(1 / (1 - dropout))
    x, a, b = (Tensor(v.copy(), requires_grad=True) for v in (x0, a0, b0))
    with ad.OpTape(residuals=residuals) as tape:
        u_ = nn.residual(x, Tensor(np.zeros_like(x0)))     # an intermediate input
        out = nn.lora_linear(u_, w, bias, a, b, SPLITS, SCALE, dropout,
                             np.random.default_rng(3))
        saved = tape.saved_bytes
        out.backward(seed=g)
    want = _reference(x0, wf, bias, a0, b0, g, mask, base == "bf16")
    for got, exp, what in zip((out.data.reshape(-1, OC), x.grad.reshape(-1, C), a.grad,
                               b.grad), want, ("out", "dx", "da", "db")):
        assert rel_err(got, exp) < 2e-5, what
    # The residual's output (float32 x), x @ A^T and the dropout mask beside the (plain
    # array) weight; nothing of the base's input.
    kept = w.nbytes + x0.nbytes + B * T * len(SPLITS) * R * 4 + (B * T * C if dropout else 0)
    assert kept <= saved < kept + 256
