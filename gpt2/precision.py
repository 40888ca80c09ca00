"""Which precision a run's matrix products take: ``--precision auto|fp32|bf16``.

fp32 is float32 throughout.  bf16 is mixed precision: float32 master weights, gradients
and AdamW moments; the linear layers' products take bf16 operands and sum in float32
(``adtape.nn.set_precision``, ``kernels.bf16``).  auto picks bf16 only where the CPU
multiplies bf16 natively (AVX512_BF16; AMX-BF16 tiles where present) and a short
probe measures its product faster than the float32 one on the run's threads; elsewhere bf16 runs an emulated path (exact,
at the float32 rate or a little below), which auto never picks.
"""
import numpy as np

from gpt2.units import median_times

# The probe: one linear layer's forward product at a training-sized shape (GPT-2
# small's MLP input: 512 rows of 768 into 3072 columns), the median of a few timings,
# the two precisions interleaved.
PROBE_SHAPE = (512, 768, 3072)
PROBE_REPEATS = 5
# bf16 must beat fp32 by this much to be picked (the conversions cost a few percent of
# a step that the probe does not see).
MARGIN = 0.9


def probe(n_threads, shape=PROBE_SHAPE, repeats=PROBE_REPEATS):
    """(fp32 seconds, bf16 seconds) of one forward product of ``shape`` (M, K, N)."""
    from adtape import buffers
    from kernels import bf16, matmul
    M, K, N = shape
    rng = np.random.default_rng(0)
    x = buffers.empty((M, K))
    w = buffers.empty((N, K))
    x[...] = rng.standard_normal((M, K), dtype=np.float32)
    w[...] = rng.standard_normal((N, K), dtype=np.float32) * 0.02
    out = buffers.empty((M, N))
    xb, wb = buffers.empty((M, K), np.uint16), buffers.empty((N, K), np.uint16)
    bf16.to_bf16(xb, x, n_threads=n_threads)
    bf16.to_bf16(wb, w, n_threads=n_threads)

    def mixed():
        bf16.to_bf16(xb, x, n_threads=n_threads)   # the input's conversion is per product
        bf16.matmul_forward_bf16(out, xb, wb, None, n_threads=n_threads)
    times = median_times({"fp32": lambda: matmul.matmul_forward(out, x, w, None, n_threads=n_threads),
                          "bf16": mixed}, repeats)
    return times["fp32"], times["bf16"]


def choose(choice, n_threads, measure=probe):
    """(precision, reason) for ``--precision choice`` on ``n_threads`` threads."""
    from kernels import bf16
    native = bf16.cpu_has_avx512_bf16()
    if choice == "fp32":
        return "fp32", "--precision fp32"
    engine = "AMX-BF16 tiles" if bf16.bf16_path() == "amx" else "AVX512_BF16"
    if choice == "bf16":
        return "bf16", (f"bf16 products on {engine}" if native else
                        "bf16 products emulated: this CPU has no AVX512_BF16 (same numbers, "
                        "not faster)")
    if choice != "auto":
        raise ValueError(f"--precision must be auto, fp32 or bf16, got {choice!r}")
    if not native:
        return "fp32", "auto: this CPU has no AVX512_BF16"
    fp32_s, bf16_s = measure(n_threads)
    speedup = fp32_s / bf16_s
    if bf16_s < MARGIN * fp32_s:
        return "bf16", f"auto: bf16 products ({engine}) measured {speedup:.2f}x as fast as fp32"
    return "fp32", (f"auto: bf16 products ({engine}) measured {speedup:.2f}x fp32's speed, "
                    f"not faster")
