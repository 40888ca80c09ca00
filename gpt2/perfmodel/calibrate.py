"""Measure this machine and write its hardware profile.

  python -m gpt2.perfmodel.calibrate [--threads N] [--output PATH] [--quick] [--spill-dir DIR]
  python -m gpt2.perfmodel.calibrate --disk-only [--spill-dir DIR]   (what the memory planner needs)
  python -m gpt2.perfmodel.calibrate --link-only [--ranks 2]   (what data-parallel estimates need)

The profile goes to this machine's entry in the user's cache (gpt2.perfmodel.hardware:
~/.cache/adtape/profiles/<cpu>-<digest>-<threads>t.json), which ``--hardware
this-machine``, ``--plan`` and ``gpt2-train --max-memory`` read; --output writes elsewhere.
--disk-only and --link-only update that file.

Measures, at GPT-2 124M's shapes at a few (B, T): float32 sgemm throughput through the
kernels' gemm for the forward product and both backward products, the same products
with bf16 operands (kernels.bf16, what ``--precision bf16`` runs: curves of their own),
the peak on a large square sgemm and on the same product in bf16, the physical peak of
the cores (kernels.peak: register-only multiply-add loops of every ISA the CPU has, all
threads at once; what MFU is taken against), memory bandwidth by array size (copied by all the threads), the fixed cost
of one kernel call and of one tape record, our kernels' throughput by op class
(attention, layernorm, GELU, residual, embedding, loss, optimizer: whichever are built),
the spill device's sequential write and read rates (O_DIRECT: the disk, not the page
cache) and the baseline RSS of a process that ran one tiny training step.  The machine is shared, so
every figure is the median of several runs, interleaved across the shapes (one run of
each shape per round).  --quick (what the first use of this-machine runs, ~30 s on two
cores) times the same shapes with fewer repeats, probes 256 MB of disk and skips the
link.  Each phase is one line on stderr, and a note says when other processes took more
than a tenth of the CPU meanwhile (the figures are then too slow).

The link between ranks on this machine (``--link-only``, and part of a full calibration
where mpiexec and mpi4py are installed): ``mpiexec -n RANKS`` runs gpt2.perfmodel.linkprobe,
which times blocking all-reduce, reduce-scatter and all-gather from 64 bytes to
--link-max-bytes, what buckets in flight cost the computation beside them, each rank's
sgemm and copy rates with every rank computing at once on the profile's threads / RANKS
threads, and the MPI runtime's resident bytes.  Each collective gets a latency (from the
sizes up to 4 KiB) and a bandwidth (from the sizes of 1 MiB and more, least relative
squares) in the terms of gpt2.perfmodel.collectives, stored in the profile's ``interconnect``.
"""
import argparse
import datetime
import errno
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np

from . import collectives
from .graph import BF16_CURVE, step_graph
from .hardware import (BF16_VARIANT, EfficiencyCurve, HardwareProfile, Interconnect, cpu_identity, load_profile,
                       profile_cache_dir, resolve_threads, save_profile, shape_key, this_machine_name,
                       this_machine_path, this_machine_profile)
from .spec import ModelSpec, ParallelConfig, Workload
from ..units import median_times

GPT2_124M = ModelSpec(12, 12, 768, 50257)
FULL_CONFIGS = ((1, 64), (4, 64), (4, 256))
# What a calibration runs: GPT-2 124M's shapes at these (B, T), repeats per figure, the
# side of the square sgemm for the peak, the largest array of the bandwidth curve (log2
# bytes), and the disk probe's bytes.  The quick one (first use: about 28 s on the 2-core
# Zen 3 VM, 6.5 of them the products at 128 and 512 rows; the full one, link probe
# included, 77 s) keeps the shapes and sizes: the curves are tables (a product shape's by
# rows, the others by FLOPs or bytes), and a size left out is interpolated from its
# neighbours.
# The physical peak's loops run ``peak_seconds`` per repeat (the best of ``repeats``).
FULL = {"configs": FULL_CONFIGS, "repeats": 7, "peak_size": 2048, "peak_seconds": 0.1, "max_array": 28,
        "disk_bytes": 1024 << 20}
QUICK = {"configs": FULL_CONFIGS, "repeats": 3, "peak_size": 2048, "peak_seconds": 0.05, "max_array": 28,
         "disk_bytes": 256 << 20}


def _set_threads(n):
    """Use ``n`` threads (None: the default); returns (count in force, previous count)."""
    from kernels import threads
    previous = threads.get_num_threads()
    return threads.set_num_threads(n), previous


def measure_peak(size, repeats):
    """sgemm throughput of a large square product through the kernels' own path
    (kernels.gemm: our OpenMP threads, BLAS single-threaded on each block)."""
    from kernels.gemm import gemm_rowmajor
    rng = np.random.default_rng(0)
    a, b = _random(rng, size, size), _random(rng, size, size)
    c = _array(a.shape)
    t = median_times({"peak": lambda: gemm_rowmajor(c, a, b, trans_b=True)}, repeats)["peak"]
    return 2.0 * size ** 3 / t


def measure_bf16_peak(size, repeats):
    """FLOP/s of the same large square product with bf16 operands and float32 sums, through
    the kernels the bf16 mode runs (kernels.bf16.matmul_forward_bf16, operands converted
    beforehand: the model charges the conversions apart); None where kernels.bf16 is not
    built.  Where the CPU has no bf16 instructions this is the emulated path's rate."""
    try:
        from kernels import bf16
    except ImportError:
        return None
    rng = np.random.default_rng(0)
    a, b = _random(rng, size, size), _random(rng, size, size)
    ab, bb = _array(a.shape, np.uint16), _array(b.shape, np.uint16)
    bf16.to_bf16(ab, a)
    bf16.to_bf16(bb, b)
    c = _array(a.shape)
    t = median_times({"peak": lambda: bf16.matmul_forward_bf16(c, ab, bb, None)}, repeats)["peak"]
    return 2.0 * size ** 3 / t


def measure_physical_peak(threads, seconds, repeats):
    """({precision: FLOP/s} of the cores' register-only multiply-add loops on ``threads``
    threads, kernels.peak.physical_peak's figures in GFLOP/s); ({}, a note) where the
    kernels have no loop for this CPU or kernels.peak is not built."""
    try:
        from kernels import peak
    except ImportError:
        return {}, {"note": "kernels.peak not built: MFU against the sgemm peak"}
    figures = peak.physical_peak(threads, seconds, repeats)
    flops = {p: figures[f"{p}_peak_gflops"] * 1e9 for p in ("fp32", "bf16") if figures[f"{p}_peak_gflops"]}
    if not flops:
        figures["note"] = "no register-only loop for this CPU: MFU against the sgemm peak"
    return flops, figures


def _array(shape, dtype=np.float32, fill=None):
    """A 64-byte aligned array (adtape.buffers, numpy's where adtape is not built), as the
    training's arenas and buffers are, filled with ``fill`` where given.  With numpy's own
    16-byte alignment a GPT-2 block's kernels took 20.4 ms against 15.5 aligned at
    B=2, T=32 (Zen 4, 2 threads), and the products measured here were the slower ones."""
    try:
        from adtape import buffers
        out = buffers.empty(tuple(shape), dtype)
    except ImportError:
        out = np.empty(shape, dtype)
    if fill is not None:
        out[...] = fill
    return out


def _random(rng, *shape):
    """A float32 array of standard normal values at the speed of a copy: one random block of
    64 Ki values repeated (the timings need values that are not constant, not independent
    ones, and drawing hundreds of millions would take seconds); aligned (``_array``)."""
    out = _array(shape)
    flat = out.reshape(-1)
    block = rng.standard_normal(min(1 << 16, flat.size), dtype=np.float32)
    whole = flat.size - flat.size % block.size
    flat[:whole].reshape(-1, block.size)[:] = block
    flat[whole:] = block[:flat.size - whole]
    return out


def _gemm_task(variant, rows, fan_in, fan_out, rng):
    """A callable running one product of the matmul (rows, fan_in) x (fan_in, fan_out):
    the forward one, or the input's or the weight's gradient."""
    from kernels.gemm import gemm_rowmajor
    if variant == "fwd":
        inp, weight = _random(rng, rows, fan_in), _random(rng, fan_out, fan_in)
        out = _array((rows, fan_out))
        return lambda: gemm_rowmajor(out, inp, weight, trans_b=True)
    if variant == "bwd_input":
        dout, weight = _random(rng, rows, fan_out), _random(rng, fan_out, fan_in)
        dinp = _array((rows, fan_in))
        return lambda: gemm_rowmajor(dinp, dout, weight)
    dout, inp = _random(rng, rows, fan_out), _random(rng, rows, fan_in)
    dweight = _array((fan_out, fan_in))
    return lambda: gemm_rowmajor(dweight, dout, inp, trans_a=True)


def matmul_shapes(spec, configs):
    """{(variant, rows, fan_in, fan_out): flops} of every matmul in the step at ``configs``,
    and of the same products at each power of two of rows between the fewest and the most
    the configs have: the kernels change with the rows (on the Zen 3 the forward takes the
    W-broadcast kernel up to 128 rows, the packed GEMM to 256, BLAS beyond), so a curve
    by rows through 64, 256 and 1024 alone missed the 128-row step by 33%."""
    shapes = {}
    for b, t in configs:
        for op in step_graph(spec, Workload(b, t), ParallelConfig()):
            if op.op_class == "matmul":
                shapes[(op.variant,) + tuple(int(d) for d in op.dims)] = op.gemm_flops
    if shapes:
        fewest, most = min(key[1] for key in shapes), max(key[1] for key in shapes)
        grid = [1 << e for e in range(most.bit_length()) if fewest < 1 << e < most]
        for variant, _, fan_in, fan_out in list(shapes):
            for r in grid:
                shapes.setdefault((variant, r, fan_in, fan_out), 2.0 * r * fan_in * fan_out)
    return shapes


def _bf16_tasks(rows, fan_in, fan_out, rng):
    """{kind: callable} of one linear layer's bf16 products as --precision bf16 runs them
    (kernels.bf16; the input and weight converted beforehand, as the model charges their
    conversions apart): "fwd", the whole backward ("bwd": the input's and the weight's
    gradients in one call, as a step makes it) and the rounding of dout to bf16 that the
    backward makes ("round_dout")."""
    from kernels import bf16
    inp, weight, dout = _random(rng, rows, fan_in), _random(rng, fan_out, fan_in), _random(rng, rows, fan_out)
    inp16, weight16, dout16 = (_array(a.shape, np.uint16) for a in (inp, weight, dout))
    bf16.to_bf16(inp16, inp)
    bf16.to_bf16(weight16, weight)
    out, dinp, dweight = _array((rows, fan_out)), _array((rows, fan_in)), _array((fan_out, fan_in))
    return {"fwd": lambda: bf16.matmul_forward_bf16(out, inp16, weight16, None),
            "bwd": lambda: bf16.matmul_backward_bf16(dinp, dweight, None, dout, inp16, weight16, overwrite=True),
            "round_dout": lambda: bf16.to_bf16(dout16, dout)}


def _bf16_product_times(times, layer):
    """{variant: seconds} of one layer's bf16 products from its ``_bf16_tasks`` timings
    (``times[(layer, kind)]``): the forward's, and each backward product half of the
    whole backward without its rounding of dout (the model charges that as the input
    gradient's conversion).  Timing the input's gradient alone and taking the weight's
    as the rest gave 0.37-1.10 of the peak for the two 64-row products of one layer
    (Zen 4): the difference of two short calls is noise."""
    t = {kind: times[(layer, kind)] for kind in ("fwd", "bwd", "round_dout")}
    half = 0.5 * max(t["bwd"] - t["round_dout"], 0.5 * t["bwd"])
    return {"fwd": t["fwd"], "bwd_input": half, "bwd_weight": half}


def measure_matmuls(spec, configs, peak, repeats, bf16_peak=None):
    """({variant: curve by FLOPs}, {variant: {shape: curve by rows}}, {product: FLOP/s}).

    With ``bf16_peak`` (kernels.bf16 built) the same shapes with bf16 operands too, as
    shares of it, under the variants' bf16 names ("fwd_bf16", ...: hardware.BF16_VARIANT):
    at 64-512 rows on Zen 4 those products reach 55-85% of the bf16 peak where float32's
    reach 66-91% of theirs, and the shared curves predicted the bf16 steps 8-10% fast."""
    rng = np.random.default_rng(1)
    shapes = matmul_shapes(spec, configs)
    tasks = {key: _gemm_task(*key, rng) for key in shapes}
    layers = sorted({key[1:] for key in shapes}) if bf16_peak else []
    for layer in layers:
        for kind, task in _bf16_tasks(*layer, rng).items():
            tasks[(layer, kind)] = task
    times = median_times(tasks, repeats)
    samples = [(key, flops, times[key], peak) for key, flops in shapes.items()]
    for layer in layers:
        for variant, seconds in _bf16_product_times(times, layer).items():
            flops = 2.0 * layer[0] * layer[1] * layer[2]
            samples.append(((variant + BF16_VARIANT,) + layer, flops, seconds, bf16_peak))
    points, by_shape = defaultdict(list), defaultdict(lambda: defaultdict(list))
    rates = {}
    for key, flops, seconds, top in samples:
        efficiency = flops / (seconds * top)
        points[key[0]].append((flops, efficiency))
        by_shape[key[0]][shape_key(key[2], key[3])].append((key[1], efficiency))
        rates[f"{key[0]} {key[1]}x{key[2]}x{key[3]}"] = flops / seconds
    return ({variant: _curve(pts) for variant, pts in points.items()},
            {variant: {shape: _curve(pts) for shape, pts in shapes_.items()} for variant, shapes_ in by_shape.items()},
            rates)


def _curve(points):
    """A table curve through the measured points (same sizes averaged), plus a saturating fit."""
    merged = defaultdict(list)
    for size, eff in points:
        merged[size].append(eff)
    pts = sorted((s, float(np.mean(e))) for s, e in merged.items())
    best = max(e for _, e in pts)
    # Saturating fit for extrapolation: half_size where the curve crosses half of the best.
    below = [s for s, e in pts if e < best / 2]
    half = float(max(below)) if below else 0.0
    return EfficiencyCurve(max_efficiency=min(best, 64.0), half_size=half, points=tuple(pts))


# Below this many bytes one thread copies (adtape/_parcopy.pyx's PAR_COPY_MIN): a team
# costs more than it saves.
PARALLEL_COPY_MIN = 1 << 20


def measure_memory(sizes, repeats, threads=1):
    """Copy bandwidth (bytes read + written per second) by array size; returns (peak bw, curve).

    From PARALLEL_COPY_MIN bytes up the copy is split over ``threads`` OpenMP threads as
    the tape's copies and the kernels' streaming loops are (adtape._parcopy: one core
    reaches only part of the machine's bandwidth); below, one thread copies.  (Threads of
    a Python pool, as before, cost tens of microseconds a task to start: at 16 threads a
    4 MiB copy read as 4 GB/s, and every conversion of a bf16 step was charged that.)"""
    from concurrent.futures import ThreadPoolExecutor
    try:
        from adtape._parcopy import copy as par_copy
    except ImportError:         # the sources unbuilt: a pool of Python threads
        par_copy = None
    tasks = {}
    with ThreadPoolExecutor(threads) as pool:
        for n in sizes:
            src = _array((n // 4,), fill=1.0)
            dst = _array((n // 4,))
            if n < PARALLEL_COPY_MIN or threads == 1:
                tasks[n] = (lambda s=src, d=dst: np.copyto(d, s))
            elif par_copy is not None:
                tasks[n] = (lambda s=src, d=dst: par_copy(d, s))
            else:
                bounds = np.linspace(0, src.size, threads + 1).astype(int)
                parts = [(dst[a:b], src[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
                tasks[n] = (lambda parts=parts: list(pool.map(lambda part: np.copyto(*part), parts)))
        times = median_times(tasks, repeats)
    bw = {n: 2.0 * n / times[n] for n in sizes}
    dram = bw[max(sizes)]
    return dram, _curve([(2.0 * n, bw[n] / dram) for n in sizes])


def measure_overheads(repeats):
    """(seconds per tiny kernel call, seconds per tape record pushed and popped, sources)."""
    small = np.ones(8, np.float32)
    out = np.empty_like(small)
    sources = {}
    try:
        from kernels import layers
        call = lambda: layers.residual_forward(out, small, small)   # noqa: E731
        sources["op_overhead"] = "kernels.layers.residual_forward on 8 floats"
    except ImportError:
        call = lambda: np.add(small, small, out=out)   # noqa: E731
        sources["op_overhead"] = "numpy.add on 8 floats (kernels not built)"
    inner = 200

    def calls():
        for _ in range(inner):
            call()
    overhead = median_times({"call": calls}, repeats)["call"] / inner
    tape_cost = 0.0
    try:
        import adtape
        tape = adtape.Tape(dtype=np.float32)

        def records():
            for _ in range(inner):
                tape.push_array(small)
            for _ in range(inner):
                tape.pop_array()
        tape_cost = median_times({"tape": records}, repeats)["tape"] / inner
        tape.close()
        sources["tape_overhead"] = "adtape.Tape push_array + pop_array of 8 floats"
    except ImportError:
        sources["tape_overhead"] = "adtape not built: 0"
    return overhead, tape_cost, sources


def _kernel_tasks(spec, b, t, rng):
    """{(op name, phase): callable} running our kernels at the shapes of one (B, T)."""
    from kernels import layers
    C, N, F, nh = spec.n_embd, b * t, spec.ffn_hidden, spec.n_head
    f = lambda *shape: _random(rng, *shape)   # noqa: E731
    x, y, dx = f(b, t, C), _array((b, t, C)), f(b, t, C)
    w, bias, dw, db = f(C), f(C), _array((C,), fill=0.0), _array((C,), fill=0.0)
    mean, rstd = _array((b, t)), _array((b, t))
    layers.layernorm_forward(y, mean, rstd, x, w, bias)
    h, hy, dh = f(b, t, F), _array((b, t, F)), f(b, t, F)
    ids = rng.integers(0, spec.vocab_size, (b, t), dtype=np.int32)
    wte, wpe = f(spec.padded_vocab, C), f(spec.block_size, C)
    dwte, dwpe = _array(wte.shape, fill=0.0), _array(wpe.shape, fill=0.0)
    tasks = {
        ("ln1", "fwd"): lambda: layers.layernorm_forward(y, mean, rstd, x, w, bias),
        ("ln1", "bwd"): lambda: layers.layernorm_backward(dx, dw, db, y, x, w, mean, rstd),
        ("gelu", "fwd"): lambda: layers.gelu_forward(hy, h),
        ("gelu", "bwd"): lambda: layers.gelu_backward(dh, h, hy),
        ("residual1", "fwd"): lambda: layers.residual_forward(y, x, dx),
        ("residual1", "bwd"): lambda: layers.residual_backward(dx, y, x),
        ("encoder", "fwd"): lambda: layers.encoder_forward(y, ids, wte, wpe),
        ("encoder", "bwd"): lambda: layers.encoder_backward(dwte, dwpe, x, ids),
    }
    try:
        from kernels import attention
        qkv, dqkv = f(b, t, 3 * C), _array((b, t, 3 * C), fill=0.0)
        qkv *= np.float32(0.1)
        att_lse, out = _array((b, nh, t)), _array((b, t, C))
        attention.attention_forward(out, att_lse, qkv, nh)
        tasks[("attention", "fwd")] = lambda: attention.attention_forward(out, att_lse, qkv, nh)
        tasks[("attention", "bwd")] = lambda: attention.attention_backward(dqkv, x, qkv, out,
                                                                           att_lse, nh)
        # and with bf16 operands, as --precision bf16 runs it (its own curves)
        tasks[("attention" + BF16_CURVE, "fwd")] = lambda: attention.attention_forward(
            out, att_lse, qkv, nh, precision="bf16")
        tasks[("attention" + BF16_CURVE, "bwd")] = lambda: attention.attention_backward(
            dqkv, x, qkv, out, att_lse, nh, precision="bf16")
    except ImportError:
        pass
    try:
        from kernels import loss
        V, Vp = spec.vocab_size, spec.padded_vocab
        logits, dlogits = f(b, t, Vp), _array((b, t, Vp), fill=0.0)
        losses, lse, dlosses = _array((b, t)), _array((b, t)), _array((b, t), fill=1.0 / N)
        tasks[("loss", "fwd")] = lambda: loss.softmax_crossentropy_forward(losses, lse, logits, ids, V)
        tasks[("loss", "bwd")] = lambda: loss.softmax_crossentropy_backward(dlogits, dlosses, logits, lse, ids, V)
        loss.softmax_crossentropy_forward(losses, lse, logits, ids, V)
    except ImportError:
        pass
    return tasks


def _optimizer_tasks(spec, rng):
    try:
        from kernels import optim
    except ImportError:
        return {}, 0
    n = spec.num_parameters()
    p, g = _random(rng, n), _random(rng, n)
    g *= np.float32(1e-3)
    m, v = _array((n,), fill=0.0), _array((n,), fill=0.0)
    return {("adamw", "optim"): lambda: optim.adamw_step(p, g, m, v, 1, 1e-4, weight_decay=0.1)}, n


def measure_kernels(spec, configs, peak, overhead, repeats):
    """{op_class.phase: EfficiencyCurve by FLOPs} from our kernels at the configs' shapes."""
    try:
        import kernels.layers   # noqa: F401
    except ImportError:
        return {}, ["kernels.layers not built: no kernel curves"]
    rng = np.random.default_rng(2)
    points, notes = defaultdict(list), []
    opt_tasks, _ = _optimizer_tasks(spec, rng)
    # Every config's kernels in one interleaved run: measured config after config, a
    # slow stretch of a shared machine fell on one config's points alone and bent the
    # curves (the 2-core Zen 3 VM: attention's backward at (4, 256) timed at 52 ms
    # where it takes 14-17, so every longer attention was predicted 3.5x slow).
    ops, tasks = {}, {}
    for b, t in configs:
        ops.update({(b, t) + (op.name, op.phase): op
                    for op in step_graph(spec, Workload(b, t), ParallelConfig()) if op.layer in (-1, 0)})
        tasks.update({(b, t) + key: task for key, task in _kernel_tasks(spec, b, t, rng).items()})
        tasks.update({(b, t) + key: task for key, task in opt_tasks.items()} if (b, t) == configs[0] else {})
    for (b, t, name, phase), seconds in median_times(tasks, repeats).items():
        bf16 = name.endswith(BF16_CURVE)
        op = ops[(b, t, name[:-len(BF16_CURVE)] if bf16 else name, phase)]
        if op.flops <= 0:
            continue
        work = max(seconds - overhead, seconds * 0.05)
        points[f"{op.op_class}{BF16_CURVE if bf16 else ''}.{'fwd' if op.phase == 'fwd' else op.phase}"].append(
            (op.flops, op.flops / (peak * work)))
    for missing in ("attention", "loss", "optimizer"):
        if not any(k.startswith(missing) for k in points):
            notes.append(f"kernels for {missing} not built: its ops use the default efficiency")
    return {k: _curve(v) for k, v in points.items()}, notes


def _open_direct(path, buf):
    """``path`` opened for reading and writing with O_DIRECT, or None where the file system
    refuses it (EINVAL at the open, or at the first write)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except AttributeError:
        return None
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return None
    try:
        os.pwrite(fd, buf, 0)
    except OSError as exc:
        os.close(fd)
        if exc.errno != errno.EINVAL:
            raise
        return None
    return fd


def measure_disk(path, max_bytes, max_seconds=10.0, chunk=4 << 20):
    """(write bytes/s, read bytes/s, method) of sequential I/O in ``path``, of the device and not
    of memory.

    Writes then reads back a file of up to ``max_bytes`` (fewer if ``max_seconds`` pass
    first) in ``chunk``-byte requests with O_DIRECT, from page-aligned buffers; where the
    filesystem refuses O_DIRECT (tmpfs), buffered writes timed through fsync and reads
    after the file's pages are dropped from the page cache (posix_fadvise DONTNEED).
    A short read, or a last block that differs from what was written, raises OSError.
    """
    wbuf, rbuf = mmap.mmap(-1, chunk), mmap.mmap(-1, chunk)   # page-aligned, as O_DIRECT requires
    wbuf.write(os.urandom(chunk))
    fd, name = tempfile.mkstemp(dir=path, prefix="adtape-disk-probe-")
    os.close(fd)
    try:
        fd = _open_direct(name, wbuf)
        method = "O_DIRECT"
        if fd is None:
            method = "fsync + fadvise(DONTNEED)"
            fd = os.open(name, os.O_RDWR)
        try:
            written = 0
            t0 = time.perf_counter()
            while written < max_bytes and time.perf_counter() - t0 < max_seconds:
                written += os.pwrite(fd, wbuf, written)
            os.fsync(fd)
            write_rate = written / (time.perf_counter() - t0)
            if method != "O_DIRECT":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            for offset in range(0, written, chunk):
                if os.preadv(fd, [rbuf], offset) != chunk:
                    raise OSError(f"{name}: short read at offset {offset}")
            read_rate = written / (time.perf_counter() - t0)
        finally:
            os.close(fd)
        if rbuf[:] != wbuf[:]:
            raise OSError(f"{name}: the device returned other bytes than were written")
    finally:
        os.unlink(name)
        wbuf.close()
        rbuf.close()
    return write_rate, read_rate, method


# The product of the baseline probe: GPT-2's lm_head (a vocabulary-wide weight) at 1024
# tokens, whose backward fills the BLAS library's packing buffers as training's does
# (OpenBLAS maps 64 MiB and touches what the operands' sizes need: 38 MiB at 512 tokens,
# all of it from 1024 on this Zen 4).
BASELINE_GEMM = (1024, 768, 50257)     # tokens, input width, output width
BASELINE_MODEL = "tiny"                # the preset of the baseline's training step


def measure_baseline_rss(threads=None):
    """RSS of a fresh interpreter that imported the runtime and ran one training step of the
    tiny model and one lm_head-sized product forward and backward (so thread pools and
    BLAS buffers are in), less that model's arenas and the product's arrays."""
    code = ("import numpy as np, psutil\n"
            "from kernels import threads, matmul\n"
            f"threads.set_num_threads({threads!r})\n"
            "from gpt2.families import preset\n"
            "from gpt2.model import Model\n"
            f"model = Model(preset({BASELINE_MODEL!r}), seed=0)\n"
            "ids = np.zeros((1, 8), np.int32)\n"
            "model.train_step(ids, ids, lr=1e-4, weight_decay=0.1)\n"
            f"N, C, OC = {BASELINE_GEMM!r}\n"
            "x, w = np.full((N, C), 0.5, np.float32), np.full((OC, C), 0.5, np.float32)\n"
            "out, dx, dw = np.empty((N, OC), np.float32), np.empty((N, C), np.float32), np.empty((OC, C), np.float32)\n"
            "matmul.matmul_forward(out, x, w, None)\n"
            "matmul.matmul_backward(dx, dw, None, out, x, w, overwrite=True)\n"
            "arrays = sum(a.nbytes for a in (model.params, model.grads, model.adam_m, model.adam_v,\n"
            "                                x, w, out, dx, dw))\n"
            "print(psutil.Process().memory_info().rss - arrays)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.getcwd())
    return float(out.stdout.strip().splitlines()[-1])


class LinkUnavailable(RuntimeError):
    """The link between ranks cannot be measured here (no mpiexec, no mpi4py, the probe failed)."""


LINK_SMALL_BYTES = 4096          # latency from the sizes up to this
LINK_LARGE_BYTES = 1 << 20       # bandwidth from the sizes from this


def measure_link(ranks=2, threads=None, max_bytes=100 << 20, repeats=5, timeout=300):
    """The link probe's raw figures (gpt2.perfmodel.linkprobe's JSON) from ``mpiexec -n ranks``,
    each rank on ``threads`` threads (default: the cores shared among the ranks)."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise LinkUnavailable("mpiexec not found on PATH: install an MPI (e.g. apt-get install mpich) "
                              "and mpi4py to measure the link between ranks")
    try:
        import mpi4py   # noqa: F401
    except ImportError:
        raise LinkUnavailable("mpi4py is not installed: pip install 'adtape[mpi]' to measure the link "
                              "between ranks") from None
    if ranks < 2:
        raise ValueError(f"the link needs at least 2 ranks, got {ranks}")
    if threads is None:
        from kernels import threads as kthreads
        threads = max(1, kthreads.available_cores() // ranks)
    with tempfile.TemporaryDirectory() as tmp:
        output = os.path.join(tmp, "link.json")
        command = [mpiexec, "-n", str(ranks), sys.executable, "-m", "gpt2.perfmodel.linkprobe",
                   "--output", output, "--max-bytes", str(int(max_bytes)), "--repeats", str(repeats),
                   "--threads", str(threads)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        try:
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise LinkUnavailable(f"the link probe ({' '.join(command[:3])} ...) did not finish in "
                                  f"{timeout} s") from None
        if proc.returncode != 0 or not os.path.exists(output):
            raise LinkUnavailable(f"the link probe failed (exit status {proc.returncode}): "
                                  f"{proc.stderr.strip()[-800:]}")
        with open(output) as f:
            return json.load(f)


def fit_collective(name, points, ranks):
    """{"bandwidth", "latency"} of collective ``name`` over ``ranks`` from [(bytes, seconds)].

    In collectives.py's terms t = a * latency + b * bytes / bandwidth (all-reduce: a =
    2(p-1), b = 2(p-1)/p; reduce-scatter, all-gather: a = p-1, b = (p-1)/p): the latency
    from the median time of the sizes up to LINK_SMALL_BYTES, then the bandwidth that
    minimises the relative squared error over the sizes from LINK_LARGE_BYTES (the
    buckets' sizes: caches make mid sizes faster than the line through both ends), then
    both again with the small sizes' bandwidth term taken off.
    """
    model = {"all_reduce": collectives.all_reduce, "reduce_scatter": collectives.reduce_scatter,
             "all_gather": collectives.all_gather}[name]
    # The formula's coefficients, read off the formula itself: a = t(0 bytes of bandwidth
    # term) per unit latency, b = bandwidth term per byte at unit bandwidth.
    a = model(1, ranks, float("inf"), 1.0)
    b = model(1, ranks, 1.0, 0.0)
    small = [(n, t) for n, t in points if n <= LINK_SMALL_BYTES]
    large = [(n, t) for n, t in points if n >= LINK_LARGE_BYTES]
    if not small or not large:
        raise ValueError(f"{name}: the link fit needs sizes up to {LINK_SMALL_BYTES} B and from "
                         f"{LINK_LARGE_BYTES} B, got {sorted(n for n, _ in points)}")
    def bandwidth(latency):
        # Minimise sum(((a*latency + b*n*inv_bw) - t) / t)^2 over inv_bw: linear least squares.
        num = sum(b * n * (t - a * latency) / t ** 2 for n, t in large)
        den = sum((b * n / t) ** 2 for n, t in large)
        if not num > 0:
            raise ValueError(f"{name}: large transfers took no longer than the latency; cannot fit a bandwidth")
        return den / num

    latency = float(np.median([t for _, t in small])) / a
    bw = bandwidth(latency)
    # Once more with the small sizes' bandwidth term taken off their times.
    latency = max(0.0, float(np.median([t - b * n / bw for n, t in small]))) / a
    return {"bandwidth": bandwidth(latency), "latency": latency}


def link_from_probe(raw):
    """(Interconnect, rank_rates entry) from the link probe's raw figures."""
    ranks = raw["ranks"]
    fits = {name: fit_collective(name, points, ranks) for name, points in raw["collectives"].items()}
    # The overlap cost is a share of the fitted time of the buckets that were in flight,
    # so that cost x the model's collective time gives back the compute time they took.
    overlap = {}
    for name, o in raw["overlap"].items():
        bw, lat = fits[name]["bandwidth"], fits[name]["latency"]
        model = getattr(collectives, name)
        fitted = o["buckets"] * model(o["bytes"] / o["buckets"], ranks, bw, lat)
        overlap[name] = min(1.0, max(0.0, o["extra_s"] / fitted))
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    link = Interconnect(
        devices_per_node=ranks, intra_node_bandwidth=fits["all_reduce"]["bandwidth"],
        intra_node_latency=fits["all_reduce"]["latency"], collectives=fits,
        overlap_cost=overlap,
        runtime_rss=float(raw["runtime_rss"]), buffer_bytes_per_byte=dict(raw.get("buffers", {})),
        measured=f"python -m gpt2.perfmodel.calibrate --link-only at {now}: mpiexec -n {ranks}, "
                 f"{raw['threads']} thread(s) per rank")
    return link, {str(ranks): dict(raw["rank_rates"])}


def calibrate_link(profile, ranks=2, threads=None, max_bytes=100 << 20, repeats=5, timeout=300):
    """``profile`` with the link between ``ranks`` ranks on this machine measured."""
    raw = measure_link(ranks, threads, max_bytes, repeats, timeout)
    link, rates = link_from_probe(raw)
    calibration = dict(profile.calibration, link_probe=raw)
    return profile.with_changes(interconnect=link, rank_rates={**profile.rank_rates, **rates},
                                calibration=calibration)


def calibrate(threads=None, quick=False, spec=None, configs=None, repeats=None, spill_dir=None, progress=None):
    """Measure this machine with ``threads`` threads (restored afterwards); returns a HardwareProfile.

    ``quick``: the QUICK settings instead of FULL (fewer repeats, a smaller disk probe);
    ``spec`` and ``configs``: other shapes to time (tests use tiny ones); ``progress``:
    called with each phase's name as it starts.
    """
    threads, previous = _set_threads(threads)
    start = _cpu_seconds()
    try:
        profile = _calibrate(threads, quick, spec, configs, repeats, spill_dir, progress or (lambda phase: None))
    finally:
        _set_threads(previous)
    # Another process's work slows every figure down (an OpenMP team waits for its
    # descheduled thread): say so, where it happened, in the profile.
    elsewhere = _busy_elsewhere(start, _cpu_seconds())
    notes = list(profile.calibration["notes"])
    if elsewhere > BUSY_ELSEWHERE_NOTE:
        notes.append(f"other processes used {elsewhere:.0%} of the CPU during the calibration: its figures are "
                     f"slower than this machine when quiet; run python -m gpt2.perfmodel.calibrate again when it is")
    return profile.with_changes(calibration=dict(profile.calibration, busy_elsewhere=round(elsewhere, 3),
                                                 notes=notes))


# Share of the machine's CPU time that other processes may take during a calibration
# before the profile says its figures are too slow.
BUSY_ELSEWHERE_NOTE = 0.1


def _cpu_seconds():
    """(wall seconds, CPU seconds all processes have used, CPU seconds of this process and its
    finished children)."""
    import psutil
    machine = psutil.cpu_times()
    busy = sum(getattr(machine, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))
    own = psutil.Process().cpu_times()
    return time.perf_counter(), busy, own.user + own.system + own.children_user + own.children_system


def _busy_elsewhere(start, end):
    """The share of the machine's CPU capacity other processes (and the hypervisor) used
    between two ``_cpu_seconds()``."""
    import psutil
    wall, busy, own = (b - a for a, b in zip(start, end))
    return max(0.0, min(1.0, (busy - own) / (wall * (psutil.cpu_count() or 1)))) if wall > 0 else 0.0


def _calibrate(threads, quick, spec, configs, repeats, spill_dir, progress):
    import psutil
    settings = QUICK if quick else FULL
    spec = spec or GPT2_124M
    # The allocator as training sets it (gpt2.tape_engine, gpt2.train): freed blocks kept
    # for reuse.  With glibc's defaults the products' scratch (a 64-row input gradient's
    # per-thread buffers) was mapped and faulted in afresh at each call as the shapes
    # took turns: Zen 4, 2 threads, 64 x 768 x 2304 dout @ W measured 127 GFLOP/s
    # interleaved against 170 with the training's setting, and the step at (1, 64) was
    # predicted 412 ms against 340 measured.
    from kernels import _openmp
    _openmp.set_malloc_retention()
    configs = tuple(configs or settings["configs"])
    repeats = repeats or settings["repeats"]
    progress("peak")
    peak = measure_peak(settings["peak_size"], repeats)
    bf16_peak = measure_bf16_peak(settings["peak_size"], repeats)
    physical, physical_figures = measure_physical_peak(threads, settings["peak_seconds"], min(repeats, 5))
    progress("matmuls")
    matmul_curves, shape_curves, gemm_rates = measure_matmuls(spec, configs, peak, repeats, bf16_peak)
    progress("memory")
    bandwidth, memory_curve = measure_memory([1 << k for k in range(14, settings["max_array"] + 1, 2)], repeats,
                                             threads)
    progress("overheads")
    overhead, tape_cost, sources = measure_overheads(repeats)
    progress("kernels")
    kernel_curves, notes = measure_kernels(spec, configs, peak, overhead, repeats)
    spill_dir = os.path.abspath(spill_dir or tempfile.gettempdir())
    progress("disk")
    disk_write, disk_read, disk_method = measure_disk(spill_dir, settings["disk_bytes"])
    progress("baseline RSS")
    baseline = measure_baseline_rss(threads)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    identity = cpu_identity()
    return HardwareProfile(
        name=this_machine_name(threads, identity), kind="cpu",
        source=f"measured by python -m gpt2.perfmodel.calibrate{' --quick' if quick else ''} at {now} on "
               f"{identity['model_name']}, {threads} threads",
        peak_flops={"fp32": peak, **({"bf16": bf16_peak} if bf16_peak else {})}, memory_bandwidth=bandwidth,
        memory_capacity=float(psutil.virtual_memory().total), matmul_efficiency=matmul_curves,
        matmul_shape_efficiency=shape_curves,
        memory_efficiency=memory_curve, op_overhead=overhead, tape_overhead=tape_cost,
        disk_write_bandwidth=disk_write, disk_read_bandwidth=disk_read,
        threads=threads, sram_bytes=0.0, baseline_rss=baseline, interconnect=Interconnect(),
        kernel_efficiency=kernel_curves, physical_peak_flops=physical,
        calibration={"time": now, "cpu": identity, "threads": threads, "quick": quick, "repeats": repeats,
                     "model": [spec.n_layer, spec.n_head, spec.n_embd, spec.vocab_size],
                     "configs": [list(c) for c in configs], "sgemm_flops_per_s": gemm_rates,
                     "physical_peak": physical_figures,
                     "sources": sources, "notes": notes, "spill_dir": spill_dir, "disk_method": disk_method})


def calibrate_once(threads, stream, path):
    """The quick calibration that the first use of ``this-machine`` runs (see
    hardware.this_machine_profile): writes ``path``, announcing it as it goes in one line on
    text ``stream`` (and a line per note, e.g. that the machine was busy)."""
    def say(text):
        stream.write(text)
        stream.flush()
    t0 = time.perf_counter()
    say(f"calibrating this machine for the performance model (once, ~30 s, {threads} thread"
        f"{'s' if threads > 1 else ''}): ")
    try:
        run_quick_calibration(threads, path, lambda phase: say(f"{phase}... "))
    except BaseException:
        say("failed\n")
        raise
    say(f"done in {time.perf_counter() - t0:.0f} s, kept in {path}\n")
    for note in load_profile(path).calibration.get("notes", []):
        say(f"note: {note}\n")


PHASE_PREFIX = "phase: "


def run_quick_calibration(threads, path, progress):
    """``python -m gpt2.perfmodel.calibrate --quick`` for ``threads`` threads into ``path``, in a
    child process: the calibration's arrays (gigabytes) and thread pools stay out of this
    process, whose peak RSS a training run under --max-memory measures.  ``progress`` is
    called with each phase's name; a failure raises RuntimeError with the child's errors."""
    command = [sys.executable, "-m", "gpt2.perfmodel.calibrate", "--quick", "--threads", str(threads),
               "--output", path, "--progress", "names"]
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as child:
        errors = []
        for line in child.stderr:
            if line.startswith(PHASE_PREFIX):
                progress(line[len(PHASE_PREFIX):].rstrip("\n"))
            else:
                errors.append(line)
    if child.returncode != 0:
        raise RuntimeError(f"the calibration of this machine ({' '.join(command[1:5])} ...) failed with exit "
                           f"status {child.returncode}: {''.join(errors).strip()[-800:]}")


def calibrate_disk(profile, spill_dir=None):
    """``profile`` with the spill device's rates (in ``spill_dir``) and the baseline RSS (with its
    threads) measured afresh: what the memory planner needs, in well under a minute."""
    spill_dir = os.path.abspath(spill_dir or tempfile.gettempdir())
    disk_write, disk_read, disk_method = measure_disk(spill_dir, FULL["disk_bytes"])
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    calibration = dict(profile.calibration, spill_dir=spill_dir, disk_method=disk_method, disk_time=now)
    return profile.with_changes(disk_write_bandwidth=disk_write, disk_read_bandwidth=disk_read,
                                baseline_rss=measure_baseline_rss(profile.threads or None),
                                calibration=calibration)


def describe_link(profile):
    """One line per measured collective, the overlap costs, the ranks' shares and the runtime's RSS."""
    link = profile.interconnect
    lines = [f"link ({link.measured}):"]
    for name, fit in sorted(link.collectives.items()):
        cost = link.overlap_cost.get(name)
        lines.append(f"  {name:<15} bandwidth {fit['bandwidth'] / 1e9:6.2f} GB/s   latency "
                     f"{fit['latency'] * 1e6:7.2f} us" + ("" if cost is None else
                                                          f"   in flight beside compute costs {cost:.0%} of its time"))
    for ranks, rates in sorted(profile.rank_rates.items()):
        lines.append(f"  {ranks} ranks x {rates['threads']} thread(s), all computing: sgemm "
                     f"{rates['sgemm_flops'] / 1e9:.1f} GFLOP/s, copy {rates['copy_bandwidth'] / 1e9:.2f} GB/s per rank")
    lines.append(f"  MPI runtime resident per rank: {link.runtime_rss / 2**20:.1f} MiB; temporary buffers per byte "
                 f"in flight: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(link.buffer_bytes_per_byte.items())))
    return "\n".join(lines)


def _bytes(text):
    from gpt2.units import parse_size
    return parse_size(text)


def _phase_lines(stream, names_only=False):
    """A ``progress`` for calibrate(): one line per phase on ``stream``, with the time so far,
    or (``names_only``) as run_quick_calibration reads them."""
    t0 = time.perf_counter()
    if names_only:
        return lambda phase: print(f"{PHASE_PREFIX}{phase}", file=stream, flush=True)
    return lambda phase: print(f"calibrate [{time.perf_counter() - t0:5.1f} s] {phase}...", file=stream, flush=True)


def _existing(path, threads):
    """The profile at ``path`` (--output), or this machine's for ``threads`` threads: the one
    --disk-only and --link-only update."""
    if path is not None:
        return load_profile(path)
    return this_machine_profile(threads, calibrate_if_missing=False)


def main(argv=None):
    if argv is None:
        from kernels import blas_dispatch
        blas_dispatch.ensure()      # a profile of the BLAS's right kernels
    p = argparse.ArgumentParser(prog="python -m gpt2.perfmodel.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None,
                   help="threads the profile is for: BLAS and OpenMP run with them (default: the kernels' "
                        "count, OMP_NUM_THREADS or all cores); --link-only shares them among the ranks")
    p.add_argument("--quick", action="store_true",
                   help="fewer (B, T) and repeats, 256 MB of disk, no link (~30 s on two cores): what the "
                        "first use of this-machine runs")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--output", default=None,
                   help="profile file to write (default: this machine's in the cache, "
                        f"{os.path.join(profile_cache_dir(), '<cpu>-<digest>-<threads>t.json')})")
    p.add_argument("--spill-dir", default=None,
                   help="directory whose device the tape spills to (default: the system temp dir)")
    p.add_argument("--disk-only", action="store_true",
                   help="re-measure only the spill device's rates and the baseline RSS in the existing profile")
    p.add_argument("--link-only", action="store_true",
                   help="measure only the link between --ranks ranks on this machine (mpiexec, mpi4py; about "
                        "a minute) and each rank's share of the machine, into the existing profile")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the link measurement (default 2)")
    p.add_argument("--link-max-bytes", type=_bytes, default=100 << 20,
                   help="largest collective of the link measurement (default 100M)")
    p.add_argument("--link-timeout", type=int, default=300, help="seconds the link measurement may take")
    p.add_argument("--progress", choices=("lines", "names"), default="lines", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")
    if args.spill_dir is not None and not os.path.isdir(args.spill_dir):
        raise SystemExit(f"error: --spill-dir {args.spill_dir!r} is not a directory")
    threads = resolve_threads(args.threads)
    output = args.output or this_machine_path(threads)
    progress = _phase_lines(sys.stderr, names_only=args.progress == "names")
    if args.link_only:
        try:
            profile = _existing(args.output, threads)
            progress(f"link (mpiexec -n {args.ranks})")
            profile = calibrate_link(profile, args.ranks, max(1, profile.threads // args.ranks), args.link_max_bytes,
                                     args.repeats or 5, args.link_timeout)
        except (FileNotFoundError, ValueError, LinkUnavailable) as exc:
            raise SystemExit(f"error: {exc}") from None
        save_profile(profile, output)
        print(describe_link(profile))
        print(f"wrote {output}")
        return 0
    if args.disk_only:
        try:
            profile = _existing(args.output, threads)
            progress(f"disk and baseline RSS ({profile.threads} threads)")
            profile = calibrate_disk(profile, args.spill_dir)
        except (FileNotFoundError, ValueError) as exc:
            raise SystemExit(f"error: {exc}") from None
    else:
        profile = calibrate(threads, args.quick, repeats=args.repeats, spill_dir=args.spill_dir, progress=progress)
        if not args.quick:
            try:
                progress(f"link (mpiexec -n {args.ranks})")
                profile = calibrate_link(profile, args.ranks, max(1, threads // args.ranks), 100 << 20, 5,
                                         args.link_timeout)
            except LinkUnavailable as exc:
                notes = profile.calibration["notes"] + [f"link between ranks not measured: {exc}"]
                profile = profile.with_changes(calibration=dict(profile.calibration, notes=notes))
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    save_profile(profile, output)
    physical = ", ".join(f"{p} {v / 1e9:.1f}" for p, v in profile.physical_peak_flops.items())
    bf16 = profile.peak_flops.get("bf16")
    print(f"physical peak {physical or 'not measured'} GFLOP/s, peak sgemm {profile.peak('fp32') / 1e9:.1f} "
          f"GFLOP/s, bf16 product {f'{bf16 / 1e9:.1f} GFLOP/s' if bf16 else 'not measured'}, copy bandwidth "
          f"{profile.memory_bandwidth / 1e9:.2f} GB/s, kernel call {profile.op_overhead * 1e6:.2f} us, "
          f"tape record {profile.tape_overhead * 1e6:.2f} us, spill write {profile.disk_write_bandwidth / 1e9:.2f} "
          f"GB/s, read {profile.disk_read_bandwidth / 1e9:.2f} GB/s ({profile.calibration['disk_method']}, "
          f"{profile.calibration['spill_dir']}), baseline RSS {profile.baseline_rss / 2**20:.0f} MiB "
          f"({profile.threads} threads)")
    if profile.interconnect.measured:
        print(describe_link(profile))
    for note in profile.calibration.get("notes", []):
        print(f"note: {note}")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
