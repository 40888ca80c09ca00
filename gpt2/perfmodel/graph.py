"""Per-operation task graph of one decoder training step (GPT-2 or Llama family), with FLOPs,
bytes and saved tensors.

``step_graph`` lists the ops one device runs for one micro-batch on one pipeline
stage: forward, recomputation, backward, then (once per step) the optimizer.  Every
op carries its FLOPs, the bytes it moves through main memory, the GEMM variant for
matmuls, and the tensors its forward saves for the backward pass.

Two layouts of what is saved:
- ``"adtape"``: what our kernels need (kernels_api.md): layernorm saves its input and
  mean/rstd, rmsnorm its input and 1/rms, each matmul its input, fused attention saves
  qkv (q|k|v of n_head + 2 n_kv_head heads), its output and each query's log-sum-exp
  (B, n_head, T) and recomputes the probabilities in the backward; rope keeps only its
  tables (constants, by reference); the SwiGLU MLP's down projection (nn.swiglu_linear)
  keeps only gate|up and recomputes swiglu in its backward; our encoder adds a zero
  position row under rotary positions and keeps it; no dropout; activations in the
  workload's precision.  ``GraphOptions(precision="bf16")`` is our engine's bf16 mode
  (``--precision bf16``, ``adtape.nn.set_precision("bf16")``; the workload's precision
  stays fp32): everything stays float32 but the linear layers' products, which take
  bf16 operands: a plain
  linear layer saves its input as bf16 (2 bytes), converts it (and, once per forward
  pass, its weight) before the product, and its backward converts the output's
  gradient; the fused down projection keeps gate|up in float32 and converts the
  recomputed swiglu output.
  ``GraphOptions(lora=LoraSpec(...))`` is LoRA fine-tuning (gpt2.lora): the base's
  products are frozen (their input's gradient only, no weight gradient), in bf16 where the
  base is held in bf16 (``LoraSpec.base_dtype``); an adapted product (nn.lora_linear)
  also runs its adapters' products in float32 (x A^T, then B) and keeps its float32 input
  and x A^T (k r floats a row), with dropout also the mask (a byte an element), never the
  base's bf16 copy of the input; an adapted down projection runs unfused (swiglu
  keeps gate|up, the projection its input); a product left without adapters keeps
  nothing of its input (a frozen down projection recomputes no swiglu output in its
  backward); the embedding is frozen, so nothing of the
  first block before its first adapted product is recorded; AdamW updates the adapters.
- ``"megatron"``: the accounting of Korthikanti et al. 2022 (16-bit activations,
  1-byte dropout masks after softmax, attention projection and MLP; attention split
  into QK^T, softmax, dropout, AV); this reproduces 34sbh + 5as^2b per layer.

Sizes: b micro-batch, s sequence, h hidden, a heads, t tensor-parallel size.
"""
from dataclasses import dataclass, field, replace

from .spec import LoraSpec

LAYOUTS = ("adtape", "megatron")
ENGINE_PRECISIONS = ("fp32", "bf16")     # our engine's --precision (gpt2.precision), auto resolved
OP_CLASSES = ("matmul", "attention", "layernorm", "elementwise", "embedding", "loss", "optimizer")
# The suffix of an op class's calibrated curve measured with bf16 operands
# ("attention_bf16.fwd": our attention under --precision bf16).
BF16_CURVE = "_bf16"

# FLOPs per element of the non-matmul kernels (counted from the kernels' arithmetic).
LAYERNORM_FWD_FLOPS = 8
LAYERNORM_BWD_FLOPS = 12
GELU_FWD_FLOPS = 10
GELU_BWD_FLOPS = 16
RMSNORM_FWD_FLOPS = 4
RMSNORM_BWD_FLOPS = 10
ROPE_FLOPS = 3                  # per rotated element, each way: x cos + rotate_half(x) sin
SWIGLU_FWD_FLOPS = 6            # per output element: silu(gate) * up
SWIGLU_BWD_FLOPS = 12
SOFTMAX_FLOPS = 5
ADAMW_FLOPS = 14


@dataclass(frozen=True)
class Saved:
    """A tensor a forward op keeps for its backward (``shared``: the same array another op
    keeps too, the attention's output as the projection's input: held by reference, once)."""
    name: str
    nbytes: float
    shared: bool = False


@dataclass
class Op:
    name: str
    op_class: str
    phase: str                   # "fwd", "recompute", "bwd", "optim"
    layer: int                   # -1: outside the transformer blocks
    flops: float
    nbytes: float                # bytes read + written in main memory
    variant: str = ""            # matmul: "fwd", "bwd_input", "bwd_weight"
    saved: tuple = field(default_factory=tuple)
    tape_records: int = 0        # records the forward pushes on the tape (popped by backward)
    gemm_flops: float = 0.0      # FLOPs of its dense matrix products (what Megatron's formula counts)
    convert_bytes: float = 0.0   # bf16 products: bytes its operands' conversions move (float32 read, bf16
    weight_convert_bytes: float = 0.0   # written), of its inputs / of its weight (once per forward pass)
    precision: str = ""          # matmul, our attention: its products' precision ("": the step's)
    dims: tuple = ()             # matmul: (rows, fan_in, fan_out) of its one product; () for others

    @property
    def saved_bytes(self):
        return sum(s.nbytes for s in self.saved)


@dataclass(frozen=True)
class GraphOptions:
    layout: str = "adtape"
    causal_attention_flops: bool = False   # count only the causal half of T x T (kernels that skip it)
    precision: str = "fp32"                # our engine's products: "fp32", or "bf16" operands (adtape layout)
    lora: LoraSpec = None                  # LoRA fine-tuning (adtape layout), or None: every weight trains

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"GraphOptions.layout must be one of {LAYOUTS}, got {self.layout!r}")
        check_engine_precision(self.precision, "GraphOptions.precision")
        if self.precision == "bf16" and self.layout != "adtape":
            raise ValueError("GraphOptions.precision='bf16' is our engine's bf16 mode: it needs layout 'adtape' "
                             "(for 16-bit training in Megatron's accounting, give Workload(precision='bf16'))")
        if self.lora is not None and not isinstance(self.lora, LoraSpec):
            raise ValueError(f"GraphOptions.lora must be a LoraSpec or None, got {type(self.lora).__name__}")
        if self.lora is not None and self.layout != "adtape":
            raise ValueError("GraphOptions.lora is our engine's LoRA (nn.lora_linear): it needs layout 'adtape'")


def check_engine_precision(precision, what="precision"):
    """``precision`` if it is one of ``ENGINE_PRECISIONS``, else ValueError naming them."""
    if precision not in ENGINE_PRECISIONS:
        raise ValueError(f"{what} must be one of {', '.join(ENGINE_PRECISIONS)}, got {precision!r}")
    return precision


def engine_bf16(workload, options):
    """Whether the step is our engine's bf16 mode: bf16 products, everything else float32
    (then the workload's precision must be fp32: its values are)."""
    if options.precision != "bf16":
        return False
    if workload.precision != "fp32":
        raise ValueError(f"GraphOptions.precision='bf16' (our engine's bf16 products) keeps the values in float32: "
                         f"it needs Workload.precision 'fp32', got {workload.precision!r}")
    return True


def value_bytes(workload, options):
    """Bytes of an activation or gradient element: the workload's precision, float32 in our
    engine's bf16 mode."""
    return 4 if engine_bf16(workload, options) else workload.act_bytes


def update_writes_bf16_copies(workload, parallel, options):
    """Whether the weights' bf16 copies are written by AdamW in its own pass (a bf16 step
    of the whole model in one process: ``gpt2.state.ArenaState``'s deferred update)
    rather than by a conversion in the forward pass.  (An offloaded state converts in the
    forward pass; the graph does not see offload, so its plans count the conversion
    as the in-RAM case does not.)"""
    return engine_bf16(workload, options) and options.lora is None and parallel.dp == 1


def product_weight_params(spec, parallel, stage):
    """Weights of the matrix products one device of ``stage`` runs (biases, norms and
    position rows excluded; the LM head's weight on the last stage, tied or not): what
    the bf16 mode keeps a bf16 copy of."""
    C, W, A, F = spec.n_embd, spec.qkv_width, spec.n_head * spec.head_dim, spec.ffn_hidden
    expert = C * (2 * F if spec.gated_mlp else F) + F * C
    per_stage = spec.n_layer // parallel.pp
    per_layer = C * W + A * C + max(spec.n_experts, 1) * expert + C * spec.n_experts
    params = per_stage * per_layer
    if spec.n_experts:
        params -= per_stage * expert * spec.n_experts * (1 - 1 / parallel.ep)
    params /= parallel.tp
    if stage == parallel.pp - 1:
        params += spec.padded_vocab * C / parallel.tp
    return params


class _Builder:
    """Emits the forward ops of one micro-batch and their backward twins."""

    def __init__(self, spec, b, s, e, tp, sp, flash, options, sram_bytes, bf16=False,
                 copies_by_update=False):
        self.spec, self.b, self.s, self.e = spec, b, s, e
        self.lora = options.lora
        self.copies_by_update = copies_by_update
        # A bf16 LoRA base runs its products in bf16 whatever the engine's precision.
        self.base_bf16 = self.lora is not None and self.lora.base_dtype == "bf16"
        self.bf16 = bf16 or self.base_bf16
        # Our attention kernel takes bf16 operands in the engine's bf16 mode only (the
        # precision of nn's ops; a bf16 base alone leaves it float32).
        self.attention_precision = "bf16" if bf16 else "fp32"
        self.adapted = {} if self.lora is None else {name: (k, rows) for name, k, rows in self.lora.adapted}
        self.tp, self.sp, self.flash, self.options = tp, sp, flash, options
        self.sram_bytes = sram_bytes
        self.N = b * s
        # Under sequence parallelism the replicated (layernorm, dropout, residual) regions
        # are split over the tensor-parallel group.
        self.rep = tp if sp else 1
        self.megatron = options.layout == "megatron"

    # --- primitive ops: each returns (forward op, [backward ops]) ---------------
    def product(self, name, layer, rows, fan_in, fan_out, bias=True, input_shard=1, saved=None,
                shares_input=False):
        """A matrix product as a list of (forward op, [backward ops]) pairs: ``matmul``'s, and
        under LoRA a frozen base's (no weight gradient), with its adapters' where ``name``
        is adapted."""
        fwd, bwd = self.matmul(name, layer, rows, fan_in, fan_out, bias, input_shard, saved, shares_input)
        if self.lora is None:
            return [(fwd, bwd)]
        bwd = [op for op in bwd if op.variant != "bwd_weight"]
        if name not in self.adapted or layer < 0:
            if saved is None and not self.megatron:
                # A frozen plain product (nn.linear) keeps no input: dx = g W reads none.
                fwd.saved, fwd.tape_records = (), 0
            return [(fwd, bwd)]
        return [(fwd, bwd)] + self._adapters(name, layer, rows, fan_in, fwd, input_shard, shares_input)

    def _adapters(self, name, layer, rows, fan_in, fwd, input_shard, shares_input):
        """The adapters of an adapted product (nn.lora_linear), float32 whatever the base:
        xa = x_l A^T (k r columns, scaled), each target's xa_j B_j^T added into its output
        rows; backward dB_j = g_j^T xa_j, dxa_j = g_j B_j, dA = dxa^T x_l, dx_l = dxa A.
        The base product's forward op records them all at once and keeps only what the
        adapters need: the frozen base's input gradient reads dY and W alone, so its input
        (or a bf16 base's bf16 copy of it) is not kept; the float32 input x (the adapters',
        before dropout), xa, and with dropout its mask (a byte an element)."""
        k, n = self.adapted[name]
        r, f = self.lora.r, 4.0
        kr = k * r
        x_bytes = f * rows * fan_in / input_shard
        saved = [Saved(f"{name}.lora_input", x_bytes, shared=shares_input and not self.megatron),
                 Saved(f"{name}.lora_xa", f * rows * kr)]
        if self.lora.dropout:
            saved.append(Saved(f"{name}.lora_mask", x_bytes / f))
        fwd.saved = tuple(saved)
        a = 2.0 * rows * fan_in * kr
        b = 2.0 * rows * r * n
        # x_l, A, xa (and its scaling: read and written again); xa_j, B_j, and the output's
        # columns of target j, read and written once (kernels.lora: added in by the product).
        a_fwd = Op(f"{name}.lora_a", "matmul", "fwd", layer, a, f * (rows * fan_in + kr * fan_in + 3 * rows * kr),
                   "fwd", gemm_flops=a, precision="fp32")
        b_fwd = Op(f"{name}.lora_b", "matmul", "fwd", layer, b, f * (rows * kr + n * r + 2 * rows * n), "fwd",
                   gemm_flops=b, precision="fp32")
        # dB and dxa read g's adapted columns where they lie (no copy).
        b_bwd = [Op(f"{name}.lora_b", "matmul", "bwd", layer, b, f * (rows * n + rows * kr + n * r),
                    "bwd_weight", gemm_flops=b, precision="fp32"),
                 Op(f"{name}.lora_b", "matmul", "bwd", layer, b, f * (rows * n + n * r + 3 * rows * kr),
                    "bwd_input", gemm_flops=b, precision="fp32")]
        a_bwd = [Op(f"{name}.lora_a", "matmul", "bwd", layer, a, f * (rows * kr + rows * fan_in + kr * fan_in),
                    "bwd_weight", gemm_flops=a, precision="fp32"),
                 Op(f"{name}.lora_a", "matmul", "bwd", layer, a, f * (rows * kr + kr * fan_in + 2 * rows * fan_in),
                    "bwd_input", gemm_flops=a, precision="fp32")]
        return [(a_fwd, a_bwd), (b_fwd, b_bwd)]

    def matmul(self, name, layer, rows, fan_in, fan_out, bias=True, input_shard=1, saved=None,
               shares_input=False):
        """input_shard: the saved input is split this many ways (sequence parallelism keeps the
        scattered input of a column-parallel matmul and all-gathers it again in backward);
        saved: what the forward keeps instead of its input (a fused op's); shares_input: the
        input is an array another op saves too (the attention's output)."""
        e = self.e
        gemm = 2.0 * rows * fan_in * fan_out
        if self.bf16:
            return self._bf16_matmul(name, layer, rows, fan_in, fan_out, bias, input_shard, saved, gemm)
        if saved is None:
            saved = (Saved(f"{name}.input", e * rows * fan_in / input_shard,
                           shared=shares_input and not self.megatron),)
        dims = (rows, fan_in, fan_out)
        fwd = Op(name, "matmul", "fwd", layer, gemm,
                 e * (rows * fan_in + fan_in * fan_out + rows * fan_out + (fan_out if bias else 0)), "fwd",
                 tuple(saved), 1 if saved else 0, gemm, dims=dims)
        bwd_in = Op(name, "matmul", "bwd", layer, gemm,
                    e * (rows * fan_out + fan_in * fan_out + 2 * rows * fan_in), "bwd_input", gemm_flops=gemm,
                    dims=dims)
        bwd_w = Op(name, "matmul", "bwd", layer, gemm + (rows * fan_out if bias else 0),
                   e * (rows * fan_out + rows * fan_in + 2 * fan_in * fan_out), "bwd_weight", gemm_flops=gemm,
                   dims=dims)
        return fwd, [bwd_in, bwd_w]

    def _bf16_matmul(self, name, layer, rows, fan_in, fan_out, bias, input_shard, saved, gemm):
        """``matmul`` in the bf16 mode (adtape.nn._product_forward / _product_backward): the
        operands are read as bf16 (2 bytes), outputs and gradients written as float32;
        the forward converts its input and weight (the latter once per forward pass; a
        re-run does not; a bf16 LoRA base's is bf16 already, and AdamW writes the whole
        model's where ``update_writes_bf16_copies``), the backward the output's gradient."""
        e, h = self.e, 2.0
        if saved is None:
            saved = (Saved(f"{name}.input", h * rows * fan_in / input_shard),)
        b = fan_out if bias else 0
        dims = (rows, fan_in, fan_out)
        fwd = Op(name, "matmul", "fwd", layer, gemm, h * (rows * fan_in + fan_in * fan_out) + e * (rows * fan_out + b),
                 "fwd", tuple(saved), 1 if saved else 0, gemm, convert_bytes=(e + h) * rows * fan_in,
                 weight_convert_bytes=0.0 if self.base_bf16 or self.copies_by_update else (e + h) * fan_in * fan_out,
                 precision="bf16",
                 dims=dims)
        bwd_in = Op(name, "matmul", "bwd", layer, gemm, h * (rows * fan_out + fan_in * fan_out) + 2 * e * rows * fan_in,
                    "bwd_input", gemm_flops=gemm, convert_bytes=(e + h) * rows * fan_out, precision="bf16",
                    dims=dims)
        bwd_w = Op(name, "matmul", "bwd", layer, gemm + (rows * fan_out if bias else 0),
                   h * (rows * fan_out + rows * fan_in) + 2 * e * fan_in * fan_out + e * rows * fan_out * (1 if bias else 0),
                   "bwd_weight", gemm_flops=gemm, precision="bf16", dims=dims)
        return fwd, [bwd_in, bwd_w]

    def pointwise(self, name, op_class, layer, elems, fwd_flops, bwd_flops, fwd_rw, bwd_rw, saved=()):
        e = self.e
        fwd = Op(name, op_class, "fwd", layer, fwd_flops * elems, e * fwd_rw * elems, "",
                 tuple(saved), 1 if saved else 0)
        bwd = Op(name, op_class, "bwd", layer, bwd_flops * elems, e * bwd_rw * elems)
        return fwd, [bwd]

    def norm(self, name, layer):
        """The spec's normalisation (``name`` without its family prefix: 1, 2 or f)."""
        if self.spec.norm == "layernorm":
            return self.layernorm(f"ln{name}", layer)
        return self.rmsnorm(f"rms{name}", layer)

    def layernorm(self, name, layer):
        C, N, e = self.spec.n_embd, self.N / self.rep, self.e
        saved = [Saved(f"{name}.input", e * N * C)]
        if not self.megatron:
            saved.append(Saved(f"{name}.mean_rstd", 2 * 4 * N))
        fwd, bwd = self.pointwise(name, "layernorm", layer, N * C, LAYERNORM_FWD_FLOPS, LAYERNORM_BWD_FLOPS,
                                  2, 4, saved)
        # mean/rstd and the (C,) parameters: small next to N*C but part of the traffic.
        fwd.nbytes += 2 * 4 * N + 2 * e * C
        bwd[0].nbytes += 2 * 4 * N + 4 * e * C
        return fwd, bwd

    def rmsnorm(self, name, layer):
        C, N, e = self.spec.n_embd, self.N / self.rep, self.e
        saved = [Saved(f"{name}.input", e * N * C)]
        if not self.megatron:
            saved.append(Saved(f"{name}.rrms", 4 * N))
        fwd, bwd = self.pointwise(name, "layernorm", layer, N * C, RMSNORM_FWD_FLOPS, RMSNORM_BWD_FLOPS,
                                  2, 4, saved)
        # 1/rms and the (C,) weight.
        fwd.nbytes += 4 * N + e * C
        bwd[0].nbytes += 4 * N + 2 * e * C
        return fwd, bwd

    def rope(self, layer):
        """Rotary embedding of the q and k heads of the packed q|k|v (v copied through); its
        tables are constants kept by reference, so it saves nothing."""
        spec, N, e = self.spec, self.N, self.e
        rotated = N * (spec.n_head + spec.n_kv_head) * spec.head_dim / self.tp
        row = N * spec.qkv_width / self.tp
        fwd = Op("rope", "elementwise", "fwd", layer, ROPE_FLOPS * rotated, e * 2 * row)
        bwd = Op("rope", "elementwise", "bwd", layer, ROPE_FLOPS * rotated, e * 2 * row)
        return fwd, [bwd]

    def dropout(self, name, layer, elems):
        # Forward writes the output and a 1-byte mask; backward reads the mask.
        fwd = Op(name, "elementwise", "fwd", layer, elems, 2 * self.e * elems + elems, "",
                 (Saved(f"{name}.mask", 1.0 * elems),), 1)
        bwd = Op(name, "elementwise", "bwd", layer, elems, 2 * self.e * elems + elems)
        return fwd, [bwd]

    def residual(self, name, layer):
        elems = self.N * self.spec.n_embd / self.rep
        # Backward accumulates the gradient into both inputs: two adds per element.
        return self.pointwise(name, "elementwise", layer, elems, 1, 2, 3, 5)

    def attention(self, layer):
        """Attention core (between the qkv and projection matmuls) of the local heads."""
        spec, b, s, e = self.spec, self.b, self.s, self.e
        heads = spec.n_head / self.tp
        # Grouped-query attention: each rank keeps at least one key/value head.
        kv_heads = max(spec.n_kv_head / self.tp, 1)
        d = spec.head_size
        pairs = s * (s + 1) / 2 if self.options.causal_attention_flops else s * s
        mm = 2.0 * b * heads * pairs * d          # one of QK^T or AV
        soft = SOFTMAX_FLOPS * b * heads * pairs
        out_elems = b * s * heads * d
        kv_elems = b * s * kv_heads * d
        qkv_elems = out_elems + 2 * kv_elems
        probs = b * heads * s * s
        if self.flash:
            # FlashAttention (Dao et al. 2022): K and V are streamed once per block of
            # queries held in on-chip memory, Theta(s^2 d^2 / M) traffic; nothing s x s is
            # written.  Backward recomputes the scores: 5 matmuls instead of 4.
            block = max(1, int(self.sram_bytes // (4 * d * e))) if self.sram_bytes else s
            passes = -(-s // block)
            traffic = e * b * heads * s * d * (2 + 2 * passes) + e * out_elems
            saved = (Saved("attn.qkv", e * qkv_elems), Saved("attn.lse", 4.0 * b * heads * s))
            if not self.megatron:
                # Our kernel's backward reads the output too (D = rowsum(dO * O)); the
                # projection after it saves the same array as its input.
                saved += (Saved("attn.out", e * out_elems),)
            fwd = Op("attention", "attention", "fwd", layer, 2 * mm + soft, traffic, "", saved, 1, 2 * mm)
            bwd = Op("attention", "attention", "bwd", layer, 5 * mm + 2 * soft, 2.5 * traffic, gemm_flops=5 * mm)
            return [fwd], [bwd]
        if not self.megatron:
            # Our fused kernel (kernels/attention.pyx): scores and probabilities stay in
            # per-thread tiles; it keeps qkv, out and the log-sum-exps, and the backward
            # recomputes Q K^T: 5 products run, 4 counted as the formula's gemm FLOPs.
            # In the bf16 mode it rounds qkv to bf16 first (a pass of its own), reads
            # that, and keeps it for the backward: 2 bytes an element.
            lse_bytes = 4.0 * b * heads * s
            bf16 = self.attention_precision == "bf16"
            q_bytes = 2.0 if bf16 else e
            saved = (Saved("attn.qkv", q_bytes * qkv_elems), Saved("attn.out", e * out_elems),
                     Saved("attn.lse", lse_bytes))
            fwd = Op("attention", "attention", "fwd", layer, 2 * mm + soft,
                     q_bytes * qkv_elems + e * out_elems + lse_bytes, "", saved, 1, 2 * mm,
                     convert_bytes=(e + 2.0) * qkv_elems if bf16 else 0.0,
                     precision=self.attention_precision)
            bwd = Op("attention", "attention", "bwd", layer, 5 * mm + 2 * soft,
                     (q_bytes + e) * qkv_elems + 2 * e * out_elems + lse_bytes, gemm_flops=4 * mm,
                     precision=self.attention_precision)
            return [fwd], [bwd]
        # Megatron: QK^T (saves q, k), softmax (saves output), dropout (mask), AV (saves
        # dropout output and v).
        qk = Op("attn.qk", "attention", "fwd", layer, mm, e * (out_elems + kv_elems + probs), "",
                (Saved("attn.q", e * out_elems), Saved("attn.k", e * kv_elems)), 1, mm)
        sm = Op("attn.softmax", "attention", "fwd", layer, soft, e * 2 * probs, "",
                (Saved("attn.softmax_out", e * probs),), 1)
        dr_fwd, dr_bwd = self.dropout("attn.dropout", layer, probs)
        av = Op("attn.av", "attention", "fwd", layer, mm, e * (probs + out_elems + kv_elems), "",
                (Saved("attn.dropout_out", e * probs), Saved("attn.v", e * kv_elems)), 1, mm)
        fwd = [qk, sm, dr_fwd, av]
        bwd = [Op("attn.av", "attention", "bwd", layer, 2 * mm, e * (3 * probs + out_elems + 2 * kv_elems),
                  gemm_flops=2 * mm)
               ] + dr_bwd + [
            Op("attn.softmax", "attention", "bwd", layer, soft, e * 3 * probs),
            Op("attn.qk", "attention", "bwd", layer, 2 * mm, e * (probs + 2 * out_elems + 2 * kv_elems),
               gemm_flops=2 * mm)]
        return fwd, bwd

    def mlp(self, layer):
        spec, N = self.spec, self.N
        C, F = spec.n_embd, spec.ffn_hidden
        pairs = []
        if not spec.n_experts:
            groups = [(N, F / self.tp)]
        else:
            pairs += self.product("router", layer, N / self.rep, C, spec.n_experts, bias=False)
            # Expert parallelism: each device holds n_experts/ep experts and receives its share
            # of every device's routed tokens, so per device it sees N*top_k*capacity rows.
            local_experts = spec.n_experts
            rows = N * spec.top_k * spec.capacity_factor / local_experts
            groups = [(rows, F / self.tp)] * local_experts
        for i, (rows, hidden) in enumerate(groups):
            tag = f"expert{i}." if spec.n_experts else ""
            if spec.gated_mlp:
                pairs += self.swiglu_mlp(tag, layer, rows, hidden)
                continue
            pairs += self.product(f"{tag}fc", layer, rows, C, hidden, input_shard=self.rep)
            pairs.append(self.pointwise(f"{tag}gelu", "elementwise", layer, rows * hidden, GELU_FWD_FLOPS,
                                        GELU_BWD_FLOPS, 2, 4,
                                        [Saved(f"{tag}gelu.input", self.e * rows * hidden)]))
            pairs += self.product(f"{tag}fcproj", layer, rows, hidden, C)
        return pairs

    def swiglu_mlp(self, tag, layer, rows, hidden):
        """gate|up matmul (2 x hidden columns), silu(gate) * up, down matmul.  Ours
        (nn.swiglu_linear) keeps only gate|up for both the swiglu and the down projection
        and recomputes swiglu(gate|up) in the backward; Megatron's keeps both inputs, and
        so does ours where LoRA adapts the down projection (swiglu, then nn.lora_linear)."""
        C, e, bias = self.spec.n_embd, self.e, self.spec.linear_bias
        elems = rows * hidden
        gate_up = Saved(f"{tag}swiglu.gate_up", e * 2 * elems)
        gateup = self.product(f"{tag}gateup", layer, rows, C, 2 * hidden, bias=bias, input_shard=self.rep)
        unfused = self.megatron or f"{tag}down" in self.adapted
        swiglu_fwd, swiglu_bwd = self.pointwise(f"{tag}swiglu", "elementwise", layer, elems, SWIGLU_FWD_FLOPS,
                                                SWIGLU_BWD_FLOPS, 3, 5, [gate_up] if unfused else [])
        if unfused:
            return gateup + [(swiglu_fwd, swiglu_bwd)] + self.product(f"{tag}down", layer, rows, hidden, C, bias=bias)
        down = self.product(f"{tag}down", layer, rows, hidden, C, bias=bias, saved=[gate_up])
        if self.lora is not None:
            # A frozen down projection's backward (dh = g W) recomputes nothing.
            return gateup + [(swiglu_fwd, swiglu_bwd)] + down
        if self.bf16:
            # Its backward converts the recomputed swiglu output for the weight's gradient.
            down[0][1][-1].convert_bytes += (e + 2.0) * elems
        recompute = Op(f"{tag}swiglu.recompute", "elementwise", "bwd", layer, SWIGLU_FWD_FLOPS * elems, e * 3 * elems)
        return gateup + [(swiglu_fwd, swiglu_bwd + [recompute])] + down

    def layer(self, layer):
        """Forward ops and backward ops (in backward order) of one transformer block."""
        spec, N = self.spec, self.N
        C = spec.n_embd
        pairs = [self.norm("1", layer)]
        pairs += self.product("qkv", layer, N, C, spec.qkv_width / self.tp, bias=spec.qkv_bias, input_shard=self.rep)
        if spec.positions == "rope":
            pairs.append(self.rope(layer))
        # (forward ops, backward ops) in forward order; the attention core is several ops in
        # Megatron's layout.
        groups = [([f], b) for f, b in pairs] + [self.attention(layer)]
        pairs = self.product("attproj", layer, N, spec.n_head * spec.head_dim / self.tp, C, bias=spec.linear_bias,
                             shares_input=True)
        if self.megatron:
            pairs.append(self.dropout("attproj.dropout", layer, N * C / self.rep))
        pairs += [self.residual("residual1", layer), self.norm("2", layer)]
        pairs += self.mlp(layer)
        if self.megatron:
            pairs.append(self.dropout("mlp.dropout", layer, N * C / self.rep))
        pairs.append(self.residual("residual2", layer))
        groups += [([f], b) for f, b in pairs]
        if self.lora is not None and layer == 0:
            self._from_constant_input(groups)
        fwd = [op for f, _ in groups for op in f]
        bwd = [op for _, b in groups for op in b]
        return fwd, bwd[::-1]

    def _from_constant_input(self, groups):
        """The first block under LoRA: its input, the frozen embedding's output, needs no
        gradient, so the ops before its first adapted product record nothing and have no
        backward, and that product computes no input gradient (its base's or its adapters')."""
        for i, (fwd, bwd) in enumerate(groups):
            if fwd[0].name in self.adapted:
                # No op before it saves its input now (the attention's output, where the
                # attention ran on constants).
                fwd[0].saved = tuple(replace(t, shared=False) for t in fwd[0].saved)
                bwd[:] = [op for op in bwd if op.variant != "bwd_input"]
                adapters_bwd = groups[i + 1][1]          # x A^T's
                adapters_bwd[:] = [op for op in adapters_bwd if op.variant != "bwd_input"]
                return
            for op in fwd:
                op.saved, op.tape_records = (), 0
            bwd.clear()

    def embedding(self):
        C, N, e = self.spec.n_embd, self.N, self.e
        if self.lora is not None:
            # A frozen table: its output is a constant, nothing is recorded.
            return Op("encoder", "embedding", "fwd", -1, N * C, 4 * N + e * 3 * N * C), []
        # Our encoder keeps the int32 token ids for its backward scatter; with rotary
        # positions it adds a zero (T, C) float32 position row, which it keeps too.
        saved = () if self.megatron else (Saved("encoder.ids", 4.0 * N),)
        if self.spec.positions == "rope" and not self.megatron:
            saved += (Saved("encoder.zero_positions", 4.0 * self.s * C),)
        fwd = Op("encoder", "embedding", "fwd", -1, N * C, 4 * N + e * 3 * N * C, "", saved, len(saved))
        bwd = Op("encoder", "embedding", "bwd", -1, 2 * N * C, 4 * N + e * 5 * N * C)
        return fwd, [bwd]

    def head(self):
        """Final norm, LM head (vocab split over tp; tied or not, the same product) and cross-entropy."""
        spec, N, e = self.spec, self.N, self.e
        Vp = spec.padded_vocab / self.tp
        lnf = self.norm("f", -1)
        logits = self.product("lm_head", -1, N, spec.n_embd, Vp, bias=False)
        # The loss keeps the log-sum-exp; logits stay alive for the backward (dlogits are
        # written in place over them).
        loss_saved = (Saved("loss.logits", e * N * Vp), Saved("loss.lse", 4.0 * N))
        if not self.megatron:
            loss_saved += (Saved("loss.targets", 4.0 * N),)      # int32 target ids
        loss = (Op("loss", "loss", "fwd", -1, SOFTMAX_FLOPS * N * Vp, e * N * Vp + 8 * N, "", loss_saved, 1),
                [Op("loss", "loss", "bwd", -1, SOFTMAX_FLOPS * N * Vp, e * 2 * N * Vp + 8 * N)])
        return [lnf, *logits, loss]


def binomial_recompute_steps(n_steps, slots):
    """Extra forward step evaluations to reverse ``n_steps`` layers with ``slots`` checkpoints.

    Griewank's binomial checkpointing, by dynamic programming: the first forward sweep
    places checkpoints for free; reversing a step re-runs it once with recording; getting
    back to a step's input from the nearest checkpoint costs one evaluation per step
    advanced.  With slots >= n_steps - 1 every layer input is stored and the cost is
    n_steps (one recording re-run per layer).
    """
    if n_steps < 1 or slots < 0:
        raise ValueError(f"binomial checkpointing needs n_steps >= 1 and slots >= 0, got {n_steps}, {slots}")
    slots = min(slots, n_steps - 1)
    # advance[n][c]: evaluations to advance from a stored state while reversing n steps.
    advance = [[0] * (slots + 1) for _ in range(n_steps + 1)]
    free = [[0] * (slots + 1) for _ in range(n_steps + 1)]
    for n in range(2, n_steps + 1):
        advance[n][0] = n * (n - 1) // 2
        free[n][0] = n * (n - 1) // 2
        for c in range(1, slots + 1):
            advance[n][c] = min(k + advance[n - k][c - 1] + advance[k][c] for k in range(1, n))
            free[n][c] = min(free[n - k][c - 1] + advance[k][c] for k in range(1, n))
    return n_steps + free[n_steps][slots]


def recompute_layer_passes(parallel, n_layers):
    """How many extra forward passes of whole layers the recompute policy costs (per micro-batch)."""
    policy = parallel.recompute
    if policy in ("full", "per_layer"):
        return n_layers
    if policy == "binomial":
        return binomial_recompute_steps(n_layers, parallel.checkpoints)
    return 0


def step_graph(spec, workload, parallel, options=GraphOptions(), stage=0, sram_bytes=0.0):
    """Ops one device runs for one micro-batch of pipeline stage ``stage``, plus the optimizer step.

    Returns a list of Ops: forward, recompute, backward (phase tells which), optimizer.
    Optimizer ops are for the whole step (they run once, not per micro-batch).
    """
    if not 0 <= stage < parallel.pp:
        raise ValueError(f"stage must be in [0, {parallel.pp}), got {stage}")
    if spec.n_layer % parallel.pp:
        raise ValueError(f"n_layer ({spec.n_layer}) must be divisible by pp ({parallel.pp})")
    if spec.n_head % parallel.tp:
        raise ValueError(f"n_head ({spec.n_head}) must be divisible by tp ({parallel.tp})")
    check_lora(spec, workload, parallel, options)
    b = workload.micro_batch_size(parallel)
    builder = _Builder(spec, b, workload.seq_len, value_bytes(workload, options), parallel.tp,
                       parallel.sequence_parallel, parallel.flash_attention, options, sram_bytes,
                       engine_bf16(workload, options),
                       update_writes_bf16_copies(workload, parallel, options))
    per_stage = spec.n_layer // parallel.pp
    layers = range(stage * per_stage, (stage + 1) * per_stage)
    first, last = stage == 0, stage == parallel.pp - 1

    fwd, bwd = [], []
    if first:
        f, bw = builder.embedding()
        fwd.append(f)
        bwd = bw + bwd
    layer_fwd = {}
    for layer in layers:
        f, bw = builder.layer(layer)
        layer_fwd[layer] = f
        fwd += f
        bwd = bw + bwd
    if last:
        head_bwd = []
        for f, bw in builder.head():
            fwd.append(f)
            head_bwd = bw + head_bwd
        bwd = head_bwd + bwd

    recompute = []
    if parallel.recompute == "selective" and not parallel.flash_attention:
        for layer in layers:
            recompute += [_as_recompute(op) for op in layer_fwd[layer] if op.op_class == "attention"]
    elif parallel.recompute in ("full", "per_layer", "binomial"):
        passes = recompute_layer_passes(parallel, per_stage)
        # Passes are spread evenly over the layers for the bookkeeping of time; for the
        # full and per_layer policies that is exactly one re-run per layer.
        for i in range(passes):
            recompute += [_as_recompute(op) for op in layer_fwd[layers[i % per_stage]]]

    optim = optimizer_ops(spec, parallel, stage, workload, options)
    return fwd + recompute + bwd + optim


def _as_recompute(op):
    """A forward op re-run: no records pushed, the weights' bf16 copies already made."""
    return Op(op.name, op.op_class, "recompute", op.layer, op.flops, op.nbytes, op.variant,
              gemm_flops=op.gemm_flops, convert_bytes=op.convert_bytes, precision=op.precision)


def check_lora(spec, workload, parallel, options):
    """ValueError where ``options.lora`` does not fit the rest: LoRA (gpt2.lora) trains a dense
    model in float32 values on one process or data-parallel replicas."""
    if options.lora is None:
        return
    options.lora.check(spec)
    if workload.precision != "fp32":
        raise ValueError(f"GraphOptions.lora keeps the values in float32: it needs Workload.precision 'fp32', "
                         f"got {workload.precision!r}")
    split = [f"{name}={getattr(parallel, name)}" for name in ("tp", "pp", "ep") if getattr(parallel, name) > 1]
    if split:
        raise ValueError(f"GraphOptions.lora runs on one process or data-parallel replicas, got {', '.join(split)}")


def trainable_parameters(spec, parallel, stage, options=GraphOptions()):
    """Parameters one device of ``stage`` trains before ZeRO sharding: its parameters
    (``stage_parameters``), or under LoRA the adapters."""
    if options.lora is None:
        return stage_parameters(spec, parallel, stage)
    return options.lora.adapter_params(spec)


def stage_parameters(spec, parallel, stage):
    """Parameters held by one device of ``stage`` before ZeRO sharding (tensor-parallel split)."""
    per_stage = spec.n_layer // parallel.pp
    params = per_stage * spec.layer_params()
    if spec.n_experts:
        # Experts are split over the expert-parallel group.
        params -= per_stage * spec.mlp_params_per_expert * spec.n_experts * (1 - 1 / parallel.ep)
    params /= parallel.tp
    if stage == 0:
        params += spec.embedding_params() / parallel.tp
    if stage == parallel.pp - 1:
        params += spec.norm_params
        if parallel.pp > 1 or not spec.tied_head:
            # The LM head's own weights, or the last stage's copy of the tied embedding.
            params += spec.padded_vocab * spec.n_embd / parallel.tp
    return params


def optimizer_ops(spec, parallel, stage, workload, options=GraphOptions()):
    """AdamW over the parameters this device updates (under LoRA the adapters), and under the Megatron layout the
    zeroing of the gradients before the step.  Our engines make no zeroing pass: the
    zeroing is deferred (``Model.zero_grad(deferred=True)``), and the backward's first
    write to each gradient overwrites it instead of adding to zeros."""
    params = trainable_parameters(spec, parallel, stage, options)
    updated = params / parallel.dp if parallel.sharding >= 1 else params
    grad_bytes = value_bytes(workload, options)
    # AdamW reads param, grad, m, v and writes param, m, v in fp32; with 16-bit training
    # it also writes the 16-bit copy of the parameters, and so does our bf16 mode where
    # ``update_writes_bf16_copies`` (elsewhere it converts the weights in the forward
    # pass: the matmuls' weight_convert_bytes).
    extra = 2.0 if grad_bytes == 2 or update_writes_bf16_copies(workload, parallel, options) else 0.0
    adam = Op("adamw", "optimizer", "optim", -1, ADAMW_FLOPS * updated,
              (6 * 4 + grad_bytes + extra) * updated)
    if options.layout == "adtape":
        return [adam]
    return [Op("zero_grad", "optimizer", "optim", -1, 0.0, grad_bytes * params), adam]


def palm_flops_per_token(n_params, n_layer, n_head, head_dim, seq_len):
    """PaLM's model FLOPs per token (Chowdhery et al. 2022, App. B): 6N + 12 L H Q T."""
    return 6.0 * n_params + 12.0 * n_layer * n_head * head_dim * seq_len


def model_flops_per_token(spec, seq_len, lora=None):
    """PaLM's definition for a ModelSpec: N counts the parameters a token uses, without the
    position embedding (it does no arithmetic; PaLM has none), nor the token embedding when
    the LM head has its own weights (then it is only looked up).  Under ``lora`` (a
    LoraSpec) the frozen base's products run forward and for their input's gradient only,
    4 N instead of 6 N, and the adapters' parameters train (6 FLOPs each)."""
    token_lookup = 0 if spec.tied_head else spec.padded_vocab * spec.n_embd
    n = spec.active_parameters() - spec.position_params() - token_lookup
    flops = palm_flops_per_token(n, spec.n_layer, spec.n_head, spec.head_size, seq_len)
    if lora is None:
        return flops
    return flops - 2.0 * n + 6.0 * lora.adapter_params(spec)


def megatron_flops(spec, batch, seq_len, full_recompute=True):
    """Narayanan et al. 2021, eq. (3): 96 B s l h^2 (1 + s/6h + V/16lh) with activation
    recomputation, 72 B s l h^2 (1 + s/6h + V/12lh) without (matmul FLOPs per iteration)."""
    B, s, l, h, V = batch, seq_len, spec.n_layer, spec.n_embd, spec.padded_vocab
    if full_recompute:
        return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def mfu(flops_per_token, tokens_per_second, peak_flops_total):
    """Model FLOPs utilisation (PaLM): achieved model FLOP/s over the peak of all devices."""
    return flops_per_token * tokens_per_second / peak_flops_total
