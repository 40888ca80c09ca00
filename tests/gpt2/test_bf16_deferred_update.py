"""A bf16 step's AdamW update waits for the next forward pass, which writes the weights'
bf16 copies in its own pass (gpt2.state.ArenaState, Model.train_step): the same bits as
the update made at once, and every reader of the parameters or moments sees them
updated."""
import numpy as np
import pytest

import gpt2.model as gm
from adtape import nn
from gpt2 import checkpoint as ckpt
from gpt2.config import GPT2Config
from gpt2.model import GPT2

CFG = GPT2Config.preset("small")


@pytest.fixture
def bf16():
    previous = nn.set_precision("bf16")
    yield
    nn.set_precision(previous)


def batches(n, B=2, T=32, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 256, (B, T), dtype=np.int32),
             rng.integers(0, 256, (B, T), dtype=np.int32)) for _ in range(n)]


def run(defer, data, **step):
    """Losses of steps over ``data`` (clipping, accumulation as ``step`` says), an
    evaluation between them, then the model (for its parameters and moments)."""
    old = gm.DEFER_BF16_UPDATE
    gm.DEFER_BF16_UPDATE = defer
    try:
        model = GPT2(CFG, seed=0)
        losses = []
        for k, (x, y) in enumerate(data):
            losses.append(model.train_step(x, y, 1e-3, weight_decay=0.1, **step)[0])
            if k == 1:
                losses.append(model.forward(x, y, logits=False)[1])     # an evaluation
        return losses, model
    finally:
        gm.DEFER_BF16_UPDATE = old


@pytest.mark.parametrize("step", [{}, {"grad_clip": 0.5}, {"grad_accum": 2}])
def test_deferred_update_gives_the_same_bits(bf16, step):
    data = batches(4, B=4 if step.get("grad_accum") else 2)
    (deferred, m1), (eager, m2) = run(True, data, **step), run(False, data, **step)
    assert m1.state.pending is not None and m2.state.pending is None
    assert deferred == eager
    for a, b in ((m1.params, m2.params), (m1.adam_m, m2.adam_m), (m1.adam_v, m2.adam_v)):
        np.testing.assert_array_equal(a.flat, b.flat)     # the properties made the update
    assert m1.state.pending is None and m1.adam_step == m2.adam_step == len(data)
    m1.close()
    m2.close()


def test_the_forward_uses_the_copies_the_update_wrote(bf16, monkeypatch):
    # after the first step no weight is converted by the products: only activations
    model = GPT2(CFG, seed=0)
    (x, y), = batches(1)
    model.train_step(x, y, 1e-3)
    converted = []
    real = nn._bf16.to_bf16

    def counting(out, inp, **kw):
        converted.append(inp.shape)
        return real(out, inp, **kw)
    monkeypatch.setattr(nn._bf16, "to_bf16", counting)
    model.train_step(x, y, 1e-3)
    assert converted and all(shape[:2] == x.shape for shape in converted)
    model.close()


def test_checkpoints_and_exports_see_the_update(bf16, tmp_path):
    data = batches(3)
    (_, m1), (_, m2) = run(True, data), run(False, data)
    assert m1.state.pending is not None
    p1, p2 = tmp_path / "deferred.bin", tmp_path / "eager.bin"
    for model, path in ((m1, p1), (m2, p2)):
        ckpt.save_state(str(path), model.state, step=len(data))
    assert p1.read_bytes() == p2.read_bytes()
    assert m1.state.pending is None
    np.testing.assert_array_equal(m1.param_arena().flat, m2.param_arena().flat)
    m1.close()
    m2.close()


def test_no_deferral_in_fp32_or_without_the_tape_engine(bf16):
    (x, y), = batches(1)
    manual = GPT2(CFG, seed=0, engine="manual")
    manual.train_step(x, y, 1e-3)
    assert manual.state.pending is None
    manual.close()
    nn.set_precision("fp32")
    model = GPT2(CFG, seed=0)
    model.train_step(x, y, 1e-3)
    assert model.state.pending is None
    model.close()
