"""Text generation with a key/value cache: ours (gpt2.generate) against transformers'
``generate``, from the same weights, greedy, on the same threads; ours also with the
weights held in bf16 (gpt2-generate --dtype bf16).

  python bench/generate.py [--models smollm2-135m,llama-3.2-1b] [--prompt 128]
                           [--tokens 64] [--rounds 3] [--threads N] [--out PATH]

Each model's weights are our random initialization, written once as a Hugging Face
directory (a temporary one, removed at the end) that both sides read: ours as
``gpt2.generate.Weights`` (what gpt2-generate runs; ``ours-bf16``: the directory read
into bf16 matrices, ``gpt2.lora.Bf16Base``, as --dtype bf16 reads it), transformers'
``AutoModelForCausalLM`` in float32 (eager, ``use_cache``), under ``torch.no_grad``.
A prompt of --prompt random ids, then --tokens tokens greedy (temperature 0; transformers
with ``do_sample=False`` and ``min_new_tokens``, so that neither stops early).  A side's
prefill is the time of a generation of one token (the prompt's forward pass and one
pick), its decoding rate (--tokens - 1) over the rest of the whole generation's time;
each is the median of --rounds, the sides taking turns.  The two sides' tokens must be
the same (greedy decoding from the same logits, up to float32 rounding: a mismatch is
reported, with the first position where they part); ours-bf16's, from rounded weights,
are compared too.

Writes bench/results/generate.json (a record per model and side, with the CPU, its
flags, the commit and the thread count; a run replaces its own models' records on the
same CPU and threads).
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import _paths  # noqa: F401  (import order: source if built in place, installed, bench/)
from _runinfo import cpu_flags, cpu_name, git_commit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run_model(name, prompt_len, n_tokens, rounds, threads, work):
    """{side: record} of one model."""
    import numpy as np
    import torch
    import transformers

    from gpt2 import hf
    from gpt2.config import preset
    from gpt2.generate import Weights, generate
    from gpt2.lora import Bf16Base
    from gpt2.params import ParamArena, init_params_
    config = preset(name)
    path = os.path.join(work, name)
    hf.save_dir(path, init_params_(ParamArena(config), 0))
    ours = Weights(hf.load_dir(path))
    ours_bf16 = Weights(Bf16Base.load_hf(path))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    theirs.eval()
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, prompt_len).tolist()
    x = torch.tensor([prompt])

    def hf_generate(n):
        with torch.no_grad():
            out = theirs.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return out[0, prompt_len:].tolist()

    sides = {"ours": lambda n: generate(ours, prompt, n, temperature=0)[prompt_len:],
             "ours-bf16": lambda n: generate(ours_bf16, prompt, n, temperature=0)[prompt_len:],
             "transformers": hf_generate}
    times = {side: {"prefill": [], "total": []} for side in sides}
    tokens = {}
    for _ in range(rounds):
        for side, fn in sides.items():
            seconds, _ = timed(lambda: fn(1))
            times[side]["prefill"].append(seconds)
            seconds, tokens[side] = timed(lambda: fn(n_tokens))
            times[side]["total"].append(seconds)
    records = {}
    for side, t in times.items():
        prefill, total = statistics.median(t["prefill"]), statistics.median(t["total"])
        records[side] = {"model": name, "side": side, "prompt": prompt_len, "tokens": n_tokens,
                         "threads": threads, "prefill_s": prefill, "total_s": total,
                         "prefill_tokens_per_s": prompt_len / prefill,
                         "decode_tokens_per_s": (n_tokens - 1) / max(total - prefill, 1e-9),
                         "times": t}
        parted = next((i for i, (a, b) in enumerate(zip(tokens[side], tokens["transformers"]))
                       if a != b), None)
        records[side].update(same_tokens=parted is None, parted_at=parted)
    return records


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default=os.path.join(RESULTS, "generate.json"))
    args = p.parse_args(argv)
    if args.prompt < 1 or args.tokens < 2 or args.rounds < 1:
        p.error("--prompt must be >= 1, --tokens >= 2 and --rounds >= 1")
    import torch

    from gpt2.config import preset
    from kernels import _openmp, threads
    models = [m for m in args.models.split(",") if m]
    for m in models:
        try:
            preset(m)
        except ValueError as exc:
            p.error(str(exc))
    n = threads.set_num_threads(args.threads)
    _openmp.set_flush_denormal(True, n)
    torch.set_num_threads(n)
    torch.set_flush_denormal(True)
    work = tempfile.mkdtemp(prefix="adtape-generate-", dir=args.work_dir)
    entries = []
    try:
        for name in models:
            records = run_model(name, args.prompt, args.tokens, args.rounds, n, work)
            shutil.rmtree(os.path.join(work, name), ignore_errors=True)
            t = records["transformers"]
            for side, r in records.items():
                print(f"{name:14s} {side:12s} prefill {r['prefill_s'] * 1e3:8.0f} ms "
                      f"({r['prefill_tokens_per_s']:7.1f} tok/s)  decode "
                      f"{r['decode_tokens_per_s']:6.2f} tok/s", flush=True)
            for side in ("ours", "ours-bf16"):
                o = records[side]
                print(f"{name:14s} {side} over transformers: prefill "
                      f"{t['prefill_s'] / o['prefill_s']:.2f}x, decode "
                      f"{o['decode_tokens_per_s'] / t['decode_tokens_per_s']:.2f}x; "
                      + ("same tokens" if o["same_tokens"] else
                         f"tokens part at position {o['parted_at']}"), flush=True)
            for r in records.values():
                r.update(cpu=cpu_name(), cpu_flags=cpu_flags(), commit=git_commit())
                entries.append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    old = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
    key = lambda e: (e["model"], e["side"], e["cpu"], e["threads"])   # noqa: E731
    new_keys = {key(e) for e in entries}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump([e for e in old if key(e) not in new_keys] + entries, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
