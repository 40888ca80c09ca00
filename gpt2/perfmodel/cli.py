"""Command line: ``python -m gpt2.perfmodel`` prints the predicted breakdown of a training step,
or sweeps one parameter and plots step time and memory against it.

Examples:
  python -m gpt2.perfmodel --model gpt2 --batch 4 --seq 64 --hardware this-machine   # calibrates once
  python -m gpt2.perfmodel --n-layer 96 --n-head 96 --n-embd 12288 --vocab 51200 --seq 2048 \\
      --batch 1536 --micro-batch 1 --hardware a100-80gb-sxm --precision bf16 --layout megatron \\
      --tp 8 --pp 16 --dp 12 --recompute full
  python -m gpt2.perfmodel --model gpt2 --seq 64 --sweep batch=1,2,4,8 --plot sweep.png
  python -m gpt2.perfmodel --model path/to/SmolLM2-360M --batch 1 --seq 1024   # its config.json
  python -m gpt2.perfmodel --model smollm2-135m --n-kv-head 9 --intermediate 2048 --seq 512
  python -m gpt2.perfmodel --plan --max-memory 8G --model gpt2 --batch 8 --seq 1024
  python -m gpt2.perfmodel --model llama-3.1-8b --lora 16 --base-dtype bf16 --batch 1 --seq 512 --recompute per_layer
"""
import argparse
import json
import sys
from dataclasses import asdict

from .estimate import device_view, estimate
from .graph import GraphOptions
from .hardware import THIS_MACHINE, available_profiles, load_profile
from .spec import RECOMPUTE_POLICIES, ModelSpec, ParallelConfig, Workload

# Sweepable parameters: name -> (where it lives, field, type).
SWEEPABLE = {
    "batch": ("workload", "global_batch", int), "seq": ("workload", "seq_len", int),
    "micro_batch": ("workload", "micro_batch", int), "dp": ("parallel", "dp", int),
    "tp": ("parallel", "tp", int), "pp": ("parallel", "pp", int), "ep": ("parallel", "ep", int),
    "interleave": ("parallel", "interleave", int), "zero": ("parallel", "zero_stage", int),
    "recompute": ("parallel", "recompute", str), "checkpoints": ("parallel", "checkpoints", int),
    "tape_budget": ("parallel", "tape_budget", float), "hardware": ("hardware", "", str),
}


def build_parser():
    p = argparse.ArgumentParser(prog="python -m gpt2.perfmodel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", metavar="PRESET|DIR",
                   help="a preset of any family (gpt2.families): gpt2, small, tiny, smollm2-135m, "
                        "tinyllama-1.1b, llama-3.2-1b, ...; or a Hugging Face model directory, whose "
                        "config.json (GPT-2, Llama, Qwen2) gives the shape (a preset's name wins: ./NAME is "
                        "the directory; without --model: the size flags below, a GPT-2 layout)")
    m.add_argument("--n-layer", type=int)
    m.add_argument("--n-head", type=int)
    m.add_argument("--n-embd", type=int)
    m.add_argument("--vocab", type=int)
    m.add_argument("--n-kv-head", type=int,
                   help="key/value heads (grouped-query attention; divides the heads): of the size flags' "
                        "shape (default: --n-head), or in place of --model's")
    m.add_argument("--intermediate", type=int, metavar="WIDTH",
                   help="the MLP's hidden width: of the size flags' shape (default: 4 x --n-embd), or in "
                        "place of --model's")
    m.add_argument("--block-size", type=int, help="position table size (default: --seq)")
    m.add_argument("--vocab-multiple", type=int, default=128)
    m.add_argument("--experts", type=int, default=0, help="mixture of experts: experts per layer (0: dense)")
    m.add_argument("--top-k", type=int, default=1)
    m.add_argument("--capacity", type=float, default=1.0, help="MoE capacity factor")
    w = p.add_argument_group("workload")
    w.add_argument("--batch", type=int, default=4, help="global batch (sequences per step)")
    w.add_argument("--seq", type=int, default=64)
    w.add_argument("--micro-batch", type=int, default=0)
    w.add_argument("--precision", default="fp32",
                   help="fp32 (default), or bf16: with --layout adtape (and --plan) our engine's bf16 mode "
                        "(gpt2-train --precision bf16: the linear layers' products take bf16 operands at the "
                        "profile's bf16 product rate, fp32's where it has none; linear inputs saved in bf16; "
                        "everything else float32); with --layout megatron 16-bit mixed precision, as tf32 "
                        "and fp16 are")
    w.add_argument("--layout", default="adtape", choices=["adtape", "megatron"],
                   help="which activations are saved (our tape's set, or Megatron's with dropout)")
    w.add_argument("--causal-flops", action="store_true", help="attention kernels skip the masked half")
    ft = p.add_argument_group("LoRA fine-tuning (gpt2-train --lora)")
    ft.add_argument("--lora", type=int, metavar="R",
                    help="train rank-R adapters on a frozen base (gpt2.lora): no gradients, moments or weight-"
                         "gradient products for the base; the adapters' products in float32")
    ft.add_argument("--lora-targets", metavar="NAMES",
                    help="comma-separated projections to adapt, peft's target_modules (default: every projection "
                         "of the model's family)")
    ft.add_argument("--lora-dropout", type=float, metavar="P",
                    help="dropout on the adapters' input (it keeps the dropped input and its mask; default 0)")
    ft.add_argument("--base-dtype", choices=("fp32", "bf16"),
                    help="how the frozen base is held: bf16 halves its matrices, and its products run in bf16 "
                         "(default fp32)")
    h = p.add_argument_group("hardware and parallelism")
    h.add_argument("--hardware", default=None,
                   help=f"profile path or name: {', '.join(available_profiles())}, or {THIS_MACHINE} (this "
                        f"machine's, for --threads, measured on first use in ~30 s and kept in the cache); "
                        f"default: generic-cpu (approximate), {THIS_MACHINE} with --plan")
    for name in ("dp", "tp", "pp", "ep", "interleave"):
        h.add_argument(f"--{name}", type=int, default=1)
    h.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    h.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    h.add_argument("--fsdp", action="store_true")
    h.add_argument("--recompute", default="none", choices=RECOMPUTE_POLICIES)
    h.add_argument("--checkpoints", type=int, default=0, help="binomial recompute: checkpoint slots")
    h.add_argument("--flash", action="store_true", help="FlashAttention")
    h.add_argument("--overlap-dp", action=argparse.BooleanOptionalAction, default=None,
                   help="gradient reduction runs during the backward pass (default: on with --layout adtape, "
                        "as gpt2.distributed does; off with megatron)")
    h.add_argument("--bucket-mb", type=float, default=25.0,
                   help="gradients reduced in buckets of this many MiB, one collective each (default 25, "
                        "gpt2.distributed's and DDP's; 0: one collective)")
    h.add_argument("--tape-budget", type=float, default=-1.0, help="activation bytes kept in memory (-1: all)")
    h.add_argument("--overlap-spill", action="store_true")
    pl = p.add_argument_group("memory planner")
    pl.add_argument("--plan", action="store_true",
                    help="choose the fastest memory policy of the tape engine within --max-memory")
    pl.add_argument("--max-memory", type=_size, help="peak RSS limit for --plan, e.g. 8G")
    pl.add_argument("--spill-dir", default=None, help="where the tape would spill (checked against the profile)")
    pl.add_argument("--threads", type=int, default=None,
                    help="threads training will use (default: OMP_NUM_THREADS or all cores): which of this "
                         "machine's profiles is read, and what a profile measured with others is compared to")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the estimate as JSON")
    o.add_argument("--sweep", help="PARAM=v1,v2,... with PARAM in " + ", ".join(SWEEPABLE))
    o.add_argument("--plot", help="PNG path for the sweep plot")
    return p


def _size(text):
    from gpt2.units import parse_size
    return parse_size(text)


def _shape_overrides(args):
    """The fields --n-kv-head and --intermediate set ({} without them)."""
    return {field: value for field, value in (("n_kv_head", args.n_kv_head),
                                              ("intermediate_size", args.intermediate))
            if value is not None}


def model_config(args):
    """The family config of --model (a preset, or a directory's config.json), with --n-kv-head and
    --intermediate in place of its own; None without --model (the size flags' shape)."""
    if not args.model:
        return None
    import dataclasses
    import os
    try:
        from gpt2.families import all_presets, preset
        if args.model in all_presets():     # a preset's name wins: ./NAME is the directory
            config = preset(args.model)
        elif os.path.isdir(args.model):
            from gpt2.hf import read_config
            config = read_config(args.model)
        elif os.sep in args.model:
            raise ValueError("no such directory (a model directory with its config.json, or a preset's name)")
        else:
            config = preset(args.model)
    except ImportError as exc:
        raise SystemExit(f"--model {args.model!r} needs gpt2.families ({exc}); give --n-layer, --n-head, "
                         f"--n-embd and --vocab instead") from None
    except ValueError as exc:
        raise SystemExit(f"error: --model {args.model}: {exc}") from None
    overrides = _shape_overrides(args)
    if overrides:
        fields = {f.name for f in dataclasses.fields(config)}
        unknown = [f"--{'n-kv-head' if k == 'n_kv_head' else 'intermediate'}" for k in overrides
                   if k not in fields]
        if unknown:
            raise SystemExit(f"error: --model {args.model} is a {config.family_name} model, which has no "
                             f"{' or '.join(unknown)} (a Llama-family model has both)")
        try:
            config = dataclasses.replace(config, **overrides)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
    return config


def model_from_args(args):
    config = model_config(args)
    if config is not None:
        extra = dict(vocab_multiple=args.vocab_multiple, n_experts=args.experts, top_k=args.top_k,
                     capacity_factor=args.capacity)
        try:
            return ModelSpec.from_config(config, **extra)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
    missing = [f"--{n}" for n in ("n-layer", "n-head", "n-embd", "vocab") if getattr(args, n.replace("-", "_")) is None]
    if missing:
        raise SystemExit(f"give --model or all of {', '.join(missing)}")
    try:
        return ModelSpec(args.n_layer, args.n_head, args.n_embd, args.vocab,
                         block_size=args.block_size or args.seq, vocab_multiple=args.vocab_multiple,
                         n_experts=args.experts, top_k=args.top_k, capacity_factor=args.capacity,
                         **_shape_overrides(args))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def family_config(args, spec):
    """The family config gpt2-train would train: --model's, or the size flags' GPT-2."""
    if args.model:
        return model_config(args)
    if _shape_overrides(args):
        raise ValueError("the size flags are a GPT-2, which has no --n-kv-head or --intermediate; give --model (a "
                         "Llama preset or a model directory) with them")
    from gpt2.families.gpt2 import GPT2Config
    # The size flags describe ModelSpec's default layout, which is GPT-2's.
    return GPT2Config(spec.n_layer, spec.n_head, spec.n_embd, spec.vocab_size, spec.block_size)


def lora_from_args(args):
    """(gpt2.lora.LoraConfig, base dtype) of --lora and its options, or (None, "fp32")."""
    given = [flag for flag, value in (("--lora-targets", args.lora_targets), ("--lora-dropout", args.lora_dropout),
                                      ("--base-dtype", args.base_dtype)) if value is not None]
    if args.lora is None:
        if given:
            raise ValueError(f"{given[0]} is a LoRA option: add --lora R (the adapters' rank)")
        return None, "fp32"
    from gpt2.lora import LoraConfig
    targets = tuple(t for t in args.lora_targets.split(",") if t) if args.lora_targets is not None else None
    return (LoraConfig(r=args.lora, dropout=args.lora_dropout or 0.0, targets=targets),
            args.base_dtype or "fp32")


def setup_from_args(args):
    spec = model_from_args(args)
    lora, base_dtype = lora_from_args(args)
    if lora is not None:
        from .spec import LoraSpec
        lora = LoraSpec.from_config(family_config(args, spec), lora, base_dtype)
    engine_bf16 = args.layout == "adtape" and args.precision == "bf16"
    workload = Workload(args.batch, args.seq, args.micro_batch, "fp32" if engine_bf16 else args.precision)
    parallel = ParallelConfig(dp=args.dp, tp=args.tp, pp=args.pp, ep=args.ep, sequence_parallel=args.sp,
                              interleave=args.interleave, zero_stage=args.zero, fsdp=args.fsdp,
                              recompute=args.recompute, checkpoints=args.checkpoints,
                              flash_attention=args.flash,
                              overlap_dp_comm=args.layout == "adtape" if args.overlap_dp is None else args.overlap_dp,
                              dp_bucket_bytes=args.bucket_mb * (1 << 20),
                              tape_budget=args.tape_budget, overlap_spill_io=args.overlap_spill)
    options = GraphOptions(layout=args.layout, causal_attention_flops=args.causal_flops,
                           precision="bf16" if engine_bf16 else "fp32", lora=lora)
    return spec, workload, parallel, load_profile(args.hardware or "generic-cpu", args.threads), options


def run_plan(args):
    """Print the memory planner's table for the model and (B, T) of ``args``."""
    from .plan import plan_memory
    if args.max_memory is None:
        raise ValueError("--plan needs --max-memory SIZE (e.g. 8G)")
    spec = model_from_args(args)
    try:
        config = family_config(args, spec)
    except ValueError as exc:
        raise ValueError(f"--plan plans a model gpt2-train can train: {exc}") from None
    lora, base_dtype = lora_from_args(args)
    plan = plan_memory(config, args.batch, args.seq, args.max_memory, hardware=args.hardware or "this-machine",
                       spill_dir=args.spill_dir, threads=args.threads, flash=args.flash, precision=args.precision,
                       lora=lora, base_dtype=base_dtype)
    if args.json:
        print(json.dumps({"chosen": plan.describe(), "engine_kwargs": plan.engine_kwargs(),
                          "candidates": [asdict(c) for c in plan.candidates], "notes": plan.notes}, indent=2))
    else:
        print(f"model: {spec.n_layer} layers, C={spec.n_embd}, V={spec.vocab_size}   batch {args.batch} x seq "
              f"{args.seq}   limit {args.max_memory} bytes")
        print(plan.table())


def _fmt_time(seconds):
    if seconds >= 1:
        return f"{seconds:9.3f} s "
    return f"{seconds * 1e3:9.3f} ms"


def _fmt_bytes(n):
    return f"{n / 2**30:9.3f} GiB" if n >= 2**30 else f"{n / 2**20:9.2f} MiB"


def format_table(est, spec, workload, parallel, hardware):
    lines = [f"model: {spec.n_layer} layers, {spec.n_head} heads, C={spec.n_embd}, V={spec.vocab_size} "
             f"({spec.num_parameters() / 1e6:.1f}M params)   batch {workload.global_batch} x seq {workload.seq_len}"
             f"   {est.details['products']}   hardware: {hardware.describe()}",
             f"parallel: dp={parallel.dp} tp={parallel.tp} pp={parallel.pp} ep={parallel.ep} "
             f"sp={parallel.sequence_parallel} interleave={parallel.interleave} zero={parallel.sharding} "
             f"recompute={parallel.recompute} flash={parallel.flash_attention}"]
    view, ranks_per_node = device_view(hardware, parallel)
    unit = "rank" if hardware.kind == "cpu" and parallel.world_size > 1 else "device"
    if ranks_per_node > 1:
        lines.append(f"per rank: batch {workload.micro_batch_size(parallel)} x seq {workload.seq_len}, "
                     f"{ranks_per_node} ranks share this machine ({view.name}); link: {hardware.interconnect.measured}")
    if parallel.dp > 1:
        lines.append(f"data-parallel communication: {est.details['data_parallel_unhidden'] * 1e3:.1f} ms alone "
                     f"({est.details['data_parallel_reduce'] * 1e3:.1f} reduce, "
                     f"{est.details['data_parallel_gather'] * 1e3:.1f} gather), "
                     f"{est.communication['data_parallel'] * 1e3:.1f} ms exposed"
                     f"{' (overlapped with the backward)' if parallel.overlap_dp_comm else ''}")
    lines.append("")
    phases = ("fwd", "recompute", "bwd")
    classes = sorted({c for _, c in est.compute})
    lines.append(f"{'time per step':<20}" + "".join(f"{p:>13}" for p in phases) + f"{'total':>13}{'share':>8}")
    for c in classes:
        row = [est.compute.get((p, c), 0.0) for p in phases]
        lines.append(f"{c:<20}" + "".join(_fmt_time(v).rjust(13) for v in row)
                     + _fmt_time(sum(row)).rjust(13) + f"{sum(row) / est.step_time:8.1%}")
    extra = [("optimizer", est.optimizer)] + [(f"comm {k}", v) for k, v in est.communication.items()] + [
        ("pipeline bubble", est.bubble), ("tape copies", est.tape_copy), ("tape spill I/O", est.spill_io)]
    for name, v in extra:
        lines.append(f"{name:<20}" + " " * 39 + _fmt_time(v).rjust(13) + f"{v / est.step_time:8.1%}")
    lines.append(f"{'step (per ' + unit + ')':<20}" + " " * 39 + _fmt_time(est.step_time).rjust(13))
    lines.append(f"tokens/s {est.tokens_per_second:,.0f}   MFU {est.mfu:.1%}   HFU {est.hfu:.1%}   "
                 f"bubble fraction {est.bubble_fraction:.1%}   micro-batches {est.details['micro_batches']}")
    lines.append("")
    lines.append(f"{'memory per ' + unit:<20}")
    for k, v in est.memory.as_dict().items():
        lines.append(f"  {k:<18}{_fmt_bytes(v):>16}")
    cap = view.memory_capacity
    lines.append(f"  {'capacity':<18}{_fmt_bytes(cap):>16}   "
                 f"{'fits' if est.memory.total <= cap else 'DOES NOT FIT'}")
    return "\n".join(lines)


def parse_sweep(text):
    if "=" not in text:
        raise SystemExit(f"--sweep {text!r}: expected PARAM=v1,v2,...")
    name, values = text.split("=", 1)
    if name not in SWEEPABLE:
        raise SystemExit(f"--sweep: unknown parameter {name!r}; choose from {', '.join(SWEEPABLE)}")
    kind = SWEEPABLE[name][2]
    try:
        parsed = [kind(v) for v in values.split(",") if v]
    except ValueError:
        raise SystemExit(f"--sweep {name}: values must be {kind.__name__}, got {values!r}") from None
    if not parsed:
        raise SystemExit(f"--sweep {name}: no values")
    return name, parsed


def run_sweep(name, values, spec, workload, parallel, hardware, options, threads=None):
    """[(value, Estimate)] for each value of the swept parameter (``threads``: which of this
    machine's profiles a swept ``this-machine`` is)."""
    where, field, _ = SWEEPABLE[name]
    out = []
    for value in values:
        w, p, hw = workload, parallel, hardware
        if where == "workload":
            w = Workload(**{**workload.__dict__, field: value})
        elif where == "parallel":
            p = parallel.with_changes(**{field: value})
        else:
            hw = load_profile(value, threads)
        out.append((value, estimate(spec, w, p, hw, options)))
    return out


# The swept parameter's axis label, with its unit.
SWEEP_LABELS = {
    "batch": "global batch (sequences per step)", "seq": "sequence length (tokens)",
    "micro_batch": "micro-batch (sequences)", "dp": "data-parallel ranks", "tp": "tensor-parallel ranks",
    "pp": "pipeline stages", "ep": "expert-parallel ranks", "interleave": "pipeline chunks per stage",
    "zero": "ZeRO stage", "recompute": "recomputation policy", "checkpoints": "binomial checkpoint slots",
    "tape_budget": "tape budget (bytes kept in memory, -1: all)", "hardware": "hardware profile",
}


def plot_sweep(name, results, path, title=""):
    """Predicted step time (left axis) and memory per device (right axis) against the swept
    parameter, with a legend; ``title``: a second title line (the model, the hardware)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [str(v) for v, _ in results]
    times = [e.step_time for _, e in results]
    in_ms = max(times) < 1.0
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    time_line, = ax.plot(labels, [t * 1e3 if in_ms else t for t in times], "o-", color="tab:blue",
                         label="step time (left axis)")
    ax.set_xlabel(SWEEP_LABELS.get(name, name))
    ax.set_ylabel(f"predicted step time ({'ms' if in_ms else 's'})", color="tab:blue")
    ax.tick_params(axis="y", colors="tab:blue")
    # Different headroom on the two axes, so that the curves' largest points do not meet.
    ax.set_ylim(0, 1.1 * ax.get_ylim()[1])
    ax.grid(True, alpha=0.3)
    memory = ax.twinx()
    memory_line, = memory.plot(labels, [e.memory.total / 2**30 for _, e in results], "s--", color="tab:red",
                               label="memory per device (right axis)")
    memory.set_ylabel("predicted memory per device (GiB)", color="tab:red")
    memory.tick_params(axis="y", colors="tab:red")
    memory.set_ylim(0, 1.3 * memory.get_ylim()[1])
    ax.legend(handles=[time_line, memory_line], loc="upper left")
    ax.set_title(f"Predicted step time and memory against {name}" + (f"\n{title}" if title else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def thread_note(profile, threads):
    """A line saying that ``profile`` was measured with other than ``threads`` threads, or ""."""
    if threads is None or not profile.threads or profile.threads == threads:
        return ""
    return (f"note: profile {profile.name} was measured with {profile.threads} threads, not the {threads} of "
            f"--threads; its rates are for {profile.threads}")


def main(argv=None):
    args = build_parser().parse_args(argv)
    if argv is None:
        from kernels import blas_dispatch
        blas_dispatch.ensure()      # calibration measures the BLAS's right kernels
    if args.plan:
        try:
            run_plan(args)
        except (ValueError, FileNotFoundError, RuntimeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        spec, workload, parallel, hardware, options = setup_from_args(args)
        if args.sweep:
            name, values = parse_sweep(args.sweep)
            results = run_sweep(name, values, spec, workload, parallel, hardware, options, args.threads)
        else:
            results = None
            est = estimate(spec, workload, parallel, hardware, options)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        raise SystemExit(f"error: {exc}") from None
    note = thread_note(hardware, args.threads) if results is None or name != "hardware" else ""
    if note:
        print(note, file=sys.stderr)
    if results is None:
        print(json.dumps(est.as_dict(), indent=2) if args.json else format_table(est, spec, workload, parallel, hardware))
        return 0
    described = "each profile swept" if name == "hardware" else hardware.describe()
    if args.json:
        print(json.dumps([{"value": v, **e.as_dict()} for v, e in results], indent=2))
    else:
        print(f"model: {spec.n_layer} layers, C={spec.n_embd}, V={spec.vocab_size}   hardware: {described}")
        print(f"{name:>14}{'step':>14}{'tokens/s':>14}{'memory':>16}{'MFU':>8}{'bubble':>8}")
        for v, e in results:
            print(f"{str(v):>14}{_fmt_time(e.step_time):>14}{e.tokens_per_second:>14,.0f}"
                  f"{_fmt_bytes(e.memory.total):>16}{e.mfu:>8.1%}{e.bubble_fraction:>8.1%}")
    if args.plot:
        fixed = [f"{spec.n_layer} layers, C={spec.n_embd}"] + [
            f"{label} {value}" for key, label, value in (("batch", "batch", workload.global_batch),
                                                         ("seq", "seq", workload.seq_len)) if key != name]
        if name != "hardware":
            fixed.append(f"{hardware.name}{' (approximate)' if hardware.approximate else ''}")
        plot_sweep(name, results, args.plot, ", ".join(fixed + [results[0][1].details["products"]]))
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
