"""Training in bf16 against float32 and PyTorch's autocast: the validation loss after N steps.

  python bench/precision_loss.py [--models gpt2,llama-tiny] [--steps 300] [-B 4] [-T 64]
                                 [--sides fp32,bf16,autocast] [--lr 6e-4] [--threads N]
                                 [--warmup 30] [--schedule cosine] [--grad-clip 1.0]

Every side starts from the same weights (our initialization, seed --seed, copied into
the PyTorch model) and takes the same batches of the built-in corpus (byte tokens, the
shuffled train split), AdamW with betas 0.9/0.999, eps 1e-8, weight decay 0.1, the
learning rate of gpt2-train's schedule (linear warmup over --warmup steps to --lr, then
cosine decay to --lr / 10 at --steps; ``--schedule constant`` keeps --lr) and the
gradient's global norm clipped to --grad-clip (0: no clipping), as gpt2-train trains:
  fp32      ours, float32 products (``--precision fp32``);
  bf16      ours, bf16 products (``--precision bf16``: kernels.bf16 on this CPU's path);
  autocast  PyTorch eager (bench/torch_gpt2.py, torch_llama.py) with the forward and
            loss under torch.autocast("cpu", torch.bfloat16), float32 weights and AdamW.
Every --eval-interval steps and at the end each side's validation loss is the mean over
the same --eval-batches batches of the val split (each side in its own precision).
The check: the bf16 side's final validation loss within --tolerance (1%) of the fp32
side's and of the autocast side's.  On a CPU without AVX512_BF16, PyTorch runs autocast's
bf16 products slowly (28x our fp32 step at GPT-2 124M (1, 16) on a Zen 3): --sides
fp32,bf16 leaves it out.

Writes bench/results/precision_loss.json (the curves and the check per model; a run
replaces its own models' records) unless --out names another file.
"""
import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import _paths  # noqa: F401  (import order: source if built in place, installed, bench/)
from _runinfo import cpu_flags, cpu_name, git_commit
from kernels import blas_dispatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
SIDES = ("fp32", "bf16", "autocast")
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.999), 1e-8, 0.1


def parse_list(choices):
    def parse(text):
        items = tuple(t for t in text.split(",") if t)
        bad = [t for t in items if choices is not None and t not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of "
                                              f"{', '.join(choices)}; got {text!r}")
        return items
    return parse


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=parse_list(None), default=("gpt2", "llama-tiny"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("-B", type=int, default=4)
    p.add_argument("-T", type=int, default=64)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--sides", type=parse_list(SIDES), default=SIDES)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--tolerance", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--corpus-bytes", type=int, default=3_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    return p


class Ours:
    """Our model in one precision: its steps and its validation loss run in it."""

    def __init__(self, config, seed, precision, grad_clip):
        from gpt2.model import GPT2
        self.model = GPT2(config, seed=seed)
        self.precision = precision
        self.grad_clip = grad_clip or None

    def _in_precision(self, fn):
        from adtape import nn
        previous = nn.set_precision(self.precision)
        try:
            return fn()
        finally:
            nn.set_precision(previous)

    def step(self, x, y, lr):
        return self._in_precision(lambda: self.model.train_step(
            x, y, lr, weight_decay=WEIGHT_DECAY, grad_clip=self.grad_clip)[0])

    def loss(self, x, y):
        return self._in_precision(lambda: float(self.model.forward(x, y)[1]))

    def close(self):
        self.model.close()


class Autocast:
    """PyTorch eager from our weights, forward and loss under bf16 autocast."""

    def __init__(self, config, params, lr, grad_clip):
        import torch
        import torch_gpt2
        import torch_llama
        build = torch_gpt2.build_model if config.family == "gpt2" else torch_llama.build_model
        self.torch = torch
        self.model = build(config, params)
        self.optimizer = torch_gpt2.make_adamw(self.model, lr=lr, betas=BETAS, eps=EPS,
                                               weight_decay=WEIGHT_DECAY)
        self.as_index = torch_gpt2.as_index_tensor
        self.train_step = torch_gpt2.train_step
        self.grad_clip = grad_clip or None

    def step(self, x, y, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return self.train_step(self.model, self.optimizer, self.as_index(x), self.as_index(y),
                               autocast=self.torch.bfloat16, grad_clip=self.grad_clip)

    def loss(self, x, y):
        torch = self.torch
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = self.model(self.as_index(x), self.as_index(y))
        return float(loss)

    def close(self):
        pass


def run_model(name, args):
    import numpy as np
    from gpt2 import data
    from gpt2.config import preset
    from gpt2.train import learning_rate
    config = preset(name)
    tokens = data.default_corpus_tokens(max_bytes=args.corpus_bytes)
    train, val = data.train_val_loaders(tokens, args.B, args.T, config.vocab_size,
                                        seed=args.seed)
    val_batches = [val.next_batch() for _ in range(args.eval_batches)]
    sides = {}
    for s in args.sides:
        if s == "autocast":
            reference = sides.get("fp32") or Ours(config, args.seed, "fp32", args.grad_clip)
            sides[s] = Autocast(config, reference.model.params, args.lr, args.grad_clip)
            if "fp32" not in sides:
                reference.close()
        else:
            sides[s] = Ours(config, args.seed, s, args.grad_clip)
    curves = {s: {"step": [], "train_loss": [], "val_step": [], "val_loss": [], "seconds": 0.0}
              for s in sides}

    def evaluate(step):
        for s, side in sides.items():
            curves[s]["val_step"].append(step)
            curves[s]["val_loss"].append(float(np.mean([side.loss(x, y)
                                                        for x, y in val_batches])))

    schedule = SimpleNamespace(lr=args.lr, min_lr=None, warmup=args.warmup,
                               schedule=args.schedule, decay_steps=args.steps)
    evaluate(0)
    for step in range(1, args.steps + 1):
        x, y = train.next_batch()
        lr = learning_rate(step - 1, schedule)
        for s, side in sides.items():
            t0 = time.perf_counter()
            loss = side.step(x, y, lr)
            curves[s]["seconds"] += time.perf_counter() - t0
            curves[s]["step"].append(step)
            curves[s]["train_loss"].append(float(loss))
        if step % args.eval_interval == 0 or step == args.steps:
            evaluate(step)
            print(f"  {name} step {step}: " + ", ".join(
                f"{s} val {c['val_loss'][-1]:.4f}" for s, c in curves.items()), flush=True)
    for side in sides.values():
        side.close()
    final = {s: c["val_loss"][-1] for s, c in curves.items()}
    checks = {}
    if "bf16" in final:
        for ref in ("fp32", "autocast"):
            if ref in final:
                rel = abs(final["bf16"] - final[ref]) / abs(final[ref])
                checks[f"bf16_vs_{ref}"] = {"relative_difference": rel,
                                             "within": rel <= args.tolerance}
    return {"model": name, "config": config.describe(), "B": args.B, "T": args.T,
            "steps": args.steps, "lr": args.lr, "warmup": args.warmup,
            "schedule": args.schedule, "grad_clip": args.grad_clip, "seed": args.seed,
            "final_val_loss": final, "checks": checks, "curves": curves}


def main(argv=None):
    args = build_parser().parse_args(argv)
    if argv is None:
        blas_dispatch.ensure()
    from kernels import _openmp, bf16, threads
    n = args.threads or len(os.sched_getaffinity(0))
    threads.set_num_threads(n)
    _openmp.set_flush_denormal(True, n)
    if "autocast" in args.sides:
        import torch
        torch.set_num_threads(n)
        torch.set_flush_denormal(True)
    print(f"precision check: {', '.join(args.models)}, {args.steps} steps of ({args.B}, "
          f"{args.T}), lr {args.lr} ({args.schedule}, warmup {args.warmup}), clip {args.grad_clip}, sides {', '.join(args.sides)}; {n} threads, "
          f"{cpu_name()}, bf16 path {bf16.bf16_path()}", flush=True)
    records, failed = [], []
    for name in args.models:
        try:
            rec = run_model(name, args)
        except (KeyError, ValueError) as e:
            sys.exit(f"error: {name}: {e}")
        records.append(rec)
        for check, c in rec["checks"].items():
            print(f"{name}: {check}: final validation losses differ by "
                  f"{100 * c['relative_difference']:.2f}% "
                  f"({'within' if c['within'] else 'OUTSIDE'} {100 * args.tolerance:g}%); "
                  + ", ".join(f"{s} {v:.4f}" for s, v in rec["final_val_loss"].items()))
            if not c["within"]:
                failed.append(f"{name} {check}")
    out = args.out or os.path.join(RESULTS, "precision_loss.json")
    try:
        with open(out) as f:
            kept = [r for r in json.load(f)["records"] if r["model"] not in args.models]
    except (FileNotFoundError, KeyError, ValueError):
        kept = []
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"cpu": cpu_name(), "cpu_flags": cpu_flags(), "commit": git_commit(),
                   "threads": n, "bf16_path": bf16.bf16_path(), **blas_dispatch.record(),
                   "records": kept + records}, f, indent=1)
    os.replace(tmp, out)
    print(f"wrote {os.path.relpath(out)}")
    if failed:
        sys.exit(f"error: outside the tolerance: {', '.join(failed)}")


if __name__ == "__main__":
    main()
