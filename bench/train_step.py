"""Benchmark one training step of GPT-2 124M or a Llama model, ours against PyTorch eager.

  python bench/train_step.py [--model gpt2] [--quick] [--threads N] [--steps 5]
                             [--weight-decay 0.1] [--configs 1x16,4x64] [--ftz both|on|off]

A step is zero grad, forward, backward and AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8,
weight decay 0.1 unless --weight-decay), no gradient clipping, per the fairness rules of
shared/BENCHMARKS.md: GPT-2 124M in float32, our init (``GPT2(config, seed)``) copied into
the PyTorch model (bench/torch_gpt2.py) so both start from the same weights, the same
fixed random batch on both sides, the same thread count n (default: all cores).

Every (B, T) and FTZ setting runs in a fresh process (this script with --worker), which
builds our model for each available engine ("tape", the default, and "manual", the
hand-sequenced baseline) and the PyTorch one, takes one warm-up step on each, then
interleaves their steps (order rotated every round) and keeps the median of
--steps timed steps.  The first pass runs both sides with flush-to-zero and
denormals-are-zero set before any OpenMP or BLAS thread starts, the second with both
cleared; each worker checks that the setting holds in the threads of both sides.

Figures per configuration:
- ms/step and tokens/s (B*T per step);
- achieved GFLOP/s with FLOPs = 6*N*B*T + 6*L*B*T^2*C, N = parameters that take part
  in matmuls (all but wpe, a lookup; wte with its V real rows, the tied LM head);
- the share of the machine's limit: max(FLOPs / physical fp32 peak, bytes / memory
  bandwidth) divided by the measured step time (above 100%: the measured limits are low,
  e.g. a busy machine while they were taken), with bytes = 4 * (12 * Np + B*T*(32*L*C + 5*Vp)):
  12 passes over the Np floats of the parameter layout (forward and backward read the
  weights, backward reads and writes the gradients, zeroing writes them, AdamW reads
  parameters, gradients and both moments and writes three of them), the 16*C floats per
  token and layer that backward reads (ln1, qkv, atty, residual2, ln2, fch, fch_gelu,
  residual3) written once and read once, and the logits written, read by the loss,
  written as their gradient and read by the two backward matmuls.  The physical fp32
  peak is that of the n cores' widest fp32 FMA (kernels.peak: multiply-adds from
  registers only, n threads at once; the bf16 peak beside it where the CPU has bf16
  dot products), not what a BLAS reaches; the step's GFLOP/s over the sgemm rate (a
  2048^3 float32 product through scipy's BLAS, the library our matmuls call, and
  through PyTorch's; the faster counts; n threads) is its own column.  The peaks,
  the sgemm rate and the bandwidth (n threads of NumPy copy, add and in-place add) are
  measured at the start and the end of the run and inside every worker after its
  steps; the best counts.

Prints a table, writes bench/results/train_step.json (one record per model, (B, T) and
FTZ setting; a run replaces its own model's records), bench/results/train_step_raw.json (per-step times, machine limits, skipped
configurations and why) and bench/results/train_step.png; --quick writes
train_step_quick*.json/.png so that a short run does not replace the full one.

--model takes a Llama-family preset instead (smollm2-135m, ...; those with Llama 3 rope
scaling excepted): our tape engine against two baselines on the same weights, batch and
threads, each worker building all three: PyTorch eager (bench/torch_llama.py, packed
q|k|v and gate|up projections) and transformers' LlamaForCausalLM (Qwen2ForCausalLM for
Qwen2) with attn_implementation="sdpa", loaded by from_pretrained from our weights
saved by gpt2.hf.save_dir.  The first step's losses must agree within 1e-4 (absolute).
The grid is (1,64) (4,64) (4,256) (4,1024); the ratios are medians of the per-step
ratios of interleaved steps; N counts the q|k|v, output, gate|up and down projections
and the LM head (V rows), the attention FLOPs use n_head * head_dim for C, and the
bytes use the floats per token and layer that our backward reads (the block's input,
both norms' outputs, the rotated q|k|v, the attention's output, the residual after
attention and gate|up: 4C + (n_head + 2 n_kv_head) head_dim + n_head head_dim + 2 I).
The peak RSS of the worker during each side's warm-up step is recorded.  Records carry
``ours_ms``, ``torch_ms`` (plain PyTorch) and ``hf_ms`` (transformers) and go to
train_step.json beside GPT-2's; the raw data and plot to train_step_<preset>_raw.json, .png.
"""
import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import _paths  # noqa: E402,F401  (import order: source if built in place, installed, bench/)
from _runinfo import compute_limit, cpu_flags, cpu_name, git_commit  # noqa: E402
from harness import LimitProbe, RssSampler, interleave  # noqa: E402
from kernels import blas_dispatch  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
GRID = ((1, 16), (1, 32), (2, 16), (1, 64), (4, 64), (4, 256), (8, 1024))
QUICK_GRID = ((1, 16), (4, 64))
LLAMA_GRID = ((1, 64), (4, 64), (4, 256), (4, 1024))
LLAMA_QUICK_GRID = ((1, 64), (4, 64))
ENGINES = ("tape", "manual")
# The Llama family: our tape engine, PyTorch eager, transformers' model.
LLAMA_SIDES = ("tape", "torch", "hf")   # hf: transformers' model
LLAMA_LOSS_TOLERANCE = 1e-4
# --precision both: ours with bf16 products ("bf16") and PyTorch under
# torch.autocast("cpu", torch.bfloat16) ("autocast"), beside the float32 sides.  Their
# first-step losses must agree with the float32 ones within this relative tolerance
# (bf16 operands move GPT-2's initial loss by about 1e-4 of its value).
BF16_SIDES = ("bf16", "autocast")
BF16_LOSS_TOLERANCE = 1e-2
# --long-steps applies from this many tokens per step: SmolLM2-135M's (4, 1024) takes
# 20-60 s per step per side on 2 cores.
LONG_TOKENS = 4096
# One side's activations over ours, for the memory estimate: PyTorch eager keeps the
# elementwise intermediates of RMSNorm, rope and SwiGLU for its backward (9.2 GB
# against our 5.7 GB for SmolLM2-135M at (4, 1024), each side alone), and three sides
# taking turns in one heap leave it fragmented: the worker's peak was 17.7 GiB there,
# which this factor with MEMORY_MARGIN covers.
LLAMA_ACTIVATION_FACTOR = 2.2
LR, BETAS, EPS = 1e-4, (0.9, 0.999), 1e-8
TARGET_SPEEDUP = 2.0
TAPE_OVERHEAD_LIMIT = 1.05
# Headroom over the estimated footprint: allocator slack, Python, other processes' growth.
MEMORY_MARGIN = 1.15
GiB = 1 << 30


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def parse_configs(text):
    """'1x16,4x64' -> ((1, 16), (4, 64))."""
    configs = []
    for item in text.split(","):
        try:
            b, t = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"a configuration is BxT, e.g. 4x64; got {item!r}") from None
        if b < 1 or t < 1 or t > 1024:
            raise argparse.ArgumentTypeError(f"need B >= 1 and 1 <= T <= 1024, got {item!r}")
        configs.append((b, t))
    return tuple(configs)


def parse_engines(text):
    """'tape,manual' -> ('tape', 'manual'): a non-empty subset of ENGINES, in their order."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in ENGINES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"engines must be among {','.join(ENGINES)}, "
                                         f"got {text!r}")
    return tuple(e for e in ENGINES if e in names)


def model_choices():
    """gpt2 and the Llama-family presets bench/torch_llama.py can build (default rope)."""
    from gpt2.config import LLAMA_PRESETS
    return ("gpt2",) + tuple(name for name, sizes in LLAMA_PRESETS.items()
                             if sizes.get("rope_scaling") is None)


def model_config(name):
    from gpt2.config import preset
    return preset(name)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=model_choices(), default="gpt2",
                   help="GPT-2 124M (default) or a Llama-family preset, e.g. smollm2-135m")
    p.add_argument("--quick", action="store_true",
                   help=f"configurations {QUICK_GRID} (Llama: {LLAMA_QUICK_GRID}) with 3 "
                        f"timed steps each")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="threads on both sides (default: all cores this process may use)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="timed steps per side and configuration (default 5, --quick 3)")
    p.add_argument("--long-steps", type=positive_int, default=None,
                   help=f"timed steps for configurations of {LONG_TOKENS} tokens (B*T) or more "
                        f"(default: --steps)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--configs", type=parse_configs, default=None,
                   help="comma-separated BxT list instead of the grid")
    p.add_argument("--ftz", choices=("both", "on", "off"), default="both",
                   help="flush-to-zero passes: both (on, then off), or one of them")
    p.add_argument("--precision", choices=("fp32", "both"), default="fp32",
                   help="fp32: float32 sides only; both: also ours with --precision bf16 "
                        "and PyTorch under bf16 autocast, in the same interleaved run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", type=parse_engines, default=ENGINES,
                   help="GPT-2: our engines to time, comma-separated (default tape,manual; "
                        "tape alone saves a side, e.g. in bench/thread_scan.py)")
    p.add_argument("--results-dir", default=RESULTS,
                   help="where the records, raw data and plot go (default bench/results)")
    p.add_argument("--worker", choices=("step", "limits"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--B", type=positive_int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--T", type=positive_int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--ftz-on", type=int, choices=(0, 1), default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    return p


# -- formulas ---------------------------------------------------------------------

def model_sizes(config):
    """(N matmul parameters, Np floats of the parameter layout) of either family."""
    from gpt2.params import num_parameters
    n_layout = num_parameters(config)
    C = config.n_embd
    if config.family == "gpt2":
        n_matmul = (n_layout - config.block_size * C
                    - (config.padded_vocab_size - config.vocab_size) * C)
        return n_matmul, n_layout
    per_layer = (config.qkv_width * C + C * config.n_head * config.head_dim
                 + 3 * config.intermediate_size * C)
    # The LM head's V real rows (the tied wte's or lm_head's); an untied wte is a lookup.
    return config.n_layer * per_layer + config.vocab_size * C, n_layout


def attention_width(config):
    """The channels attention scores and mixes: n_head * head_dim (GPT-2: C)."""
    return config.n_embd if config.family == "gpt2" else config.n_head * config.head_dim


def saved_floats(config):
    """Floats per token and layer that the backward reads: GPT-2 16 C (ln1, qkv, atty,
    residual2, ln2, fch, fch_gelu, residual3); Llama the block's input, the two norms'
    outputs, the rotated q|k|v, the attention's output, the residual after attention
    and gate|up (the down projection recomputes the SwiGLU output from it)."""
    C = config.n_embd
    if config.family == "gpt2":
        return 16 * C
    return (4 * C + config.qkv_width + config.n_head * config.head_dim
            + 2 * config.intermediate_size)


def step_flops(config, B, T):
    n_matmul, _ = model_sizes(config)
    return 6 * n_matmul * B * T + 6 * config.n_layer * B * T * T * attention_width(config)


def step_bytes(config, B, T):
    _, n_layout = model_sizes(config)
    per_token = 2 * config.n_layer * saved_floats(config) + 5 * config.padded_vocab_size
    return 4 * (12 * n_layout + B * T * per_token)


# -- worker: machine limits --------------------------------------------------------

def measure_limits(n_threads, repeats=5):
    """The machine's limits on n cores (harness.LimitProbe): the physical FMA peaks,
    the best sgemm GFLOP/s of ours, SciPy's OpenBLAS and PyTorch's (the fastest counts)
    and the best copy/add/in-place update/read GB/s over 256 MiB streams."""
    return LimitProbe(n_threads).measure(repeats)


def best_limits(runs):
    """The run's limits from every measurement of them: the best of each (a measurement
    taken while other processes ran reads low)."""
    def best(key):
        values = [r[key] for r in runs if r.get(key) is not None]
        return max(values) if values else None
    isa = {kind: next((r[f"{kind}_peak_isa"] for r in runs if r.get(f"{kind}_peak_isa")), None)
           for kind in ("fp32", "bf16")}
    return {"fp32_peak_gflops": best("fp32_peak_gflops"), "fp32_peak_isa": isa["fp32"],
            "bf16_peak_gflops": best("bf16_peak_gflops"), "bf16_peak_isa": isa["bf16"],
            "sgemm_gflops": best("sgemm_gflops"), "bandwidth_gbs": best("bandwidth_gbs")}


def limits_line(limits):
    """The limits in a few words, for tables and plots."""
    peak, what = compute_limit(limits)
    bf16 = (f", bf16 peak {limits['bf16_peak_gflops']:.0f} ({limits['bf16_peak_isa']})"
            if limits.get("bf16_peak_gflops") else "")
    sgemm = f", sgemm {limits['sgemm_gflops']:.0f}" if what != "sgemm" else ""
    return (f"{what} {peak:.0f} GFLOP/s{bf16}{sgemm}, memory bandwidth "
            f"{limits['bandwidth_gbs']:.1f} GB/s")


# -- worker: one (B, T) configuration ------------------------------------------------

def memory_estimate(config, B, T, engines, n_torch=1):
    """Bytes the worker would touch: per side four parameter-sized arenas plus activations.

    Ours: the manual engine's ActivationArena, whose size is B*(a*T + b*T^2) floats
    (b: any T x T buffers; none since attention keeps log-sum-exps), read off two
    small arenas (T = 16 and 32: every buffer a whole number of the arena's 16-float
    padding, so the fit is exact); the tape engine saves the same activations.
    PyTorch: the same minus any T x T buffers plus the log-softmax copy of the logits,
    for each of its ``n_torch`` models.
    """
    from gpt2.model import ActivationArena
    _, n_layout = model_sizes(config)
    f1 = ActivationArena(config, 1, 16).flat.size
    f2 = ActivationArena(config, 1, 32).flat.size
    quad = (f2 - 2 * f1) / (2 * 16 * 16)
    lin = (f1 - quad * 16 * 16) / 16
    ours_acts = 4 * B * (lin * T + quad * T * T)
    arenas = 4 * 4 * n_layout
    torch_acts = ours_acts - 4 * B * quad * T * T + 4 * B * T * config.padded_vocab_size
    return len(engines) * (arenas + ours_acts) + n_torch * (arenas + torch_acts)


def check_flush(ftz, torch):
    """Whether denormals are flushed in our OpenMP threads, our BLAS threads, and PyTorch's
    elementwise and matmul threads: each sees 1e-39 inputs, which DAZ reads as zero."""
    import numpy as np
    from kernels import _openmp, layers, matmul

    tiny = np.full(1 << 22, 1e-39, dtype=np.float32)
    out = np.empty_like(tiny)
    layers.residual_forward(out, tiny, tiny)
    rows = np.full((1024, 768), 1e-39, dtype=np.float32)
    ones = np.ones((768, 768), dtype=np.float32)
    prod = np.empty((1024, 768), dtype=np.float32)
    matmul.matmul_forward(prod, rows, ones, None)
    t_tiny = torch.from_numpy(tiny)
    t_rows, t_ones = torch.from_numpy(rows), torch.from_numpy(ones)
    found = {
        "ours_main_thread": bool(_openmp.flush_denormal_enabled()),
        "ours_openmp": _all_or_none_zero(out),
        "ours_blas": _all_or_none_zero(prod),
        "torch_elementwise": _all_or_none_zero((t_tiny + t_tiny).numpy()),
        "torch_matmul": _all_or_none_zero((t_rows @ t_ones).numpy()),
    }
    mixed = {k: v for k, v in found.items() if v is not ftz}
    if mixed:
        raise RuntimeError(f"flush-to-zero was asked {'on' if ftz else 'off'} but these threads "
                           f"disagree: {mixed} (all checks: {found})")
    return found


def _all_or_none_zero(arr):
    """True when every element flushed to zero, False when none did; else a mixed state."""
    import numpy as np
    zeros = int(arr.size - np.count_nonzero(arr))
    if zeros == arr.size:
        return True
    if zeros == 0:
        return False
    raise RuntimeError(f"{zeros} of {arr.size} denormal results flushed: some threads have "
                       f"FTZ/DAZ and some not")


def start_worker(n, ftz):
    """Flush-to-zero, malloc retention and n threads on every side; returns torch."""
    # MXCSR first: threads inherit it from the thread that creates them, and the
    # OpenMP pool (shared with PyTorch, one libgomp), OpenBLAS and MKL start later.
    from kernels import _openmp
    _openmp.set_flush_denormal(ftz, n)
    # As gpt2.train does: keep freed memory mapped, for every side (process-wide).
    _openmp.set_malloc_retention()
    import torch
    import torch_gpt2
    torch_gpt2.configure_torch(n, ftz)
    from kernels import threads
    threads.set_num_threads(n)
    _openmp.set_flush_denormal(ftz, n)
    return torch


def random_batch(config, B, T, seed):
    """(inputs, targets) int32 (B, T): a fixed random token sequence and its next tokens."""
    import numpy as np
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, (B, T + 1),
                                                  dtype=np.int64)
    return (np.ascontiguousarray(tokens[:, :-1], dtype=np.int32),
            np.ascontiguousarray(tokens[:, 1:], dtype=np.int32))


def fits(need):
    """Whether ``need`` bytes with the margin fit in the memory available now."""
    import psutil
    return need * MEMORY_MARGIN <= psutil.virtual_memory().available


def too_big(result, need, what):
    """Record the estimate; True (with the reason in ``result``) when ``need`` bytes
    with the margin do not fit in the memory available now."""
    import psutil
    result["memory_estimate_bytes"] = int(need)
    if fits(need):
        return False
    available = psutil.virtual_memory().available
    result["skipped"] = (f"needs about {need / GiB:.1f} GiB ({what}), "
                         f"{need * MEMORY_MARGIN / GiB:.1f} GiB with the x{MEMORY_MARGIN} "
                         f"margin; {available / GiB:.1f} GiB available")
    return True


def timed_steps(result, steps, sides, warm_loss, args, torch):
    """The timed steps of every side, interleaved, then the FTZ check and the machine's
    limits, into ``result``."""
    times, losses = interleave({s: steps[s] for s in sides}, args.steps)
    result["flush_check_after"] = check_flush(bool(args.ftz_on), torch)
    # Limits again here, in this configuration's conditions (on a shared machine a
    # measurement taken while others run reads low; the best of the run counts).
    # After the timed steps: its large buffers and PyTorch's sgemm threads must not
    # disturb them.
    result["limits"] = measure_limits(args.threads, repeats=3)
    result["warmup_loss"] = warm_loss
    result["loss"] = losses
    result["seconds"] = times


def bf16_sides(args, torch, ours, baseline, step_ours, t_inputs, t_targets):
    """The --precision both sides: {"bf16": a step of ``ours`` with bf16 products,
    "autocast": a step of ``baseline`` (a PyTorch model, float32 weights) under
    torch.autocast("cpu", torch.bfloat16)}; empty for --precision fp32."""
    if args.precision == "fp32":
        return {}
    import torch_gpt2
    from adtape import nn
    optimizer = torch_gpt2.make_adamw(baseline, lr=LR, betas=BETAS, eps=EPS,
                                      weight_decay=args.weight_decay)

    def bf16():
        previous = nn.set_precision("bf16")
        try:
            return step_ours(ours)
        finally:
            nn.set_precision(previous)
    return {"bf16": bf16,
            "autocast": lambda: torch_gpt2.train_step(baseline, optimizer, t_inputs, t_targets,
                                                      autocast=torch.bfloat16)}


def check_bf16_losses(warm_loss, reference, shared_refs=None):
    """The bf16 sides' first-step losses against the float32 ``reference`` side's, or
    where they train the float32 sides' models (``shared_refs``: {side: the float32 loss
    of the weights its warm-up step started from}) against those."""
    for s in BF16_SIDES:
        if s not in warm_loss:
            continue
        if shared_refs:
            ref, name = shared_refs[s], "the float32 loss of the same weights"
        else:
            ref, name = warm_loss[reference], f"{reference}'s"
        if abs(warm_loss[s] - ref) > BF16_LOSS_TOLERANCE * abs(ref):
            raise RuntimeError(f"first-step loss of {s} ({warm_loss[s]:.6f}) differs from "
                               f"{name} ({ref:.6f}) by more than {BF16_LOSS_TOLERANCE:.0%}")


def warm_up(steps, sides, shared_refs):
    """{side: its first (untimed) step's loss}, and where ``shared_refs`` is {side:
    callable} (the bf16 sides train the float32 sides' models) {side: the float32 loss
    of the weights that side's step starts from}, each taken just before it."""
    warm, refs = {}, {}
    for s in sides:
        if s in shared_refs:
            refs[s] = shared_refs[s]()
        warm[s] = steps[s]()
    return warm, refs


def run_step_worker(args):
    if args.model != "gpt2":
        return run_llama_worker(args)
    n, ftz, B, T = args.threads, bool(args.ftz_on), args.B, args.T
    torch = start_worker(n, ftz)
    import importlib.util

    import psutil
    import torch_gpt2
    from gpt2.config import GPT2Config
    from gpt2.model import GPT2

    config = GPT2Config.preset("gpt2")
    engines = [e for e in args.engines
               if e != "tape" or importlib.util.find_spec("gpt2.tape_engine") is not None]
    both = args.precision == "both"
    result = {"B": B, "T": T, "ftz": ftz, "threads": n, "engines": engines,
              "precision": args.precision}
    need = memory_estimate(config, B, T, engines + ["bf16"] * both, 1 + both)
    what = f"{len(engines) + both} model(s) of ours + {1 + both} of PyTorch"
    # Where five models do not fit (GPT-2 (4, 1024): 28 GiB), the bf16 sides train the
    # float32 sides' models (ours bf16 the tape engine's, autocast PyTorch's, with an
    # optimizer of its own): the same work per step, in one run.
    shared = both and not fits(need) and fits(memory_estimate(config, B, T, engines, 1))
    if shared:
        need = memory_estimate(config, B, T, engines, 1)
        what = f"{len(engines)} model(s) of ours + 1 of PyTorch, shared by the bf16 sides"
    result["shared_models"] = shared
    if too_big(result, need, what):
        return result
    result["flush_check_before"] = check_flush(ftz, torch)

    inputs, targets = random_batch(config, B, T, args.seed)
    t_inputs = torch_gpt2.as_index_tensor(inputs, "inputs")
    t_targets = torch_gpt2.as_index_tensor(targets, "targets")

    models = {e: GPT2(config, seed=args.seed, engine=e) for e in engines}
    first = models[engines[0]]
    t_model = torch_gpt2.build_model(config, first.params)
    t_opt = torch_gpt2.make_adamw(t_model, lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=args.weight_decay)

    steps = {e: (lambda m=models[e]: m.train_step(inputs, targets, LR,
                                                  weight_decay=args.weight_decay,
                                                  grad_clip=None)[0])
             for e in engines}
    steps["torch"] = lambda: torch_gpt2.train_step(t_model, t_opt, t_inputs, t_targets)
    if both:
        if not shared:
            models["bf16"] = GPT2(config, seed=args.seed)
        steps.update(bf16_sides(
            args, torch, first if shared else models["bf16"],
            t_model if shared else torch_gpt2.build_model(config, first.params),
            lambda m: m.train_step(inputs, targets, LR, weight_decay=args.weight_decay,
                                   grad_clip=None)[0], t_inputs, t_targets))
    sides = list(steps)

    shared_refs = {}
    if shared:
        shared_refs = {"bf16": lambda: first.forward(inputs, targets, logits=False)[1],
                       "autocast": lambda: torch_gpt2.forward(t_model, inputs, targets)[1]}
    warm_loss, refs = warm_up(steps, sides, shared_refs)
    check_bf16_losses(warm_loss, "torch", refs)
    for s in engines:
        if abs(warm_loss[s] - warm_loss["torch"]) > 1e-3 * abs(warm_loss["torch"]):
            raise RuntimeError(f"first-step loss of {s} ({warm_loss[s]:.6f}) differs from "
                               f"PyTorch's ({warm_loss['torch']:.6f}): the two sides do not "
                               f"compute the same step")
    timed_steps(result, steps, sides, warm_loss, args, torch)
    result["peak_rss_bytes"] = int(psutil.Process().memory_info().rss)
    for m in models.values():
        m.close()
    return result


def llama_memory_estimate(config, B, T, n_sides=len(LLAMA_SIDES)):
    """Bytes a Llama worker would touch: the parameters, gradients and both moments of
    each of its three sides, plus one side's activations (each side frees its own after
    its backward): ours (``saved_floats`` per token and layer, the logits and their
    gradient) times LLAMA_ACTIVATION_FACTOR for the baselines' larger graphs."""
    _, n_layout = model_sizes(config)
    ours_acts = 4 * B * T * (config.n_layer * saved_floats(config) + 2 * config.padded_vocab_size)
    return n_sides * 4 * 4 * n_layout + LLAMA_ACTIVATION_FACTOR * ours_acts


def run_llama_worker(args):
    """One (B, T) of a Llama-family model: ours (tape), PyTorch eager, transformers."""
    n, ftz, B, T = args.threads, bool(args.ftz_on), args.B, args.T
    torch = start_worker(n, ftz)
    import resource

    import torch_gpt2
    import torch_llama
    from gpt2.model import GPT2

    config = model_config(args.model)
    both = args.precision == "both"
    sides = list(LLAMA_SIDES) + (list(BF16_SIDES) if both else [])
    result = {"model": args.model, "B": B, "T": T, "ftz": ftz, "threads": n, "sides": sides,
              "precision": args.precision}
    # Where every side's model does not fit, the bf16 sides train the float32 sides'
    # (ours bf16 ours', autocast PyTorch eager's, with an optimizer of its own).
    models = len(sides)
    shared = (both and not fits(llama_memory_estimate(config, B, T, models))
              and fits(llama_memory_estimate(config, B, T, len(LLAMA_SIDES))))
    if shared:
        models = len(LLAMA_SIDES)
    result["shared_models"] = shared
    if too_big(result, llama_memory_estimate(config, B, T, models),
               f"{models} sides' model states, one side's activations"):
        return result
    result["flush_check_before"] = check_flush(ftz, torch)

    inputs, targets = random_batch(config, B, T, args.seed)
    t_inputs = torch_gpt2.as_index_tensor(inputs, "inputs")
    t_targets = torch_gpt2.as_index_tensor(targets, "targets")
    model = GPT2(config, seed=args.seed)
    baselines = {"torch": torch_llama.build_model(config, model.params),
                 "hf": torch_llama.build_transformers(config, model.params)}
    optimizers = {s: torch_gpt2.make_adamw(m, lr=LR, betas=BETAS, eps=EPS,
                                           weight_decay=args.weight_decay)
                  for s, m in baselines.items()}
    steps = {"tape": lambda: model.train_step(inputs, targets, LR,
                                              weight_decay=args.weight_decay)[0]}
    for s in baselines:
        steps[s] = (lambda m=baselines[s], o=optimizers[s]:
                    torch_gpt2.train_step(m, o, t_inputs, t_targets))
    if both:
        model_bf16 = model if shared else GPT2(config, seed=args.seed)
        steps.update(bf16_sides(
            args, torch, model_bf16,
            baselines["torch"] if shared else torch_llama.build_model(config, model.params),
            lambda m: m.train_step(inputs, targets, LR, weight_decay=args.weight_decay)[0],
            t_inputs, t_targets))

    # The warm-up step is the first step of each side from the same weights: the
    # same maths gives the same loss, to float32 rounding.
    rss = {}

    def sampled(s):
        with RssSampler(interval=0.005) as sampler:
            loss = steps[s]()
        rss[s] = {"before": sampler.before, "peak": sampler.peak}
        return loss
    shared_refs = {}
    if shared:
        shared_refs = {"bf16": lambda: model.forward(inputs, targets, logits=False)[1],
                       "autocast": lambda: torch_gpt2.forward(baselines["torch"], inputs,
                                                              targets)[1]}
    warm_loss, refs = warm_up({s: functools.partial(sampled, s) for s in sides}, sides,
                              shared_refs)
    check_bf16_losses(warm_loss, "tape", refs)
    for s in LLAMA_SIDES[1:]:
        if abs(warm_loss[s] - warm_loss["tape"]) > LLAMA_LOSS_TOLERANCE:
            raise RuntimeError(f"first-step loss of {s} ({warm_loss[s]:.6f}) differs from "
                               f"ours ({warm_loss['tape']:.6f}) by more than "
                               f"{LLAMA_LOSS_TOLERANCE}: the sides do not compute the same "
                               f"step")
    timed_steps(result, steps, sides, warm_loss, args, torch)
    result["warmup_rss_bytes"] = rss
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model.close()
    if both and not shared:
        model_bf16.close()
    return result


# -- driver ---------------------------------------------------------------------------

def run_worker(kind, args, extra, steps=None, timeout=3600):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind,
               "--threads", str(args.threads), "--steps", str(steps or args.steps),
               "--weight-decay", repr(args.weight_decay), "--seed", str(args.seed),
               "--model", args.model, "--precision", args.precision,
               "--engines", ",".join(args.engines),
               "--result-file", path, *extra]
        proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"worker {' '.join(extra) or kind} failed with exit code "
                               f"{proc.returncode}")
        with open(path) as f:
            return json.load(f)


def write_records(path, model, records):
    """Replace ``model``'s records in the JSON list at ``path``, keeping other models'."""
    try:
        with open(path) as f:
            kept = [r for r in json.load(f) if r.get("model", "gpt2") != model]
    except FileNotFoundError:
        kept = []
    blas = blas_dispatch.record()
    cpu = {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "commit": git_commit()}
    records = [dict(r, **blas, **cpu) for r in records]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(kept + records, f, indent=1)
    os.replace(tmp, path)


def machine_floor(flops, bytes_moved, limits):
    """(seconds the step needs at the machine's limits, "compute" or "memory")."""
    compute_s = flops / (compute_limit(limits)[0] * 1e9)
    memory_s = bytes_moved / (limits["bandwidth_gbs"] * 1e9)
    return max(compute_s, memory_s), "compute" if compute_s >= memory_s else "memory"


def summarize(raw, config, limits):
    """The record of one measured configuration (times in ms, medians of the timed steps)."""
    B, T = raw["B"], raw["T"]
    med = {s: 1e3 * statistics.median(v) for s, v in raw["seconds"].items()}
    ours_engine = "tape" if "tape" in med else "manual"
    flops = step_flops(config, B, T)
    bytes_moved = step_bytes(config, B, T)
    floor_s, bound = machine_floor(flops, bytes_moved, limits)

    def paired_ratio(num, den):
        return statistics.median(a / b for a, b in zip(raw["seconds"][num], raw["seconds"][den]))

    rec = {
        "model": "gpt2", "B": B, "T": T, "ftz": raw["ftz"], "threads": raw["threads"],
        "ours_engine": ours_engine,
        "ours_ms": med[ours_engine], "torch_ms": med["torch"],
        "manual_ms": med.get("manual"), "tape_ms": med.get("tape"),
        "speedup": med["torch"] / med[ours_engine],
        "speedup_paired": paired_ratio("torch", ours_engine),
        "tape_over_manual": (med["tape"] / med["manual"]) if "tape" in med and "manual" in med
        else None,
        "tokens_per_s": B * T / (med[ours_engine] / 1e3),
        "torch_tokens_per_s": B * T / (med["torch"] / 1e3),
        "gflops": flops / (med[ours_engine] / 1e3) / 1e9,
        "torch_gflops": flops / (med["torch"] / 1e3) / 1e9,
        "share": floor_s / (med[ours_engine] / 1e3),
        "torch_share": floor_s / (med["torch"] / 1e3),
        "sgemm_share": flops / (med[ours_engine] / 1e3) / (limits["sgemm_gflops"] * 1e9),
        "bound": bound, "flops": flops, "bytes": bytes_moved,
        "steps": len(raw["seconds"]["torch"]),
    }
    if "manual" in med and ours_engine != "manual":
        rec["manual_speedup"] = med["torch"] / med["manual"]
    rec.update(bf16_fields(raw, flops, limits, "torch", ours_engine))
    return rec


def bf16_fields(raw, flops, limits, torch_side, ours_side):
    """--precision both: the bf16 sides' ms, GFLOP/s, share of the bf16 peak (the fp32
    one where the CPU has no bf16 dot products) and paired ratios: PyTorch fp32 and
    autocast over ours bf16, autocast over ours fp32.  {"precision": "fp32"} otherwise."""
    sec = raw["seconds"]
    if "bf16" not in sec:
        return {"precision": "fp32"}
    med = {s: 1e3 * statistics.median(sec[s]) for s in ("bf16", "autocast")}
    peak = limits.get("bf16_peak_gflops") or compute_limit(limits)[0]

    def paired(num, den):
        return statistics.median(a / b for a, b in zip(sec[num], sec[den]))
    return {"precision": "fp32+bf16", "bf16_ms": med["bf16"], "autocast_ms": med["autocast"],
            "bf16_gflops": flops / (med["bf16"] / 1e3) / 1e9,
            "bf16_share": flops / (med["bf16"] / 1e3) / (peak * 1e9),
            "autocast_gflops": flops / (med["autocast"] / 1e3) / 1e9,
            "torch_over_bf16_paired": paired(torch_side, "bf16"),
            "autocast_over_bf16_paired": paired("autocast", "bf16"),
            "autocast_over_ours_paired": paired("autocast", ours_side),
            "ours_over_bf16_paired": paired(ours_side, "bf16"),
            "bf16_first_step_loss": raw["warmup_loss"]["bf16"],
            "autocast_first_step_loss": raw["warmup_loss"]["autocast"],
            # the bf16 sides trained the float32 sides' models (memory)
            "shared_models": bool(raw.get("shared_models"))}


def summarize_llama(raw, config, limits):
    """The record of one Llama-family configuration: per side ms (median), tokens/s,
    GFLOP/s and share of the limit; the baselines' time over ours, as the median of the
    per-step ratios (``*_paired``, the figure to quote) and as the ratio of medians."""
    B, T = raw["B"], raw["T"]
    sec = raw["seconds"]
    med = {s: 1e3 * statistics.median(v) for s, v in sec.items()}
    flops = step_flops(config, B, T)
    bytes_moved = step_bytes(config, B, T)
    floor_s, bound = machine_floor(flops, bytes_moved, limits)
    warm = raw["warmup_loss"]
    rec = {"model": raw["model"], "B": B, "T": T, "ftz": raw["ftz"], "threads": raw["threads"],
           "ours_engine": "tape", "ours_ms": med["tape"]}
    for s in LLAMA_SIDES[1:]:
        rec[f"{s}_ms"] = med[s]
    for s in LLAMA_SIDES[1:]:
        rec[f"{s}_over_ours"] = med[s] / med["tape"]
        rec[f"{s}_over_ours_paired"] = statistics.median(
            a / b for a, b in zip(sec[s], sec["tape"]))
    for s in LLAMA_SIDES:
        prefix = "" if s == "tape" else f"{s}_"
        rec[f"{prefix}tokens_per_s"] = B * T / (med[s] / 1e3)
        rec[f"{prefix}gflops"] = flops / (med[s] / 1e3) / 1e9
        rec[f"{prefix}share"] = floor_s / (med[s] / 1e3)
        rec[f"{prefix}sgemm_share"] = flops / (med[s] / 1e3) / (limits["sgemm_gflops"] * 1e9)
    rec.update({
        "bound": bound, "flops": flops, "bytes": bytes_moved, "steps": len(sec["tape"]),
        "first_step_loss": warm,
        "first_step_loss_max_diff": max(abs(warm[s] - warm["tape"]) for s in LLAMA_SIDES),
        # Each side's own losses over the timed steps (the same batch again and again):
        # how far the three trajectories drift apart after a few AdamW updates (None
        # where the bf16 sides also trained the models: two updates a round).
        "timed_loss_max_diff": None if raw.get("shared_models") else max(
            abs(a - b) for s in LLAMA_SIDES[1:] for a, b in zip(raw["loss"][s], raw["loss"]["tape"])),
        "peak_rss_bytes": raw["peak_rss_bytes"],
        "warmup_peak_rss_bytes": {s: v["peak"] for s, v in raw["warmup_rss_bytes"].items()},
    })
    rec.update(bf16_fields(raw, flops, limits, "torch", "tape"))
    return rec


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def print_table(records, skipped):
    head = (f"{'B':>2} {'T':>5} {'FTZ':>3} {'ours ms':>9} {'manual ms':>9} {'torch ms':>9} "
            f"{'speedup':>7} {'tape/man':>8} {'tok/s':>7} {'GFLOP/s':>7} {'torchGF':>7} "
            f"{'share':>6} {'t.share':>7} {'sgemm%':>6} bound")
    print(head)
    print("-" * len(head))
    for r in records:
        print(f"{r['B']:>2} {r['T']:>5} {'on' if r['ftz'] else 'off':>3} {r['ours_ms']:>9.1f} "
              f"{fmt(r['manual_ms'], '9.1f'):>9} {r['torch_ms']:>9.1f} {r['speedup']:>6.2f}x "
              f"{fmt(r['tape_over_manual'], '8.3f'):>8} {r['tokens_per_s']:>7.0f} "
              f"{r['gflops']:>7.1f} {r['torch_gflops']:>7.1f} {100 * r['share']:>5.1f}% "
              f"{100 * r['torch_share']:>6.1f}% {100 * r['sgemm_share']:>5.1f}% {r['bound']}")
    for s in skipped:
        print(f"{s['B']:>2} {s['T']:>5} {'on' if s['ftz'] else 'off':>3} skipped: {s['skipped']}")


def print_bf16_table(records):
    """--precision both: ours bf16 and PyTorch autocast beside the float32 sides."""
    recs = [r for r in records if r.get("precision") == "fp32+bf16"]
    if not recs:
        return
    head = (f"\n{'B':>2} {'T':>5} {'FTZ':>3} {'bf16 ms':>9} {'autocast ms':>11} "
            f"{'torch/bf16':>10} {'autoc/bf16':>10} {'autoc/fp32':>10} {'fp32/bf16':>9} "
            f"{'bf16 GF':>8} {'bf16 share':>10}")
    print(head)
    print("-" * (len(head) - 1))
    for r in recs:
        print(f"{r['B']:>2} {r['T']:>5} {'on' if r['ftz'] else 'off':>3} {r['bf16_ms']:>9.1f} "
              f"{r['autocast_ms']:>11.1f} {r['torch_over_bf16_paired']:>9.2f}x "
              f"{r['autocast_over_bf16_paired']:>9.2f}x {r['autocast_over_ours_paired']:>9.2f}x "
              f"{r['ours_over_bf16_paired']:>8.2f}x {r['bf16_gflops']:>8.1f} "
              f"{100 * r['bf16_share']:>9.1f}%"
              + ("  (bf16 sides on the fp32 sides' models)" if r.get("shared_models") else ""))


def print_table_llama(records, skipped):
    head = (f"{'B':>2} {'T':>5} {'FTZ':>3} {'ours ms':>9} {'torch ms':>9} {'HF ms':>9} "
            f"{'torch/us':>8} {'HF/us':>6} {'tok/s':>7} {'GFLOP/s':>7} {'share':>6} "
            f"{'t.share':>7} {'HF.share':>8} {'sgemm%':>6} {'peak RSS':>8} bound")
    print(head)
    print("-" * len(head))
    for r in records:
        print(f"{r['B']:>2} {r['T']:>5} {'on' if r['ftz'] else 'off':>3} {r['ours_ms']:>9.1f} "
              f"{r['torch_ms']:>9.1f} {r['hf_ms']:>9.1f} "
              f"{r['torch_over_ours_paired']:>7.2f}x {r['hf_over_ours_paired']:>5.2f}x "
              f"{r['tokens_per_s']:>7.0f} {r['gflops']:>7.1f} {100 * r['share']:>5.1f}% "
              f"{100 * r['torch_share']:>6.1f}% {100 * r['hf_share']:>7.1f}% "
              f"{100 * r['sgemm_share']:>5.1f}% {r['peak_rss_bytes'] / GiB:>6.1f}Gi {r['bound']}")
    for s in skipped:
        print(f"{s['B']:>2} {s['T']:>5} {'on' if s['ftz'] else 'off':>3} skipped: {s['skipped']}")


def plot_llama(records, path, threads, limits, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    settings = [f for f in (True, False) if any(r["ftz"] is f for r in records)]
    per_setting = max(sum(r["ftz"] is f for r in records) for f in settings)
    fig, axes = plt.subplots(2, len(settings), figsize=(max(7.0, 1.2 * per_setting) * len(settings), 8),
                             squeeze=False)
    for col, ftz in enumerate(settings):
        recs = [r for r in records if r["ftz"] is ftz]
        labels = [f"({r['B']},{r['T']})" for r in recs]
        x = np.arange(len(recs))
        series = [("ours (tape)", "ours_ms", "tab:blue"),
                  ("PyTorch eager", "torch_ms", "tab:gray"),
                  ("transformers (sdpa)", "hf_ms", "tab:purple")]
        width = 0.8 / len(series)
        ax = axes[0, col]
        for i, (name, key, color) in enumerate(series):
            ax.bar(x + (i - 1) * width, [r[key] for r in recs], width, label=name, color=color)
        ax.set_yscale("log")
        ax.set_ylim(bottom=min(r[key] for r in recs for _, key, _ in series) / 4)
        ax.set_xticks(x, labels)
        ax.set_ylabel("ms per training step (median)")
        ax.set_title(f"FTZ/DAZ {'on' if ftz else 'off'}, {threads} threads")
        ax.legend()
        ax = axes[1, col]
        for i, (name, key, color) in enumerate(series[1:]):
            values = [r[f"{key[:-3]}_over_ours_paired"] for r in recs]
            xs = x + (i - 0.5) * 0.35
            ax.bar(xs, values, 0.35, color=color, label=f"{name} time / ours")
            for xi, v in zip(xs, values):
                ax.annotate(f"{v:.2f}x", (xi, v), ha="center", va="bottom", fontsize=8)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(x, labels)
        ax.set_xlabel("(B, T)")
        ax.set_ylabel("baseline time / ours (median of paired steps)")
        ax.legend()
    fig.suptitle(f"{title} training step\n{limits_line(limits)} (measured in this run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(records, path, threads, limits):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    settings = [f for f in (True, False) if any(r["ftz"] is f for r in records)]
    fig, axes = plt.subplots(2, len(settings), figsize=(7 * len(settings), 8), squeeze=False)
    for col, ftz in enumerate(settings):
        recs = [r for r in records if r["ftz"] is ftz]
        labels = [f"({r['B']},{r['T']})" for r in recs]
        x = np.arange(len(recs))
        series = [("PyTorch eager", [r["torch_ms"] for r in recs], "tab:gray")]
        if any(r["tape_ms"] is not None for r in recs):
            series.append(("ours: tape", [r["tape_ms"] or np.nan for r in recs], "tab:blue"))
        if any(r["manual_ms"] is not None for r in recs):
            series.append(("ours: manual", [r["manual_ms"] or np.nan for r in recs], "tab:orange"))
        width = 0.8 / len(series)
        ax = axes[0, col]
        for i, (name, values, color) in enumerate(series):
            ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=name, color=color)
        ax.set_yscale("log")
        # Bars on a log axis start at its bottom: put it well below the shortest bar so
        # bar lengths compare.
        ax.set_ylim(bottom=min(min(v for v in values if v == v) for _, values, _ in series) / 4)
        ax.set_xticks(x, labels)
        ax.set_ylabel("ms per training step (median)")
        ax.set_title(f"GPT-2 124M step, FTZ/DAZ {'on' if ftz else 'off'}, {threads} threads")
        ax.legend()
        ax = axes[1, col]
        ax.bar(x, [r["speedup"] for r in recs], 0.6, color="tab:green",
               label=f"PyTorch time / ours ({recs[0]['ours_engine'] if recs else ''})")
        ax.axhline(TARGET_SPEEDUP, color="tab:red", linestyle="--", label="target 2x")
        ax.axhline(1.0, color="black", linewidth=0.8)
        for xi, r in zip(x, recs):
            ax.annotate(f"{r['speedup']:.2f}x", (xi, r["speedup"]), ha="center", va="bottom")
        ax.set_xticks(x, labels)
        ax.set_xlabel("(B, T)")
        ax.set_ylabel("speedup over PyTorch")
        ax.legend()
    fig.suptitle(f"{limits_line(limits)} (measured in this run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.worker is None and argv is None:
        blas_dispatch.ensure()      # the workers inherit OPENBLAS_CORETYPE
    if args.threads is None:
        args.threads = len(os.sched_getaffinity(0))
    if args.steps is None:
        args.steps = 3 if args.quick else 5
    if args.worker is not None:
        if args.worker == "limits":
            result = measure_limits(args.threads)
        else:
            result = run_step_worker(args)
        with open(args.result_file, "w") as f:
            json.dump(result, f)
        return

    config = model_config(args.model)
    llama = config.family != "gpt2"
    if llama:
        grid = args.configs or (LLAMA_QUICK_GRID if args.quick else LLAMA_GRID)
        title = f"{args.model} ({config.describe()})"
    else:
        grid = args.configs or (QUICK_GRID if args.quick else GRID)
        title = "GPT-2 124M"
    ftz_passes = {"both": (True, False), "on": (True,), "off": (False,)}[args.ftz]
    started = time.time()
    long_note = (f" ({args.long_steps} from {LONG_TOKENS} tokens)"
                 if args.long_steps is not None else "")
    print(f"{title} training step, {args.threads} threads, {args.steps} timed steps"
          f"{long_note}, weight decay {args.weight_decay}", flush=True)
    limits_runs = [run_worker("limits", args, [])]
    raws, records, skipped = [], [], []
    for ftz in ftz_passes:
        for B, T in grid:
            t0 = time.time()
            long = args.long_steps is not None and B * T >= LONG_TOKENS
            raw = run_worker("step", args, ["--B", str(B), "--T", str(T),
                                            "--ftz-on", str(int(ftz))],
                             steps=args.long_steps if long else args.steps)
            raws.append(raw)
            if "skipped" in raw:
                skipped.append({"B": B, "T": T, "ftz": ftz, "skipped": raw["skipped"]})
                print(f"  ({B},{T}) FTZ {'on' if ftz else 'off'}: skipped, {raw['skipped']}",
                      flush=True)
                continue
            med = {s: 1e3 * statistics.median(v) for s, v in raw["seconds"].items()}
            print(f"  ({B},{T}) FTZ {'on' if ftz else 'off'}: "
                  + ", ".join(f"{s} {v:.1f} ms" for s, v in med.items())
                  + f"  [{time.time() - t0:.0f} s]", flush=True)
    limits_runs.append(run_worker("limits", args, []))
    limits_runs += [raw["limits"] for raw in raws if "limits" in raw]
    limits = best_limits(limits_runs)
    for raw in raws:
        if "skipped" not in raw:
            rec = (summarize_llama if llama else summarize)(raw, config, limits)
            rec.update(limits)
            records.append(rec)
    print()
    (print_table_llama if llama else print_table)(records, skipped)
    print_bf16_table(records)
    n_matmul, n_layout = model_sizes(config)
    if llama:
        flops_formula = "6*N*B*T + 6*L*B*T^2*(n_head*head_dim)"
        bytes_formula = ("4*(12*Np + B*T*(2*L*(4*C + (n_head + 2*n_kv_head)*head_dim "
                         "+ n_head*head_dim + 2*I) + 5*Vp))")
    else:
        flops_formula = "6*N*B*T + 6*L*B*T^2*C"
        bytes_formula = "4*(12*Np + B*T*(32*L*C + 5*Vp))"
    print(f"\nN = {n_matmul:,} matmul parameters ({n_layout:,} floats in the layout); "
          f"FLOPs = {flops_formula}; bytes = {bytes_formula}")
    print(f"limits (best of {len(limits_runs)} measurements in this run): "
          + ", ".join(f"{isa} peak {max(r['peak_gflops_by_isa'].get(isa, 0.0) for r in limits_runs):.1f}"
                      for isa in limits_runs[0].get("peak_gflops_by_isa", {}))
          + f" GFLOP/s (register-only FMA); sgemm {limits['sgemm_gflops']:.1f} GFLOP/s (scipy best "
          f"{max(r['scipy_sgemm_gflops'] for r in limits_runs):.1f}, PyTorch best "
          f"{max(r['torch_sgemm_gflops'] for r in limits_runs):.1f}), bandwidth "
          f"{limits['bandwidth_gbs']:.1f} GB/s (copy best "
          f"{max(r['copy_gbs'] for r in limits_runs):.1f}, add best "
          f"{max(r['add_gbs'] for r in limits_runs):.1f}, in-place update best "
          f"{max(r.get('update_gbs', 0.0) for r in limits_runs):.1f})")
    for ftz in ftz_passes:
        recs = [r for r in records if r["ftz"] is ftz]
        if not recs:
            continue
        if llama:
            for s in LLAMA_SIDES[1:]:
                ratios = [r[f"{s}_over_ours_paired"] for r in recs]
                print(f"FTZ {'on' if ftz else 'off'}: {s} time / ours (paired) "
                      f"{min(ratios):.2f}x to {max(ratios):.2f}x")
            drift = [r["timed_loss_max_diff"] for r in recs if r["timed_loss_max_diff"] is not None]
            print(f"  first-step losses agree within "
                  f"{max(r['first_step_loss_max_diff'] for r in recs):.1e}"
                  + (f"; timed steps within {max(drift):.1e}" if drift else ""))
            continue
        engine = recs[0]["ours_engine"]
        met = [r for r in recs if r["speedup"] >= TARGET_SPEEDUP]
        print(f"FTZ {'on' if ftz else 'off'}: ours ({engine}) >= {TARGET_SPEEDUP}x PyTorch on "
              f"{len(met)} of {len(recs)} configurations; speedups "
              f"{min(r['speedup'] for r in recs):.2f}x to {max(r['speedup'] for r in recs):.2f}x")
        ratios = [r["tape_over_manual"] for r in recs if r["tape_over_manual"] is not None]
        if ratios:
            print(f"  tape / manual step time: {min(ratios):.3f} to {max(ratios):.3f} "
                  f"(limit {TAPE_OVERHEAD_LIMIT}); within on "
                  f"{sum(x <= TAPE_OVERHEAD_LIMIT for x in ratios)} of {len(ratios)}")
        elif engine == "manual":
            print("  tape engine not available (gpt2/tape_engine.py missing): ours = manual")
    print(f"total {time.time() - started:.0f} s")

    # One records file for every model: this run replaces its own model's records.
    table = "train_step_quick" if args.quick else "train_step"
    stem = table if not llama else f"{table}_{args.model}"
    results = args.results_dir
    os.makedirs(results, exist_ok=True)
    write_records(os.path.join(results, f"{table}.json"), args.model, records)
    meta = {"model": args.model, "threads": args.threads, "weight_decay": args.weight_decay,
            "lr": LR, "betas": BETAS, "eps": EPS, "steps": args.steps, "long_steps": args.long_steps,
            "long_tokens": LONG_TOKENS, "seed": args.seed,
            "cpu": cpu_name(), "cpu_flags": cpu_flags(), "precision": args.precision,
            "commit": git_commit(), **blas_dispatch.record(),
            "n_matmul_params": n_matmul, "n_layout_floats": n_layout,
            "flops_formula": flops_formula, "bytes_formula": bytes_formula,
            "limits": limits, "limits_runs": limits_runs, "skipped": skipped, "workers": raws}
    with open(os.path.join(results, f"{stem}_raw.json"), "w") as f:
        json.dump(meta, f, indent=1)
    if not records:
        print("nothing measured: no plot")
    elif llama:
        plot_llama(records, os.path.join(results, f"{stem}.png"), args.threads, limits, title)
    else:
        plot(records, os.path.join(results, f"{stem}.png"), args.threads, limits)
    where = "bench/results" if results == RESULTS else results
    print(f"wrote {where}/{table}.json ({args.model}'s records), "
          f"{stem}_raw.json, {stem}.png")

if __name__ == "__main__":
    main()
