"""GPT-2 against PyTorch (llm.c's test_gpt2, failing for real): logits, loss, every
parameter gradient and the losses of 10 AdamW steps on one batch."""
import numpy as np
import pytest
import torch

import torch_gpt2 as tg
from gpt2.config import GPT2Config
from gpt2.model import GPT2


def batch(config, B, T, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    return x, y


def rel_err(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / (np.abs(b).max() + 1e-12))


def check_against_torch(config, engine, B, T, logits_tol, grad_tol, loss_tol, steps=10,
                        lr=1e-3):
    torch.manual_seed(0)
    model = GPT2(config, seed=3, engine=engine)
    x, y = batch(config, B, T)
    ref = tg.build_model(config, model.params)

    logits, _ = model.forward(x)
    ref_logits, _ = tg.forward(ref, x)
    V = config.vocab_size
    assert rel_err(logits[..., :V], np.asarray(ref_logits)[..., :V]) < logits_tol

    model.zero_grad()
    loss = model.loss_and_grad(x, y)
    ref_loss, ref_grads = tg.loss_and_grads(ref, x, y)
    assert abs(loss - float(ref_loss)) < loss_tol
    for name, grad in model.grads.views.items():
        err = rel_err(grad, ref_grads[name])
        assert err < grad_tol, f"gradient of {name}: relative error {err:.2e}"

    # 10 AdamW steps on the same batch, weight decay on: the losses must track.
    ref = tg.build_model(config, model.params)
    opt = tg.make_adamw(ref, lr=lr, weight_decay=0.1)
    ours, theirs = [], []
    tx, ty = tg.as_index_tensor(x), tg.as_index_tensor(y)
    for _ in range(steps):
        loss, _ = model.train_step(x, y, lr=lr, weight_decay=0.1)
        ours.append(loss)
        theirs.append(float(tg.train_step(ref, opt, tx, ty)))
    assert theirs[-1] < theirs[0]  # the oracle itself learns
    np.testing.assert_allclose(ours, theirs, atol=loss_tol, rtol=0)
    model.close()


@pytest.mark.parametrize("engine", ["manual", "tape"])
def test_tiny_matches_pytorch(engine):
    check_against_torch(GPT2Config.preset("tiny"), engine, B=4, T=32,
                        logits_tol=1e-5, grad_tol=1e-4, loss_tol=1e-4)


def test_padded_vocab_matches_pytorch():
    config = GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=200, block_size=32)
    check_against_torch(config, "manual", B=2, T=17, logits_tol=1e-5, grad_tol=1e-4,
                        loss_tol=1e-4, steps=3)


def test_gpt2_124m_matches_pytorch():
    # llm.c's test_gpt2 settings: lr 1e-4 (a larger step on one batch makes float32
    # rounding differences grow chaotically over 10 steps, in PyTorch too)
    check_against_torch(GPT2Config.preset("gpt2"), "tape", B=1, T=16,
                        logits_tol=1e-2, grad_tol=2e-2, loss_tol=1e-2, lr=1e-4)


def test_tape_and_manual_engines_agree():
    config = GPT2Config.preset("tiny")
    x, y = batch(config, 3, 20, seed=5)
    tape = GPT2(config, seed=1, engine="tape")
    manual = GPT2(config, seed=1, engine="manual")
    for _ in range(3):
        lt, _ = tape.train_step(x, y, lr=1e-3, weight_decay=0.1)
        lm, _ = manual.train_step(x, y, lr=1e-3, weight_decay=0.1)
        assert abs(lt - lm) < 1e-6
    for name in tape.grads.views:
        assert rel_err(tape.grads.views[name], manual.grads.views[name]) < 1e-6, name
    assert rel_err(tape.params.flat, manual.params.flat) < 1e-6
    tape.close()


def test_bad_batches_get_clear_errors():
    model = GPT2(GPT2Config.preset("tiny"), engine="manual")
    x = np.zeros((2, 65), np.int32)
    with pytest.raises(ValueError, match="block_size"):
        model.forward(x)
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        model.forward(np.full((1, 4), 256))
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        model.loss_and_grad(np.zeros((1, 4), np.int32), np.full((1, 4), -1))
    with pytest.raises(ValueError, match="shape"):
        model.loss_and_grad(np.zeros((1, 4), np.int32), np.zeros((1, 5), np.int32))
    with pytest.raises(TypeError, match="integer"):
        model.forward(np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        model.forward(np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="engine"):
        GPT2(GPT2Config.preset("tiny"), engine="jit")
