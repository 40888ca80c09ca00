"""How a training step scales with cores: bench/train_step.py at 1, 2, 4, ... threads.

    python bench/thread_scan.py [--model gpt2] [--threads 1,2,4,8,16] [--configs 4x256]
                                [--precision both] [--steps 3] [--engines tape]

For each thread count this runs bench/train_step.py (FTZ on; its workers pin nothing,
they use the first n cores the process may run on), with ours (the tape engine), PyTorch
eager and, with --precision both, ours bf16 and PyTorch's bf16 autocast interleaved in
one worker, the machine's limits probed at that thread count.  Thread counts above the
cores this process may use are dropped.  Per thread count and (B, T) it prints the
median step of each side, the paired ratios, the share of the physical peak of those n
cores, and the speedup over the smallest thread count with its parallel efficiency
(speedup / thread ratio).

Writes bench/results/thread_scan.json (train_step.py's records with the thread count,
the CPU, the BLAS kernels and the commit) and thread_scan.png; nothing else under
bench/results/ is touched (each train_step.py run writes into a temporary folder).
"""
import argparse
import json
import os
import sys
import tempfile
import time

import _paths  # noqa: F401  (import order: source if built in place, installed, bench/)
import train_step
from _runinfo import cpu_flags, cpu_name, git_commit
from kernels import blas_dispatch

RESULTS = train_step.RESULTS
SIDES = (("ours_ms", "ours fp32"), ("torch_ms", "PyTorch fp32"),
         ("bf16_ms", "ours bf16"), ("autocast_ms", "PyTorch autocast"))


def thread_list(text):
    try:
        counts = list(dict.fromkeys(int(t) for t in text.split(",") if t.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--threads takes counts like 1,2,4; got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--threads takes positive counts; got {text!r}")
    return counts


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2", choices=train_step.model_choices())
    p.add_argument("--threads", type=thread_list, default=None,
                   help="thread counts, run in this order (default: 1, 2, 4, ... up to the cores this "
                        "process may use; largest first saves the figures that matter most "
                        "where time is short: results are written after each count)")
    p.add_argument("--configs", default="4x256", help="BxT list (default 4x256)")
    p.add_argument("--precision", choices=("fp32", "both"), default="both")
    p.add_argument("--steps", type=int, default=3, help="timed steps per side (default 3)")
    p.add_argument("--engines", default="tape",
                   help="GPT-2: our engines (default tape; tape,manual adds the manual one)")
    return p


def default_threads(cores):
    counts, n = [], 1
    while n < cores:
        counts.append(n)
        n *= 2
    return counts + [cores]


def scaled(records):
    """Add each record's speedup over the same (B, T)'s smallest thread count and the
    parallel efficiency (speedup / thread ratio), per side."""
    for r in records:
        base = min((b for b in records if (b["B"], b["T"]) == (r["B"], r["T"])),
                   key=lambda b: b["threads"])
        for key, _ in SIDES:
            if r.get(key) and base.get(key):
                speedup = base[key] / r[key]
                r[f"{key[:-3]}_scaling"] = speedup
                r[f"{key[:-3]}_efficiency"] = speedup / (r["threads"] / base["threads"])
    return records


def print_table(records):
    both = any("bf16_ms" in r for r in records)
    head = (f"{'thr':>3} {'B':>2} {'T':>5} {'ours ms':>8} {'torch ms':>8} {'torch/us':>8} "
            f"{'share':>6} {'scale':>6} {'eff':>5}")
    if both:
        head += (f" {'bf16 ms':>8} {'autoc ms':>8} {'torch/bf16':>10} {'autoc/bf16':>10} "
                 f"{'bf16 sh':>7} {'scale':>6}")
    print(head)
    print("-" * len(head))
    for r in records:
        paired = r.get("speedup_paired", r.get("torch_over_ours_paired"))   # GPT-2, Llama
        line = (f"{r['threads']:>3} {r['B']:>2} {r['T']:>5} {r['ours_ms']:>8.1f} "
                f"{r['torch_ms']:>8.1f} {paired:>7.2f}x {100 * r['share']:>5.1f}% "
                f"{r.get('ours_scaling', 1.0):>5.2f}x {100 * r.get('ours_efficiency', 1.0):>4.0f}%")
        if "bf16_ms" in r:
            line += (f" {r['bf16_ms']:>8.1f} {r['autocast_ms']:>8.1f} "
                     f"{r['torch_over_bf16_paired']:>9.2f}x {r['autocast_over_bf16_paired']:>9.2f}x "
                     f"{100 * r['bf16_share']:>6.1f}% {r.get('bf16_scaling', 1.0):>5.2f}x")
        print(line)


def plot(records, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r["B"], r["T"]) for r in records})
    fig, axes = plt.subplots(1, len(configs), figsize=(7 * len(configs), 5), squeeze=False)
    for ax, (B, T) in zip(axes[0], configs):
        recs = sorted((r for r in records if (r["B"], r["T"]) == (B, T)), key=lambda r: r["threads"])
        threads = [r["threads"] for r in recs]
        for key, label in SIDES:
            if all(r.get(key) for r in recs):
                ms = [r[key] for r in recs]
                ax.plot(threads, ms, marker="o", label=label)
                if key == "ours_ms":
                    ax.plot(threads, [ms[0] * threads[0] / t for t in threads], "k:",
                            label="ours fp32, linear scaling")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(threads, [str(t) for t in threads])
        ax.set_xlabel("threads")
        ax.set_ylabel("ms per training step (median)")
        ax.set_title(f"{title} ({B}, {T})")
        ax.legend()
    fig.suptitle(cpu_name())
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(args, counts, records, started):
    meta = {"model": args.model, "threads": counts, "cpu": cpu_name(), "cpu_flags": cpu_flags(),
            "commit": git_commit(), **blas_dispatch.record(), "steps": args.steps,
            "seconds": time.time() - started}
    os.makedirs(RESULTS, exist_ok=True)
    tmp = os.path.join(RESULTS, "thread_scan.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)
    os.replace(tmp, os.path.join(RESULTS, "thread_scan.json"))


def main(argv=None):
    args = build_parser().parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    counts = [n for n in (args.threads or default_threads(cores)) if n <= cores]
    if not counts:
        raise SystemExit(f"error: no thread count fits the {cores} cores this process may use")
    blas_dispatch.ensure()          # before the workers start: they inherit OPENBLAS_CORETYPE
    started, records = time.time(), []
    for n in counts:
        with tempfile.TemporaryDirectory() as tmp:
            train_step.main(["--model", args.model, "--threads", str(n), "--configs", args.configs,
                             "--precision", args.precision, "--steps", str(args.steps),
                             "--ftz", "on", "--engines", args.engines, "--results-dir", tmp])
            with open(os.path.join(tmp, "train_step.json")) as f:
                records += [r for r in json.load(f) if r.get("model", "gpt2") == args.model]
        records = scaled(sorted(records, key=lambda r: (r["B"], r["T"], r["threads"])))
        write(args, counts, records, started)
        print(f"[{n} threads done, {time.time() - started:.0f} s]\n", flush=True)
    print(f"\n{args.model} training step by threads, {cpu_name()}")
    print_table(records)
    plot(records, os.path.join(RESULTS, "thread_scan.png"), args.model)
    print(f"wrote bench/results/thread_scan.json, thread_scan.png ({time.time() - started:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
