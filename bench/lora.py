"""Benchmark LoRA fine-tuning steps: ours against peft on transformers (PyTorch eager fp32
and bf16 autocast), and full fine-tuning of the same model, each side in a fresh process.

  python bench/lora.py [--model llama-3.2-1b] [--B 1] [--T 1024] [--r 16] [--steps 3]
                       [--sides ours,peft,peft-autocast,full] [--threads N]
  python bench/lora.py --model llama-3.1-8b --T 512 --sides ours --base-dtype bf16 \\
                       --checkpointing layer --limit 20G
  python bench/lora.py --masked 0.5      # chat-like batch: each row's first half masked

Every side trains the same model from the same random weights (ours, written once as a
Hugging Face directory in --work-dir and read by every side; --no-shared-weights: each
side initializes its own, for models whose float32 directory does not fit the disk), on
the same fixed batch (--masked F: the first F of each row's targets are -100, a prompt
whose loss does not count, as a chat dataset's labels are), LoRA rank --r with alpha 2r on every attention and MLP projection,
AdamW (lr 1e-4, weight decay 0), the same thread count.  A worker builds its side, takes
one warm-up step and then --steps timed steps (their median); peak RSS is the worker's
VmHWM (the kernel's high-water mark: everything it ever held, the model's construction
included).  FTZ/DAZ on for every side.

Ours beside the performance model: the worker's resident set just before it builds the
model is the baseline given to ``gpt2.perfmodel.plan.predict_policy`` (with the base it
read, which the model keeps), whose predicted peak and step time (from --hardware's
profile) stand beside the measured ones.

Sides: ``ours`` (gpt2-train's Model with --lora; --base-dtype bf16 holds the base in
bf16), ``ours-bf16`` (the base in bf16 whatever --base-dtype: its products in bf16, the
pair of autocast), ``peft`` (peft.get_peft_model on transformers' LlamaForCausalLM, float32),
``peft-autocast`` (the same under torch.autocast("cpu", torch.bfloat16)), ``full`` (ours,
every weight trained, float32).  Results: a table, bench/results/lora.json (one record
per model, (B, T) and side, with the CPU, its flags, the commit and the thread count; ours
with the prediction).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import _paths  # noqa: E402,F401  (import order: source if built in place, installed, bench/)
from _runinfo import cpu_flags, cpu_name, git_commit  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
SIDES = ("ours", "ours-bf16", "peft", "peft-autocast", "full")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 1e-4


def proc_status_bytes(field):
    """``field`` of /proc/self/status (VmHWM: the peak resident set; VmRSS: the current one)
    in bytes, or None."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def batch(config, B, T, masked=0.0):
    """Inputs and targets (B, T); the first ``masked`` of each row's targets are -100."""
    import numpy as np
    rng = np.random.default_rng(0)
    x = rng.integers(0, config.vocab_size, (B, T + 1)).astype(np.int32)
    y = x[:, 1:].copy()
    y[:, :int(round(masked * T))] = -100
    return x[:, :-1].copy(), y


def worker(args):
    """One side: build, warm up, time --steps steps; print one JSON line."""
    import numpy as np
    from gpt2.config import preset
    config = preset(args.model)
    x, y = batch(config, args.B, args.T, args.masked)
    times, losses = [], []
    baseline = base_read = None
    t_build = time.perf_counter()
    if args.side in ("ours", "ours-bf16", "full"):
        from kernels import _openmp, threads
        from gpt2 import hf
        from gpt2.lora import LoraConfig
        from gpt2.model import Model
        _openmp.set_flush_denormal(True)
        n = threads.set_num_threads(args.threads)
        _openmp.set_flush_denormal(True, n)
        base_dtype = "bf16" if args.side == "ours-bf16" else args.base_dtype
        base = None
        if args.weights:
            # A bf16 base is read tensor by tensor, as gpt2-train --base-dtype bf16 reads it.
            from gpt2.lora import Bf16Base
            base = (Bf16Base.load_hf(args.weights) if base_dtype == "bf16"
                    and args.side != "full" else hf.load_dir(args.weights))
        kwargs = dict(checkpointing=args.checkpointing)
        if args.side != "full":
            kwargs.update(lora=LoraConfig(r=args.r, alpha=2.0 * args.r),
                          base_dtype=base_dtype, base=base)
        baseline = proc_status_bytes("VmRSS")
        base_read = base.nbytes if base is not None else 0
        model = Model(config if base is None else base.config, seed=0, **kwargs)
        if args.side == "full" and base is not None:
            model.set_params(base)
        # The kwargs hold the base too: a float32 one the model rounded to bf16 is freed.
        del base, kwargs
        build_s = time.perf_counter() - t_build

        def step():
            return model.train_step(x, y, LR)[0]
    else:
        import peft
        import torch
        import transformers
        torch.set_num_threads(args.threads or os.cpu_count())
        torch.set_flush_denormal(True)
        if args.weights:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                args.weights, dtype=torch.float32, attn_implementation="sdpa")
        else:
            from gpt2 import hf
            cfg = hf.hf_config_dict(config)
            cls = getattr(transformers, cfg.pop("architectures")[0])
            model = cls(transformers.AutoConfig.for_model(**cfg)).float()
        model.config.use_cache = False
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=args.r, lora_alpha=2 * args.r, target_modules=TARGETS, lora_dropout=0.0))
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                weight_decay=0.0)
        xt, yt = torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64))
        autocast = args.side == "peft-autocast"
        build_s = time.perf_counter() - t_build

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(xt).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), yt.reshape(-1))
            loss.backward()
            opt.step()
            return float(loss)
    for i in range(args.steps + 1):
        t0 = time.perf_counter()
        losses.append(step())
        if i:
            times.append(time.perf_counter() - t0)
    print(json.dumps({"side": args.side, "build_s": build_s, "step_s": times,
                      "median_s": statistics.median(times), "losses": losses,
                      "peak_rss_bytes": proc_status_bytes("VmHWM"),
                      "baseline_rss_bytes": baseline, "base_read_bytes": base_read}), flush=True)


def predict(args, side, rec):
    """(predicted peak bytes, predicted step seconds) of an ``ours`` side's run."""
    from gpt2.config import preset
    from gpt2.lora import LoraConfig
    from gpt2.perfmodel.plan import predict_policy
    c = predict_policy(preset(args.model), args.B, args.T, checkpointing=args.checkpointing,
                       hardware=args.hardware, threads=args.threads,
                       baseline_bytes=rec["baseline_rss_bytes"], base_read_bytes=rec["base_read_bytes"],
                       lora=LoraConfig(r=args.r, alpha=2.0 * args.r),
                       base_dtype="bf16" if side == "ours-bf16" else args.base_dtype)
    return c.predicted_peak_bytes, c.predicted_ms / 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--masked", type=float, default=0.0,
                   help="fraction of each row's targets masked (-100), as a chat prompt's are")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--sides", default="ours,peft,peft-autocast,full")
    p.add_argument("--base-dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--checkpointing", choices=("none", "layer"), default="none")
    p.add_argument("--limit", default=None, help="address-space limit of each worker, e.g. 20G")
    p.add_argument("--hardware", default="this-machine",
                   help="the profile ours is predicted with (default: this machine's, calibrated on first use)")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--no-shared-weights", action="store_true")
    p.add_argument("--out", default=os.path.join(RESULTS, "lora.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--side", default=None, help=argparse.SUPPRESS)
    p.add_argument("--weights", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    sides = [s for s in args.sides.split(",") if s]
    bad = [s for s in sides if s not in SIDES]
    if bad:
        p.error(f"unknown side(s) {bad}; sides: {', '.join(SIDES)}")
    if not 0.0 <= args.masked < 1.0:
        p.error(f"--masked must be in [0, 1) (some targets must count), got {args.masked}")
    work = tempfile.mkdtemp(prefix="adtape-lora-", dir=args.work_dir)
    weights = None
    try:
        if not args.no_shared_weights:
            weights = os.path.join(work, "base")
            subprocess.run([sys.executable, "-c",
                            "import sys; from gpt2.config import preset; from gpt2 import hf; "
                            "from gpt2.params import ParamArena, init_params_; "
                            "c = preset(sys.argv[1]); "
                            "hf.save_dir(sys.argv[2], init_params_(ParamArena(c), 0))",
                            args.model, weights], check=True, cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=ROOT))
        records = []
        for side in sides:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--side", side,
                   "--model", args.model, "--B", str(args.B), "--T", str(args.T),
                   "--r", str(args.r), "--steps", str(args.steps), "--masked", str(args.masked),
                   "--base-dtype", args.base_dtype, "--checkpointing", args.checkpointing]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            if weights:
                cmd += ["--weights", weights]
            if args.limit:
                cmd = ["prlimit", f"--as={_bytes(args.limit)}", *cmd]
            t0 = time.perf_counter()
            run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                 env=dict(os.environ, PYTHONPATH=ROOT))
            line = next((l for l in reversed(run.stdout.splitlines()) if l.startswith("{")),
                        None)
            if run.returncode or line is None:
                print(f"{side}: failed (exit {run.returncode}): "
                      f"{(run.stderr or run.stdout).strip().splitlines()[-1:]}", flush=True)
                records.append({"side": side, "failed": run.returncode,
                                "error": (run.stderr or "")[-2000:]})
                continue
            rec = json.loads(line)
            rec["wall_s"] = time.perf_counter() - t0
            tokens = args.B * args.T
            rec["tokens_per_s"] = tokens / rec["median_s"]
            records.append(rec)
            predicted = ""
            if side in ("ours", "ours-bf16"):
                rec["predicted_peak_bytes"], rec["predicted_s"] = predict(args, side, rec)
                predicted = (f" (predicted {rec['predicted_peak_bytes'] / 2**30:.2f} GiB "
                             f"{rec['peak_rss_bytes'] / rec['predicted_peak_bytes'] - 1:+.1%}, "
                             f"{rec['predicted_s'] * 1e3:.0f} ms "
                             f"{rec['median_s'] / rec['predicted_s'] - 1:+.0%})")
            print(f"{side:14s} {rec['median_s'] * 1e3:9.0f} ms/step  "
                  f"{rec['tokens_per_s']:8.1f} tok/s  peak RSS "
                  f"{rec['peak_rss_bytes'] / 2**30:6.2f} GiB{predicted}  (build {rec['build_s']:.0f} s, "
                  f"first loss {rec['losses'][0]:.4f})", flush=True)
        by = {r["side"]: r for r in records if "median_s" in r}
        for mine in ("ours", "ours-bf16"):
            for other in ("peft", "peft-autocast", "full"):
                if mine in by and other in by:
                    print(f"{mine} over {other}: "
                          f"{by[other]['median_s'] / by[mine]['median_s']:.2f}x tokens/s, "
                          f"{by[mine]['peak_rss_bytes'] / by[other]['peak_rss_bytes']:.2f}x "
                          f"peak RSS", flush=True)
        entry = {"model": args.model, "B": args.B, "T": args.T, "masked": args.masked, "r": args.r,
                 "alpha": 2 * args.r, "steps": args.steps, "threads": args.threads or os.cpu_count(),
                 "base_dtype": args.base_dtype, "checkpointing": args.checkpointing,
                 "shared_weights": weights is not None, "cpu": cpu_name(),
                 "cpu_flags": cpu_flags(), "commit": git_commit(), "sides": records}
        old = []
        if os.path.exists(args.out):
            with open(args.out) as f:
                old = json.load(f)
        key = lambda e: (e["model"], e["B"], e["T"], e.get("masked", 0.0), e["base_dtype"],
                         e.get("checkpointing"), e["cpu"], e["threads"])
        old = [e for e in old if key(e) != key(entry)] + [entry]
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(old, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


if __name__ == "__main__":
    sys.exit(main())
