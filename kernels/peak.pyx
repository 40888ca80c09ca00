"""The physical peak of the cores: multiply-adds from registers only, per ISA.

``fma_peak(isa, n_threads)`` runs one register-only loop (kernels/peak.h) on each of
``n_threads`` OpenMP threads at once and returns GFLOP/s: the flops of all threads
over the wall time of the parallel region, the best of a few runs.  It is the limit
a benchmark's share is taken against: a BLAS sgemm rate measures the BLAS as much
as the machine.  ``available_isas()`` lists the loops this CPU and its OS run:

  "avx2"         fp32 FMA on 8 lanes (vfmadd231ps ymm)
  "avx512"       fp32 FMA on 16 lanes (vfmadd231ps zmm)
  "avx512_bf16"  bf16 pair dot products into fp32 (vdpbf16ps zmm)
  "amx_bf16"     bf16 tile products into fp32 (tdpbf16ps, 16 x 16 x 32)

Flops: an fp32 FMA is 2 per lane, a vdpbf16ps on a zmm 64, a tdpbf16ps 16*16*32*2.
``fma_checksum`` runs a loop for a given number of iterations on one thread and
returns the sum of its accumulators, which ``fma_checksum_naive`` computes the plain
way: with values whose products and sums are exact in float32, the two agree
exactly, which shows the loop did its work.
"""
import math
import time

import numpy as np

from cython.parallel cimport prange
from libc.stdint cimport int64_t

from kernels._openmp cimport checked_thread_count
from kernels.threads import get_num_threads

cdef extern from "peak.h" nogil:
    const int* adt_peak_accumulators
    const int* adt_peak_lanes
    const int* adt_peak_lane_flops
    double adt_peak_flops_per_iteration(int isa)
    int adt_peak_isas()
    double adt_peak_run(int isa, int64_t iterations, float mul, float add)

# In the order of peak.h's ADT_PEAK_* constants.
ISA_NAMES = ("avx2", "avx512", "avx512_bf16", "amx_bf16")
FP32_ISAS = ("avx2", "avx512")
BF16_ISAS = ("avx512_bf16", "amx_bf16")

cdef int _isas = -1


cdef int _isa_mask():
    # Asked once: on Linux the AMX check also requests the tile state for this process.
    global _isas
    if _isas < 0:
        _isas = adt_peak_isas()
    return _isas


def available_isas():
    """The loops this CPU runs and its OS allows, from ISA_NAMES (empty off x86-64)."""
    cdef int mask = _isa_mask()
    return [name for i, name in enumerate(ISA_NAMES) if mask & (1 << i)]


cdef int _isa_index(object isa, bint must_run) except -1:
    if isa not in ISA_NAMES:
        raise ValueError(f"unknown ISA {isa!r}: one of {', '.join(ISA_NAMES)}")
    cdef int index = ISA_NAMES.index(isa)
    if must_run and not _isa_mask() & (1 << index):
        raise ValueError(f"this CPU (or its OS) does not run {isa}: it runs "
                         f"{', '.join(available_isas()) or 'none of ' + ', '.join(ISA_NAMES)}")
    return index


def flops_per_iteration(isa):
    """Flops one iteration of ``isa``'s loop does."""
    return adt_peak_flops_per_iteration(_isa_index(isa, False))


def _check_iterations(iterations):
    if not isinstance(iterations, int) or isinstance(iterations, bool) or not 0 <= iterations < 2 ** 62:
        raise ValueError(f"iterations must be an int in [0, 2**62), got {iterations!r}")


def fma_checksum(isa, iterations, mul=1.0, add=1.0):
    """The sum of ``isa``'s accumulators after ``iterations`` iterations on this thread
    (see kernels/peak.h for what one iteration does with ``mul`` and ``add``)."""
    cdef int index = _isa_index(isa, True)
    _check_iterations(iterations)
    cdef int64_t n = iterations
    cdef float m = mul, a = add
    cdef double result
    with nogil:
        result = adt_peak_run(index, n, m, a)
    return result


def _bf16(x):
    """float32 ``x`` cut to bf16 (its top 16 bits), as the bf16 loops take it."""
    return (np.array([x], np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)[0]


def fma_checksum_naive(isa, iterations, mul=1.0, add=1.0):
    """What ``fma_checksum`` returns, computed with NumPy in float32 one operation at a
    time (an FMA as a product and a sum: the same where those are exact)."""
    cdef int index = _isa_index(isa, False)
    _check_iterations(iterations)
    acc = np.arange(adt_peak_accumulators[index] * adt_peak_lanes[index], dtype=np.float32)
    if isa in FP32_ISAS:
        m, a = np.float32(mul), np.float32(add)
        for _ in range(iterations):
            acc = acc * m + a
    else:
        product = _bf16(mul) * _bf16(add)
        # Products per lane and iteration: half its flops (2 for a pair, 32 for a
        # tile's inner dimension).
        for _ in range(iterations * adt_peak_lane_flops[index] // 2):
            acc = acc + product
    return float(np.sum(acc, dtype=np.float64))


cdef int64_t _iterations_for(int index, double seconds) except -1:
    """Iterations of loop ``index`` that take one thread about ``seconds``, from its time
    on a count that takes a tenth of that (or 10 ms); this also brings the core to its
    clock for this ISA."""
    cdef int64_t n = 1024
    cdef double elapsed
    while True:
        t0 = time.perf_counter()
        with nogil:
            adt_peak_run(index, n, 1.0, 1.0)
        elapsed = time.perf_counter() - t0
        if elapsed >= min(0.01, seconds / 10) or n >= (<int64_t>1) << 40:
            break
        n *= 2
    return max(1, <int64_t>(n * (seconds / elapsed)))


def fma_peak(isa, n_threads=None, seconds=0.1, repeats=3):
    """GFLOP/s of ``isa``'s register-only loop on ``n_threads`` threads at once (None:
    the kernels' count): the best of ``repeats`` runs of about ``seconds`` each."""
    cdef int index = _isa_index(isa, True)
    cdef int nt = get_num_threads() if n_threads is None else checked_thread_count(n_threads, "n_threads")
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"seconds must be a positive finite number, got {seconds!r}")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    cdef int64_t n = _iterations_for(index, seconds)
    cdef double[::1] sums = np.zeros(nt, np.float64)
    cdef Py_ssize_t t
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for t in prange(nt, nogil=True, schedule="static", chunksize=1, num_threads=nt):
            sums[t] = adt_peak_run(index, n, 1.0, 1.0)
        elapsed = time.perf_counter() - t0
        best = max(best, nt * n * adt_peak_flops_per_iteration(index) / elapsed / 1e9)
    return best


def physical_peak(n_threads=None, seconds=0.1, repeats=3):
    """The peak of ``n_threads`` threads (None: the kernels' count) by every loop this
    CPU runs, and the limits taken from it: {"peak_gflops_by_isa": {isa: GFLOP/s},
    "fp32_peak_isa", "fp32_peak_gflops": the widest fp32 loop's, "bf16_peak_isa",
    "bf16_peak_gflops": the widest bf16 loop's (None where the CPU has none)}."""
    rates = {isa: fma_peak(isa, n_threads, seconds, repeats) for isa in available_isas()}
    out = {"peak_gflops_by_isa": rates}
    for kind, isas in (("fp32", FP32_ISAS), ("bf16", BF16_ISAS)):
        present = [isa for isa in isas if isa in rates]
        widest = present[len(present) - 1] if present else None
        out[f"{kind}_peak_isa"] = widest
        out[f"{kind}_peak_gflops"] = rates.get(widest)
    return out
