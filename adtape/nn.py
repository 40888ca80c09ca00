"""GPT-2 ops for tensors: each op runs its OpenMP kernel from ``kernels``.

The forward kernels write into freshly allocated outputs; the backward kernels
accumulate (+=), so these ops register accumulating rules
(``defvjp_accumulate``): the sweep hands them the gradient buffers (a leaf's
``.grad``, e.g. a view into a gradient arena, or a running buffer of an
intermediate) and nothing is allocated or copied per gradient.  The rules are
registered with ``overwrite=True``: a buffer that holds no gradient yet (a new
intermediate's, or a leaf's after ``zero_grad(deferred=True)``) is handed over
uninitialised and the kernel writes it (its ``overwrite`` flag) rather than
adding into zeros, which saves zeroing it and reading it back.  Everything is
float32 (the linear layers' and attention's products take bf16 operands under
``set_precision("bf16")``); the kernels check shapes and dtypes and name the offending
argument.
"""
import numpy as np

from kernels import attention as _attention
from kernels import bf16 as _bf16
from kernels import layers as _layers
from kernels import llama as _llama
from kernels import loss as _loss
from kernels import lora as _lora
from kernels import matmul as _matmul

from adtape import buffers as _buffers
from adtape import numpy as anp
from adtape.tensor import Primitive, Tensor, _constant, _record, _state, defvjp, defvjp_accumulate

__all__ = ["set_precision", "get_precision", "weights_changed", "provide_bf16_copy",
           "set_bf16_targets", "drop_bf16_targets",
           "encoder", "layernorm", "gelu", "residual", "linear", "gelu_linear", "attention",
           "attention_linear", "softmax_cross_entropy", "IGNORE_INDEX", "loss_denominator",
           "mean_cross_entropy", "take_rows", "rmsnorm", "rope", "swiglu",
           "swiglu_linear", "lora_linear", "softmax", "log_softmax"]

ENCODER = Primitive("encoder", ("ids", "wte", "wpe"))
LAYERNORM = Primitive("layernorm", ("x", "weight", "bias"))
GELU = Primitive("gelu", ("x",))
RESIDUAL = Primitive("residual", ("x", "y"))
LINEAR = Primitive("linear", ("x", "weight", "bias"))
GELU_LINEAR = Primitive("gelu_linear", ("x", "weight", "bias"))
ATTENTION = Primitive("attention", ("qkv",))
ATTENTION_LINEAR = Primitive("attention_linear", ("qkv", "weight", "bias"))
SOFTMAX_CROSS_ENTROPY = Primitive("softmax_cross_entropy", ("logits", "targets"))
RMSNORM = Primitive("rmsnorm", ("x", "weight"))
ROPE = Primitive("rope", ("qkv",))
SWIGLU = Primitive("swiglu", ("gate_up",))
SWIGLU_LINEAR = Primitive("swiglu_linear", ("gate_up", "weight", "bias"))
LORA_LINEAR = Primitive("lora_linear", ("x", "weight", "bias", "a", "b"))
TAKE_ROWS = Primitive("take_rows", ("x",))


def _data(x):
    return x.data if type(x) is Tensor else x


def _needs_grad(*xs):
    if not _state.enabled:
        return False
    for x in xs:
        if type(x) is Tensor and x.requires_grad:
            return True
    return False


def _contiguous(g):
    return g if g.flags.c_contiguous and g.dtype == np.float32 else np.ascontiguousarray(
        g, dtype=np.float32)


def _or_scratch(dest, fresh, like):
    # A kernel that always writes every gradient gets a throwaway buffer for unneeded
    # ones, which it overwrites: -> (buffer, overwrite flag).
    return (dest, fresh) if dest is not None else (_buffers.empty_like(like), True)


# -- precision of the matrix products ---------------------------------------------
# "fp32": float32 operands.  "bf16": the products take bf16 operands (inputs rounded to
# nearest even) and sum in float32 (kernels.bf16: VDPBF16PS where the CPU has it,
# exact widening and fp32 FMAs elsewhere), attention's too (kernels.attention's
# precision="bf16": q, k, v and the probabilities rounded, the softmax float32);
# everything else stays float32.  A linear layer saves its input for the backward in
# bf16 (half the bytes), the weights' bf16 copies are made once per forward pass
# (``weights_changed`` drops them).
PRECISIONS = ("fp32", "bf16")
_precision = "fp32"
_bf16_weights = {}          # id(weight array) -> (weight array, its bf16 copy)
# id(weight array) -> (weight array, where its bf16 copy is written when one is made):
# kept across weights_changed(), so that a model's copies live in one place of its own
# (gpt2.state.ArenaState's arena of them) instead of buffers allocated every step.
_bf16_targets = {}


def set_precision(name):
    """Run the linear layers' and attention's products in ``name`` ("fp32" or "bf16");
    returns the previous one.  Drops the weights' bf16 copies."""
    global _precision
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {name!r}")
    previous, _precision = _precision, name
    _bf16_weights.clear()
    return previous


def get_precision():
    return _precision


def weights_changed():
    """The weights changed (an optimizer step, a load): the next bf16 product converts
    them again.  The training loop calls it at the start of every forward pass."""
    _bf16_weights.clear()


def provide_bf16_copy(w, wb):
    """``wb`` (uint16, ``w``'s shape) is ``w`` rounded to bf16 until the next
    ``weights_changed()``: the products take it instead of converting ``w`` (an
    optimizer that wrote the rounding in its own pass, ``gpt2.state.ArenaState``)."""
    _check_copy(w, wb)
    _bf16_weights[id(w)] = (w, wb)


def set_bf16_targets(pairs):
    """For each (w, wb) of ``pairs``: a bf16 copy of ``w`` is written into ``wb`` (uint16,
    ``w``'s shape) when the products need one, until ``drop_bf16_targets``."""
    for w, wb in pairs:
        _check_copy(w, wb)
        _bf16_targets[id(w)] = (w, wb)


def drop_bf16_targets(weights):
    for w in weights:
        entry = _bf16_targets.get(id(w))
        if entry is not None and entry[0] is w:
            del _bf16_targets[id(w)]


def _check_copy(w, wb):
    if wb.dtype != np.uint16 or wb.shape != w.shape:
        raise ValueError(f"a bf16 copy must be uint16 of the weight's shape {w.shape}, got "
                         f"{wb.dtype} {wb.shape}")


def _bf16_weight(w):
    if w.dtype == np.uint16:        # a weight held in bf16 (a frozen LoRA base)
        return w
    entry = _bf16_weights.get(id(w))
    if entry is None or entry[0] is not w:
        target = _bf16_targets.get(id(w))
        wb = target[1] if target is not None and target[0] is w else _buffers.empty(w.shape, np.uint16)
        _bf16.to_bf16(wb, w)
        entry = _bf16_weights[id(w)] = (w, wb)
    return entry[1]


def _product_forward(out, x, w, bias):
    """out = x @ w.T + bias in the current precision; returns what the backward needs
    of ``x`` (x itself, or its bf16 copy)."""
    if _precision == "fp32" and w.dtype != np.uint16:
        _matmul.matmul_forward(out, x, w, bias)
        return x
    xb = _product_input(x, w)
    _bf16.matmul_forward_bf16(out, xb, _bf16_weight(w), bias)
    return xb


def _product_backward(dx, dw, db, g, x, w, overwrite):
    """The gradients of ``_product_forward``; ``x`` as it returned (bf16: uint16), or
    for a frozen weight (``dw`` None) only its dtype: dx = g W reads no input."""
    if isinstance(x, np.dtype):
        dtype, x = x, None
    else:
        dtype = x.dtype
    if dtype == np.uint16:
        _bf16.matmul_backward_bf16(dx, dw, db, g, x, _bf16_weight(w), overwrite=overwrite)
    else:
        _matmul.matmul_backward(dx, dw, db, g, x, w, overwrite=overwrite)


def _product_dtype(x, w=None):
    """The dtype ``_product_input(x, w)`` gives: what a frozen weight's backward keeps
    of its input (``_product_backward`` takes it for the input)."""
    if _precision == "fp32" and (w is None or w.dtype != np.uint16):
        return x.dtype
    return np.dtype(np.uint16)


def _product_input(x, w=None):
    """A recomputed product input, as the forward gave it to the product (with weight
    ``w``: a bf16 weight takes bf16 inputs whatever the precision)."""
    if _product_dtype(x, w) != np.uint16:
        return x
    xb = _buffers.empty(x.shape, np.uint16)
    _bf16.to_bf16(xb, x)
    return xb


def encoder(ids, wte, wpe):
    """Token plus position embeddings: ``wte[ids] + wpe[:T]``; ids (B,T) int32."""
    ids = np.asarray(ids)
    wte_d, wpe_d = _data(wte), _data(wpe)
    out = _buffers.empty(ids.shape + (wte_d.shape[-1],))
    _layers.encoder_forward(out, ids, wte_d, wpe_d)
    if _needs_grad(wte, wpe):
        return _record(ENCODER, out, (None, wte, wpe), (ids, wte, wpe), None)
    return _constant(out)


def _encoder_bwd(g, dests, fresh, ids, wte, wpe):
    dwte, ow_wte = _or_scratch(dests[1], fresh[1], wte)
    dwpe, ow_wpe = _or_scratch(dests[2], fresh[2], wpe)
    _layers.encoder_backward(dwte, dwpe, _contiguous(g), ids, overwrite=(ow_wte, ow_wpe))


def layernorm(x, weight, bias):
    """Layer normalisation over the last axis (eps 1e-5)."""
    xd = np.ascontiguousarray(_data(x))
    out = _buffers.empty_like(xd)
    mean = _buffers.empty(xd.shape[:-1])
    rstd = _buffers.empty(xd.shape[:-1])
    _layers.layernorm_forward(out, mean, rstd, xd, _data(weight), _data(bias))
    if _needs_grad(x, weight, bias):
        return _record(LAYERNORM, out, (x, weight, bias),
                       (x if xd is _data(x) else xd, weight, mean, rstd), None)
    return _constant(out)


def _layernorm_bwd(g, dests, fresh, x, weight, mean, rstd):
    dx, ow_x = _or_scratch(dests[0], fresh[0], x)
    dw, ow_w = _or_scratch(dests[1], fresh[1], weight)
    db, ow_b = _or_scratch(dests[2], fresh[2], weight)
    _layers.layernorm_backward(dx, dw, db, _contiguous(g), x, weight, mean, rstd,
                               overwrite=(ow_x, ow_w, ow_b))


def gelu(x):
    """GELU, tanh approximation."""
    xd = np.ascontiguousarray(_data(x))
    out = _buffers.empty_like(xd)
    _layers.gelu_forward(out, xd)
    if _needs_grad(x):
        return _record(GELU, out, (x,), (x if xd is _data(x) else xd,), None)
    return _constant(out)


def _gelu_bwd(g, dests, fresh, x):
    _layers.gelu_backward(dests[0], x, _contiguous(g), overwrite=fresh[0])


def residual(x, y):
    """``x + y`` for the residual stream (same shapes)."""
    xd = np.ascontiguousarray(_data(x))
    yd = np.ascontiguousarray(_data(y))
    out = _buffers.empty_like(xd)
    _layers.residual_forward(out, xd, yd)
    if _needs_grad(x, y):
        return _record(RESIDUAL, out, (x, y), (), None)
    return _constant(out)


def _residual_bwd(g, dests, fresh):
    g = _contiguous(g)
    dx, dy = dests
    if dx is not None and dy is not None and dx is not dy:
        _layers.residual_backward(dx, dy, g, overwrite=(fresh[0], fresh[1]))
        return
    for d, f in zip(dests, fresh):     # x + x: the first write, then the add
        if d is not None:
            if f:
                d[...] = g
            else:
                d += g


def linear(x, weight, bias=None):
    """``x @ weight.T + bias``; x (N,C) or (B,T,C), weight (OC,C), bias (OC,) or None."""
    xd = np.ascontiguousarray(_data(x))
    wd = _data(weight)
    out = _buffers.empty(xd.shape[:-1] + (wd.shape[0],))
    saved = _product_forward(out, xd, wd, None if bias is None else _data(bias))
    if _needs_grad(x, weight, bias):
        # A frozen weight (the LM head or a projection LoRA leaves alone) has no weight
        # gradient, and its input gradient reads no input: only the input's dtype (the
        # product's path) is kept, on the node.
        kept = (x if saved is _data(x) else saved) if _needs_grad(weight) else saved.dtype
        return _record(LINEAR, out, (x, weight, bias), (kept, weight), None)
    return _constant(out)


def _linear_bwd(g, dests, fresh, x, weight):
    dw, ow_w = dests[1], fresh[1]      # None: a frozen weight, no dW product
    _product_backward(dests[0], dw, dests[2], _contiguous(g), x, weight,
                      (fresh[0], ow_w, fresh[2]))


def gelu_linear(x, weight, bias=None):
    """``linear(gelu(x), weight, bias)`` saving only ``x``: the backward recomputes
    ``gelu(x)`` (the same kernel, so the same bits) for the weight gradient.  In the
    MLP this saves the 4C-wide GELU output, a quarter of a block's residuals, for one
    GELU pass in the backward (about 1% of a GPT-2 step)."""
    xd = np.ascontiguousarray(_data(x))
    wd = _data(weight)
    h = _buffers.empty_like(xd)
    _layers.gelu_forward(h, xd)
    out = _buffers.empty(xd.shape[:-1] + (wd.shape[0],))
    _product_forward(out, h, wd, None if bias is None else _data(bias))
    if _needs_grad(x, weight, bias):
        return _record(GELU_LINEAR, out, (x, weight, bias),
                       (x if xd is _data(x) else xd, weight), None)
    return _constant(out)


def _activation_product_backward(g, dests, fresh, x, weight, shape, activation):
    """The product's part of the backward of ``linear(activation(x), weight, bias)``
    (gelu_linear, swiglu_linear): dW and dbias into ``dests[1:]``, with h =
    activation(x) (``shape``) recomputed for dW and freed on return, before the
    activation's gradient is allocated (3 hidden-width arrays live, as unfused); a frozen
    weight (dW None) recomputes nothing.  Returns dh = g W (None where x needs none)."""
    dh = None if dests[0] is None else _buffers.empty(shape)
    dw, ow_w = dests[1], fresh[1]
    if dw is None:          # a frozen weight: dh = g W alone
        h = _product_dtype(x, weight)
    else:
        h = _buffers.empty(shape)
        activation(h, x)
        h = _product_input(h, weight)
    _product_backward(dh, dw, dests[2], _contiguous(g), h, weight, (True, ow_w, fresh[2]))
    return dh


def _gelu_linear_bwd(g, dests, fresh, x, weight):
    dh = _activation_product_backward(g, dests, fresh, x, weight, x.shape, _layers.gelu_forward)
    if dh is not None:
        _layers.gelu_backward(dests[0], x, dh, overwrite=fresh[0])


def _attention_forward(op, qd, n_head, n_kv_head):
    """(output, log-sum-exps, the qkv the backward reads) of causal attention over a
    contiguous packed ``qkv``, its products in the current precision.  bf16: q, k, v and
    the probabilities rounded, the softmax in float32, and qkv kept in bf16 for the
    backward, what its products read (half the bytes on the tape)."""
    try:
        B, T, n_head, n_kv_head, hs = _attention.attention_shapes(qd, n_head, n_kv_head)
    except ValueError as e:
        raise ValueError(f"{op}: {e}") from None
    precision = _attention_precision()
    if precision == "bf16" and qd.dtype == np.float32:
        qb = _buffers.empty(qd.shape, np.uint16)
        _bf16.to_bf16(qb, qd)
        qd = qb
    out = _buffers.empty((B, T, n_head * hs))
    # Each query's log-sum-exp: with qkv and out, all the backward needs (it
    # recomputes the probabilities), O(T) per head where they are O(T^2).
    lse = _buffers.empty((B, n_head, T))
    _attention.attention_forward(out, lse, qd, n_head, n_kv_head=n_kv_head, precision=precision)
    return out, lse, qd, precision


def _attention_precision():
    """The precision of attention's products: the linear layers' (a bf16 LoRA base's
    products are bf16 whatever it is; attention has no weight and follows it)."""
    return _precision


def attention(qkv, n_head, n_kv_head=None):
    """Causal self-attention of a packed ``[q|k|v]`` (B, T, (n_head + 2 n_kv_head) hs):
    returns (B, T, n_head hs).  Query head h reads kv head h // (n_head // n_kv_head)
    (grouped-query attention); n_kv_head None: n_head, GPT-2's (B, T, 3C)."""
    qd = np.ascontiguousarray(_data(qkv))
    out, lse, saved, precision = _attention_forward("attention", qd, n_head, n_kv_head)
    if _needs_grad(qkv):
        return _record(ATTENTION, out, (qkv,),
                       (qkv if saved is _data(qkv) else saved, out, lse, n_head, n_kv_head,
                        precision), None)
    return _constant(out)


def _attention_bwd(g, dests, fresh, qkv, out, lse, n_head, n_kv_head, precision):
    _attention.attention_backward(dests[0], _contiguous(g), qkv, out, lse, n_head,
                                  n_kv_head=n_kv_head, overwrite=fresh[0], precision=precision)


def attention_linear(qkv, n_head, weight, bias=None, n_kv_head=None):
    """``linear(attention(qkv, n_head, n_kv_head), weight, bias)``, the attention's output
    saved once (on the byte tape the two ops would each push a copy of it: the attention
    for its backward, the projection as its input)."""
    qd = np.ascontiguousarray(_data(qkv))
    wd = _data(weight)
    a, lse, saved, precision = _attention_forward("attention_linear", qd, n_head, n_kv_head)
    out = _buffers.empty(a.shape[:2] + (wd.shape[0],))
    _product_forward(out, a, wd, None if bias is None else _data(bias))
    if _needs_grad(qkv, weight, bias):
        return _record(ATTENTION_LINEAR, out, (qkv, weight, bias),
                       (qkv if saved is _data(qkv) else saved, a, lse, weight, n_head,
                        n_kv_head, precision), None)
    return _constant(out)


def _attention_linear_bwd(g, dests, fresh, qkv, a, lse, weight, n_head, n_kv_head, precision):
    da = None if dests[0] is None else _buffers.empty_like(a)
    dw, ow_w = dests[1], fresh[1]
    _product_backward(da, dw, dests[2], _contiguous(g),
                      _product_dtype(a, weight) if dw is None else _product_input(a, weight),
                      weight, (True, ow_w, fresh[2]))
    if da is not None:
        _attention.attention_backward(dests[0], da, qkv, a, lse, n_head, n_kv_head=n_kv_head,
                                      overwrite=fresh[0], precision=precision)


# The target of a position that takes no loss (padding, a prompt): PyTorch's ignore_index.
IGNORE_INDEX = _loss.IGNORE_INDEX


def softmax_cross_entropy(logits, targets, V=None):
    """Per-position loss ``logsumexp(logits[..., :V]) - logits[..., target]``.

    logits (B,T,Vp) or (N,Vp); columns from ``V`` (default Vp) on are padding and
    get zero gradient; targets int32 in [0, V), or ``IGNORE_INDEX`` for a position
    without loss (its loss 0, its logits' gradient 0).  Returns losses of shape (B,T)
    or (N,).
    """
    ld = np.ascontiguousarray(_data(logits))
    targets = np.asarray(targets)
    if V is None:
        V = ld.shape[-1]
    losses = _buffers.empty(ld.shape[:-1])
    lse = _buffers.empty(ld.shape[:-1])
    _loss.softmax_crossentropy_forward(losses, lse, ld, targets, V)
    if _needs_grad(logits):
        # The logits are saved as a plain array: the rule overwrites the popped copy
        # with the gradient instead of allocating one (held by reference they are
        # read-only, and the rule writes a new array).
        return _record(SOFTMAX_CROSS_ENTROPY, losses, (logits, None),
                       (ld, lse, targets, V), None)
    return _constant(losses)


def loss_denominator(targets, denominator=None):
    """What a mean loss over ``targets`` divides its sum by: ``denominator`` where given
    (a positive number: gradient accumulation passes the whole batch's count, so that
    its micro-batches' gradients add up to the whole batch's mean), else the number of
    targets that are not ``IGNORE_INDEX``; ValueError where that is 0."""
    if denominator is not None:
        if isinstance(denominator, bool) or not denominator > 0:
            raise ValueError(f"the loss denominator must be a positive number, got "
                             f"{denominator!r}")
        return denominator
    counted = int(np.count_nonzero(np.asarray(targets) != IGNORE_INDEX))
    if not counted:
        raise ValueError(f"every target is IGNORE_INDEX ({IGNORE_INDEX}): no position to "
                         f"take the loss of")
    return counted


def mean_cross_entropy(logits, targets, V=None, denominator=None):
    """The mean of ``softmax_cross_entropy`` over the targets that count (those not
    ``IGNORE_INDEX``; every one, it is the plain mean), or its sum over ``denominator``
    (``loss_denominator``).  A 0-d Tensor, recorded where the logits need a gradient."""
    losses = softmax_cross_entropy(logits, targets, V)
    # sum * (1/n) is what mean() computes, forward and backward: with nothing ignored, the
    # same bits as losses.mean().
    return losses.sum() * (1.0 / loss_denominator(targets, denominator))


def take_rows(x, rows):
    """The rows ``rows`` (distinct indices, int) of x's last axis's vectors: x (B,T,C) or
    (N,C) -> (len(rows), C).  The head of a step whose targets are partly
    ``IGNORE_INDEX`` (a chat's prompts) takes only the rows that have a loss: those the
    others would give no loss and no gradient, at the cost of the LM head's products."""
    xd = _data(x)
    rows = np.asarray(rows, dtype=np.intp)
    if xd.ndim < 2:
        raise ValueError(f"take_rows: x must have rows of vectors, got shape {xd.shape}")
    x2 = xd.reshape(-1, xd.shape[-1])
    if rows.ndim != 1 or (rows.size and (rows.min() < 0 or rows.max() >= x2.shape[0])):
        raise ValueError(f"take_rows: rows must be a 1-D array of indices below "
                         f"{x2.shape[0]}, got {rows!r}")
    out = _buffers.empty((rows.size, x2.shape[1]))
    np.take(x2, rows, axis=0, out=out)
    if _needs_grad(x):
        return _record(TAKE_ROWS, out, (x,), (rows,), None)
    return _constant(out)


def _take_rows_bwd(g, dests, fresh, rows):
    dx = dests[0].reshape(-1, dests[0].shape[-1])
    if fresh[0]:
        dx[...] = 0.0
        dx[rows] = g
    else:
        dx[rows] += g          # distinct rows: no index repeats


def _softmax_cross_entropy_vjp(g, logits, lse, targets, V):
    dlogits = logits if logits.flags.writeable else _buffers.empty_like(logits)
    _loss.softmax_crossentropy_backward(dlogits, _contiguous(g), logits, lse, targets, V,
                                        overwrite=True)
    return dlogits


def rmsnorm(x, weight, eps):
    """RMS normalisation over the last axis, as Hugging Face's LlamaRMSNorm:
    ``weight * (x / sqrt(mean(x^2) + eps))``; x (B,T,C) or (N,C), weight (C,)."""
    xd = np.ascontiguousarray(_data(x))
    out = _buffers.empty_like(xd)
    rrms = _buffers.empty(xd.shape[:-1])
    _llama.rmsnorm_forward(out, rrms, xd, _data(weight), eps)
    if _needs_grad(x, weight):
        return _record(RMSNORM, out, (x, weight), (x if xd is _data(x) else xd, weight, rrms),
                       None)
    return _constant(out)


def _rmsnorm_bwd(g, dests, fresh, x, weight, rrms):
    dx, ow_x = _or_scratch(dests[0], fresh[0], x)
    dw, ow_w = _or_scratch(dests[1], fresh[1], weight)
    _llama.rmsnorm_backward(dx, dw, _contiguous(g), x, weight, rrms, overwrite=(ow_x, ow_w))


def rope(qkv, cos, sin, n_rot_heads):
    """Rotary position embedding (Hugging Face's rotate-half convention, position t) of
    the first ``n_rot_heads`` heads of each row of a packed (B, T, W) ``qkv``; the other
    heads pass through.  For ``[q | k | v]`` with n_head query and n_kv_head key/value
    heads, n_rot_heads = n_head + n_kv_head.  cos, sin: (maxT, head_dim / 2) tables from
    ``kernels.llama.rope_tables``, constants (no gradient) kept by reference for the
    backward, so they must not change before it."""
    qd = np.ascontiguousarray(_data(qkv))
    cd, sd = _data(cos), _data(sin)
    out = _buffers.empty_like(qd)
    _llama.rope_forward(out, qd, cd, sd, n_rot_heads)
    if _needs_grad(qkv):
        return _record(ROPE, out, (qkv,), (_constant(cd), _constant(sd), n_rot_heads), None)
    return _constant(out)


def _rope_bwd(g, dests, fresh, cos, sin, n_rot_heads):
    _llama.rope_backward(dests[0], _contiguous(g), cos, sin, n_rot_heads, overwrite=fresh[0])


def swiglu(gate_up):
    """``silu(gate) * up`` of a packed (B,T,2I) or (N,2I) ``gate_up`` holding ``[gate | up]``
    in each row (one matrix product gives both); returns (B,T,I) or (N,I)."""
    gd = np.ascontiguousarray(_data(gate_up))
    out = _buffers.empty(gd.shape[:-1] + (gd.shape[-1] // 2 if gd.ndim else 0,))
    _llama.swiglu_forward(out, gd)
    if _needs_grad(gate_up):
        return _record(SWIGLU, out, (gate_up,), (gate_up if gd is _data(gate_up) else gd,), None)
    return _constant(out)


def _swiglu_bwd(g, dests, fresh, gate_up):
    _llama.swiglu_backward(dests[0], _contiguous(g), gate_up, overwrite=fresh[0])


def swiglu_linear(gate_up, weight, bias=None):
    """``linear(swiglu(gate_up), weight, bias)`` (Llama's down projection) saving only
    ``gate_up``: the backward recomputes ``swiglu(gate_up)`` (the same kernel, so the same
    bits) for the weight gradient, as ``gelu_linear`` does.  That keeps 2I floats a row
    for the MLP's second half instead of 3I."""
    gd = np.ascontiguousarray(_data(gate_up))
    wd = _data(weight)
    h = _buffers.empty(gd.shape[:-1] + (gd.shape[-1] // 2 if gd.ndim else 0,))
    _llama.swiglu_forward(h, gd)
    out = _buffers.empty(h.shape[:-1] + (wd.shape[0],))
    _product_forward(out, h, wd, None if bias is None else _data(bias))
    if _needs_grad(gate_up, weight, bias):
        return _record(SWIGLU_LINEAR, out, (gate_up, weight, bias),
                       (gate_up if gd is _data(gate_up) else gd, weight), None)
    return _constant(out)


def _swiglu_linear_bwd(g, dests, fresh, gate_up, weight):
    dh = _activation_product_backward(g, dests, fresh, gate_up, weight,
                                      gate_up.shape[:-1] + (gate_up.shape[-1] // 2,),
                                      _llama.swiglu_forward)
    if dh is not None:
        _llama.swiglu_backward(dests[0], dh, gate_up, overwrite=fresh[0])



def lora_linear(x, weight, bias, a, b, splits, scale, dropout=0.0, rng=None):
    """``linear(x, weight, bias)`` plus LoRA's low-rank update of some of its output rows:
    output rows ``start:start + n`` of each ``(start, n)`` in ``splits`` (target j) gain
    ``scale * (dropout(x) @ a[j*r:(j+1)*r].T) @ b[rows of j].T``.

    x (N,C) or (B,T,C); weight (OC,C) float32 or uint16 (bf16), frozen: its gradient is
    never computed; bias (OC,) or None, frozen; a (k*r, C) holds the k targets' A
    matrices stacked, b (sum of n, r) their B matrices stacked in ``splits`` order (as
    peft's lora_A and lora_B).  ``dropout`` p drops elements of the adapters' input
    (scaled by 1/(1-p), as torch.nn.Dropout), ``rng`` a numpy Generator.  The adapters'
    products run in float32 whatever the precision (they are r wide), each target's
    added straight into its columns of the output (``kernels.lora``); the base product
    in the current precision (bf16 for a bf16 weight).  Saved: ``x`` (the adapters'
    input; the frozen base's backward needs none, so a bf16 base keeps no bf16 copy),
    ``x @ a.T`` (k*r floats a row), and with dropout its mask (a byte an element)."""
    xd = np.ascontiguousarray(_data(x))
    wd, ad, bd = _data(weight), _data(a), _data(b)
    k = len(splits)
    r = ad.shape[0] // max(k, 1)
    if ad.ndim != 2 or bd.ndim != 2 or ad.shape != (k * r, xd.shape[-1]) or bd.shape != (
            sum(n for _, n in splits), r):
        raise ValueError(f"lora_linear: a {ad.shape} and b {bd.shape} do not fit {k} "
                         f"targets of rank {r} over inputs of width {xd.shape[-1]} "
                         f"(splits {splits})")
    out = _buffers.empty(xd.shape[:-1] + (wd.shape[0],))
    # The base's bf16 copy of x (if any) is dropped here: its backward needs only dY, W.
    bf16_base = _product_forward(out, xd, wd, None if bias is None else _data(bias)) is not xd
    x2 = xd.reshape(-1, xd.shape[-1])
    keep = None
    xl = x2
    if dropout:
        rng = rng if rng is not None else np.random.default_rng()
        # One key from the Generator, the draws filled in parallel from it.
        u = _buffers.empty(x2.shape)
        _lora.uniforms(u, rng.integers(0, 1 << 64, dtype=np.uint64))
        keep = _buffers.empty(x2.shape, np.uint8)
        xl = _buffers.empty(x2.shape)
        _lora.dropout_forward(xl, keep, x2, u, dropout)
        del u
    xa = _buffers.empty((x2.shape[0], k * r))
    _matmul.matmul_forward(xa, xl, ad, None)
    xa *= np.float32(scale)
    del xl
    _lora.lora_forward(out.reshape(-1, out.shape[-1]), xa, bd, splits)
    if _needs_grad(x, a, b):
        return _record(LORA_LINEAR, out, (x, weight, bias, a, b),
                       (x if xd is _data(x) else xd, keep, xa, weight, a, b, splits, scale,
                        dropout, bf16_base), None)
    return _constant(out)


def _lora_linear_bwd(g, dests, fresh, x, keep, xa, weight, a, b, splits, scale, dropout,
                     bf16_base):
    # x: the adapters' input before dropout; keep: dropout's mask (uint8) or None
    g = _contiguous(g)
    g2 = g.reshape(-1, g.shape[-1])
    N = g2.shape[0]
    dx = None if dests[0] is None else dests[0].reshape(N, -1)
    # The base: dx only (the weight and bias are frozen), no input needed.
    if dx is not None:
        if bf16_base:
            _bf16.matmul_backward_bf16(dx, None, None, g2, None, _bf16_weight(weight),
                                       overwrite=(fresh[0], False, False))
        else:
            _matmul.matmul_backward(dx, None, None, g2, None, weight,
                                    overwrite=(fresh[0], False, False))
    # The adapters: with xa = scale * x_l @ A.T and out_j += xa_j @ B_j.T,
    # dB_j = g_j.T @ xa_j, dxa_j = scale * g_j @ B_j, dA = dxa.T @ x_l, dx_l = dxa @ A;
    # g_j are g's columns of target j, read in place.
    dxa = _buffers.empty(xa.shape)
    _lora.lora_backward(dxa, dests[4], g2, xa, b, splits, overwrite=bool(fresh[4]))
    dxa *= np.float32(scale)
    if dx is None and dests[3] is None:
        return
    x2 = x.reshape(N, -1)
    x_l = x2
    if keep is not None and dests[3] is not None:
        x_l = _buffers.empty(x2.shape)
        _lora.dropout_apply(x_l, x2, keep, dropout)
    dx_l = dx if keep is None or dx is None else _buffers.empty(x2.shape)
    _matmul.matmul_backward(dx_l, dests[3], None, dxa, x_l, a,
                            overwrite=(keep is not None, bool(fresh[3]), False))
    if keep is not None and dx is not None:
        _lora.dropout_backward(dx, dx_l, keep, dropout)


defvjp_accumulate(ENCODER, _encoder_bwd, overwrite=True)
defvjp_accumulate(LAYERNORM, _layernorm_bwd, overwrite=True)
defvjp_accumulate(GELU, _gelu_bwd, overwrite=True)
defvjp_accumulate(RESIDUAL, _residual_bwd, overwrite=True)
defvjp_accumulate(LINEAR, _linear_bwd, overwrite=True)
defvjp_accumulate(GELU_LINEAR, _gelu_linear_bwd, overwrite=True)
defvjp_accumulate(ATTENTION, _attention_bwd, overwrite=True)
defvjp_accumulate(ATTENTION_LINEAR, _attention_linear_bwd, overwrite=True)
defvjp(SOFTMAX_CROSS_ENTROPY, _softmax_cross_entropy_vjp, None)
defvjp_accumulate(RMSNORM, _rmsnorm_bwd, overwrite=True)
defvjp_accumulate(ROPE, _rope_bwd, overwrite=True)
defvjp_accumulate(SWIGLU, _swiglu_bwd, overwrite=True)
defvjp_accumulate(SWIGLU_LINEAR, _swiglu_linear_bwd, overwrite=True)
defvjp_accumulate(LORA_LINEAR, _lora_linear_bwd, overwrite=True)
defvjp_accumulate(TAKE_ROWS, _take_rows_bwd, overwrite=True)


def softmax(x, axis=-1):
    """``exp(x) / sum(exp(x), axis)`` in any float dtype (``adtape.numpy.softmax``: its
    rule can be differentiated again)."""
    return anp.softmax(x, axis)


def log_softmax(x, axis=-1):
    """``x - logsumexp(x, axis)`` (``adtape.numpy.log_softmax``)."""
    return anp.log_softmax(x, axis)
