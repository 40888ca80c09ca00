"""What the benchmarks and the tests' workers share to measure a process: its peak
resident memory, sampled (``RssSampler``) or as the kernel keeps it (``vm_hwm``,
``reset_vm_hwm``), interleaved runs of several sides (``interleave``), and the
machine's limits that shares are taken against (``LimitProbe``)."""
import threading

import psutil

from gpt2.units import interleave, peak_rss_bytes, reset_peak_rss  # noqa: F401 (interleave: for the benchmarks)


class RssSampler:
    """The largest RSS of this process (or of process ``pid``) while the ``with`` block
    runs, sampled every ``interval`` seconds from a thread: ``before`` (at entry), ``peak`` (bytes) and
    ``samples`` (how many were taken).  A peak between two samples is missed: where
    that matters, ``vm_hwm`` is the kernel's own."""

    def __init__(self, interval=0.001, pid=None):
        self.process = psutil.Process(pid)
        self.interval = interval
        self.before = self.peak = 0
        self.samples = 0

    def _sample(self):
        try:
            self.peak = max(self.peak, self.process.memory_info().rss)
            self.samples += 1
        except psutil.Error:        # another process (``pid``) that has ended
            pass

    def _run(self):
        while not self._done.wait(self.interval):
            self._sample()

    def __enter__(self):
        self.peak = 0
        self.samples = 0
        self._sample()
        self.before = self.peak
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self._sample()
        return False

    @property
    def growth(self):
        """peak - before, in bytes."""
        return self.peak - self.before


def vm_hwm():
    """The kernel's peak RSS of this process (VmHWM of /proc/self/status), in bytes."""
    return peak_rss_bytes()


def reset_vm_hwm():
    """Set VmHWM to the current RSS, so that a later ``vm_hwm`` is the peak from now on."""
    reset_peak_rss()


class LimitProbe:
    """The machine's limits on ``n_threads`` cores that the benchmarks' shares are taken
    against, with operands allocated once so that a benchmark can probe again beside
    each case: the physical FMA peaks, the best of three sgemm
    (``sgemm``: ours, SciPy's BLAS, PyTorch's, on an ``sgemm_n`` square) and the memory
    bandwidth (``bandwidth``: three float32 streams of ``stream_floats``, far past the
    caches).  Every figure is the best of its repetitions: a probe that runs while other
    processes do reads low, never high."""

    def __init__(self, n_threads, sgemm_n=2048, stream_floats=64 << 20):
        import numpy as np

        from adtape import buffers
        self.n_threads, self.sgemm_n, self.stream_floats = n_threads, sgemm_n, stream_floats
        rng = np.random.default_rng(0)
        self.a, self.b, self.c = (buffers.empty((sgemm_n, sgemm_n)) for _ in range(3))
        self.a[...] = rng.standard_normal((sgemm_n, sgemm_n), dtype=np.float32)
        self.b[...] = rng.standard_normal((sgemm_n, sgemm_n), dtype=np.float32)
        self.streams = tuple(np.ones(stream_floats, dtype=np.float32) for _ in range(3))

    @staticmethod
    def _best(fn, repeats):
        import time
        fn()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    def sgemm(self, repeats=3):
        """GFLOP/s of c = a @ b.T through ours (kernels.matmul), SciPy's BLAS and
        PyTorch's (where it is installed); ``sgemm_gflops`` is the fastest."""
        from scipy.linalg import blas
        from threadpoolctl import threadpool_limits

        from kernels import matmul
        a, b, c, n = self.a, self.b, self.c, self.n_threads
        flops = 2 * self.sgemm_n ** 3
        out = {"sgemm_n": self.sgemm_n}
        out["ours_sgemm_gflops"] = flops / self._best(
            lambda: matmul.matmul_forward(c, a, b, None, n_threads=n), repeats) / 1e9
        with threadpool_limits(limits=n, user_api="blas"):
            # c.T = b @ a.T in Fortran order: the same memory, no copies
            out["scipy_sgemm_gflops"] = flops / self._best(
                lambda: blas.sgemm(1.0, b.T, a.T, c=c.T, trans_a=True, overwrite_c=1),
                repeats) / 1e9
        try:
            import torch
        except ImportError:
            out["torch_sgemm_gflops"] = None
        else:
            threads = torch.get_num_threads()
            torch.set_num_threads(n)
            ta, tb, tc = (torch.from_numpy(x) for x in (a, b, c))
            out["torch_sgemm_gflops"] = flops / self._best(
                lambda: torch.mm(ta, tb.t(), out=tc), repeats) / 1e9
            torch.set_num_threads(threads)
        out["sgemm_gflops"] = max(v for k, v in out.items()
                                  if k.endswith("_sgemm_gflops") and v is not None)
        return out

    def bandwidth(self, repeats=3):
        """GB/s of four passes over the streams, each split between n threads (NumPy
        releases the GIL): a copy and an add (z = x + y), which write a third array whose
        write-allocate read they do not count; an in-place update (x += y, as AdamW
        updates its state: all three streams real traffic); a read (a sum), which on a
        small VM is bound by the misses each core keeps in flight.  ``bandwidth_gbs`` is
        the fastest."""
        import threading

        import numpy as np
        x, y, z = self.streams
        count = self.stream_floats
        bounds = [(int(ch[0]), int(ch[-1]) + 1)
                  for ch in np.array_split(np.arange(count), self.n_threads) if ch.size]
        bodies = {"copy": (2, lambda lo, hi: np.copyto(z[lo:hi], x[lo:hi])),
                  "add": (3, lambda lo, hi: np.add(x[lo:hi], y[lo:hi], out=z[lo:hi])),
                  "update": (3, lambda lo, hi: np.add(x[lo:hi], y[lo:hi], out=x[lo:hi])),
                  "read": (1, lambda lo, hi: x[lo:hi].sum())}

        def on_threads(body):
            workers = [threading.Thread(target=body, args=bound) for bound in bounds]
            for w in workers:
                w.start()
            for w in workers:
                w.join()

        out = {f"{name}_gbs": streams * 4 * count / self._best(
                   lambda body=body: on_threads(body), repeats) / 1e9
               for name, (streams, body) in bodies.items()}
        x[...] = 1.0                           # the updates grew it: keep it finite
        out["bandwidth_gbs"] = max(out.values())
        out["stream_bytes_per_array"] = 4 * count
        return out

    def measure(self, repeats=3):
        """All of the limits: physical peaks (kernels.peak.physical_peak: GFLOP/s of
        register-only multiply-add loops per ISA), sgemm rates and bandwidths."""
        from kernels import peak
        return {**peak.physical_peak(self.n_threads), **self.sgemm(repeats),
                **self.bandwidth(repeats)}
