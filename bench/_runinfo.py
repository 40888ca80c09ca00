"""What the benchmarks that run GPT-2 workers share: the MODEL:BxT configuration lists
they take, the CPU and commit each result file names, and the machine's limits their
shares are taken against (the physical compute peak, sgemm rates, memory bandwidth)."""
import argparse
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_configs(text, example, note=""):
    """'gpt2:4x1024,gpt2-medium:4x1024' -> (('gpt2', 4, 1024), ('gpt2-medium', 4, 1024))."""
    out = []
    for item in text.split(","):
        try:
            model, bt = item.split(":")
            b, t = (int(v) for v in bt.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"a configuration is MODEL:BxT{note}, e.g. {example}; got {item!r}") from None
        out.append((model, b, t))
    return tuple(out)


# AMD family 25 (0x19) models: 0x00-0x0f and 0x20-0x5f Zen 3, 0x10-0x1f and 0x60-0xaf Zen 4.
_AMD_ZEN = {25: lambda m: "Zen 4" if 0x10 <= m <= 0x1f or 0x60 <= m <= 0xaf else "Zen 3",
            26: lambda m: "Zen 5", 23: lambda m: "Zen 2" if m >= 0x30 else "Zen/Zen+"}


def cpu_name():
    """The CPU's model name from /proc/cpuinfo, with its family, model and vector width
    (a VM often names only "AMD EPYC": Zen 3 and Zen 4 differ by AVX-512); "unknown"
    where there is no /proc/cpuinfo."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break                                # the first processor is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return "unknown"
    name = fields.get("model name", "unknown")
    try:
        family, model = int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return name
    core = _AMD_ZEN[family](model) if "AMD" in fields.get("vendor_id", "") and family in _AMD_ZEN else None
    avx = "AVX-512" if "avx512f" in fields.get("flags", "").split() else "AVX2, no AVX-512"
    return f"{name} ({core + ', ' if core else ''}family {family} model {model}, {avx})"


# The flags that decide which kernels run: vector widths, bf16 dot products, AMX tiles.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_flags():
    """Which of KERNEL_FLAGS the CPU reports (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.partition(":")[2].split())
                    return [flag for flag in KERNEL_FLAGS if flag in have]
    except OSError:
        pass
    return []


def git_commit():
    """The checkout's short commit hash, or None outside a git checkout."""
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def physical_peak(n_threads, seconds=0.1, repeats=3):
    """The physical FMA peak of ``n_threads`` cores (kernels.peak.physical_peak: GFLOP/s of
    register-only multiply-add loops per ISA, ``fp32_peak_gflops`` from the widest fp32
    loop, ``bf16_peak_gflops`` from the widest bf16 one or None), the compute limit of
    every benchmark's share; the BLAS sgemm rates are reported beside it.  Its keys are
    there, with None, where the kernels have no loop for this CPU."""
    from kernels import peak
    return peak.physical_peak(n_threads, seconds, repeats)


def compute_limit(limits):
    """(GFLOP/s, what it is) of a run's compute limit: the physical fp32 peak, or the sgemm
    rate where the CPU has no peak loop (``limits`` holds ``fp32_peak_gflops`` and
    ``sgemm_gflops`` or ``sgemm_peak_gflops``)."""
    if limits.get("fp32_peak_gflops"):
        return limits["fp32_peak_gflops"], f"fp32 peak ({limits.get('fp32_peak_isa') or 'widest fp32 FMA'})"
    return limits.get("sgemm_gflops", limits.get("sgemm_peak_gflops")), "sgemm"


class LimitProbe:
    """The machine's limits on ``n_threads`` cores that the benchmarks' shares are taken
    against, with operands allocated once so that a benchmark can probe again beside
    each case: the physical FMA peaks (``physical_peak``), the best of three sgemm
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
        """All of the limits: physical peaks, sgemm rates and bandwidths."""
        return {**physical_peak(self.n_threads), **self.sgemm(repeats),
                **self.bandwidth(repeats)}
