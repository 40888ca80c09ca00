"""Stress benchmark of adtape.Tape against baselines measured in the same run.

  python bench/tape_stress.py [--quick] [--rounds N]

Sections (BENCHMARKS.md, "Tape"):
- cython: ns per push and per pop of float64 from a nogil loop (adtape._bench.push_pop_ns),
  for a tape that stays in the small buffer and one spread over many slabs, lock on and
  off, beside a NumPy array grown by doubling, a C array with its top index in a local
  (the same fast path without the memory round trip of the tape's top pointer) and one
  atomic exchange + release store per op (the floor of any lock);
- python: ns per push and per pop from a Python loop, beside list.append/list.pop, a
  NumPy array grown by doubling driven from Python, and an extension type whose
  push/pop only convert the float (the cost of the call itself);
- bulk: bytes/s of push_many/pop_many of 64 KiB and 1 MiB arrays, beside slice copies
  into and out of a NumPy array grown by doubling;
- spill: a tape 8x larger than its memory budget, scalar (nogil) and bulk, against the
  same run without a budget, each case in a fresh process so its peak RSS is its own:
  bytes/s, prefetch hits/misses, the tape's I/O counters (time pops waited on reads,
  time pushes waited on writes, bytes written and read), peak RSS growth (kernel VmHWM
  and psutil samples) and the tape's peak_resident_bytes next to the budget; beside
  them, interleaved, a probe of the spill device: a sequential write then read of as
  many bytes in the spill directory, with O_DIRECT (or, where the file system refuses
  it, fsync and posix_fadvise(DONTNEED) before the read), so the rates are the
  device's and not the page cache's; the spilled pop rate is reported as a share of
  the device's read rate and the push rate as a share of its write rate;
- machine: page-fault cost of fresh memory, memcpy, pwrite/pread of 1 MiB blocks in the
  spill directory, the floors under cold pushes and spilled pops on this machine;
- threads: 1, 2, 4, 8 OS threads on one shared locked tape and on per-thread unlocked
  tapes: total ops/s, then the invariant (no entry lost or duplicated; exact LIFO per
  thread).

Every timing is the median of ``--rounds`` samples (default 7, at least 5; twice that
plus one for the short in-process sections) taken after a warm-up round, variants
interleaved within a round (order reversed every other round); ratios are medians of
same-round pairs.
Prints a table and the verdict on each target, writes bench/results/tape_stress.json
(one record per case with raw samples) and bench/results/tape_stress.png (--quick:
tape_stress_quick.json/.png, so a short run does not replace the full one).
"""
import argparse
import json
import mmap
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import _paths  # noqa: E402,F401  (import order: installed packages, source, bench/)

from adtape import Tape, _bench, _bench_stress  # noqa: E402
from gpt2.perfmodel.calibrate import measure_disk  # noqa: E402
from harness import RssSampler, interleave, reset_vm_hwm, vm_hwm  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
MiB = 1 << 20

# Sizes per mode.  "small" fits the inline buffer (sbo_size=256 float64 = 2 KiB);
# "slabs" spreads over many 1 MiB slabs; spill data is SPILL_FACTOR x the budget.
SBO = 256
SPILL_FACTOR = 8
SIZES = {
    "full": {"cy_ops": 1 << 22, "cy_slab_n": 1 << 22, "py_small_ops": 1 << 17,
             "py_slab_n": 1 << 21, "bulk_bytes": 64 * MiB, "spill_budget": 32 * MiB,
             "thread_ops": 1 << 24},
    "quick": {"cy_ops": 1 << 20, "cy_slab_n": 1 << 21, "py_small_ops": 1 << 15,
              "py_slab_n": 1 << 19, "bulk_bytes": 16 * MiB, "spill_budget": 8 * MiB,
              "thread_ops": 1 << 22},
}

TARGETS = {
    "cython_ns": 1.0,          # unlocked push or pop from Cython, in memory
    "cython_locked_ns": 4.0,   # with the lock, uncontended
    "python_ratio": 1.5,       # tape.push/pop over list.append/list.pop
    "bulk_Bps": 2e9,           # push_many / pop_many of 1 MiB arrays
    "spill_pop_share": 0.5,    # spilled pop speed over in-memory pop speed
    "spill_pop_device_share": 0.8,   # spilled bulk pop speed over the device's read rate
    "rss_over_budget": 1.10,   # peak RSS growth over the memory budget
}


# ---------------------------------------------------------------------------
# Measurement helpers
# ---------------------------------------------------------------------------

def interleaved(variants, rounds, warmup=1):
    """Run each variant once per round, in turn (harness.interleave: the order rotated
    every round); return {name: {metric: [samples]}}.  ``variants`` is a list of
    (name, fn); fn() returns a dict of numbers."""
    _, results = interleave(dict(variants), rounds, warmup)
    samples = {name: {} for name, _ in variants}
    for name, outs in results.items():
        for out in outs:
            for key, value in out.items():
                samples[name].setdefault(key, []).append(value)
    return samples


def med(values):
    return statistics.median(values)


def record(section, case, variant, samples, **extra):
    """One JSON record: medians of every metric, the raw samples, and extra fields."""
    rec = {"section": section, "case": case, "variant": variant}
    rec.update(extra)
    for key, values in samples.items():
        rec[key] = med(values)
        rec[key + "_samples"] = values
    return rec


def paired_ratio(a, b, key, b_key=None):
    """Median over rounds of a[key] / b[b_key or key], each pair taken in the same round."""
    return med([x / y for x, y in zip(a[key + "_samples"], b[(b_key or key) + "_samples"])])


def find(records, section, case, variant):
    for rec in records:
        if rec["section"] == section and rec["case"] == case and rec["variant"] == variant:
            return rec
    raise KeyError(f"no record {section}/{case}/{variant}")


# ---------------------------------------------------------------------------
# Cython: nogil push/pop loops
# ---------------------------------------------------------------------------

def bench_cython(sizes, rounds):
    records = []
    cases = [("small", SBO, sizes["cy_ops"] // SBO),
             ("slabs", sizes["cy_slab_n"], max(1, sizes["cy_ops"] // sizes["cy_slab_n"]))]
    for case, n, repeats in cases:
        unlocked = Tape(sbo_size=SBO, threadsafe=False)
        locked = Tape(sbo_size=SBO, threadsafe=True)
        doubling = _bench_stress.DoublingBuffer()

        def tape_fn(tape, lock, cursor=False):
            def run():
                push, pop = _bench.push_pop_ns(tape, n, repeats, locked=lock, cursor=cursor)
                return {"push_ns": push, "pop_ns": pop}
            return run

        def doubling_fn():
            push, pop = _bench_stress.doubling_push_pop_ns(doubling, n, repeats)
            return {"push_ns": push, "pop_ns": pop}

        def raw_fn():
            push, pop = _bench_stress.raw_array_push_pop_ns(n, repeats)
            return {"push_ns": push, "pop_ns": pop}

        def lock_fn():
            return {"pair_ns": _bench_stress.lock_floor_ns(n, repeats)}

        samples = interleaved([("tape_unlocked", tape_fn(unlocked, False)),
                               ("tape_cursor", tape_fn(unlocked, False, cursor=True)),
                               ("tape_locked", tape_fn(locked, True)),
                               ("numpy_doubling", doubling_fn),
                               ("raw_array", raw_fn),
                               ("lock_floor", lock_fn)], rounds)
        unlocked.push_many(np.zeros(n))
        slabs = unlocked.stats["n_slabs"]
        unlocked.pop_many(n)
        if (case == "small") != (slabs == 0):
            raise AssertionError(f"case {case}: {n} entries took {slabs} heap slabs")
        for name, s in samples.items():
            records.append(record("cython", case, name, s, n=n, repeats=repeats,
                                  heap_slabs=slabs if name.startswith("tape") else None))
        unlocked.close()
        locked.close()

    # Cold first fill: a fresh tape links slabs, a fresh doubling array copies itself
    # at every doubling; both fault in fresh pages.
    n = sizes["cy_slab_n"]

    def cold_tape():
        with Tape(sbo_size=SBO, threadsafe=False) as tape:
            push, pop = _bench.push_pop_ns(tape, n, 1, locked=False)
        return {"push_ns": push, "pop_ns": pop}

    def cold_doubling():
        push, pop = _bench_stress.doubling_push_pop_ns(_bench_stress.DoublingBuffer(), n, 1)
        return {"push_ns": push, "pop_ns": pop}

    samples = interleaved([("tape_unlocked", cold_tape), ("numpy_doubling", cold_doubling)], rounds)
    for name, s in samples.items():
        records.append(record("cython", "slabs_cold", name, s, n=n, repeats=1))
    return records


# ---------------------------------------------------------------------------
# Python: interpreted push/pop loops, each in the call form CPython specializes
# ---------------------------------------------------------------------------

class NumpyDoubling:
    """A float64 stack in one NumPy array that doubles when full, driven from Python."""
    __slots__ = ("data", "size")

    def __init__(self, capacity=16):
        self.data = np.empty(capacity, dtype=np.float64)
        self.size = 0

    def push(self, value):
        size = self.size
        if size == self.data.shape[0]:
            bigger = np.empty(2 * size, dtype=np.float64)
            bigger[:size] = self.data
            self.data = bigger
        self.data[size] = value
        self.size = size + 1

    def pop(self):
        self.size -= 1
        return self.data[self.size]

    def push_many(self, values):
        size, k = self.size, values.shape[0]
        if size + k > self.data.shape[0]:
            capacity = self.data.shape[0]
            while capacity < size + k:
                capacity *= 2
            bigger = np.empty(capacity, dtype=np.float64)
            bigger[:size] = self.data[:size]
            self.data = bigger
        self.data[size:size + k] = values
        self.size = size + k

    def pop_many(self, k):
        self.size -= k
        return self.data[self.size:self.size + k].copy()


def py_list(stack, values, repeats):
    clock = time.perf_counter_ns
    push = pop = 0
    for _ in range(repeats):
        t0 = clock()
        for v in values:
            stack.append(v)
        t1 = clock()
        for _ in values:
            last = stack.pop()
        pop += clock() - t1
        push += t1 - t0
        if last != values[0]:
            raise AssertionError("list returned a wrong value")
    return push, pop


def py_stack(stack, values, repeats, lifo=True):
    """The same loop for any object with push/pop; lifo=False for the call floors, which
    keep only the last value."""
    clock = time.perf_counter_ns
    push = pop = 0
    for _ in range(repeats):
        t0 = clock()
        for v in values:
            stack.push(v)
        t1 = clock()
        for _ in values:
            last = stack.pop()
        pop += clock() - t1
        push += t1 - t0
        if last != (values[0] if lifo else values[-1]):
            raise AssertionError(f"{type(stack).__name__} returned a wrong value")
    return push, pop


def bench_python(sizes, rounds):
    records = []
    cases = [("small", SBO, sizes["py_small_ops"] // SBO), ("slabs", sizes["py_slab_n"], 1)]
    for case, n, repeats in cases:
        # A few thousand distinct float objects, cycled: the loop reads values that are
        # hot in cache, as values just computed are, for every container alike.
        hot = [float(i) for i in range(4096)]
        values = [hot[i % 4096] for i in range(n)]
        stacks = {"list": [], "tape_unlocked": Tape(sbo_size=SBO, threadsafe=False),
                  "tape_locked": Tape(sbo_size=SBO, threadsafe=True), "numpy_doubling": NumpyDoubling(),
                  "call_floor": _bench_stress.CallFloor(),
                  "call_floor_positional": _bench_stress.CallFloorPositional()}

        def fn(name):
            def run():
                if name == "list":
                    push, pop = py_list(stacks[name], values, repeats)
                else:
                    push, pop = py_stack(stacks[name], values, repeats, lifo=not name.startswith("call_floor"))
                return {"push_ns": push / (n * repeats), "pop_ns": pop / (n * repeats)}
            return run

        samples = interleaved([(name, fn(name)) for name in stacks], rounds)
        for name, s in samples.items():
            records.append(record("python", case, name, s, n=n, repeats=repeats))
        stacks["tape_unlocked"].close()
        stacks["tape_locked"].close()
    return records


# ---------------------------------------------------------------------------
# Bulk: push_many / pop_many
# ---------------------------------------------------------------------------

def bulk_run(stack, chunk, n_chunks):
    """Push n_chunks tagged copies of chunk, pop them back; (push s, pop s), checked."""
    clock = time.perf_counter
    push = pop = 0.0
    for i in range(n_chunks):
        chunk[0] = chunk[-1] = i
        t0 = clock()
        stack.push_many(chunk)
        push += clock() - t0
    for i in range(n_chunks - 1, -1, -1):
        t0 = clock()
        out = stack.pop_many(chunk.shape[0])
        pop += clock() - t0
        if out[0] != i or out[-1] != i or out[1] != chunk[1]:
            raise AssertionError(f"{type(stack).__name__}: chunk {i} came back wrong")
    return push, pop


def bench_bulk(sizes, rounds):
    records = []
    total = sizes["bulk_bytes"]
    for chunk_bytes in (64 * 1024, MiB):
        k = chunk_bytes // 8
        n_chunks = total // chunk_bytes
        chunk = np.arange(k, dtype=np.float64)
        stacks = {"tape": Tape(), "numpy_doubling": NumpyDoubling()}

        def fn(name):
            def run():
                push, pop = bulk_run(stacks[name], chunk, n_chunks)
                return {"push_Bps": total / push, "pop_Bps": total / pop}
            return run

        samples = interleaved([(name, fn(name)) for name in stacks], rounds)
        for name, s in samples.items():
            records.append(record("bulk", f"chunk_{chunk_bytes // 1024}KiB", name, s,
                                  chunk_bytes=chunk_bytes, total_bytes=total))
        stacks["tape"].close()
    return records


# ---------------------------------------------------------------------------
# Spill: one fresh process per case
# ---------------------------------------------------------------------------

def spill_worker(spec):
    """Run one spill case in this (fresh) process and return its numbers."""
    mode, data_bytes, budget = spec["mode"], spec["data_bytes"], spec["budget"]
    chunk = np.arange(MiB // 8, dtype=np.float64)
    # Warm-up on a small in-memory tape: code paths, NumPy's allocator, the chunk's pages.
    with Tape(threadsafe=False) as warm:
        _bench.push_pop_ns(warm, 1 << 20, 1, locked=False)
        bulk_run(warm, chunk, 8)
    tape = Tape(threadsafe=(mode == "bulk"), memory_budget=budget)
    reset_vm_hwm()
    rss_before = psutil.Process().memory_info().rss
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with RssSampler(interval=0.0005) as sampler:
        if mode == "scalar":
            n = data_bytes // 8
            push_ns, pop_ns = _bench.push_pop_ns(tape, n, 1, locked=False)
            push_s, pop_s = push_ns * n / 1e9, pop_ns * n / 1e9
        else:
            push_s, pop_s = bulk_run(tape, chunk, data_bytes // MiB)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    stats = tape.stats
    hwm = vm_hwm()
    tape.close()
    out = {"push_Bps": data_bytes / push_s, "pop_Bps": data_bytes / pop_s,
           "rss_before": rss_before, "peak_rss_sampled": sampler.peak, "rss_samples": sampler.samples,
           "vm_hwm": hwm, "rss_growth": max(hwm, sampler.peak) - rss_before,
           "minor_faults_per_MiB": faults / (data_bytes / MiB)}
    if mode == "scalar":
        out.update(push_ns=push_ns, pop_ns=pop_ns)
    for key in ("spills", "reloads", "prefetch_hits", "prefetch_misses", "peak_resident_bytes",
                "spill_file_bytes", "length", "io_wait_ns", "push_wait_ns", "bytes_written",
                "bytes_read", "bytes_cancelled"):
        out[key] = stats[key]
    if out["length"] != 0:
        raise AssertionError(f"spill case {spec}: {out['length']} entries left after popping all")
    return out


def run_spill_case(spec):
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--spill-case", json.dumps(spec)],
                         capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        raise RuntimeError(f"spill case {spec} failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


PROBE_BLOCK = 4 * MiB


def bench_spill(sizes, rounds):
    budget = sizes["spill_budget"]
    data = SPILL_FACTOR * budget
    spill_dir = tempfile.gettempdir()
    variants = []
    for mode in ("scalar", "bulk"):
        for label, b in (("in_memory", None), ("spill", budget)):
            spec = {"mode": mode, "data_bytes": data, "budget": b}
            variants.append((f"{mode}/{label}", lambda spec=spec: run_spill_case(spec)))
    methods = set()

    def probe():
        # The device alone: O_DIRECT, or its page cache dropped (gpt2.perfmodel's probe).
        write, read, method = measure_disk(spill_dir, data, max_seconds=float("inf"),
                                           chunk=PROBE_BLOCK)
        methods.add(method)
        return {"write_Bps": write, "read_Bps": read}

    variants.append(("device/probe", probe))
    # Each sample is already a fresh process after its own warm-up: no warm-up round.
    samples = interleaved(variants, rounds, warmup=0)
    records = []
    for name, s in samples.items():
        mode, label = name.split("/")
        extra = {"method": "/".join(sorted(methods)), "block_bytes": PROBE_BLOCK} if mode == "device" else {}
        records.append(record("spill", mode, label, s, data_bytes=data,
                              memory_budget=budget if label == "spill" else None,
                              spill_dir=spill_dir, **extra))
    return records


# ---------------------------------------------------------------------------
# Machine floors under the spill and cold numbers
# ---------------------------------------------------------------------------

def bench_machine(sizes, rounds):
    """Page-fault cost of fresh memory, memcpy, and pwrite/pread of 1 MiB blocks of a file in
    the spill directory (the page cache): what bounds cold pushes and spilled pops here."""
    nbytes = sizes["spill_budget"]
    src = np.full(nbytes // 8, 1.5)
    dst = np.empty_like(src)
    dst.fill(0.0)
    block = MiB // 8

    def fault():
        # Fresh 1 MiB anonymous maps, like the tape's slabs (NumPy's own large arrays may
        # get transparent huge pages, the slabs do not).
        first = again = 0.0
        for _ in range(8):
            with mmap.mmap(-1, MiB) as m:
                a = np.frombuffer(m, dtype=np.float64)
                t0 = time.perf_counter()
                a.fill(1.0)          # first touch: one fault per 4 KiB page
                t1 = time.perf_counter()
                a.fill(2.0)          # same pages, already mapped
                t2 = time.perf_counter()
                del a
            first += t1 - t0
            again += t2 - t1
        return {"fault_us_per_page": max(first - again, 1e-9) / (8 * MiB / 4096) * 1e6}

    def memcpy():
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return {"memcpy_Bps": nbytes / (time.perf_counter() - t0)}

    fd, path = tempfile.mkstemp(prefix="tape-stress-", dir=tempfile.gettempdir())
    os.unlink(path)

    def file_io():
        t0 = time.perf_counter()
        for off in range(0, src.shape[0], block):
            os.pwrite(fd, src[off:off + block], off * 8)
        t1 = time.perf_counter()
        for off in range(0, dst.shape[0], block):
            os.preadv(fd, [dst[off:off + block]], off * 8)
        t2 = time.perf_counter()
        return {"pwrite_Bps": nbytes / (t1 - t0), "pread_Bps": nbytes / (t2 - t1)}

    try:
        samples = interleaved([("page_fault", fault), ("memcpy", memcpy), ("file_io", file_io)], rounds)
    finally:
        os.close(fd)
    if not np.array_equal(dst, src):
        raise AssertionError("pread returned different bytes than pwrite wrote")
    return [record("machine", "floors", name, s, nbytes=nbytes) for name, s in samples.items()]


# ---------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------

def bench_threads(sizes, rounds):
    total = sizes["thread_ops"]
    shared = Tape()
    per_thread = {nt: [Tape(threadsafe=False) for _ in range(nt)] for nt in (1, 2, 4, 8)}
    checks = {}

    def shared_fn(nt):
        def run():
            n_ops = total // nt
            popped, seconds = _bench.shared_push_pop(shared, nt, n_ops, pop_every=2)
            rest = shared.pop_many(len(shared))
            everything = np.concatenate([popped, rest])
            ids = everything.astype(np.int64)
            ok = bool(np.array_equal(ids, everything) and ids.min() >= 0 and ids.max() < nt * n_ops
                      and np.array_equal(np.bincount(ids, minlength=nt * n_ops), np.ones(nt * n_ops)))
            checks.setdefault(("shared_locked", nt), []).append(ok)
            return {"ops_per_s": (nt * n_ops + popped.shape[0]) / seconds, "seconds": seconds}
        return run

    def per_thread_fn(nt):
        def run():
            n_ops = total // nt
            errors, seconds = _bench.per_thread_lifo(per_thread[nt], n_ops)
            ok = errors == [0] * nt and all(len(t) == 0 for t in per_thread[nt])
            checks.setdefault(("per_thread_unlocked", nt), []).append(ok)
            return {"ops_per_s": 2 * nt * n_ops / seconds, "seconds": seconds}
        return run

    variants = []
    for nt in (1, 2, 4, 8):
        variants += [(f"shared_locked/{nt}", shared_fn(nt)), (f"per_thread_unlocked/{nt}", per_thread_fn(nt))]
    samples = interleaved(variants, rounds)
    records = []
    for name, s in samples.items():
        variant, nt = name.split("/")
        ok = all(checks[(variant, int(nt))])
        records.append(record("threads", f"{nt}_threads", variant, s, threads=int(nt),
                              total_pushes=total, invariant_ok=ok))
    shared.close()
    for tapes in per_thread.values():
        for t in tapes:
            t.close()
    return records


# ---------------------------------------------------------------------------
# Targets, table, plot
# ---------------------------------------------------------------------------

def evaluate(records):
    out = []

    def add(name, value, target, met, detail):
        out.append({"target": name, "value": value, "limit": target, "met": bool(met), "detail": detail})

    for case in ("small", "slabs"):
        u = find(records, "cython", case, "tape_unlocked")
        lk = find(records, "cython", case, "tape_locked")
        raw = find(records, "cython", case, "raw_array")
        floor = find(records, "cython", case, "lock_floor")["pair_ns"]
        cur = find(records, "cython", case, "tape_cursor")
        worst = max(cur["push_ns"], cur["pop_ns"])
        add(f"cython {case}: cursor push/pop <= 1 ns", worst, TARGETS["cython_ns"],
            worst <= TARGETS["cython_ns"],
            f"cursor push {cur['push_ns']:.2f} ns, pop {cur['pop_ns']:.2f} ns; per-op unlocked "
            f"calls {u['push_ns']:.2f} / {u['pop_ns']:.2f} ns; raw C array in the same run "
            f"{raw['push_ns']:.2f} / {raw['pop_ns']:.2f} ns")
        worst = max(lk["push_ns"], lk["pop_ns"])
        add(f"cython {case}: locked push/pop <= 4 ns", worst, TARGETS["cython_locked_ns"],
            worst <= TARGETS["cython_locked_ns"],
            f"push {lk['push_ns']:.2f} ns, pop {lk['pop_ns']:.2f} ns; lock cost "
            f"{lk['push_ns'] - u['push_ns']:.2f} / {lk['pop_ns'] - u['pop_ns']:.2f} ns vs "
            f"atomic xchg+store floor {floor:.2f} ns")
    for case in ("small", "slabs"):
        lst = find(records, "python", case, "list")
        for variant in ("tape_unlocked", "tape_locked"):
            t = find(records, "python", case, variant)
            rp, rq = paired_ratio(t, lst, "push_ns"), paired_ratio(t, lst, "pop_ns")
            add(f"python {case} {variant}: <= 1.5x list", max(rp, rq), TARGETS["python_ratio"],
                max(rp, rq) <= TARGETS["python_ratio"],
                f"push {t['push_ns']:.1f} ns ({rp:.2f}x list {lst['push_ns']:.1f}), "
                f"pop {t['pop_ns']:.1f} ns ({rq:.2f}x list {lst['pop_ns']:.1f}); ratios are medians of "
                f"same-round pairs")
    t = find(records, "bulk", "chunk_1024KiB", "tape")
    worst = min(t["push_Bps"], t["pop_Bps"])
    add("bulk 1 MiB push_many/pop_many >= 2 GB/s", worst, TARGETS["bulk_Bps"], worst >= TARGETS["bulk_Bps"],
        f"push {t['push_Bps'] / 1e9:.2f} GB/s, pop {t['pop_Bps'] / 1e9:.2f} GB/s")
    dev = find(records, "spill", "device", "probe")
    for mode in ("scalar", "bulk"):
        mem, sp = find(records, "spill", mode, "in_memory"), find(records, "spill", mode, "spill")
        share = paired_ratio(sp, mem, "pop_Bps")
        add(f"spill {mode}: pop at 8x budget >= 50% of in-memory", share, TARGETS["spill_pop_share"],
            share >= TARGETS["spill_pop_share"],
            f"pop {sp['pop_Bps'] / 1e9:.2f} vs {mem['pop_Bps'] / 1e9:.2f} GB/s; prefetch hits "
            f"{sp['prefetch_hits']:.0f}, misses {sp['prefetch_misses']:.0f}; pops waited "
            f"{sp['io_wait_ns'] / 1e6:.1f} ms on reads, pushes {sp['push_wait_ns'] / 1e6:.1f} ms on writes")
        if mode == "bulk":
            share = paired_ratio(sp, dev, "pop_Bps", "read_Bps")
            add("spill bulk: pop >= 80% of the spill device's read rate", share,
                TARGETS["spill_pop_device_share"], share >= TARGETS["spill_pop_device_share"],
                f"pop {sp['pop_Bps'] / 1e9:.2f} GB/s vs device read {dev['read_Bps'] / 1e9:.2f} GB/s "
                f"({dev['method']}, same rounds); push {sp['push_Bps'] / 1e9:.2f} GB/s = "
                f"{paired_ratio(sp, dev, 'push_Bps', 'write_Bps'):.0%} of device write "
                f"{dev['write_Bps'] / 1e9:.2f} GB/s")
        over = sp["rss_growth"] / sp["memory_budget"]
        add(f"spill {mode}: peak RSS growth <= budget + 10%", over, TARGETS["rss_over_budget"],
            over <= TARGETS["rss_over_budget"],
            f"RSS growth {sp['rss_growth'] / MiB:.1f} MiB (max over rounds "
            f"{max(sp['rss_growth_samples']) / MiB:.1f}), tape peak_resident "
            f"{sp['peak_resident_bytes'] / MiB:.1f} MiB, budget {sp['memory_budget'] / MiB:.0f} MiB")
    for rec in records:
        if rec["section"] == "threads":
            add(f"threads {rec['variant']} x{rec['threads']}: invariant", None, None, rec["invariant_ok"],
                f"{rec['ops_per_s'] / 1e6:.1f} Mops/s total")
    return out


def print_table(records, verdicts):
    print("\n== Cython nogil loop: ns per op (median) ==")
    print(f"{'case':<11}{'variant':<16}{'push ns':>9}{'pop ns':>9}{'push/raw':>10}{'pop/raw':>9}")
    for rec in records:
        if rec["section"] != "cython" or rec["variant"] == "lock_floor":
            continue
        base = ([r for r in records if r["section"] == "cython" and r["case"] == rec["case"]
                 and r["variant"] == "raw_array"] or [None])[0]
        ratio = (f"{paired_ratio(rec, base, 'push_ns'):>10.2f}{paired_ratio(rec, base, 'pop_ns'):>9.2f}"
                 if base else "")
        print(f"{rec['case']:<11}{rec['variant']:<16}{rec['push_ns']:>9.2f}{rec['pop_ns']:>9.2f}{ratio}")
    for rec in records:
        if rec["section"] == "cython" and rec["variant"] == "lock_floor":
            print(f"{rec['case']:<11}{'lock_floor':<16}{rec['pair_ns']:>9.2f}  (xchg + release store per op)")
    print("\n== Python loop: ns per op (median) ==")
    print(f"{'case':<11}{'variant':<22}{'push ns':>9}{'pop ns':>9}{'push/list':>11}{'pop/list':>10}")
    for rec in records:
        if rec["section"] == "python":
            lst = find(records, "python", rec["case"], "list")
            print(f"{rec['case']:<11}{rec['variant']:<22}{rec['push_ns']:>9.1f}{rec['pop_ns']:>9.1f}"
                  f"{paired_ratio(rec, lst, 'push_ns'):>11.2f}{paired_ratio(rec, lst, 'pop_ns'):>10.2f}")
    print("\n== Bulk push_many/pop_many: GB/s (median) ==")
    for rec in records:
        if rec["section"] == "bulk":
            print(f"{rec['case']:<15}{rec['variant']:<16}push {rec['push_Bps'] / 1e9:6.2f}  "
                  f"pop {rec['pop_Bps'] / 1e9:6.2f}")
    print("\n== Machine floors (median) ==")
    fl = {r["variant"]: r for r in records if r["section"] == "machine"}
    print(f"page fault {fl['page_fault']['fault_us_per_page']:.2f} us per 4 KiB page "
          f"(= {4096 / fl['page_fault']['fault_us_per_page'] / 1e3:.2f} GB/s of first touch), memcpy "
          f"{fl['memcpy']['memcpy_Bps'] / 1e9:.2f} GB/s, pwrite {fl['file_io']['pwrite_Bps'] / 1e9:.2f} GB/s, "
          f"pread {fl['file_io']['pread_Bps'] / 1e9:.2f} GB/s (1 MiB blocks, {tempfile.gettempdir()})")
    print("\n== Spill: 8x the budget, fresh process per case (median) ==")
    dev = find(records, "spill", "device", "probe")
    for rec in records:
        if rec["section"] == "spill" and rec["case"] != "device":
            ns = (f"  push {rec['push_ns']:.2f} ns  pop {rec['pop_ns']:.2f} ns" if "push_ns" in rec else "")
            print(f"{rec['case']:<7}{rec['variant']:<10}push {rec['push_Bps'] / 1e9:5.2f} GB/s  "
                  f"pop {rec['pop_Bps'] / 1e9:5.2f} GB/s  RSS growth {rec['rss_growth'] / MiB:6.1f} MiB  "
                  f"tape peak {rec['peak_resident_bytes'] / MiB:6.1f} MiB  hits/misses "
                  f"{rec['prefetch_hits']:.0f}/{rec['prefetch_misses']:.0f}  page faults/MiB "
                  f"{rec['minor_faults_per_MiB']:.0f}{ns}")
            if rec["variant"] == "spill":
                print(f"{'':<17}I/O: pops waited {rec['io_wait_ns'] / 1e6:.1f} ms, pushes waited "
                      f"{rec['push_wait_ns'] / 1e6:.1f} ms; written {rec['bytes_written'] / MiB:.0f} MiB, "
                      f"read {rec['bytes_read'] / MiB:.0f} MiB, taken back unwritten "
                      f"{rec['bytes_cancelled'] / MiB:.0f} MiB; push {paired_ratio(rec, dev, 'push_Bps', 'write_Bps'):.0%} "
                      f"of device write, pop {paired_ratio(rec, dev, 'pop_Bps', 'read_Bps'):.0%} of device read")
    print(f"device probe ({dev['method']}, {dev['block_bytes'] // MiB} MiB requests, {dev['spill_dir']}): "
          f"write {dev['write_Bps'] / 1e9:.2f} GB/s, read {dev['read_Bps'] / 1e9:.2f} GB/s")
    print("\n== Threads: total ops/s (median) ==")
    for rec in records:
        if rec["section"] == "threads":
            print(f"{rec['threads']:>2} threads  {rec['variant']:<22}{rec['ops_per_s'] / 1e6:8.1f} Mops/s  "
                  f"invariant {'ok' if rec['invariant_ok'] else 'BROKEN'}")
    print("\n== Targets ==")
    for v in verdicts:
        print(f"[{'met' if v['met'] else 'NOT MET':>7}] {v['target']}: {v['detail']}")


def plot(records, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    colors = {"tape_unlocked": "tab:blue", "tape_locked": "tab:cyan", "numpy_doubling": "tab:orange",
              "raw_array": "tab:gray", "list": "tab:green", "tape": "tab:blue", "call_floor": "tab:purple",
              "call_floor_positional": "tab:pink"}

    def bars(ax, section, cases, variants, metrics, ylabel, title, scale=1.0):
        width = 0.8 / len(variants)
        labels = [f"{c}\n{m.replace('_ns', '').replace('_Bps', '')}" for c in cases for m in metrics]
        x = np.arange(len(labels))
        for j, v in enumerate(variants):
            ys = [find(records, section, c, v)[m] * scale for c in cases for m in metrics]
            ax.bar(x + (j - (len(variants) - 1) / 2) * width, ys, width, label=v, color=colors.get(v))
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)

    ax = axes[0, 0]
    bars(ax, "cython", ["small", "slabs"],
         ["tape_cursor", "tape_unlocked", "tape_locked", "numpy_doubling", "raw_array"],
         ["push_ns", "pop_ns"],
         "ns per op", "")
    floor = find(records, "cython", "slabs", "lock_floor")["pair_ns"]
    ax.set_title(f"Cython nogil loop (median)\n-- 1 ns target (unlocked), -- 4 ns target (locked), "
                 f"··· atomic xchg+store floor {floor:.1f} ns", fontsize=9)
    ax.axhline(TARGETS["cython_ns"], color="k", ls="--", lw=1)
    ax.axhline(TARGETS["cython_locked_ns"], color="tab:red", ls="--", lw=1)
    ax.axhline(floor, color="tab:purple", ls=":", lw=1)

    bars(axes[0, 1], "python", ["small", "slabs"],
         ["list", "tape_unlocked", "tape_locked", "call_floor", "call_floor_positional", "numpy_doubling"],
         ["push_ns", "pop_ns"], "ns per op (log)", "Python loop (median)")
    axes[0, 1].set_yscale("log")

    bars(axes[0, 2], "bulk", ["chunk_64KiB", "chunk_1024KiB"], ["tape", "numpy_doubling"],
         ["push_Bps", "pop_Bps"], "GB/s", "Bulk push_many / pop_many (median)", scale=1e-9)
    axes[0, 2].axhline(TARGETS["bulk_Bps"] / 1e9, color="k", ls="--", lw=1)

    ax = axes[1, 0]
    labels, ys, cs = [], [], []
    for mode in ("scalar", "bulk"):
        for label in ("in_memory", "spill"):
            rec = find(records, "spill", mode, label)
            for m in ("push_Bps", "pop_Bps"):
                labels.append(f"{mode}\n{label}\n{m[:-4]}")
                ys.append(rec[m] / 1e9)
                cs.append("tab:blue" if label == "in_memory" else "tab:red")
    dev = find(records, "spill", "device", "probe")
    for m in ("write_Bps", "read_Bps"):
        labels.append(f"device\nprobe\n{m[:-4]}")
        ys.append(dev[m] / 1e9)
        cs.append("tab:gray")
    ax.bar(np.arange(len(labels)), ys, color=cs)
    ax.set_xticks(np.arange(len(labels)), labels, fontsize=7)
    ax.set_ylabel("GB/s")
    ax.set_title(f"Spill: data {SPILL_FACTOR}x budget vs in memory, and the spill device\n"
                 f"({dev['method']}) (median)", fontsize=10)

    ax = axes[1, 1]
    labels, growth, tape_peak = [], [], []
    budget = None
    for mode in ("scalar", "bulk"):
        for label in ("in_memory", "spill"):
            rec = find(records, "spill", mode, label)
            labels.append(f"{mode}\n{label}")
            growth.append(rec["rss_growth"] / MiB)
            tape_peak.append(rec["peak_resident_bytes"] / MiB)
            budget = rec["memory_budget"] or budget
    x = np.arange(len(labels))
    ax.bar(x - 0.2, growth, 0.4, label="process RSS growth (VmHWM)", color="tab:olive")
    ax.bar(x + 0.2, tape_peak, 0.4, label="tape peak_resident_bytes", color="tab:brown")
    ax.axhline(budget / MiB, color="k", ls="--", lw=1, label="budget")
    ax.axhline(1.1 * budget / MiB, color="tab:red", ls=":", lw=1, label="budget + 10%")
    ax.set_yscale("log")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("MiB")
    ax.set_title("Peak memory next to the budget (median)", fontsize=10)
    ax.legend(fontsize=7)

    ax = axes[1, 2]
    for variant, color in (("shared_locked", "tab:cyan"), ("per_thread_unlocked", "tab:blue")):
        recs = sorted((r for r in records if r["section"] == "threads" and r["variant"] == variant),
                      key=lambda r: r["threads"])
        ax.plot([r["threads"] for r in recs], [r["ops_per_s"] / 1e6 for r in recs], "o-",
                label=variant, color=color)
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    ax.set_xlabel(f"OS threads (machine: {os.cpu_count()} cores)")
    ax.set_ylabel("total Mops/s (push + pop)")
    ax.set_title("Threads (median)", fontsize=10)
    ax.legend(fontsize=8)

    fig.suptitle("adtape.Tape stress benchmark", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: under a minute")
    parser.add_argument("--rounds", type=int, default=7, help="samples per variant (>= 5)")
    parser.add_argument("--out", default=RESULTS, help="directory of the JSON and PNG")
    parser.add_argument("--spill-case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.spill_case:
        print(json.dumps(spill_worker(json.loads(args.spill_case))))
        return
    if args.rounds < 5:
        parser.error(f"--rounds must be at least 5 (medians of >= 5 samples), got {args.rounds}")
    mode = "quick" if args.quick else "full"
    sizes = SIZES[mode]
    t_start = time.perf_counter()
    records = []
    for name, fn in (("cython", bench_cython), ("python", bench_python), ("bulk", bench_bulk),
                     ("machine", bench_machine), ("spill", bench_spill), ("threads", bench_threads)):
        t0 = time.perf_counter()
        # The in-process sections are short: more rounds steady their medians, which
        # matter most where a shared core makes samples bimodal.
        rounds = 2 * args.rounds + 1 if name in ("cython", "python", "bulk", "machine") else args.rounds
        records += fn(sizes, rounds)
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)
    verdicts = evaluate(records)
    print_table(records, verdicts)
    os.makedirs(args.out, exist_ok=True)
    meta = {"mode": mode, "rounds": args.rounds, "sizes": sizes, "sbo_size": SBO, "targets": TARGETS,
            "python": sys.version.split()[0], "numpy": np.__version__, "platform": platform.platform(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "load_avg_at_end": os.getloadavg(), "seconds": time.perf_counter() - t_start,
            "spill_dir": tempfile.gettempdir()}
    stem = "tape_stress" if mode == "full" else "tape_stress_quick"
    json_path = os.path.join(args.out, stem + ".json")
    with open(json_path, "w") as f:
        json.dump({"meta": meta, "targets": verdicts, "records": records}, f, indent=1)
    png_path = os.path.join(args.out, stem + ".png")
    plot(records, png_path)
    print(f"\nwrote {json_path} and {png_path} ({meta['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
