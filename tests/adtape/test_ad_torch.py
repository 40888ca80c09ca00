"""Tensor-mode AD against torch.autograd: random composite programs (float64) and
the GPT-2 ops on the kernels (float32), including a transformer block."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import adtape as ad
from adtape import nn
from adtape.tensor import Tensor

UNARY = ["exp", "tanh", "neg", "square", "log1p_abs", "sum_keep", "mean_keep", "transpose",
         "reshape", "slice"]
BINARY = ["add", "sub", "mul", "div", "matmul_self"]


def _apply_unary(name, x, lib):
    if name == "exp":
        return lib["exp"](x * 0.3)
    if name == "tanh":
        return lib["tanh"](x)
    if name == "neg":
        return -x
    if name == "square":
        return x ** 2.0
    if name == "log1p_abs":
        return lib["log"](x * x + 1.0)
    if name == "sum_keep":
        return x.sum(**{lib["axis"]: -1, lib["keep"]: True}) + x
    if name == "mean_keep":
        return x.mean(**{lib["axis"]: 0, lib["keep"]: True}) * x
    if name == "transpose":
        return x.T
    if name == "reshape":
        return x.reshape(x.shape[::-1])
    return x[1:3].sum(0) * x


def _apply_binary(name, x, y):
    if name == "add":
        return x + y
    if name == "sub":
        return x - y
    if name == "mul":
        return x * y
    if name == "div":
        return x / (y * y + 1.0)
    return x @ y.T


def random_program(seed, n_ops=30):
    """A random program over a pool of 4x4 values, as (op, operand indices) steps."""
    rng = np.random.default_rng(seed)
    steps = []
    for i in range(n_ops):
        if rng.random() < 0.5:
            steps.append(("u", UNARY[rng.integers(len(UNARY))], int(rng.integers(0, 3 + i))))
        else:
            steps.append(("b", BINARY[rng.integers(len(BINARY))], int(rng.integers(0, 3 + i)),
                          int(rng.integers(0, 3 + i))))
    return steps


def run_program(steps, inputs, lib):
    pool = list(inputs)
    for step in steps:
        if step[0] == "u":
            out = _apply_unary(step[1], pool[step[2]], lib)
        else:
            out = _apply_binary(step[1], pool[step[2]], pool[step[3]])
        pool.append(lib["tanh"](out))
    total = pool[-1]
    for v in pool[3:]:
        total = total + v * 0.1
    return total.sum()


OURS = {"exp": ad.exp, "tanh": ad.tanh, "log": ad.log, "axis": "axis", "keep": "keepdims"}
TORCH = {"exp": torch.exp, "tanh": torch.tanh, "log": torch.log, "axis": "dim", "keep": "keepdim"}


@pytest.mark.parametrize("seed", range(25))
def test_random_programs_match_torch(seed):
    steps = random_program(seed)
    rng = np.random.default_rng(1000 + seed)
    arrays = [rng.standard_normal((4, 4)) for _ in range(3)]
    ours = [Tensor(a, requires_grad=True) for a in arrays]
    value = run_program(steps, ours, OURS)
    value.backward()
    theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
    ref = run_program(steps, theirs, TORCH)
    ref.backward()
    np.testing.assert_allclose(float(value), ref.item(), rtol=1e-12)
    for a, b in zip(ours, theirs):
        if b.grad is None:
            assert a.grad is None
        else:
            np.testing.assert_allclose(a.grad, b.grad.numpy(), rtol=1e-9, atol=1e-12)


def test_broadcasting_matches_torch():
    rng = np.random.default_rng(7)
    a, b, c = rng.standard_normal((2, 1, 4)), rng.standard_normal((3, 1)), rng.standard_normal(4)
    ours = [Tensor(v, requires_grad=True) for v in (a, b, c)]
    theirs = [torch.tensor(v, requires_grad=True) for v in (a, b, c)]
    for xs, lib in ((ours, OURS), (theirs, TORCH)):
        x, y, z = xs
        (lib["tanh"](x * y + z) / (1.0 + z * z) - y).sum().backward()
    for o, t in zip(ours, theirs):
        np.testing.assert_allclose(o.grad, t.grad.numpy(), rtol=1e-12)


def _f32(rng, *shape, scale=0.2):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def _gpt2_params(rng, C, Vp, V, T):
    p = dict(wte=_f32(rng, Vp, C, scale=0.1), wpe=_f32(rng, T, C, scale=0.1),
             lnw=1 + _f32(rng, C, scale=0.1), lnb=_f32(rng, C, scale=0.1),
             qw=_f32(rng, 3 * C, C), qb=_f32(rng, 3 * C, scale=0.1), pw=_f32(rng, C, C),
             pb=_f32(rng, C, scale=0.1), fw=_f32(rng, 4 * C, C), fb=_f32(rng, 4 * C, scale=0.1),
             f2w=_f32(rng, C, 4 * C), f2b=_f32(rng, C, scale=0.1))
    p["wte"][V:] = 0
    return p


def _ours_gpt2(p, ids, targets, NH, V):
    t = {k: Tensor(v, requires_grad=True) for k, v in p.items()}
    x = nn.encoder(ids, t["wte"], t["wpe"])
    h = nn.layernorm(x, t["lnw"], t["lnb"])
    x = nn.residual(x, nn.linear(nn.attention(nn.linear(h, t["qw"], t["qb"]), NH),
                                 t["pw"], t["pb"]))
    h = nn.gelu(nn.linear(nn.layernorm(x, t["lnw"], t["lnb"]), t["fw"], t["fb"]))
    x = nn.residual(x, nn.linear(h, t["f2w"], t["f2b"]))
    loss = nn.softmax_cross_entropy(nn.linear(x, t["wte"]), targets, V).mean()
    loss.backward()
    return float(loss), {k: v.grad for k, v in t.items()}


def _torch_gpt2(p, ids, targets, NH, V):
    t = {k: torch.tensor(v, requires_grad=True) for k, v in p.items()}
    B, T = ids.shape
    C = p["wpe"].shape[1]
    x = t["wte"][torch.tensor(ids, dtype=torch.long)] + t["wpe"][:T]
    qkv = F.linear(F.layer_norm(x, (C,), t["lnw"], t["lnb"], 1e-5), t["qw"], t["qb"])
    q, k, v = (z.view(B, T, NH, C // NH).transpose(1, 2) for z in qkv.split(C, dim=2))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
    x = x + F.linear(a, t["pw"], t["pb"])
    h = F.gelu(F.linear(F.layer_norm(x, (C,), t["lnw"], t["lnb"], 1e-5), t["fw"], t["fb"]),
               approximate="tanh")
    x = x + F.linear(h, t["f2w"], t["f2b"])
    logits = F.linear(x, t["wte"])[..., :V]
    loss = F.cross_entropy(logits.reshape(-1, V),
                           torch.tensor(targets, dtype=torch.long).reshape(-1))
    loss.backward()
    return loss.item(), {k: v.grad.numpy() for k, v in t.items()}


def test_gpt2_block_matches_torch():
    rng = np.random.default_rng(3)
    B, T, C, NH, V, Vp = 2, 8, 16, 4, 50, 64
    p = _gpt2_params(rng, C, Vp, V, T)
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    loss, grads = _ours_gpt2(p, ids, targets, NH, V)
    ref_loss, ref_grads = _torch_gpt2(p, ids, targets, NH, V)
    assert abs(loss - ref_loss) < 1e-5
    for k in p:
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-3, atol=2e-6, err_msg=k)
    assert not grads["wte"][V:].any()


@pytest.mark.parametrize("op", ["layernorm", "gelu", "linear", "linear_nobias", "gelu_linear",
                                "residual", "residual_same", "attention", "attention_linear",
                                "softmax_cross_entropy"])
def test_gpt2_op_gradients_match_torch(op):
    rng = np.random.default_rng(11)
    B, T, C, NH = 2, 5, 12, 3
    x = _f32(rng, B, T, C, scale=1.0)
    w = 1 + _f32(rng, C)
    b = _f32(rng, C)
    W = _f32(rng, 2 * C, C)
    qkv = _f32(rng, B, T, 3 * C, scale=1.0)
    targets = rng.integers(0, C - 2, (B, T)).astype(np.int32)

    def build(lib, X, Wt, bt, Wm, Q):
        if op == "layernorm":
            return (nn.layernorm(X, Wt, bt) if lib == "ours"
                    else F.layer_norm(X, (C,), Wt, bt, 1e-5))
        if op == "gelu":
            return nn.gelu(X) if lib == "ours" else F.gelu(X, approximate="tanh")
        if op == "linear":
            return nn.linear(X, Wm, Wm[:, 0] * 1.0) if lib == "ours" else F.linear(X, Wm, Wm[:, 0])
        if op == "gelu_linear":
            return (nn.gelu_linear(X, Wm, Wm[:, 0] * 1.0) if lib == "ours"
                    else F.linear(F.gelu(X, approximate="tanh"), Wm, Wm[:, 0]))
        if op == "linear_nobias":
            return nn.linear(X, Wm) if lib == "ours" else F.linear(X, Wm)
        if op == "residual":
            return nn.residual(X, X * bt) if lib == "ours" else X + X * bt
        if op == "residual_same":
            return nn.residual(X, X) if lib == "ours" else X + X
        if op in ("attention", "attention_linear"):
            if lib == "ours":
                return (nn.attention(Q, NH) if op == "attention"
                        else nn.attention_linear(Q, NH, Wm, Wm[:, 1] * 1.0))
            q, k, v = (z.view(B, T, NH, C // NH).transpose(1, 2) for z in Q.split(C, dim=2))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2) \
                .reshape(B, T, C)
            return a if op == "attention" else F.linear(a, Wm, Wm[:, 1])
        if lib == "ours":
            return nn.softmax_cross_entropy(X, targets, C - 2)
        return F.cross_entropy(X[..., :C - 2].reshape(-1, C - 2),
                               torch.tensor(targets, dtype=torch.long).reshape(-1),
                               reduction="none").reshape(B, T)

    seed_shape = build("torch", *(torch.tensor(a) for a in (x, w, b, W, qkv))).shape
    seed = _f32(rng, *seed_shape, scale=1.0)
    ours = [Tensor(a, requires_grad=True) for a in (x, w, b, W, qkv)]
    out = build("ours", *ours)
    out.backward(seed=seed)
    theirs = [torch.tensor(a, requires_grad=True) for a in (x, w, b, W, qkv)]
    ref = build("torch", *theirs)
    ref.backward(torch.tensor(seed))
    np.testing.assert_allclose(out.data, ref.detach().numpy(), rtol=1e-4, atol=1e-5)
    for o, t in zip(ours, theirs):
        if t.grad is None:
            assert o.grad is None
        else:
            np.testing.assert_allclose(o.grad, t.grad.numpy(), rtol=1e-3, atol=1e-5)
    if op == "softmax_cross_entropy":
        assert not ours[0].grad[..., C - 2:].any()
