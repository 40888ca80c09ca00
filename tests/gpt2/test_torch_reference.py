"""The PyTorch GPT-2 oracle (bench/torch_gpt2.py) checked against a plain numpy GPT-2.

The numpy model is written from the GPT-2 equations in float64; the oracle must match its
logits and loss, its gradients must match finite differences of it, and its AdamW step must
match the decoupled-weight-decay update written out by hand.
"""
import math

import numpy as np
import pytest
import torch

import torch_gpt2
from gpt2.config import GPT2Config
from gpt2.params import ParamArena, init_params_, param_shapes

TINY = GPT2Config.preset("tiny")
PADDED = GPT2Config(n_layer=2, n_head=4, n_embd=16, vocab_size=200, block_size=16)


def random_params(config, seed):
    """GPT-2 init plus noise on every tensor (biases, layernorms), padded wte rows left non-zero
    on purpose: the loss must ignore the padded logits whatever they hold."""
    arena = init_params_(ParamArena(config), seed)
    rng = np.random.default_rng(seed)
    arena.flat += rng.standard_normal(arena.flat.size, dtype=np.float32) * 0.05
    return arena


def batch(config, B, T, seed):
    rng = np.random.default_rng(seed + 1)
    return (rng.integers(0, config.vocab_size, (B, T)).astype(np.int32),
            rng.integers(0, config.vocab_size, (B, T)).astype(np.int32))


def layernorm(x, w, b):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * w + b


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def numpy_gpt2(p, config, idx, targets):
    """(logits (B, T, Vp), mean cross-entropy over the real vocab), float64."""
    B, T = idx.shape
    C, NH = config.n_embd, config.n_head
    hs = C // NH
    x = p["wte"][idx] + p["wpe"][:T]
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    for l in range(config.n_layer):
        qkv = layernorm(x, p["ln1w"][l], p["ln1b"][l]) @ p["qkvw"][l].T + p["qkvb"][l]
        q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, NH, hs).transpose(0, 2, 1, 3)
                   for i in range(3))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hs)
        scores[..., future] = -np.inf
        att = np.exp(scores - scores.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
        x = x + y @ p["attprojw"][l].T + p["attprojb"][l]
        h = gelu_tanh(layernorm(x, p["ln2w"][l], p["ln2b"][l]) @ p["fcw"][l].T + p["fcb"][l])
        x = x + h @ p["fcprojw"][l].T + p["fcprojb"][l]
    logits = layernorm(x, p["lnfw"], p["lnfb"]) @ p["wte"].T
    real = logits[..., :config.vocab_size]
    top = real.max(-1, keepdims=True)
    logsumexp = np.log(np.exp(real - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(real, targets[..., None].astype(np.int64), -1)[..., 0]
    return logits, float((logsumexp - picked).mean())


def as_float64(arena):
    return {name: view.astype(np.float64) for name, view in arena.views.items()}


@pytest.mark.parametrize("config", [TINY, PADDED], ids=["tiny", "padded-vocab"])
def test_forward_matches_numpy(config):
    params = random_params(config, 0)
    inputs, targets = batch(config, 3, 11, 0)
    logits, loss = torch_gpt2.forward(torch_gpt2.build_model(config, params), inputs, targets)
    ref_logits, ref_loss = numpy_gpt2(as_float64(params), config, inputs, targets)
    assert logits.shape == (3, 11, config.padded_vocab_size)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    logits_only, no_loss = torch_gpt2.forward(torch_gpt2.build_model(config, params), inputs)
    assert no_loss is None
    np.testing.assert_array_equal(logits_only, logits)


def test_full_block_size_sequence_and_too_long():
    params = random_params(TINY, 1)
    model = torch_gpt2.build_model(TINY, params)
    inputs, targets = batch(TINY, 1, TINY.block_size, 1)
    _, loss = torch_gpt2.forward(model, inputs, targets)
    assert loss == pytest.approx(numpy_gpt2(as_float64(params), TINY, inputs, targets)[1],
                                 rel=1e-5)
    too_long, _ = batch(TINY, 1, TINY.block_size + 1, 1)
    with pytest.raises(ValueError, match="exceeds block_size 64"):
        torch_gpt2.forward(model, too_long)


def test_gradients_match_finite_differences_of_numpy_model():
    config = PADDED
    params = random_params(config, 2)
    inputs, targets = batch(config, 2, 7, 2)
    model = torch_gpt2.build_model(config, params, dtype=torch.float64)
    loss, grads = torch_gpt2.loss_and_grads(model, inputs, targets)
    p = as_float64(params)
    assert loss == pytest.approx(numpy_gpt2(p, config, inputs, targets)[1], rel=1e-12)
    assert list(grads) == list(param_shapes(config))
    rng = np.random.default_rng(0)
    eps = 1e-6
    for name, shape in param_shapes(config).items():
        assert grads[name].shape == shape
        for _ in range(3):
            index = tuple(int(rng.integers(0, n)) for n in shape)
            if name == "wte":  # rows that the batch touches, so the check is not vacuous
                index = (int(inputs[0, 0]), index[1])
            saved = p[name][index]
            p[name][index] = saved + eps
            up = numpy_gpt2(p, config, inputs, targets)[1]
            p[name][index] = saved - eps
            down = numpy_gpt2(p, config, inputs, targets)[1]
            p[name][index] = saved
            assert grads[name][index] == pytest.approx((up - down) / (2 * eps), rel=1e-5,
                                                       abs=1e-9), (name, index)
    assert not grads["wte"][config.vocab_size:].any(), "padded columns must not get gradient"


def test_float32_gradients_track_float64():
    params = random_params(TINY, 3)
    inputs, targets = batch(TINY, 2, 16, 3)
    _, g32 = torch_gpt2.loss_and_grads(torch_gpt2.build_model(TINY, params), inputs, targets)
    _, g64 = torch_gpt2.loss_and_grads(
        torch_gpt2.build_model(TINY, params, dtype=torch.float64), inputs, targets)
    for name in g32:
        assert g32[name].dtype == np.float32
        np.testing.assert_allclose(g32[name], g64[name], rtol=1e-3, atol=1e-5, err_msg=name)


def test_adamw_steps_match_decoupled_weight_decay_by_hand():
    config, lr, betas, eps, wd = TINY, 1e-2, (0.9, 0.95), 1e-8, 0.1
    params = random_params(config, 4)
    model = torch_gpt2.build_model(config, params, dtype=torch.float64)
    optimizer = torch_gpt2.make_adamw(model, lr=lr, betas=betas, eps=eps, weight_decay=wd)
    p = as_float64(params)
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(val) for k, val in p.items()}
    for t in range(1, 4):
        inputs, targets = batch(config, 2, 8, 10 + t)
        _, grads = torch_gpt2.loss_and_grads(model, inputs, targets)
        optimizer.step()
        for name in p:
            g = grads[name]
            m[name] = betas[0] * m[name] + (1 - betas[0]) * g
            v[name] = betas[1] * v[name] + (1 - betas[1]) * g * g
            m_hat = m[name] / (1 - betas[0] ** t)
            v_hat = v[name] / (1 - betas[1] ** t)
            p[name] = p[name] * (1 - lr * wd) - lr * m_hat / (np.sqrt(v_hat) + eps)
        after = model.params_numpy()
        for name in p:
            np.testing.assert_allclose(after[name], p[name], rtol=1e-10, atol=1e-12,
                                       err_msg=f"step {t} {name}")
    assert len(optimizer.param_groups[0]["params"]) == len(list(model.parameters()))


def test_train_step_lowers_loss_on_a_fixed_batch():
    params = random_params(TINY, 5)
    model = torch_gpt2.build_model(TINY, params)
    optimizer = torch_gpt2.make_adamw(model, lr=1e-3, weight_decay=0.1)
    inputs, targets = (torch_gpt2.as_index_tensor(a) for a in batch(TINY, 4, 32, 5))
    losses = [torch_gpt2.train_step(model, optimizer, inputs, targets) for _ in range(10)]
    assert losses[-1] < losses[0] - 0.5
    # wte, wpe, 12 tensors per block, final layernorm: no separate LM head (tied to wte)
    assert sum(1 for _ in model.parameters()) == 2 + 12 * TINY.n_layer + 2


def test_layout_round_trip_and_bad_layouts():
    params = random_params(TINY, 6)
    model = torch_gpt2.build_model(TINY, params.views)
    back = model.params_numpy()
    for name, view in params.views.items():
        np.testing.assert_array_equal(back[name], view)
    with pytest.raises(KeyError, match="'lnfb' missing"):
        torch_gpt2.build_model(TINY, {k: v for k, v in params.views.items() if k != "lnfb"})
    with pytest.raises(ValueError, match="'qkvw' has shape"):
        torch_gpt2.build_model(TINY, {**params.views, "qkvw": params.qkvw[:1]})
    with pytest.raises(ValueError, match=r"inputs must be an integer array of shape \(B, T\)"):
        torch_gpt2.forward(model, np.zeros(5, np.int32))
