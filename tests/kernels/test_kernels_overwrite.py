"""Every backward kernel's ``overwrite`` flag: writing a gradient over a buffer of
garbage gives what adding it into zeros gives, for each output on its own, in the
fast kernels and their naive twins."""
import itertools

import numpy as np
import pytest

from kernels import attention, layers, matmul


def _cases(rng):
    """(name, kernel, naive, output shapes, call(kernel, outputs, overwrite))."""
    B, T, C, NH, V = 2, 5, 24, 3, 11
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    d = rng.standard_normal((B, T, C)).astype(np.float32)
    w = rng.standard_normal(C).astype(np.float32)
    b = rng.standard_normal(C).astype(np.float32)
    mean, rstd = np.empty((B, T), np.float32), np.empty((B, T), np.float32)
    layers.layernorm_forward(np.empty_like(x), mean, rstd, x, w, b)
    W = rng.standard_normal((7, C)).astype(np.float32)
    dout7 = rng.standard_normal((B, T, 7)).astype(np.float32)
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    qkv = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    att_out, att_lse = np.empty((B, T, C), np.float32), np.empty((B, NH, T), np.float32)
    attention.attention_forward(att_out, att_lse, qkv, NH)
    return [
        ("matmul", matmul.matmul_backward, matmul.matmul_backward_naive,
         [(B, T, C), (7, C), (7,)], lambda k, o, ow: k(*o, dout7, x, W, overwrite=ow)),
        ("layernorm", layers.layernorm_backward, layers.layernorm_backward_naive,
         [(B, T, C), (C,), (C,)], lambda k, o, ow: k(*o, d, x, w, mean, rstd, overwrite=ow)),
        ("encoder", layers.encoder_backward, layers.encoder_backward_naive,
         [(V, C), (8, C)], lambda k, o, ow: k(*o, d, ids, overwrite=ow)),
        ("gelu", layers.gelu_backward, layers.gelu_backward_naive,
         [(B, T, C)], lambda k, o, ow: k(*o, x, d, overwrite=ow)),
        ("residual", layers.residual_backward, layers.residual_backward_naive,
         [(B, T, C), (B, T, C)], lambda k, o, ow: k(*o, d, overwrite=ow)),
        ("attention", attention.attention_backward, attention.attention_backward_naive,
         [(B, T, 3 * C)], lambda k, o, ow: k(*o, d, qkv, att_out, att_lse, NH, overwrite=ow)),
    ]


@pytest.mark.parametrize("which", ["matmul", "layernorm", "encoder", "gelu", "residual",
                                   "attention"])
@pytest.mark.parametrize("twin", ["fast", "naive"])
def test_overwrite_equals_adding_into_zeros(which, twin, vector_lanes):
    rng = np.random.default_rng(0)
    name, fast, naive, shapes, call = next(c for c in _cases(rng) if c[0] == which)
    kernel = fast if twin == "fast" else naive
    reference = [np.zeros(s, np.float32) for s in shapes]
    call(kernel, reference, False)
    prior = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    for flags in itertools.product((False, True), repeat=len(shapes)):
        outs = [np.full(s, np.nan, np.float32) if f else p.copy()
                for s, f, p in zip(shapes, flags, prior)]
        call(kernel, outs, flags)
        for out, ref, f, p in zip(outs, reference, flags, prior):
            expected = ref if f else p + ref
            np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name} overwrite={flags}")


def test_overwrite_flag_is_checked():
    with pytest.raises(ValueError, match="overwrite must be a bool or 3 bools"):
        layers.overwrite_flags((True, False), ("dinp", "dweight", "dbias"))
    with pytest.raises(ValueError, match="overwrite must be a bool"):
        layers.overwrite_flags("yes", ("dinp",))
    assert layers.overwrite_flags(True, ("a", "b")) == (True, True)
