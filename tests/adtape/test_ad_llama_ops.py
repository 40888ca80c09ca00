"""The Llama ops of adtape.nn (rmsnorm, rope, swiglu, swiglu_linear) against torch.autograd
in float64 on the same float32 inputs, alone and in a Llama block; their overwriting rules
(fresh and deferred-zero gradient buffers); and adtape.check_grads through float32 casts."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import adtape as ad
from adtape import nn
from adtape.tensor import Tensor
from kernels.llama import rope_tables

EPS = 1e-5


def _f32(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def _t64(a, grad=True):
    return torch.tensor(np.asarray(a, np.float64), requires_grad=grad)


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)


def torch_rmsnorm(x, w, eps=EPS):
    """Hugging Face's LlamaRMSNorm."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def torch_rope(qkv, cos, sin, head_dim, n_rot):
    """Hugging Face's apply_rotary_pos_emb on the first n_rot heads of a (B, T, W) row."""
    B, T, W = qkv.shape
    heads = qkv.reshape(B, T, W // head_dim, head_dim)
    c = torch.cat([_t64(cos[:T], False)] * 2, -1)[None, :, None]
    s = torch.cat([_t64(sin[:T], False)] * 2, -1)[None, :, None]
    rot = heads[:, :, :n_rot] * c + _rotate_half(heads[:, :, :n_rot]) * s
    return torch.cat([rot, heads[:, :, n_rot:]], 2).reshape(B, T, W)


def torch_swiglu(gate_up):
    I = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :I]) * gate_up[..., I:]


HEAD_DIM, N_Q, N_KV, T = 16, 3, 1, 9
COS, SIN = rope_tables(HEAD_DIM, T + 3, 10000.0)


def _case(op, rng):
    """(arrays, ours(*tensors), theirs(*torch tensors)) for one op."""
    if op in ("rmsnorm", "rmsnorm_rows"):
        shape = (2, T, 24) if op == "rmsnorm" else (7, 24)
        return ([_f32(rng, *shape, scale=2.0), 1 + _f32(rng, 24, scale=0.3)],
                lambda x, w: nn.rmsnorm(x, w, EPS), torch_rmsnorm)
    if op == "rope":
        W = (N_Q + 2 * N_KV) * HEAD_DIM
        return ([_f32(rng, 2, T, W)], lambda q: nn.rope(q, COS, SIN, N_Q + N_KV),
                lambda q: torch_rope(q, COS, SIN, HEAD_DIM, N_Q + N_KV))
    if op == "swiglu":
        return [_f32(rng, 2, T, 2 * 20, scale=3.0)], nn.swiglu, torch_swiglu
    return ([_f32(rng, 2, T, 2 * 20, scale=3.0), _f32(rng, 7, 20, scale=0.3), _f32(rng, 7)],
            nn.swiglu_linear, lambda g, w, b: F.linear(torch_swiglu(g), w, b))


OPS = ["rmsnorm", "rmsnorm_rows", "rope", "swiglu", "swiglu_linear"]


@pytest.mark.parametrize("op", OPS)
def test_llama_op_gradients_match_torch(op):
    rng = np.random.default_rng(1)
    arrays, ours_fn, theirs_fn = _case(op, rng)
    ours = [Tensor(a, requires_grad=True) for a in arrays]
    out = ours_fn(*ours)
    seed = _f32(rng, *out.shape)
    out.backward(seed=seed)
    theirs = [_t64(a) for a in arrays]
    ref = theirs_fn(*theirs)
    ref.backward(_t64(seed, False))
    assert out.data.dtype == np.float32
    np.testing.assert_allclose(out.data, ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    for o, t in zip(ours, theirs):
        np.testing.assert_allclose(o.grad, t.grad.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", OPS)
def test_llama_ops_without_gradients(op):
    rng = np.random.default_rng(2)
    arrays, ours_fn, _ = _case(op, rng)
    with ad.no_grad():
        plain = ours_fn(*[Tensor(a, requires_grad=True) for a in arrays])
    assert not plain.requires_grad
    np.testing.assert_array_equal(plain.data, ours_fn(*arrays).data)


def test_rmsnorm_gradient_of_one_input_alone():
    # The kernel writes both gradients: the one nobody asked for goes to scratch.
    rng = np.random.default_rng(3)
    x, w = _f32(rng, 2, 5, 12), 1 + _f32(rng, 12, scale=0.3)
    seed = _f32(rng, 2, 5, 12)
    tx, tw = _t64(x), _t64(w)
    torch_rmsnorm(tx, tw).backward(_t64(seed, False))
    for grad_x in (True, False):
        ox, ow = Tensor(x, requires_grad=grad_x), Tensor(w, requires_grad=not grad_x)
        nn.rmsnorm(ox, ow, EPS).backward(seed=seed)
        got, want = (ox.grad, tx.grad) if grad_x else (ow.grad, tw.grad)
        assert (ow.grad if grad_x else ox.grad) is None
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


def _block(lib, p, x, n_head, head_dim, cos, sin):
    """A Llama block (multi-head attention: n_kv_head = n_head), x (B, T, C)."""
    C = x.shape[-1]
    if lib == "ours":
        h = nn.rmsnorm(x, p["rms1"], EPS)
        qkv = nn.rope(nn.linear(h, p["qkv"]), cos, sin, 2 * n_head)
        x = nn.residual(x, nn.linear(nn.attention(qkv, n_head), p["o"]))
        h = nn.swiglu(nn.linear(nn.rmsnorm(x, p["rms2"], EPS), p["gate_up"]))
        return nn.residual(x, nn.linear(h, p["down"]))
    B, T, _ = x.shape
    h = torch_rmsnorm(x, p["rms1"])
    qkv = torch_rope(F.linear(h, p["qkv"]), cos, sin, head_dim, 2 * n_head)
    q, k, v = (z.view(B, T, n_head, head_dim).transpose(1, 2) for z in qkv.split(C, dim=2))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
    x = x + F.linear(a, p["o"])
    h = torch_swiglu(F.linear(torch_rmsnorm(x, p["rms2"]), p["gate_up"]))
    return x + F.linear(h, p["down"])


def test_llama_block_matches_torch():
    rng = np.random.default_rng(4)
    B, T, n_head, head_dim, I = 2, 11, 2, 16, 40
    C = n_head * head_dim
    cos, sin = rope_tables(head_dim, T, 10000.0)
    params = {"rms1": 1 + _f32(rng, C, scale=0.2), "rms2": 1 + _f32(rng, C, scale=0.2),
              "qkv": _f32(rng, 3 * C, C, scale=0.3), "o": _f32(rng, C, C, scale=0.3),
              "gate_up": _f32(rng, 2 * I, C, scale=0.3), "down": _f32(rng, C, I, scale=0.3)}
    x = _f32(rng, B, T, C)
    seed = _f32(rng, B, T, C)
    ours = {k: Tensor(v, requires_grad=True) for k, v in params.items()}
    ox = Tensor(x, requires_grad=True)
    out = _block("ours", ours, ox, n_head, head_dim, cos, sin)
    out.backward(seed=seed)
    theirs = {k: _t64(v) for k, v in params.items()}
    tx = _t64(x)
    ref = _block("torch", theirs, tx, n_head, head_dim, cos, sin)
    ref.backward(_t64(seed, False))
    # each element within 1e-4 of itself or 1e-5 of the largest (sums that cancel)
    pairs = [("out", out.data, ref.detach()), ("x", ox.grad, tx.grad)]
    pairs += [(k, ours[k].grad, theirs[k].grad) for k in params]
    for name, got, want in pairs:
        want = want.numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(),
                                   err_msg=name)


@pytest.mark.parametrize("deferred", [False, True])
def test_overwriting_rules_match_accumulating_into_zeros(deferred):
    # Each op's rule writes a fresh gradient buffer and adds into a running one: x feeds
    # rmsnorm, the rope's pass-through and the residual, w two rmsnorms, gate_up swiglu
    # and swiglu_linear.
    rng = np.random.default_rng(5)
    W = (N_Q + 2 * N_KV) * HEAD_DIM
    x = Tensor(_f32(rng, 2, T, W), requires_grad=True)
    w = Tensor(1 + _f32(rng, W, scale=0.3), requires_grad=True)
    up = Tensor(_f32(rng, 2 * W, W, scale=0.2), requires_grad=True)
    down = Tensor(_f32(rng, W, W, scale=0.2), requires_grad=True)
    leaves = (x, w, up, down)

    def loss():
        h = nn.rope(nn.rmsnorm(x, w, EPS), COS, SIN, N_Q + N_KV)
        h = nn.residual(nn.rope(x, COS, SIN, N_Q), h)
        gate_up = nn.linear(nn.rmsnorm(h, w, EPS), up)
        h = nn.residual(nn.swiglu(gate_up), nn.swiglu_linear(gate_up, down, None))
        return (nn.residual(h, x) * 0.5).sum()

    for leaf in leaves:
        leaf.grad = np.zeros_like(leaf.data)
    loss().backward()
    expected = [leaf.grad.copy() for leaf in leaves]
    for leaf in leaves:
        if deferred:
            leaf.grad[...] = np.nan
            leaf.zero_grad(deferred=True)
        else:
            leaf.zero_grad()
    loss().backward()
    for leaf, want in zip(leaves, expected):
        np.testing.assert_allclose(leaf.grad, want, rtol=1e-5, atol=1e-7)


# check_grads: central differences of the float32 ops, reached through float64 casts, with a
# step and tolerance that float32 rounding allows (a step of 3e-3 keeps the rounding of
# the outputs, about 1e-7, small against the differences).

@ad.primitive
def as_f32(x):
    return np.ascontiguousarray(x, np.float32)


@ad.primitive
def as_f64(x):
    return np.asarray(x, np.float64)


ad.defvjp(as_f32, lambda g, ans, x: np.asarray(g, np.float64))
ad.defvjp(as_f64, lambda g, ans, x: np.ascontiguousarray(g, np.float32))


@pytest.mark.parametrize("op", OPS)
def test_llama_ops_pass_check_grads(op):
    rng = np.random.default_rng(6)
    arrays, ours_fn, _ = _case(op, rng)

    def f(*xs):
        return as_f64(ours_fn(*(as_f32(a) for a in xs)))
    ad.check_grads(f, *(a.astype(np.float64) for a in arrays), eps=3e-3, rtol=2e-3, atol=1e-5,
                   n_directions=4)
