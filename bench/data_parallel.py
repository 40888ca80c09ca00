"""Benchmark data-parallel GPT-2 training over MPI against PyTorch DDP (gloo), on loopback.

  python bench/data_parallel.py [--quick] [--configs gpt2:4x64,gpt2:4x256] [--steps 5]
                                [--rounds 2] [--cores 2] [--no-torch]

For each model and per-rank batch (B, T) it runs, each in fresh processes:
- ``1x1``: one process, one thread, batch B: the baseline of the scaling efficiency;
- ``1x2``: one process with all --cores threads on the global batch (cores x B);
- ``2x1`` (with ``zero`` 0 and 1): --cores ranks of one thread each under ``mpiexec``,
  each on its B rows of the same global batch, gradients averaged in 25 MB buckets that
  the reverse sweep launches as soon as they are final (gpt2.distributed).
PyTorch runs the same layouts (ranks x threads = cores): a plain process for 1x1 and
1x2, ``DistributedDataParallel`` over gloo (25 MB buckets) for 2x1, with
``ZeroRedundancyOptimizer`` for zero 1; launched by the same ``mpiexec``.  Same model,
initialization, data, AdamW (lr 1e-4, weight decay 0.1) and flush-to-zero on both sides
(shared/BENCHMARKS.md); one warm-up step, then --steps timed steps, ours and PyTorch
interleaved for --rounds rounds, the median over all timed steps counting.

Communication: ``comm_ms`` is what the step's collectives take alone and blocking on the
same buckets (``reduce_ms``: the gradient allreduce, or reduce-scatter under ZeRO-1, plus
``allgather_ms``: ZeRO-1's parameter all-gather, which runs in the update; rank 0, median
of 5).  ``wait_ms`` is rank 0's time blocked on the gradient collectives after the
backward; it also holds the time rank 0 waits for a slower rank to finish its backward.
``exposed_wait_ms`` takes, step by step, the wait of the rank that finished its backward
last (the least over the ranks), which is the communication left when every rank is
there, then the median over the steps.  ``hidden_fraction`` = 1 - min(exposed_wait_ms,
reduce_ms) / reduce_ms: the share of the gradient communication that ran behind the
backward.  ``scaling_efficiency`` = 1x1 ms / 2x1 ms:
1.0 when every rank steps its B rows as fast as one process alone.  Losses of 2x1 are
checked against 1x2's (the same global batch) within 1e-6.

Prints a table, writes bench/results/data_parallel.json (records with ranks,
threads_per_rank, B, T, zero, ours_ms, torch_ms, comm_ms, hidden_fraction, ...) and
bench/results/data_parallel.png; --quick (the small model at per-rank (2,32) and (2,64),
2 steps, 1 round) writes data_parallel_quick.json/.png.
"""
import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import _paths  # noqa: E402,F401  (import order: source if built in place, installed, bench/)
from _runinfo import cpu_name, git_commit, model_configs  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
CONFIGS = (("gpt2", 4, 64), ("gpt2", 4, 256))
QUICK_CONFIGS = (("small", 2, 32), ("small", 2, 64))
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 0.1
BUCKET_BYTES = 25 << 20


def parse_configs(text):
    return model_configs(text, "gpt2:4x64", " (per-rank batch)")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help=f"configurations {QUICK_CONFIGS}, 2 timed steps, 1 round")
    p.add_argument("--configs", type=parse_configs, default=None,
                   help="MODEL:BxT,... with B the per-rank batch (default gpt2:4x64,gpt2:4x256)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 5)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 2)")
    p.add_argument("--cores", type=int, default=2, help="ranks x threads of each layout")
    p.add_argument("--timeout", type=int, default=None,
                   help="seconds per run (default 1800, --quick 300)")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch")
    p.add_argument("--worker", choices=("ours", "torch"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--B", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--T", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--zero", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    return p


# -- workers (one per rank) -----------------------------------------------------------------

def _rank_and_size():
    from gpt2.distributed import launched_ranks
    return int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", 0))), \
        launched_ranks()


def _global_batch(config, B, T, ranks):
    """The global batch of ranks x B rows, and this rank's rows of it."""
    import numpy as np
    rank, _ = _rank_and_size()
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (B * ranks, T + 1))
    x = np.ascontiguousarray(tokens[:, :-1], dtype=np.int32)
    y = np.ascontiguousarray(tokens[:, 1:], dtype=np.int32)
    return x, y, slice(rank * B, (rank + 1) * B)


def _timed(step, n):
    """One warm-up call, then n timed calls: (per-step ms, losses, per-step extras)."""
    losses, extras = [step()[0]], []
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        loss, extra = step()
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss)
        extras.append(extra)
    return times, losses, extras


def run_ours(args):
    from kernels import _openmp, threads
    _openmp.set_flush_denormal(True, args.threads)
    _openmp.set_malloc_retention()
    threads.set_num_threads(args.threads)
    from gpt2.config import GPT2Config
    from gpt2.model import GPT2
    config = GPT2Config.preset(args.model)
    _, ranks = _rank_and_size()
    model = GPT2(config, seed=0, engine="tape")
    x, y, rows = _global_batch(config, args.B, args.T, ranks)
    result = {}
    if ranks == 1:
        def step():
            return model.train_step(x, y, LR, weight_decay=WEIGHT_DECAY)[0], {}
        result["step_ms"], result["losses"], _ = _timed(step, args.steps)
    else:
        from mpi4py import MPI

        from gpt2 import distributed
        comm = MPI.COMM_WORLD
        distributed.install_abort_hook(comm)
        trainer = distributed.DataParallelTrainer(model, comm, zero=args.zero,
                                                  bucket_bytes=BUCKET_BYTES,
                                                  settings={"B": args.B, "T": args.T})

        def step():
            loss, _ = trainer.train_step(x, y, LR, weight_decay=WEIGHT_DECAY)
            return loss, dict(trainer.last_step)
        result["step_ms"], result["losses"], extras = _timed(step, args.steps)
        for key in ("backward_ms", "wait_ms", "update_ms"):
            result[key] = statistics.median(e[key] for e in extras)
        waits = comm.gather([e["wait_ms"] for e in extras], root=0)
        result["buckets"] = len(trainer.layout.bounds)
        result["buckets_in_backward"] = extras[-1]["buckets_in_backward"]
        result.update(trainer.communication_ms())
        result["optimizer_floats_per_rank"] = int(trainer.adam_m.size + trainer.adam_v.size)
        if comm.Get_rank() != 0:
            return None
        result["exposed_wait_ms"] = statistics.median(map(min, zip(*waits)))
    model.close()
    return result


def run_torch(args):
    import torch
    import torch_gpt2
    torch_gpt2.configure_torch(args.threads, True)
    from gpt2.config import GPT2Config
    from gpt2.params import ParamArena, init_params_
    config = GPT2Config.preset(args.model)
    params = ParamArena(config)
    init_params_(params, 0)
    model = torch_gpt2.build_model(config, params)
    del params
    rank, ranks = _rank_and_size()
    x, y, rows = _global_batch(config, args.B, args.T, ranks)
    result = {}
    if ranks == 1:
        net, opt = model, torch_gpt2.make_adamw(model, lr=LR, betas=BETAS, eps=EPS,
                                                weight_decay=WEIGHT_DECAY)
    else:
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel
        from datetime import timedelta
        # A collective that a vanished peer never joins raises instead of hanging.
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=rank, world_size=ranks,
                                timeout=timedelta(seconds=args.timeout))
        net = DistributedDataParallel(model, bucket_cap_mb=BUCKET_BYTES / (1 << 20))
        if args.zero:
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                          lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        else:
            opt = torch_gpt2.make_adamw(model, lr=LR, betas=BETAS, eps=EPS,
                                        weight_decay=WEIGHT_DECAY)
        x, y = x[rows], y[rows]
    t_in = torch_gpt2.as_index_tensor(x, "inputs")
    t_tg = torch_gpt2.as_index_tensor(y, "targets")

    def step():
        opt.zero_grad(set_to_none=True)
        _, loss = net(t_in, t_tg)
        loss.backward()
        opt.step()
        return loss.item(), {}
    result["step_ms"], result["losses"], _ = _timed(step, args.steps)
    if ranks > 1:
        flat = torch.zeros(sum(p.numel() for p in model.parameters()))
        per_bucket = BUCKET_BYTES // 4
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            for start in range(0, flat.numel(), per_bucket):
                dist.all_reduce(flat[start:start + per_bucket])
            times.append((time.perf_counter() - t0) * 1e3)
        result["torch_allreduce_ms"] = statistics.median(times)
        dist.destroy_process_group()
        if rank != 0:
            return None
    return result


def worker_main(args):
    result = run_ours(args) if args.worker == "ours" else run_torch(args)
    if result is not None:
        with open(args.result_file, "w") as f:
            json.dump(result, f)


# -- the parent -----------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(side, model, B, T, ranks, threads, zero, args):
    """One run in fresh processes; its rank 0's result dict (or {"error": ...})."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--worker", side, "--model", model,
                   "--B", str(B), "--T", str(T), "--zero", str(zero), "--threads", str(threads),
                   "--steps", str(args.steps), "--port", str(free_port()),
                   "--timeout", str(args.timeout),
                   "--result-file", result_file]
        if ranks > 1:
            command = [shutil.which("mpiexec") or "mpiexec", "-n", str(ranks), *command]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        try:
            proc = subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {args.timeout} s"}
        if proc.returncode != 0 or not os.path.exists(result_file):
            return {"error": f"exit status {proc.returncode}: {proc.stderr.strip()[-600:]}"}
        with open(result_file) as f:
            return json.load(f)


LAYOUTS = (  # (name, ranks, zero); threads per rank = cores / ranks, except 1x1
    ("1x1", 1, 0), ("1xN", 1, 0), ("Nx1", None, 0), ("Nx1", None, 1))


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args)
    configs = args.configs or (QUICK_CONFIGS if args.quick else CONFIGS)
    args.steps = args.steps or (2 if args.quick else 5)
    args.timeout = args.timeout or (300 if args.quick else 1800)
    rounds = args.rounds or (1 if args.quick else 2)
    cores = args.cores
    if cores < 2:
        raise SystemExit("error: --cores must be at least 2 (ranks x threads)")
    sides = ("ours",) if args.no_torch else ("ours", "torch")
    records = []
    for model, B, T in configs:
        runs = {}
        for name, ranks, zero in LAYOUTS:
            ranks = cores if ranks is None else 1
            threads = 1 if name != "1xN" else cores
            per_run_B = B if ranks > 1 or name == "1x1" else B * cores
            layout = name.replace("N", str(cores))
            for rnd in range(rounds):
                for side in sides:     # interleaved: ours, torch, ours, torch ...
                    print(f"{model} per-rank B={B} T={T} {layout} zero={zero} {side} "
                          f"round {rnd + 1}/{rounds}", flush=True)
                    got = run_worker(side, model, per_run_B, T, ranks, threads, zero, args)
                    runs.setdefault((layout, zero, side), []).append(got)
        records.extend(summarize(model, B, T, cores, runs, sides))
    print_table(records)
    write_results(records, args, cores)


def _median_ms(results):
    steps = [t for r in results if "step_ms" in r for t in r["step_ms"]]
    return statistics.median(steps) if steps else None


def _errors(results):
    return "; ".join(r["error"] for r in results if "error" in r) or None


def _relative_gap(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def summarize(model, B, T, cores, runs, sides):
    """One record per (layout, zero) of a configuration."""
    out = []
    base = {side: _median_ms(runs[("1x1", 0, side)]) for side in sides}
    for (layout, zero, side), results in runs.items():
        if side != "ours":
            continue
        ranks = cores if layout.endswith("x1") and layout != "1x1" else 1
        torch_results = runs.get((layout, zero, "torch"), [])
        ours_ms = _median_ms(results)
        torch_ms = _median_ms(torch_results) if torch_results else None
        rec = {"model": model, "layout": layout, "ranks": ranks,
               "threads_per_rank": 1 if layout != f"1x{cores}" else cores,
               "B": B if layout != f"1x{cores}" else B * cores, "T": T,
               "global_B": B * (cores if layout != "1x1" else 1), "zero": zero,
               "ours_ms": ours_ms, "torch_ms": torch_ms,
               "torch_over_ours": torch_ms / ours_ms if ours_ms and torch_ms else None,
               "comm_ms": None, "wait_ms": None, "exposed_wait_ms": None,
               "hidden_fraction": None,
               "scaling_efficiency": None, "torch_scaling_efficiency": None,
               "ours_step_ms": [t for r in results for t in r.get("step_ms", [])],
               "torch_step_ms": [t for r in torch_results for t in r.get("step_ms", [])],
               "error": _errors(results), "torch_error": _errors(torch_results)}
        done = [r for r in results if "step_ms" in r]
        if ranks > 1 and done:
            def med(key):
                return statistics.median(r[key] for r in done)
            reduce_ms, allgather_ms = med("reduce_ms"), med("allgather_ms")
            exposed_ms = med("exposed_wait_ms")
            rec.update(comm_ms=reduce_ms + allgather_ms, reduce_ms=reduce_ms,
                       allgather_ms=allgather_ms, wait_ms=med("wait_ms"),
                       exposed_wait_ms=exposed_ms,
                       hidden_fraction=1.0 - min(exposed_ms, reduce_ms) / reduce_ms,
                       backward_ms=med("backward_ms"), update_ms=med("update_ms"),
                       buckets=done[0]["buckets"],
                       buckets_in_backward=done[0]["buckets_in_backward"],
                       optimizer_floats_per_rank=done[0]["optimizer_floats_per_rank"])
            if base["ours"] and ours_ms:
                rec["scaling_efficiency"] = base["ours"] / ours_ms
            if "torch" in base and base["torch"] and torch_ms:
                rec["torch_scaling_efficiency"] = base["torch"] / torch_ms
            torch_done = [r for r in torch_results if "torch_allreduce_ms" in r]
            if torch_done:
                rec["torch_allreduce_ms"] = statistics.median(r["torch_allreduce_ms"]
                                                              for r in torch_done)
            single = [r for r in runs[(f"1x{cores}", 0, "ours")] if "losses" in r]
            if single:
                rec["losses_match_1_process"] = _relative_gap(done[0]["losses"],
                                                              single[0]["losses"]) < 1e-6
        out.append(rec)
    return out


def print_table(records):
    def g(v, fmt="{:.0f}"):
        return "-" if v is None else fmt.format(v)
    head = (f"{'model':<7}{'B':>3}{'T':>5} {'layout':<7}{'zero':>5}{'ours ms':>9}{'torch ms':>9}"
            f"{'torch/ours':>11}{'comm ms':>9}{'exposed':>9}{'hidden':>8}{'eff':>6}"
            f"{'torch eff':>10}{'losses':>8}")
    print("\n" + head)
    for r in records:
        hidden = None if r["hidden_fraction"] is None else 100 * r["hidden_fraction"]
        print(f"{r['model']:<7}{r['B']:>3}{r['T']:>5} {r['layout']:<7}{r['zero']:>5}"
              f"{g(r['ours_ms']):>9}{g(r['torch_ms']):>9}{g(r['torch_over_ours'], '{:.2f}'):>11}"
              f"{g(r['comm_ms']):>9}{g(r['exposed_wait_ms']):>9}"
              f"{g(hidden, '{:.0f}%'):>8}"
              f"{g(r['scaling_efficiency'], '{:.2f}'):>6}"
              f"{g(r['torch_scaling_efficiency'], '{:.2f}'):>10}"
              f"{str(r.get('losses_match_1_process', '-')):>8}")
        for key in ("error", "torch_error"):
            if r.get(key):
                print(f"    {key}: {r[key]}")
    print("B is per rank (1xN: the global batch); eff = 1x1 ms / Nx1 ms; exposed = ms the "
          "last rank out of the backward waited on the gradient collectives; hidden = share of "
          "the gradient communication that ran behind the backward")


def write_results(records, args, cores):
    os.makedirs(RESULTS, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    out = {"machine": cpu_name(), "cores": cores, "date": time.strftime("%Y-%m-%d"),
           "commit": git_commit(), "mpi": mpi_version(), "records": records}
    path = os.path.join(RESULTS, f"data_parallel{suffix}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    plot(records, os.path.join(RESULTS, f"data_parallel{suffix}.png"))
    print(f"\nwrote {path}")


def plot(records, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    groups = sorted({(r["model"], r["T"], r["global_B"]) for r in records if r["layout"] != "1x1"})
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(5.5 * max(1, len(groups)), 4.2),
                             squeeze=False)
    for ax, (model, T, global_B) in zip(axes[0], groups):
        rows = [r for r in records if (r["model"], r["T"], r["global_B"]) == (model, T, global_B)
                and r["layout"] != "1x1"]
        labels = [f"{r['layout']}\nzero {r['zero']}" for r in rows]
        pos = np.arange(len(rows))
        ax.bar(pos - 0.2, [r["ours_ms"] or 0 for r in rows], 0.4, label="adtape (MPI)")
        ax.bar(pos + 0.2, [r["torch_ms"] or 0 for r in rows], 0.4, label="PyTorch (DDP, gloo)")
        for p, r in zip(pos, rows):
            if r["hidden_fraction"] is not None:
                ax.annotate(f"{100 * r['hidden_fraction']:.0f}% hidden", (p - 0.2, r["ours_ms"]),
                            ha="center", va="bottom", fontsize=7)
        ax.set_xticks(pos, labels)
        ax.set_title(f"{model} T={T}, global B={global_B}")
        ax.set_ylabel("ms/step")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.suptitle("Data-parallel GPT-2 step on loopback: ranks x threads per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mpi_version():
    try:
        import mpi4py
        mpi4py.rc.initialize = False     # the parent only asks for the library's name
        from mpi4py import MPI
        return MPI.Get_library_version().splitlines()[0].strip()
    except ImportError:
        return None


if __name__ == "__main__":
    main()
