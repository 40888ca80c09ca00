"""Attention that keeps O(T) for the backward: log-sum-exps in place of the T x T
probabilities, recomputed tile by tile (FlashAttention-2's backward)."""
import numpy as np
import pytest

from gpt2.config import GPT2Config
from gpt2.model import GPT2, ActivationArena
from kernels.attention import (attention_backward, attention_backward_naive,
                               attention_forward, attention_forward_naive)


def make(rng, B, T, C):
    return (rng.standard_normal((B, T, 3 * C)).astype(np.float32),
            rng.standard_normal((B, T, C)).astype(np.float32))


def rel_err(actual, expected):
    return float(np.abs(np.asarray(actual, np.float64) - expected).max()
                 / max(float(np.abs(expected).max()), 1e-30))


# Around every block edge of the kernel: the 64-row query and key blocks (63, 64, 65,
# 127, 128, 129) and the 256-row depth block of packed K (255, 256, 257).
EDGES = [1, 63, 64, 65, 127, 128, 129, 255, 256, 257]


@pytest.mark.parametrize("T", EDGES)
def test_block_edges_against_the_float64_twin(T, vector_lanes):
    rng = np.random.default_rng(T)
    B, C, NH = 1, 128, 2
    qkv, dout = make(rng, B, T, C)
    out, lse = np.empty((B, T, C), np.float32), np.empty((B, NH, T), np.float32)
    attention_forward(out, lse, qkv, NH)
    q64, d64 = qkv.astype(np.float64), dout.astype(np.float64)
    out64, lse64 = np.empty((B, T, C)), np.empty((B, NH, T))
    attention_forward_naive(out64, lse64, q64, NH)
    assert rel_err(out, out64) < 1e-5
    assert rel_err(lse, lse64) < 1e-5
    dqkv = np.zeros_like(qkv)
    attention_backward(dqkv, dout, qkv, out, lse, NH)
    dqkv64 = np.zeros_like(q64)
    attention_backward_naive(dqkv64, d64, q64, out64, lse64, NH)
    assert rel_err(dqkv, dqkv64) < 1e-5


@pytest.mark.parametrize("T", [1, 7, 64, 65, 100, 129, 300])
def test_overwrite_never_reads_dqkv(T, vector_lanes):
    # With overwrite each slice of dqkv is written by its first product (dq at key
    # block 0, dk and dv at the diagonal tile) rather than zeroed first: NaN left in
    # dqkv must not reach the result, which is the bits of adding into zeros.
    rng = np.random.default_rng(100 + T)
    B, C, NH = 2, 64, 2
    qkv, dout = make(rng, B, T, C)
    out, lse = np.empty((B, T, C), np.float32), np.empty((B, NH, T), np.float32)
    attention_forward(out, lse, qkv, NH)
    added = np.zeros_like(qkv)
    attention_backward(added, dout, qkv, out, lse, NH)
    written = np.full_like(qkv, np.nan)
    attention_backward(written, dout, qkv, out, lse, NH, overwrite=True)
    np.testing.assert_array_equal(written, added)


def test_nothing_t_by_t_is_kept():
    # The probabilities alone would be NH * T * T floats per layer; now the tape
    # engine's saved bytes and the manual engine's arena are linear in T.
    config = GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=256, block_size=512)
    B, T = 1, 512
    probabilities = config.n_layer * B * config.n_head * T * T * 4
    arena = ActivationArena(config, B, T)
    assert arena.att_lse.shape == (config.n_layer, B, config.n_head, T)
    assert arena.flat.nbytes < probabilities / 2
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (B, T)).astype(np.int32)
    y = rng.integers(0, 256, (B, T)).astype(np.int32)
    saved = {}
    for engine in ("tape", "manual"):
        model = GPT2(config, seed=0, engine=engine)
        saved[engine] = model.train_step(x, y, lr=1e-3, weight_decay=0.0)[0]
        if engine == "tape":
            assert 0 < model._tape_engine.last_forward_bytes < probabilities / 2
    assert saved["tape"] == pytest.approx(saved["manual"], rel=1e-6)
