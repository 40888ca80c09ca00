"""Deferred zeroing: ``zero_grad(deferred=True)`` makes the next backward write a
leaf's gradient instead of adding it, through every kind of rule, and the GPT-2
step that relies on it gives the gradients of a step from zeroed buffers."""
import numpy as np
import pytest

import adtape as ad
from adtape import nn
from adtape.tensor import Tensor, apply_deferred_zero
from gpt2.config import GPT2Config
from gpt2.model import GPT2


def _leaf(value, garbage):
    t = Tensor(np.asarray(value, np.float32), requires_grad=True)
    t.grad = np.full(t.data.shape, garbage, np.float32)
    return t


def test_deferred_leaf_gets_the_gradient_not_the_sum():
    x = _leaf([1.0, 2.0, 3.0], np.nan)
    x.zero_grad(deferred=True)
    ((x * 2.0).sum() + (x * x).sum()).backward()       # two contributions, pullback rules
    np.testing.assert_allclose(x.grad, 2.0 + 2 * x.data)
    ((x * 2.0).sum()).backward()                        # no longer deferred: adds
    np.testing.assert_allclose(x.grad, 4.0 + 2 * x.data)


@pytest.mark.parametrize("deferred", [False, True])
def test_overwriting_rules_match_accumulating_into_zeros(deferred):
    rng = np.random.default_rng(0)
    B, T, C, NH = 2, 4, 12, 3
    leaves = {name: _leaf(rng.standard_normal(shape) * 0.3, 7.0)
              for name, shape in (("wte", (9, C)), ("wpe", (T, C)), ("lnw", (C,)), ("lnb", (C,)),
                                  ("qkvw", (3 * C, C)), ("qkvb", (3 * C,)), ("fcw", (C, C)))}
    ids = rng.integers(0, 9, (B, T)).astype(np.int32)
    targets = rng.integers(0, 9, (B, T)).astype(np.int32)

    def loss():
        L = leaves
        x = nn.encoder(ids, L["wte"], L["wpe"])
        h = nn.layernorm(x, L["lnw"], L["lnb"])
        a = nn.attention(nn.linear(h, L["qkvw"], L["qkvb"]), NH)
        x = nn.residual(x, nn.gelu(nn.linear(a, L["fcw"], None)))
        x = nn.residual(x, x)                           # one buffer for both inputs
        logits = nn.linear(x, L["wte"], None)          # wte used twice
        return nn.softmax_cross_entropy(logits, targets).mean()

    for leaf in leaves.values():
        leaf.grad[...] = 0
    loss().backward()
    expected = {k: v.grad.copy() for k, v in leaves.items()}
    for leaf in leaves.values():
        if deferred:
            leaf.grad[...] = np.nan
            leaf.zero_grad(deferred=True)
        else:
            leaf.zero_grad()
    loss().backward()
    for k, v in leaves.items():
        np.testing.assert_allclose(v.grad, expected[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_unreached_deferred_leaf_reads_zero_after_apply():
    x = _leaf([1.0, 2.0], 5.0)
    unused = _leaf([3.0], 5.0)
    x.zero_grad(deferred=True)
    unused.zero_grad(deferred=True)
    (x * 3.0).sum().backward()
    np.testing.assert_allclose(x.grad, [3.0, 3.0])
    np.testing.assert_allclose(unused.grad, [5.0])      # untouched until applied
    apply_deferred_zero([x, unused])
    np.testing.assert_allclose(unused.grad, [0.0])
    np.testing.assert_allclose(x.grad, [3.0, 3.0])     # not deferred any more: kept


def _twin_models(engine, seed):
    """Two identical tiny models and a batch (x, y)."""
    config = GPT2Config.preset("tiny")
    rng = np.random.default_rng(seed)
    x = rng.integers(0, config.vocab_size, (2, 8)).astype(np.int32)
    y = rng.integers(0, config.vocab_size, (2, 8)).astype(np.int32)
    return GPT2(config, seed=0, engine=engine), GPT2(config, seed=0, engine=engine), x, y


@pytest.mark.parametrize("engine", ["tape", "manual"])
def test_train_step_gradients_equal_a_step_from_zeroed_buffers(engine):
    a, b, x, y = _twin_models(engine, 1)
    for _ in range(3):
        a.train_step(x, y, lr=1e-3, weight_decay=0.1)
        b.zero_grad()
        b.loss_and_grad(x, y)
        b.adamw_step(1e-3, weight_decay=0.1)
        np.testing.assert_array_equal(a.grads.flat, b.grads.flat)
        np.testing.assert_array_equal(a.params.flat, b.params.flat)
    # After a step the gradients count as zero for the next train_step, but a plain
    # loss_and_grad after zero_grad(deferred=True) and one after zero_grad agree.
    a.zero_grad(deferred=True)
    a.loss_and_grad(x, y)
    b.zero_grad()
    b.loss_and_grad(x, y)
    np.testing.assert_array_equal(a.grads.flat, b.grads.flat)
    a.close()
    b.close()


@pytest.mark.parametrize("engine", ["tape", "manual"])
def test_train_step_clipping_inside_adamw_equals_clipping_the_gradients_first(engine):
    # train_step clips by scaling the gradients inside AdamW; the parameters must be
    # bit-identical to clip_grad_norm (gradients rewritten in place) then AdamW, the
    # returned norm the norm before clipping, and self.grads the unclipped gradient.
    a, b, x, y = _twin_models(engine, 2)
    clipped = 0
    for grad_clip in (0.05, 1e6, 0.3):          # clipping, none needed, clipping
        _, norm = a.train_step(x, y, lr=1e-3, weight_decay=0.1, grad_clip=grad_clip)
        b.zero_grad()
        b.loss_and_grad(x, y)
        unclipped = b.grads.flat.copy()
        norm_b = b.clip_grad_norm(grad_clip)
        clipped += norm_b > grad_clip
        b.adamw_step(1e-3, weight_decay=0.1)
        assert norm == norm_b
        np.testing.assert_array_equal(a.params.flat, b.params.flat)
        np.testing.assert_array_equal(a.adam_m.flat, b.adam_m.flat)
        np.testing.assert_array_equal(a.adam_v.flat, b.adam_v.flat)
        np.testing.assert_array_equal(a.grads.flat, unclipped)
    assert clipped == 2
    a.close()
    b.close()
