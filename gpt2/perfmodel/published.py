"""Checks of the model against published figures; each check is one record.

A record: name, predicted (this model), measured (the published figure), the signed
relative error (predicted - measured) / measured, the unit and the source.  Used by
bench/perfmodel_validation.py (which writes them all) and by the tests.
"""
from .graph import GraphOptions, megatron_flops, mfu, palm_flops_per_token, step_graph
from .hardware import load_profile
from .estimate import estimate
from .memory import korthikanti_activations_per_layer, layer_activation_bytes, model_state_bytes
from .spec import ModelSpec, ParallelConfig, Workload

ZERO_SOURCE = "Rajbhandari et al. 2020, ZeRO, Figure 1: 7.5B parameters, Nd = 64, K = 12"
KORTHIKANTI_SOURCE = "Korthikanti et al. 2022, Reducing Activation Recomputation, Table 2 (per layer)"
MEGATRON_SOURCE = "Narayanan et al. 2021, Efficient Large-Scale LM Training with Megatron-LM"
PALM_SOURCE = "Chowdhery et al. 2022, PaLM, Sec. 4.1 and App. B"

# GPT-3 175B as in Megatron-LM: 96 layers, 96 heads, h = 12288, s = 2048, V = 51200.
GPT3_175B = ModelSpec(96, 96, 12288, 51200, block_size=2048, vocab_multiple=1)


def record(name, predicted, measured, unit, source, note=""):
    rec = {"name": name, "predicted": float(predicted), "measured": float(measured),
           "rel_error": (float(predicted) - float(measured)) / float(measured), "unit": unit, "source": source}
    if note:
        rec["note"] = note
    return rec


def zero_checks():
    published = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    names = {0: "baseline", 1: "stage1", 2: "stage2", 3: "stage3"}
    out = []
    for stage, gb in published.items():
        predicted = sum(model_state_bytes(7.5e9, "fp16", dp=64, zero_stage=stage)) / 1e9
        out.append(record(f"zero_7.5B_64gpu_{names[stage]}", predicted, gb, "GB", ZERO_SOURCE,
                          "published figure rounded to 0.1 GB"))
    return out


def korthikanti_checks(spec=GPT3_175B, seq=2048, micro_batch=1, t=8):
    """Per-layer activation bytes from the op graph (Megatron layout) against the closed forms."""
    s, b, h, a = seq, micro_batch, spec.n_embd, spec.n_head
    options = GraphOptions(layout="megatron")
    cases = [("no_parallelism", 1, False, "none"), ("tensor_parallel", t, False, "none"),
             ("tensor_sequence_parallel", t, True, "none"), ("tp_selective_recompute", t, False, "selective"),
             ("tp_sp_selective_recompute", t, True, "selective"), ("full_recompute", 1, False, "full")]
    out = []
    for name, tp, sp, recompute in cases:
        parallel = ParallelConfig(tp=tp, sequence_parallel=sp, recompute=recompute)
        workload = Workload(micro_batch, seq, precision="bf16")
        predicted = layer_activation_bytes(spec, workload, parallel, options)
        closed = korthikanti_activations_per_layer(s, b, h, a, tp, sp, recompute)
        out.append(record(f"korthikanti_{name}", predicted / 2**20, closed / 2**20, "MiB", KORTHIKANTI_SOURCE,
                          f"GPT-3 175B shapes, s={s}, b={b}, t={tp}"))
    return out


def megatron_flops_checks(spec=GPT3_175B, seq=2048, batch=4):
    """Dense-product FLOPs of our op graph per iteration against Megatron's formula."""
    out = []
    for recompute, full in (("full", True), ("none", False)):
        ops = step_graph(spec, Workload(batch, seq, precision="bf16"), ParallelConfig(recompute=recompute),
                         GraphOptions(layout="megatron"))
        predicted = sum(op.gemm_flops for op in ops)
        formula = megatron_flops(spec, batch, seq, full_recompute=full)
        out.append(record(f"megatron_flops_{'recompute' if full else 'no_recompute'}", predicted, formula,
                          "FLOP", MEGATRON_SOURCE + ", eq. (3)", f"GPT-3 175B, B={batch}, s={seq}"))
    return out


def palm_mfu_check():
    """PaLM 540B: 6N + 12LHQT FLOPs per token at 238.3k tokens/s on 6144 TPU v4 (275 TFLOP/s bf16)."""
    per_token = palm_flops_per_token(540.35e9, 118, 48, 256, 2048)
    predicted = mfu(per_token, 238.3e3, 6144 * 275e12)
    return [record("palm_540B_mfu", predicted, 0.462, "fraction", PALM_SOURCE + ", Table 3: 46.2% MFU")]


def megatron_throughput_check():
    """End-to-end: GPT-3 175B on 1536 A100s (t=8, p=16, batch 1536) reached 153 TFLOP/s per GPU.

    The A100 profile's efficiency curves are assumptions, not fitted to this run, so this
    check shows how far the uncalibrated time model is from a published step time.
    """
    parallel = ParallelConfig(dp=12, tp=8, pp=16, recompute="full")
    workload = Workload(1536, 2048, micro_batch=1, precision="bf16")
    est = estimate(GPT3_175B, workload, parallel, load_profile("a100-80gb-sxm"), GraphOptions(layout="megatron"))
    predicted = megatron_flops(GPT3_175B, 1536, 2048) / est.step_time / parallel.world_size / 1e12
    return [record("megatron_175B_tflops_per_gpu", predicted, 153.0, "TFLOP/s per GPU",
                   MEGATRON_SOURCE + ", Table 1",
                   "micro-batch 1 and non-interleaved 1F1B assumed; A100 efficiency curves not fitted")]


def published_checks():
    return (zero_checks() + korthikanti_checks() + megatron_flops_checks() + palm_mfu_check()
            + megatron_throughput_check())
