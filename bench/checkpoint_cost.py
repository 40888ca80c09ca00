"""What gpt2-train's default periodic checkpoints cost: the same run with
``--checkpoint-interval auto`` (the default) and ``0`` (only the final save), interleaved.

  python bench/checkpoint_cost.py [--configs small:8x128,gpt2:4x64] [--steps 1500,60]
                                  [--rounds 3] [--threads N] [--out-dir DIR]

Each run is ``python -m gpt2.train`` in a fresh process and a fresh output directory
(removed afterwards), the built-in corpus, no evaluation and no sample.  Its
summary.json gives the training loop's wall time (``checkpoints.train_seconds``: steps,
logging and every save, the final one included) and the time spent saving.  Reported
per configuration: the direct cost (seconds saving periodically / loop time, the final
save, which both policies make, left out), and the ratio of the loop times, auto against
0, median over rounds (A B A B ...).  Writes bench/results/checkpoint_cost.json.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import _paths  # noqa: E402,F401  (import order: source if built in place, installed, bench/)
from _runinfo import cpu_name, git_commit, model_configs  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")


def run_once(model, B, T, steps, interval, threads, out_dir):
    """One training run; returns its summary's ``checkpoints`` dict."""
    command = [sys.executable, "-m", "gpt2.train", "--model", model, "-B", str(B), "-T", str(T),
               "--steps", str(steps), "--eval-interval", "0", "--sample-tokens", "0",
               "--no-progress", "--checkpoint-interval", interval, "--out-dir", out_dir]
    if threads:
        command += ["--threads", str(threads)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=out_dir + "-cwd")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {proc.stderr.strip()}")
    with open(os.path.join(out_dir, "summary.json")) as f:
        return json.load(f)["checkpoints"]


def measure(model, B, T, steps, rounds, threads, scratch):
    runs = {"auto": [], "0": []}
    for r in range(rounds):
        for interval in ("auto", "0"):
            out_dir = os.path.join(scratch, f"{model}-{B}x{T}-{interval}-{r}")
            os.makedirs(out_dir + "-cwd")
            try:
                runs[interval].append(run_once(model, B, T, steps, interval, threads, out_dir))
            finally:
                shutil.rmtree(out_dir, ignore_errors=True)
                shutil.rmtree(out_dir + "-cwd", ignore_errors=True)
    # The final save is the same in both policies: count the periodic ones only.
    final = statistics.median(c["seconds"] for c in runs["0"])
    periodic = [max(0.0, c["seconds"] - final) / c["train_seconds"] for c in runs["auto"]]
    auto_s = statistics.median(c["train_seconds"] for c in runs["auto"])
    none_s = statistics.median(c["train_seconds"] for c in runs["0"])
    return {"model": model, "B": B, "T": T, "steps": steps, "rounds": rounds,
            "periodic_saves": statistics.median(c["saves"] - 1 for c in runs["auto"]),
            "periodic_save_share": statistics.median(periodic),
            "final_save_s": final, "loop_s_auto": auto_s, "loop_s_none": none_s,
            "loop_ratio": auto_s / none_s, "runs": runs}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="small:8x128,gpt2:4x64",
                   type=lambda s: model_configs(s, "small:8x128"))
    p.add_argument("--steps", default="1500,60",
                   help="steps per run, one per configuration (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out-dir", default=None, help="scratch directory (default: the temp dir)")
    args = p.parse_args(argv)
    steps = [int(s) for s in args.steps.split(",")]
    if len(steps) != len(args.configs):
        p.error(f"--steps needs one count per configuration ({len(args.configs)})")
    records = []
    with tempfile.TemporaryDirectory(dir=args.out_dir) as scratch:
        for (model, B, T), n in zip(args.configs, steps):
            rec = measure(model, B, T, n, args.rounds, args.threads, scratch)
            records.append(rec)
            print(f"{model} ({B},{T}) x {n} steps: {rec['periodic_saves']:.0f} periodic saves, "
                  f"{rec['periodic_save_share']:.2%} of the loop saving; loop "
                  f"{rec['loop_s_auto']:.1f} s (auto) vs {rec['loop_s_none']:.1f} s (0): "
                  f"{rec['loop_ratio']:.3f}x; final save {rec['final_save_s'] * 1e3:.0f} ms",
                  flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, "checkpoint_cost.json")
    with open(path, "w") as f:
        json.dump({"cpu": cpu_name(), "commit": git_commit(), "threads": args.threads,
                   "records": records}, f, indent=2)
    print(f"wrote {path} ({cpu_name()})")


if __name__ == "__main__":
    main()
