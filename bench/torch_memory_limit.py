"""What PyTorch eager needs to train GPT-2 models whose states outgrow RAM.

Each model trains 2 steps at (B, T) (float32, ``torch.optim.AdamW``, the bench's
PyTorch GPT-2) in a fresh process inside a cgroup v1 memory limit (``--limit``, default
20 GiB), so a model that does not fit is killed by the limit, not the machine.  Records
the peak RSS of those that finish and how far the others got before the kill, fits
peak = a + b * parameters over the finished ones and extrapolates to the others.
Writes bench/results/torch_memory_limit.json.  Needs root (cgroup v1); run nothing else
beside it.

    python bench/torch_memory_limit.py [--models gpt2-medium,gpt2-large,gpt2-xl] [--limit 20G]
"""
import argparse
import json
import os
import subprocess
import sys
import time

import _paths  # noqa: F401  (import order: installed packages, source, bench/)
from _runinfo import cpu_name, git_commit  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "torch_memory_limit.json")
CGROUP = "/sys/fs/cgroup/memory/adtape-torch-limit"
GiB = 1 << 30


def worker(model, B, T):
    import resource

    import numpy as np
    import torch
    import torch_gpt2
    from gpt2.config import preset
    torch_gpt2.configure_torch(os.cpu_count(), True)
    config = preset(model)
    m = torch_gpt2.TorchGPT2(config)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.02)
    opt = torch_gpt2.make_adamw(m, lr=1e-4, weight_decay=0.1)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (B, T + 1))
    x = torch_gpt2.as_index_tensor(tokens[:, :-1])
    y = torch_gpt2.as_index_tensor(tokens[:, 1:])
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        torch_gpt2.train_step(m, opt, x, y)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"params": sum(p.numel() for p in m.parameters()),
                      "step_ms": times[-1] * 1e3,
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def run_limited(model, B, T, limit):
    os.makedirs(CGROUP, exist_ok=True)
    with open(os.path.join(CGROUP, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit))
    with open(os.path.join(CGROUP, "memory.max_usage_in_bytes"), "w") as f:
        f.write("0")
    cmd = [sys.executable, __file__, "--worker", model, "-B", str(B), "-T", str(T)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: open(os.path.join(CGROUP, "tasks"), "w").write(
                                str(os.getpid())))
    out, err = proc.communicate(timeout=3600)
    with open(os.path.join(CGROUP, "memory.max_usage_in_bytes")) as f:
        max_usage = int(f.read())
    rec = {"model": model, "B": B, "T": T, "limit_bytes": limit, "returncode": proc.returncode,
           "cgroup_max_usage_bytes": max_usage}
    if proc.returncode == 0:
        rec.update(json.loads(out.strip().splitlines()[-1]))
    else:
        rec["error"] = (err.strip().splitlines() or ["killed"])[-1][:300]
    return rec


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2-medium,gpt2-large,gpt2-xl")
    p.add_argument("-B", type=int, default=1)
    p.add_argument("-T", type=int, default=1024)
    p.add_argument("--limit", default="20G")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.B, args.T)
    from gpt2.config import preset
    from gpt2.params import num_parameters
    from gpt2.train import parse_size
    limit = parse_size(args.limit)
    records = []
    try:
        for model in args.models.split(","):
            rec = run_limited(model, args.B, args.T, limit)
            rec.setdefault("params", num_parameters(preset(model)))
            records.append(rec)
            print(f"{model:12} {rec['params'] / 1e6:8.1f}M params: " + (
                f"peak RSS {rec['peak_rss_bytes'] / GiB:.2f} GiB, {rec['step_ms']:.0f} ms/step"
                if rec["returncode"] == 0 else
                f"killed at the {limit / GiB:.0f} GiB limit (exit {rec['returncode']}, "
                f"cgroup max {rec['cgroup_max_usage_bytes'] / GiB:.2f} GiB)"), flush=True)
    finally:
        os.rmdir(CGROUP) if os.path.isdir(CGROUP) else None
    done = [r for r in records if r["returncode"] == 0]
    if len(done) >= 2:
        (n0, p0), (n1, p1) = [(r["params"], r["peak_rss_bytes"]) for r in done[-2:]]
        b = (p1 - p0) / (n1 - n0)
        a = p0 - b * n0
        for r in records:
            r["fit_peak_bytes"] = a + b * r["params"]
        print(f"fit: peak = {a / GiB:.2f} GiB + {b:.1f} bytes per parameter")
        for r in records:
            if r["returncode"] != 0:
                print(f"{r['model']}: needs about {r['fit_peak_bytes'] / GiB:.1f} GiB")
    with open(RESULTS, "w") as f:
        json.dump({"cpu": cpu_name(), "commit": git_commit(), "date": time.strftime("%Y-%m-%d"),
                   "records": records}, f, indent=1)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
