"""The performance model against our data-parallel runs: step time and per-rank peak RSS.

  python bench/perfmodel_dp.py [--profile this-machine] [--configs gpt2:4x64,gpt2:4x256]
                               [--steps 3] [--no-single]

For each model and per-rank batch (B, T), in fresh processes: ``mpiexec -n 2`` ranks of
one thread each training with gpt2.distributed's DataParallelTrainer (25 MB buckets),
ZeRO 0 and ZeRO 1, and (unless --no-single) one process on two threads on the global
batch.  One warm-up step, then --steps timed steps; the median counts.  Each rank's
peak resident memory is read from the kernel (VmHWM, reset after the warm-up step so
that model construction does not count) and the largest rank's is compared.  The
prediction is ``python -m gpt2.perfmodel --dp 2 --zero Z --hardware PROFILE`` (the
profile's link and the ranks' share of the machine from ``calibrate --link-only``).

Targets: time within 10%, memory within 5%.  The machine is shared: the load average
when each run started is recorded beside it.  Prints a table; writes
bench/results/perfmodel_dp.json and bench/results/perfmodel_dp.png.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import _paths  # noqa: F401  (import order: source if built in place, installed, bench/)
import data_parallel
from _runinfo import cpu_name, git_commit, model_configs

from gpt2.perfmodel import GraphOptions, ModelSpec, ParallelConfig, Workload, estimate, load_profile
from gpt2.units import peak_rss_bytes, reset_peak_rss

RESULTS = data_parallel.RESULTS
CONFIGS = (("gpt2", 4, 64), ("gpt2", 4, 256))
TIME_TARGET, MEMORY_TARGET = 0.10, 0.05


def worker(args):
    """One rank (or the single process): timed steps and this process's peak RSS."""
    from kernels import _openmp, threads
    _openmp.set_flush_denormal(True, args.threads)
    _openmp.set_malloc_retention()
    threads.set_num_threads(args.threads)
    from gpt2.config import GPT2Config
    from gpt2.model import GPT2
    config = GPT2Config.preset(args.model)
    ranks = int(os.environ.get("PMI_SIZE", "1"))
    model = GPT2(config, seed=0, engine="tape")
    x, y, _ = data_parallel._global_batch(config, args.B, args.T, ranks)
    comm = trainer = None
    if ranks > 1:
        from mpi4py import MPI

        from gpt2 import distributed
        comm = MPI.COMM_WORLD
        distributed.install_abort_hook(comm)
        trainer = distributed.DataParallelTrainer(model, comm, zero=args.zero,
                                                  bucket_bytes=data_parallel.BUCKET_BYTES)

    def step():
        if trainer is None:
            return model.train_step(x, y, data_parallel.LR, weight_decay=data_parallel.WEIGHT_DECAY)[0], {}
        loss, _ = trainer.train_step(x, y, data_parallel.LR, weight_decay=data_parallel.WEIGHT_DECAY)
        return loss, dict(trainer.last_step)

    step()
    reset_peak_rss()
    times, _, extras = data_parallel._timed(step, args.steps)
    mine = {"step_ms": times, "peak_rss": peak_rss_bytes(), "extras": extras}
    everyone = comm.gather(mine, root=0) if comm is not None else [mine]
    if comm is None or comm.Get_rank() == 0:
        with open(args.result_file, "w") as f:
            json.dump(everyone, f)


def run(model, B, T, ranks, threads, zero, steps, timeout):
    """Per-rank results of one run in fresh processes, or {"error": ...}."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--B", str(B),
                   "--T", str(T), "--zero", str(zero), "--threads", str(threads), "--steps", str(steps),
                   "--result-file", result_file]
        if ranks > 1:
            command = ["mpiexec", "-n", str(ranks), *command]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        try:
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout} s"}
        if proc.returncode != 0 or not os.path.exists(result_file):
            return {"error": f"exit status {proc.returncode}: {proc.stderr.strip()[-600:]}"}
        with open(result_file) as f:
            return {"ranks": json.load(f)}


def predict(profile, model, B, T, ranks, zero):
    from gpt2.config import GPT2Config
    spec = ModelSpec.from_config(GPT2Config.preset(model))
    parallel = ParallelConfig(dp=ranks, zero_stage=zero, overlap_dp_comm=True,
                              dp_bucket_bytes=float(data_parallel.BUCKET_BYTES))
    est = estimate(spec, Workload(B * ranks, T), parallel, profile, GraphOptions())
    return est


def record(model, B, T, layout, ranks, threads, zero, got, est, load):
    rec = {"model": model, "B": B, "T": T, "layout": layout, "ranks": ranks, "threads_per_rank": threads,
           "zero": zero, "load_average": load, "predicted_ms": est.step_time * 1e3,
           "predicted_rss": est.memory.total, "predicted_comm_ms": est.communication["data_parallel"] * 1e3,
           "predicted_comm_unhidden_ms": est.details["data_parallel_unhidden"] * 1e3,
           "predicted_optimizer_ms": est.optimizer * 1e3, "predicted_memory": est.memory.as_dict()}
    if "error" in got:
        rec["error"] = got["error"]
        return rec
    per_rank = got["ranks"]
    rec["measured_ms"] = statistics.median(t for r in per_rank for t in r["step_ms"])
    rec["measured_rss"] = max(r["peak_rss"] for r in per_rank)
    rec["rank_rss"] = [r["peak_rss"] for r in per_rank]
    rec["step_ms"] = [r["step_ms"] for r in per_rank]
    if ranks > 1:
        for key in ("backward_ms", "wait_ms", "update_ms"):
            rec[key] = statistics.median(e[key] for e in per_rank[0]["extras"])
    rec["time_error"] = rec["predicted_ms"] / rec["measured_ms"] - 1
    rec["memory_error"] = rec["predicted_rss"] / rec["measured_rss"] - 1
    return rec


def print_table(records):
    print(f"\n{'model':<6}{'B':>3}{'T':>5} {'layout':<7}{'zero':>5}{'pred ms':>9}{'meas ms':>9}{'error':>8}"
          f"{'pred MiB':>10}{'meas MiB':>10}{'error':>8}{'comm ms':>9}{'wait ms':>9}{'load':>6}")
    for r in records:
        if "error" in r:
            print(f"{r['model']:<6}{r['B']:>3}{r['T']:>5} {r['layout']:<7}{r['zero']:>5}  error: {r['error']}")
            continue
        print(f"{r['model']:<6}{r['B']:>3}{r['T']:>5} {r['layout']:<7}{r['zero']:>5}{r['predicted_ms']:>9.0f}"
              f"{r['measured_ms']:>9.0f}{r['time_error']:>+8.1%}{r['predicted_rss'] / 2**20:>10.0f}"
              f"{r['measured_rss'] / 2**20:>10.0f}{r['memory_error']:>+8.1%}{r['predicted_comm_ms']:>9.0f}"
              f"{r.get('wait_ms', 0.0):>9.0f}{r['load_average']:>6.2f}")
    print(f"B and memory are per rank (1x2: one process on the global batch); comm = predicted exposed "
          f"data-parallel communication; targets: time {TIME_TARGET:.0%}, memory {MEMORY_TARGET:.0%}")


def plot(records, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    done = [r for r in records if "error" not in r]
    labels = [f"{r['B']}x{r['T']}\n{r['layout']} z{r['zero']}" for r in done]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, target, title in ((axes[0], "time_error", TIME_TARGET, "step time"),
                                   (axes[1], "memory_error", MEMORY_TARGET, "per-rank peak RSS")):
        errors = [100 * r[key] for r in done]
        ax.bar(labels, errors, color=["tab:green" if abs(e) <= 100 * target else "tab:red" for e in errors])
        for y in (-100 * target, 100 * target):
            ax.axhline(y, color="k", lw=0.6, ls="--")
        ax.axhline(0, color="k", lw=0.8)
        ax.set_ylabel("predicted vs measured (%)")
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("perfmodel vs data-parallel runs (2 ranks x 1 thread, MPI loopback)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="this-machine")
    p.add_argument("--configs", type=lambda t: model_configs(t, "gpt2:4x64", " (per-rank batch)"), default=CONFIGS)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--no-single", action="store_true", help="skip the one-process, all-threads run")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("model", "result-file"):
        p.add_argument(f"--{name}", help=argparse.SUPPRESS)
    for name in ("B", "T", "zero", "threads"):
        p.add_argument(f"--{name}", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    profile = load_profile(args.profile)
    ranks = args.ranks
    records = []
    for model, B, T in args.configs:
        layouts = [(f"{ranks}x1", ranks, 1, 0), (f"{ranks}x1", ranks, 1, 1)]
        if not args.no_single:
            layouts.append((f"1x{ranks}", 1, ranks, 0))
        for layout, n, threads, zero in layouts:
            batch = B if n > 1 else B * ranks
            print(f"{model} B={batch} T={T} {layout} zero={zero}", flush=True)
            load = os.getloadavg()[0]
            est = predict(profile, model, batch, T, n, zero)
            got = run(model, batch, T, n, threads, zero, args.steps, args.timeout)
            records.append(record(model, batch, T, layout, n, threads, zero, got, est, load))
    print_table(records)
    os.makedirs(RESULTS, exist_ok=True)
    out = {"machine": cpu_name(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
           "profile": profile.name, "profile_source": profile.source, "link": profile.interconnect.measured,
           "steps": args.steps, "records": records}
    path = os.path.join(RESULTS, "perfmodel_dp.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    plot(records, os.path.join(RESULTS, "perfmodel_dp.png"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
