"""The link probe: what ``mpiexec -n N python -m gpt2.perfmodel.linkprobe`` measures on
this machine for ``calibrate --link-only`` (which launches it and fits the figures).

Every rank runs the same sequence; rank 0 writes one JSON file:
- ``collectives``: {name: [[bytes, median seconds], ...]}, blocking ``Allreduce``,
  ``Reduce_scatter_block`` and ``Allgather`` of float32 buffers from a few bytes to
  --max-bytes (each rank's full buffer; a barrier before each run, the slowest rank's
  time counting);
- ``overlap``: what collectives in flight cost the computation beside them.  Each rank
  runs a loop of sgemm chunks (one of the model's MLP products at 256 rows) alone, then
  with --buckets ``Iallreduce`` (and ``Ireduce_scatter_block``) requests of
  --bucket-bytes launched one every few chunks and ``Testall`` between chunks, as
  gpt2.distributed does; ``cost`` = (loop with them, their wait included - loop alone)
  / the same buckets' blocking collectives alone, medians of paired runs: 0 when the
  link hides them, 1 when they take the cores as long as they do alone;
- ``rank_rates``: each rank's sgemm throughput and copy bandwidth with every rank
  computing at once on ``threads`` threads (the share of the machine a rank gets);
- ``runtime_rss``: the resident bytes the MPI library adds to a rank (its shared-memory
  segments included), after the collectives ran and their buffers were freed;
- ``buffers``: {collective: bytes the library allocates per byte in flight} (its
  temporary buffers), from the peak RSS while --buckets requests are launched at once.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

from gpt2.units import peak_rss_bytes, reset_peak_rss


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _sizes(max_bytes):
    sizes, n = [], 64
    while n < max_bytes:
        sizes.append(n)
        n *= 8 if n < (1 << 20) else 4
    return sizes + [max_bytes]


def _time_collective(comm, fn, repeats):
    """Median over ``repeats`` of the slowest rank's seconds for ``fn()``."""
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(comm.allreduce(time.perf_counter() - t0, op=_mpi().MAX))
    return float(np.median(times))


def _mpi():
    from mpi4py import MPI
    return MPI


def measure_collectives(comm, max_bytes, repeats):
    MPI = _mpi()
    p = comm.Get_size()
    out = {"all_reduce": [], "reduce_scatter": [], "all_gather": []}
    for nbytes in _sizes(max_bytes):
        n = max(p, nbytes // 4 // p * p)
        buf = np.ones(n, np.float32)
        part = np.empty(n // p, np.float32)
        reps = repeats if nbytes <= (16 << 20) else max(3, repeats // 2)
        out["all_reduce"].append([4 * n, _time_collective(
            comm, lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), reps)])
        out["reduce_scatter"].append([4 * n, _time_collective(
            comm, lambda: comm.Reduce_scatter_block(buf, part, op=MPI.SUM), reps)])
        out["all_gather"].append([4 * n, _time_collective(
            comm, lambda: comm.Allgather(MPI.IN_PLACE, buf), reps)])
        del buf, part
    return out


def _sgemm_chunk(rows, threads):
    from kernels import threads as kthreads
    from kernels.gemm import gemm_rowmajor
    kthreads.set_num_threads(threads)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((rows, 768), dtype=np.float32)
    b = rng.standard_normal((3072, 768), dtype=np.float32)
    c = np.empty((rows, 3072), np.float32)
    return (lambda: gemm_rowmajor(c, a, b, trans_b=True)), 2.0 * rows * 768 * 3072


def _buckets(comm, bucket_bytes, buckets):
    """([(bucket, its reduce-scatter part)] of ``buckets`` float32 buckets of about
    ``bucket_bytes``, {collective: non-blocking launch of one bucket})."""
    MPI = _mpi()
    p = comm.Get_size()
    n = bucket_bytes // 4 // p * p
    buf = np.ones(n * buckets, np.float32)
    part = np.empty(n * buckets // p, np.float32)
    views = [(buf[i * n:(i + 1) * n], part[i * n // p:(i + 1) * n // p]) for i in range(buckets)]
    launch = {"all_reduce": lambda v, _: comm.Iallreduce(MPI.IN_PLACE, v, op=MPI.SUM),
              "reduce_scatter": lambda v, w: comm.Ireduce_scatter_block(v, w, op=MPI.SUM)}
    return views, launch


def measure_overlap(comm, bucket_bytes, buckets, chunks, repeats, threads):
    """{collective: cost share} of ``buckets`` buckets launched one after another in a loop
    of ``chunks`` sgemm chunks, with Testall between chunks and Waitall after the loop."""
    MPI = _mpi()
    chunk, _ = _sgemm_chunk(256, threads)
    views, launch = _buckets(comm, bucket_bytes, buckets)
    total = sum(v.nbytes for v, _ in views)
    block = {"all_reduce": lambda v, _: comm.Allreduce(MPI.IN_PLACE, v, op=MPI.SUM),
             "reduce_scatter": lambda v, w: comm.Reduce_scatter_block(v, w, op=MPI.SUM)}
    every = max(1, chunks // buckets)

    def loop(name):
        requests = []
        for i in range(chunks):
            if name is not None and i % every == 0 and len(requests) < buckets:
                requests.append(launch[name](*views[len(requests)]))
            chunk()
            MPI.Request.Testall(requests)
        for v, w in views[len(requests):] if name is not None else ():
            requests.append(launch[name](v, w))
        MPI.Request.Waitall(requests)

    def alone(name):
        for v, w in views:
            block[name](v, w)

    chunk()
    out = {}
    for name in launch:
        comm_s = _time_collective(comm, lambda: alone(name), repeats)
        extra, plain = [], []
        for _ in range(repeats):          # paired: without, with, without, with ...
            t_plain = _time_collective(comm, lambda: loop(None), 1)
            extra.append(_time_collective(comm, lambda: loop(name), 1) - t_plain)
            plain.append(t_plain)
        out[name] = {"bytes": total, "buckets": buckets, "alone_s": comm_s,
                     "compute_s": float(np.median(plain)), "extra_s": float(np.median(extra)),
                     "cost": min(1.0, max(0.0, float(np.median(extra)) / comm_s))}
    return out


def measure_rank_rates(comm, threads, repeats):
    """Each rank's sgemm FLOP/s and copy bytes/s while every rank runs the same at once."""
    chunk, flops = _sgemm_chunk(1024, threads)
    src = np.ones((256 << 20) // 4, np.float32)
    dst = np.empty_like(src)
    chunk()
    np.copyto(dst, src)
    gemm = _time_collective(comm, chunk, repeats)
    copy = _time_collective(comm, lambda: np.copyto(dst, src), repeats)
    return {"threads": threads, "sgemm_shape": [1024, 768, 3072], "sgemm_flops": flops / gemm,
            "copy_bytes": src.nbytes, "copy_bandwidth": 2.0 * src.nbytes / copy}


def measure_buffers(comm, bucket_bytes, buckets, repeats):
    """{collective: resident bytes the library allocates per byte in flight}: ``buckets``
    requests launched back to back (none progressing before the wait, the most a step
    can have in flight), the peak RSS above what it was before the launches."""
    MPI = _mpi()
    views, launch = _buckets(comm, bucket_bytes, buckets)
    total = sum(v.nbytes for v, _ in views)
    out = {}
    for name, fn in launch.items():
        grown = []
        for _ in range(repeats):
            comm.Barrier()
            reset_peak_rss()
            before = peak_rss_bytes()
            MPI.Request.Waitall([fn(v, w) for v, w in views])
            grown.append(comm.allreduce(peak_rss_bytes() - before, op=MPI.MAX))
        out[name] = float(np.median(grown)) / (total)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True)
    p.add_argument("--max-bytes", type=int, default=100 << 20)
    p.add_argument("--bucket-bytes", type=int, default=25 << 20)
    p.add_argument("--buckets", type=int, default=8, help="buckets in flight in the overlap measurement")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="threads per rank")
    args = p.parse_args(argv)
    before = _rss()
    MPI = _mpi()
    comm = MPI.COMM_WORLD
    result = {"ranks": comm.Get_size(), "threads": args.threads,
              "collectives": measure_collectives(comm, args.max_bytes, args.repeats)}
    runtime = comm.allreduce(_rss() - before, op=MPI.MAX)
    result["runtime_rss"] = float(runtime)
    result["buffers"] = measure_buffers(comm, args.bucket_bytes, args.buckets, 3)
    result["rank_rates"] = measure_rank_rates(comm, args.threads, args.repeats)
    result["overlap"] = measure_overlap(comm, args.bucket_bytes, args.buckets, 4 * args.buckets, args.repeats,
                                        args.threads)
    if comm.Get_rank() == 0:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
