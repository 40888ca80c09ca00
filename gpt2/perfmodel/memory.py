"""Memory model: parameters, gradients, optimizer moments and saved activations per device.

Activations are summed from the tensors each forward op of ``graph.step_graph`` saves,
so the model follows the graph's layout exactly; recomputation, pipeline micro-batches
in flight and the tape's memory budget (what spills to disk) are applied on top.
``korthikanti_activations_per_layer`` gives the paper's closed forms for checking.
"""
from dataclasses import dataclass

from .graph import GraphOptions, engine_bf16, product_weight_params, stage_parameters, step_graph, value_bytes

# Saved tensors that selective recomputation (Korthikanti et al. 2022) drops: the
# s x s attention intermediates.
SELECTIVE_DROPS = ("attn.probs", "attn.softmax_out", "attn.dropout.mask", "attn.dropout_out")


@dataclass
class MemoryBreakdown:
    parameters: float
    gradients: float
    optimizer: float
    activations: float       # saved for backward, resident (after any spill)
    workspace: float         # transient buffers during backward (activation gradients, one layer recomputed)
    baseline: float          # process / runtime overhead from the hardware profile
    spilled: float           # activation bytes the tape writes to disk under its budget
    activations_unbudgeted: float

    @property
    def model_states(self):
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self):
        return self.model_states + self.activations + self.workspace + self.baseline

    def as_dict(self):
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "workspace": self.workspace, "baseline": self.baseline,
                "spilled": self.spilled, "total": self.total}


def model_state_bytes(n_params, precision, dp=1, zero_stage=0):
    """(parameters, gradients, optimizer) bytes per device for ``n_params`` parameters.

    fp32 training: 4 + 4 bytes, AdamW moments 8.  Mixed precision (Rajbhandari et al.
    2020): 2 + 2 bytes, optimizer K = 12 (fp32 master copy, momentum, variance).  ZeRO
    stage 1 shards the optimizer over ``dp``, stage 2 also the gradients, stage 3 (and
    FSDP) also the parameters.
    """
    if precision in ("bf16", "fp16"):
        p, g, k = 2.0, 2.0, 12.0
    else:
        p, g, k = 4.0, 4.0, 8.0
    shard = lambda stage: dp if zero_stage >= stage else 1   # noqa: E731 - a one-line table
    return p * n_params / shard(3), g * n_params / shard(2), k * n_params / shard(1)


def korthikanti_activations_per_layer(s, b, h, a, t=1, sequence_parallel=False, recompute="none",
                                      bytes_per_value=2):
    """Closed forms of Korthikanti et al. 2022 (Table 2), bytes per layer with 16-bit values.

    none: sbh(10 + 24/t) + 5as^2b/t (t = 1: 34sbh + 5as^2b); with sequence parallelism
    sbh*34/t + 5as^2b/t; selective recompute drops the 5as^2b term; full recompute keeps
    the layer input, 2sbh.
    """
    if recompute == "full":
        return 2.0 * s * b * h / (t if sequence_parallel else 1)
    linear = 34.0 / t if sequence_parallel else 10.0 + 24.0 / t
    quadratic = 0.0 if recompute == "selective" else 5.0 * a * s * s * b / t
    return (s * b * h * linear + quadratic) * bytes_per_value / 2


def saved_by_layer(ops, referenced=False):
    """{layer: {tensor name: bytes}} from the forward ops (layer -1: embedding and head);
    ``referenced``: as held by reference, an array two ops save counted once (the
    ``shared`` ones left out)."""
    out = {}
    for op in ops:
        if op.phase != "fwd":
            continue
        for saved in op.saved:
            if referenced and saved.shared:
                continue
            out.setdefault(op.layer, {})[saved.name] = out.get(op.layer, {}).get(saved.name, 0.0) + saved.nbytes
    return out


def layer_input_bytes(spec, workload, parallel, options=GraphOptions()):
    """Bytes of one layer's input (the checkpoint kept by full/per-layer recomputation)."""
    b = workload.micro_batch_size(parallel)
    shard = parallel.tp if parallel.sequence_parallel else 1
    return value_bytes(workload, options) * b * workload.seq_len * spec.n_embd / shard


def activation_bytes(spec, workload, parallel, options=GraphOptions(), stage=0, ops=None):
    """(stored, transient) activation bytes of one micro-batch on ``stage``.

    stored: what stays in memory between forward and backward; transient: the one layer
    re-run at a time during the backward under full/per-layer/binomial recomputation.
    """
    if ops is None:
        ops = step_graph(spec, workload, parallel, options, stage)
    # Without a tape budget our engine holds the saved arrays by reference (an array two
    # ops save is one array); with one it copies each onto the byte tape.
    by_layer = saved_by_layer(ops, referenced=options.layout == "adtape" and parallel.tape_budget < 0)
    other = sum(by_layer.pop(-1, {}).values())
    layers = sorted(by_layer)
    full_layer = {layer: sum(tensors.values()) for layer, tensors in by_layer.items()}
    policy = parallel.recompute
    if policy == "none" or (policy == "selective" and parallel.flash_attention):
        return other + sum(full_layer.values()), 0.0
    if policy == "selective":
        kept = sum(v for tensors in by_layer.values() for k, v in tensors.items() if k not in SELECTIVE_DROPS)
        return other + kept, 0.0
    checkpoint = layer_input_bytes(spec, workload, parallel, options)
    if policy in ("full", "per_layer"):
        slots = len(layers)
    else:
        # The first layer's input is the starting state; `checkpoints` more are stored.
        slots = 1 + min(parallel.checkpoints, len(layers) - 1)
    return other + slots * checkpoint, max(full_layer.values(), default=0.0)


def layer_activation_bytes(spec, workload, parallel, options=GraphOptions()):
    """Stored activation bytes per transformer layer (one micro-batch, embedding and head excluded)."""
    ops = step_graph(spec, workload, parallel, options)
    stored, _ = activation_bytes(spec, workload, parallel, options, ops=ops)
    other = sum(saved_by_layer(ops).get(-1, {}).values())
    return (stored - other) / (spec.n_layer // parallel.pp)


def in_flight_micro_batches(parallel, n_micro):
    """Micro-batches whose activations the first pipeline stage holds at once (1F1B)."""
    if parallel.pp == 1:
        return 1.0
    held = float(min(parallel.pp, n_micro))
    if parallel.interleave > 1:
        # Interleaved schedule: Korthikanti et al. 2022, sec. 4.2.3.
        held *= 1 + (parallel.pp - 1) / (parallel.pp * parallel.interleave)
    return held


def loss_backward_bytes(spec, tokens, act_bytes=4, tp=1):
    """Bytes the loss's backward adds beside the saved logits: the logits' gradient
    (tokens x vocabulary, ``tp`` shards of it), then the lm_head input's gradient."""
    return act_bytes * tokens * (spec.padded_vocab / tp + spec.n_embd)


def memory_breakdown(spec, workload, parallel, hardware, options=GraphOptions(), stage=0, ops=None):
    """Peak bytes on one device of ``stage``."""
    params = stage_parameters(spec, parallel, stage)
    bf16 = engine_bf16(workload, options)
    e = value_bytes(workload, options)
    lora = options.lora
    if lora is None:
        p_bytes, g_bytes, o_bytes = model_state_bytes(params, workload.precision, parallel.dp, parallel.sharding)
    else:
        # The frozen base (no gradient, no moments) beside the adapters' four float32 arenas.
        p_bytes, g_bytes, o_bytes = model_state_bytes(lora.adapter_params(spec), "fp32", parallel.dp,
                                                      parallel.sharding)
        p_bytes += lora.base_bytes(spec)
    if bf16 and (lora is None or lora.base_dtype == "fp32"):
        # float32 master weights, gradients and moments, and the products' weights' bf16
        # copies (adtape.nn keeps them from the forward pass until the weights change; a
        # bf16 LoRA base is its own).
        p_bytes += 2.0 * product_weight_params(spec, parallel, stage)
    reduced = g_bytes
    if options.layout == "adtape" and parallel.sharding == 1 and parallel.dp > 1:
        # gpt2.distributed keeps the whole gradient arena (the backward writes it) and
        # the rank's reduced shard beside it, which the reduce-scatter fills.
        g_bytes += g_bytes / parallel.dp
    stored, transient = activation_bytes(spec, workload, parallel, options, stage, ops)
    stored *= in_flight_micro_batches(parallel, workload.num_micro_batches(parallel))
    budget = parallel.tape_budget
    spilled = max(0.0, stored - budget) if budget >= 0 else 0.0
    # Backward keeps the residual stream's gradient and the gradients of one op's
    # inputs alive: bounded by one layer's activation set plus the residual stream.
    if ops is None:
        ops = step_graph(spec, workload, parallel, options, stage)
    layer_sets = [v for k, v in _layer_totals(ops).items() if k >= 0]
    workspace = transient + max(layer_sets, default=0.0) + layer_input_bytes(spec, workload, parallel, options)
    if stage == parallel.pp - 1:
        # The loss's backward, on the last stage: at GPT-2's vocabulary the backward's
        # fullest moment below a few thousand tokens per micro-batch (measured peaks were
        # 3-8% above the prediction without it).
        tokens = workload.micro_batch_size(parallel) * workload.seq_len
        workspace = max(workspace, loss_backward_bytes(spec, tokens, e,
                                                       parallel.tp))
    if parallel.dp > 1 and parallel.overlap_dp_comm:
        # Non-blocking collectives allocate temporary buffers while in flight; every
        # bucket may be in flight at once (the backward launches them faster than a
        # shared CPU completes them), and a heap that keeps freed memory stays at that.
        name = "all_reduce" if parallel.sharding == 0 else "reduce_scatter"
        per_byte = hardware.interconnect.buffer_bytes_per_byte.get(name, 0.0)
        workspace += per_byte * reduced
    if parallel.sharding == 3:
        # Stage 3 / FSDP gathers one layer's full parameters at a time.
        workspace += spec.layer_params() / parallel.tp * (2 if e == 2 else 4)
    return MemoryBreakdown(p_bytes, g_bytes, o_bytes, stored - spilled, workspace, hardware.baseline_rss,
                           spilled, stored)


def _layer_totals(ops):
    return {layer: sum(t.values()) for layer, t in saved_by_layer(ops).items()}
