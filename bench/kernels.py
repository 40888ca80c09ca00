"""Every kernel against the same operation in PyTorch, at GPT-2 124M shapes.

For each kernel and (B, T) the two sides run in pairs, interleaved and in
alternating order (ours then torch, torch then ours, ...), after a warm-up, with the
same thread count.  The ratio is the median over the pairs of torch time / our time,
with its quartiles; the median times are reported with the achieved GFLOP/s
(matmuls, attention) or GB/s (everything else) and their share of this machine's
limits, measured in the same run right before and after each case: the physical fp32
peak (the cores' widest fp32 FMA from registers only, kernels.peak, the same threads)
and the memory bandwidth (the fastest of a large triad, a large in-place update and a
large sum in PyTorch with the same threads, and a NumPy copy).  The sgemm rate (the
best repetition of a large square product, ours or PyTorch's) is its own column.
Writes bench/results/kernels.json and kernels.png.

    python bench/kernels.py [--quick] [--threads N] [--reps R]
"""
import argparse
import json
import os
import pathlib
import platform
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

REPO = pathlib.Path(__file__).resolve().parent.parent
import _paths  # noqa: E402,F401  (import order: source if built in place, installed, bench/)
from _runinfo import compute_limit  # noqa: E402
from harness import LimitProbe  # noqa: E402

from adtape import buffers  # noqa: E402
from kernels import attention, blas_dispatch, layers, loss, matmul, optim, peak, threads  # noqa: E402

C, NH, V, VP, MAXT, L = 768, 12, 50257, 50304, 1024, 12
N_PARAMS = VP * C + MAXT * C + L * (12 * C * C + 13 * C) + 2 * C  # GPT-2 124M, padded vocab
RESULTS = REPO / "bench" / "results"


def median_ms(samples):
    return statistics.median(samples) * 1e3


# A kernel under this much time per side gets more repetitions, up to MAX_REPS or
# until the pair has taken MAX_CASE_SECONDS: a 40-microsecond kernel timed 7 times on
# a shared VM is mostly noise, and so is a matrix product at parity with MKL timed 7
# times (the median of 7 paired ratios moved by 1-2% between runs, the size of the
# differences left).  The cap keeps a case whose PyTorch side is slow (the
# cross-entropy forward: 1.7 s against our 70 ms) to a dozen seconds.
MIN_SECONDS = 2.0
MAX_REPS = 400
MAX_CASE_SECONDS = 12.0


def race(ours, theirs, reps, setup=None):
    """Paired, interleaved timings of ours and PyTorch's after one warm-up of each.

    Each repetition times both sides back to back, ours first in even repetitions
    and PyTorch first in odd ones (so neither always runs on the other's caches or
    spinning threads); there are at least ``reps`` and, for fast kernels, more,
    until each side has run MIN_SECONDS (both together at most MAX_CASE_SECONDS).
    The ratio is the median over repetitions of torch time / our time within each
    pair: a slow spell of the machine, which on a shared VM lasts longer than a
    pair, slows both halves of the pair alike and cancels, where it would move the
    median of either side alone.  Returns
    (our median ms, PyTorch's median ms, the paired ratios).
    ``setup(side)`` runs untimed before every call (e.g. a fresh autograd graph)."""
    times = {"ours": [], "torch": []}
    sides = (("ours", ours), ("torch", theirs))
    rep = 0
    while rep <= reps or (rep <= MAX_REPS
                          and min(sum(times["ours"]), sum(times["torch"])) < MIN_SECONDS
                          and sum(times["ours"]) + sum(times["torch"]) < MAX_CASE_SECONDS):
        for side, fn in (sides if rep % 2 == 0 else sides[::-1]):
            arg = setup(side) if setup else None
            t0 = time.perf_counter()
            fn(arg)
            dt = time.perf_counter() - t0
            if rep:
                times[side].append(dt)
        rep += 1
    ratios = [th / us for us, th in zip(times["ours"], times["torch"])]
    return median_ms(times["ours"]), median_ms(times["torch"]), ratios


def quartiles(xs):
    """(first quartile, median, third quartile) of xs."""
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def limit_probe(quick, n):
    """The limit probes' operands, allocated once (harness.LimitProbe): an n x n
    product (1024 with ``quick``, else 2048) and three float32 streams of 256 MB (64
    MB with ``quick``), far past the caches."""
    return LimitProbe(n, sgemm_n=1024 if quick else 2048,
                      stream_floats=(16 if quick else 64) << 20)


# Each case's share is taken against its limit probed right before and right after
# it (LOCAL_REPS repetitions each, the higher of the two windows counting, probe by
# probe; the record keeps them all as local_probes), as its ratio is taken against
# PyTorch in the same stretch: on this shared VM the memory has slow spells of its
# own (the sgemm probe unchanged, the bandwidth probe down by a third), and a limit
# probed minutes earlier put a kernel that met one at 45% of a bandwidth it could
# not have had then.  The run's probe at its start is kept beside it
# (share_of_run_limit).
LOCAL_REPS = 3


def local_probe(kind, probe, fp32_isa):
    """{probe: rate} of ``kind``'s limit, LOCAL_REPS repetitions: the physical peak of
    loop ``fp32_isa`` (None: none) and the sgemm peak, or the four bandwidth probes and
    their best."""
    if kind != "flops":
        return probe.bandwidth(LOCAL_REPS)
    probes = {"sgemm_gflops": probe.sgemm(LOCAL_REPS)["sgemm_gflops"]}
    if fp32_isa:
        probes["fp32_peak_gflops"] = peak.fma_peak(fp32_isa, probe.n_threads, seconds=0.02,
                                                   repeats=LOCAL_REPS)
    return probes


def t(a):
    return torch.from_numpy(a)


def aligned(a):
    """``a`` copied to a 64-byte-aligned buffer, as the training arenas are (PyTorch's
    allocator aligns its own tensors so; NumPy only to 16 bytes).  The PyTorch side
    shares these buffers (``t``)."""
    out = buffers.empty_like(a)
    out[...] = a
    return out


def matmul_cases(B, T, rng, include_lm_head):
    shapes = [("qkv", 3 * C, C, True), ("attproj", C, C, True), ("fc", 4 * C, C, True),
              ("fcproj", C, 4 * C, True)]
    if include_lm_head:
        shapes.append(("lm_head", VP, C, False))
    for name, OC, IC, has_bias in shapes:
        inp = aligned(rng.standard_normal((B, T, IC), dtype=np.float32))
        w = aligned(rng.standard_normal((OC, IC), dtype=np.float32) * 0.02)
        bias = aligned(rng.standard_normal(OC, dtype=np.float32)) if has_bias else None
        out = buffers.empty((B, T, OC))
        dout = aligned(rng.standard_normal((B, T, OC), dtype=np.float32))
        dinp, dw = buffers.zeros(inp.shape), buffers.zeros(w.shape)
        db = buffers.zeros(OC) if has_bias else None
        ti, tw, tb, to, tdo = t(inp), t(w), None if bias is None else t(bias), t(out), t(dout)
        tdi, tdw, tdb = torch.zeros_like(ti), torch.zeros_like(tw), torch.zeros(OC)
        N = B * T
        flops = 2 * N * IC * OC

        def torch_bwd(_, tdo=tdo, ti=ti, tw=tw, tdi=tdi, tdw=tdw, tdb=tdb, has_bias=has_bias,
                      N=N, IC=IC, OC=OC):
            g = tdo.view(N, OC)
            tdi.view(N, IC).addmm_(g, tw)
            tdw.addmm_(g.t(), ti.view(N, IC))
            if has_bias:
                tdb.add_(g.sum(0))

        def torch_fwd(_, ti=ti, tw=tw, tb=tb, to=to, N=N, IC=IC, OC=OC):
            if tb is None:
                torch.mm(ti.view(N, IC), tw.t(), out=to.view(N, OC))
            else:
                torch.addmm(tb, ti.view(N, IC), tw.t(), out=to.view(N, OC))

        yield (f"matmul_forward[{name}]", "flops", flops,
               lambda _, out=out, inp=inp, w=w, bias=bias: matmul.matmul_forward(out, inp, w, bias),
               torch_fwd, None)
        yield (f"matmul_backward[{name}]", "flops", 2 * flops,
               lambda _, a=(dinp, dw, db, dout, inp, w): matmul.matmul_backward(*a),
               torch_bwd, None)


def attention_cases(B, T, rng):
    qkv = aligned(rng.standard_normal((B, T, 3 * C), dtype=np.float32))
    dout = aligned(rng.standard_normal((B, T, C), dtype=np.float32))
    out = buffers.empty((B, T, C))
    lse = buffers.empty((B, NH, T))
    dqkv = buffers.zeros(qkv.shape)
    hs = C // NH
    causal_flops = 2 * B * NH * (T * (T + 1) // 2) * hs
    tq = t(qkv)
    tdout = t(dout).view(B, T, NH, hs).transpose(1, 2)

    def split(x):
        return (p.view(B, T, NH, hs).transpose(1, 2) for p in x.split(C, dim=2))

    def torch_fwd(_):
        with torch.no_grad():
            return F.scaled_dot_product_attention(*split(tq), is_causal=True)

    def graph(side):
        if side == "ours":
            return None
        x = tq.detach().requires_grad_()
        return F.scaled_dot_product_attention(*split(x), is_causal=True)

    attention.attention_forward(out, lse, qkv, NH)
    yield ("attention_forward", "flops", 2 * causal_flops,
           lambda _: attention.attention_forward(out, lse, qkv, NH), torch_fwd, None)
    # The four products the gradient needs; ours also recomputes Q K^T (a fifth), as
    # PyTorch's flash backward does: the rate is of the operation, not of either.
    yield ("attention_backward", "flops", 4 * causal_flops,
           lambda _: attention.attention_backward(dqkv, dout, qkv, out, lse, NH),
           lambda o: o.backward(tdout), graph)


def elementwise_cases(B, T, rng):
    N = B * T
    f4 = 4
    # encoder
    ids = rng.integers(0, V, (B, T), dtype=np.int32)
    wte = aligned(rng.standard_normal((VP, C), dtype=np.float32))
    wpe = aligned(rng.standard_normal((MAXT, C), dtype=np.float32))
    enc = buffers.empty((B, T, C))
    dwte, dwpe = buffers.zeros(wte.shape), buffers.zeros(wpe.shape)
    denc = aligned(rng.standard_normal((B, T, C), dtype=np.float32))
    tids, twte, twpe, tenc = t(ids).long(), t(wte), t(wpe), t(enc)
    tdwte, tdwpe, tdenc = torch.zeros_like(twte), torch.zeros_like(twpe), t(denc)
    yield ("encoder_forward", "bytes", 3 * N * C * f4,
           lambda _: layers.encoder_forward(enc, ids, wte, wpe),
           lambda _: torch.add(twte[tids], twpe[:T], out=tenc), None)
    yield ("encoder_backward", "bytes", 5 * N * C * f4,
           lambda _: layers.encoder_backward(dwte, dwpe, denc, ids),
           lambda _: (tdwte.index_add_(0, tids.view(-1), tdenc.view(N, C)),
                      tdwpe[:T].add_(tdenc.sum(0))), None)
    # layernorm
    x = aligned(rng.standard_normal((B, T, C), dtype=np.float32))
    w = aligned(rng.standard_normal(C, dtype=np.float32))
    bvec = aligned(rng.standard_normal(C, dtype=np.float32))
    y = buffers.empty_like(x)
    mean, rstd = buffers.empty((B, T)), buffers.empty((B, T))
    dy = aligned(rng.standard_normal((B, T, C), dtype=np.float32))
    dx, dw, db = buffers.zeros(x.shape), buffers.zeros(w.shape), buffers.zeros(bvec.shape)
    tx, tw, tb, tdy = t(x), t(w), t(bvec), t(dy)
    _, tmean, trstd = torch.ops.aten.native_layer_norm(tx, [C], tw, tb, 1e-5)
    layers.layernorm_forward(y, mean, rstd, x, w, bvec)
    yield ("layernorm_forward", "bytes", 2 * N * C * f4,
           lambda _: layers.layernorm_forward(y, mean, rstd, x, w, bvec),
           lambda _: torch.ops.aten.native_layer_norm(tx, [C], tw, tb, 1e-5), None)
    yield ("layernorm_backward", "bytes", 4 * N * C * f4,
           lambda _: layers.layernorm_backward(dx, dw, db, dy, x, w, mean, rstd),
           lambda _: torch.ops.aten.native_layer_norm_backward(
               tdy, tx, [C], tmean, trstd, tw, tb, [True, True, True]), None)
    # gelu on the (B, T, 4C) MLP activation
    h = aligned(rng.standard_normal((B, T, 4 * C), dtype=np.float32))
    gh = buffers.empty_like(h)
    dgh = aligned(rng.standard_normal(h.shape, dtype=np.float32))
    dh = buffers.zeros(h.shape)
    th, tgh, tdgh = t(h), t(gh), t(dgh)
    yield ("gelu_forward", "bytes", 2 * N * 4 * C * f4,
           lambda _: layers.gelu_forward(gh, h),
           lambda _: torch.ops.aten.gelu.out(th, approximate="tanh", out=tgh), None)
    yield ("gelu_backward", "bytes", 4 * N * 4 * C * f4,
           lambda _: layers.gelu_backward(dh, h, dgh),
           lambda _: torch.ops.aten.gelu_backward(tdgh, th, approximate="tanh"), None)
    # residual
    r1, r2 = (aligned(rng.standard_normal((B, T, C), dtype=np.float32)) for _ in range(2))
    ro = buffers.empty_like(r1)
    d1, d2 = buffers.zeros(r1.shape), buffers.zeros(r1.shape)
    tr1, tr2, tro, td1, td2 = t(r1), t(r2), t(ro), torch.zeros_like(t(r1)), torch.zeros_like(t(r1))
    yield ("residual_forward", "bytes", 3 * N * C * f4,
           lambda _: layers.residual_forward(ro, r1, r2),
           lambda _: torch.add(tr1, tr2, out=tro), None)
    yield ("residual_backward", "bytes", 5 * N * C * f4,
           lambda _: layers.residual_backward(d1, d2, dy),
           lambda _: (td1.add_(tdy), td2.add_(tdy)), None)
    # softmax + cross-entropy over the padded vocabulary
    logits = aligned(rng.standard_normal((B, T, VP), dtype=np.float32))
    targets = rng.integers(0, V, (B, T), dtype=np.int32)
    losses, lse = buffers.empty((B, T)), buffers.empty((B, T))
    dlosses = np.full((B, T), 1.0 / N, np.float32)
    dlogits = buffers.zeros(logits.shape)
    tl = t(logits).view(N, VP)[:, :V]
    tt = t(targets).long().view(N)
    tdl = t(dlosses).view(N)
    loss.softmax_crossentropy_forward(losses, lse, logits, targets, V)

    def ce_graph(side):
        if side == "ours":
            return None
        x = tl.detach().requires_grad_()
        return F.cross_entropy(x, tt, reduction="none")

    yield ("softmax_crossentropy_forward", "bytes", N * VP * f4,
           lambda _: loss.softmax_crossentropy_forward(losses, lse, logits, targets, V),
           lambda _: F.cross_entropy(tl, tt, reduction="none"), None)
    yield ("softmax_crossentropy_backward", "bytes", 3 * N * VP * f4,
           lambda _: loss.softmax_crossentropy_backward(dlogits, dlosses, logits, lse, targets, V),
           lambda o: o.backward(tdl), ce_graph)


def optimizer_cases(rng):
    n = N_PARAMS
    params = aligned(rng.standard_normal(n, dtype=np.float32) * 0.02)
    grads = aligned(rng.standard_normal(n, dtype=np.float32) * 1e-3)
    m, v = buffers.zeros(n), buffers.zeros(n)
    tp = torch.nn.Parameter(t(aligned(params)))
    tp.grad = t(aligned(grads))
    opt = torch.optim.AdamW([tp], lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    step = [0]

    def ours_adamw(_):
        step[0] += 1
        optim.adamw_step(params, grads, m, v, step[0], 1e-4, weight_decay=0.1)

    f4 = 4
    yield ("adamw_step", "bytes", 7 * n * f4, ours_adamw, lambda _: opt.step(), None)
    yield ("zero_grad", "bytes", n * f4, lambda _: optim.zero_grad(m),
           lambda _: tp.grad.zero_(), None)
    yield ("grad_norm", "bytes", n * f4, lambda _: optim.grad_norm(grads),
           lambda _: torch.linalg.vector_norm(tp.grad), None)
    # max_norm 1 is below the gradients' norm (about 11, then 1 after the first
    # call), so every call scales them, as the 3n bytes count (torch always scales;
    # ours skips the pass when the factor is 1)
    yield ("clip_grad_norm", "bytes", 3 * n * f4, lambda _: optim.clip_grad_norm(grads, 1.0),
           lambda _: torch.nn.utils.clip_grad_norm_([tp], 1.0), None)


def run(args):
    n = args.threads or threads.available_cores()
    torch.set_num_threads(n)
    threads.set_num_threads(n)
    probe = limit_probe(args.quick, n)
    limits = probe.measure(args.reps)
    print(f"threads {n}; physical peak "
          + ", ".join(f"{isa} {rate:.1f}" for isa, rate in limits["peak_gflops_by_isa"].items())
          + f" GFLOP/s (register-only FMA); sgemm peak {limits['sgemm_gflops']:.1f} GFLOP/s "
          f"(n={limits['sgemm_n']}, best rep: ours {limits['ours_sgemm_gflops']:.1f}, SciPy "
          f"{limits['scipy_sgemm_gflops']:.1f}, PyTorch {limits['torch_sgemm_gflops']:.1f}); "
          f"memory bandwidth {limits['bandwidth_gbs']:.1f} GB/s "
          f"(add {limits['add_gbs']:.1f}, copy {limits['copy_gbs']:.1f}, "
          f"in-place update {limits['update_gbs']:.1f}, read {limits['read_gbs']:.1f}); "
          f"each case's share is of its limit probed beside it (column 'limit': the "
          f"{compute_limit(limits)[1]} or the bandwidth; column 'sgemm': the sgemm peak beside it)")
    configs = [(4, 64)] if args.quick else [(4, 64), (8, 1024)]
    records = []
    header = (f"{'kernel':34s} {'shape':>15s} {'ours ms':>9s} {'torch ms':>9s} {'ratio':>6s} "
              f"{'quartiles':>11s} {'reps':>4s} {'rate':>14s} {'limit':>6s} {'share':>6s} {'sgemm':>6s}")
    print(header)
    print("-" * len(header))

    def record(name, shape, kind, amount, setup, ours, theirs):
        before = local_probe(kind, probe, limits["fp32_peak_isa"])
        ours_ms, torch_ms, ratios = race(ours, theirs, args.reps, setup)
        after = local_probe(kind, probe, limits["fp32_peak_isa"])
        probes = {k: max(before[k], after[k]) for k in before}
        unit_key = "gflops" if kind == "flops" else "gbps"
        if kind == "flops":
            limit, run_limit = compute_limit(probes)[0], compute_limit(limits)[0]
        else:
            limit, run_limit = probes["bandwidth_gbs"], limits["bandwidth_gbs"]
        sgemm = probes.get("sgemm_gflops")
        rate = amount / (ours_ms * 1e-3) / 1e9
        q1, ratio, q3 = quartiles(ratios)
        rec = {"kernel": name, "shape": shape, "threads": n, "ours_ms": ours_ms,
               "torch_ms": torch_ms, "ratio": ratio, "ratio_q1": q1, "ratio_q3": q3,
               "reps": len(ratios), "share": rate / limit, "limit_" + unit_key: limit,
               "share_of_run_limit": rate / run_limit, "local_probes": probes,
               "share_of_sgemm": rate / sgemm if sgemm else None,
               unit_key: rate, "torch_" + unit_key: amount / (torch_ms * 1e-3) / 1e9}
        records.append(rec)
        unit = "GFLOP/s" if kind == "flops" else "GB/s"
        print(f"{name:34s} {shape:>15s} {ours_ms:9.3f} {torch_ms:9.3f} {ratio:6.2f} "
              f"{q1:5.2f}-{q3:<5.2f} {len(ratios):4d} {rate:8.1f} {unit:>5s} {limit:6.1f} "
              f"{rec['share']:6.0%} {f'{sgemm:6.1f}' if sgemm else '-':>6s}",
              flush=True)

    for B, T in configs:
        rng = np.random.default_rng(B * 10000 + T)
        shape = f"B={B},T={T}"
        cases = [matmul_cases(B, T, rng, include_lm_head=(T <= 64 or args.lm_head)),
                 attention_cases(B, T, rng), elementwise_cases(B, T, rng)]
        for group in cases:
            for name, kind, amount, ours, theirs, setup in group:
                record(name, shape, kind, amount, setup, ours, theirs)
    for name, kind, amount, ours, theirs, setup in optimizer_cases(np.random.default_rng(1)):
        record(name, f"n={N_PARAMS}", kind, amount, setup, ours, theirs)
    return n, limits, records


def plot(records, n, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in records))
    fig, axes = plt.subplots(len(shapes), 1, figsize=(11, 3.2 + 0.28 * len(records)),
                             squeeze=False)
    for ax, shape in zip(axes[:, 0], shapes):
        rows = [r for r in records if r["shape"] == shape]
        names = [r["kernel"] for r in rows]
        ratios = [r["ratio"] for r in rows]
        spread = [[r["ratio"] - r["ratio_q1"] for r in rows],
                  [r["ratio_q3"] - r["ratio"] for r in rows]]
        colors = ["tab:green" if x >= 1 else "tab:red" for x in ratios]
        ax.barh(names, ratios, color=colors, xerr=spread, ecolor="black", capsize=2)
        ax.axvline(1.0, color="black", lw=1)
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_title(f"{shape}: PyTorch time / ours, median of paired runs, quartiles "
                     f"({n} threads)", fontsize=10)
        for i, r in enumerate(rows):
            ax.text(r["ratio"], i, f" {r['ratio']:.2f}x, {r['share']:.0%} of limit",
                    va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="B=4,T=64 only, small limit probes")
    parser.add_argument("--threads", type=int, default=None, help="threads for both sides "
                        "(default: all available cores)")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per side (>= 5)")
    parser.add_argument("--lm-head", action="store_true",
                        help="also time the (V, C) LM-head matmul at B=8,T=1024 (minutes)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/kernels"
                        "[_quick].json; the PNG goes beside it)")
    args = parser.parse_args(argv)
    if argv is None:
        blas_dispatch.ensure()
    if args.reps < 5:
        parser.error("--reps must be at least 5 (median of >= 5)")
    n, limits, records = run(args)
    out = pathlib.Path(args.out) if args.out else \
        RESULTS / ("kernels_quick.json" if args.quick else "kernels.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"threads": n, "torch": torch.__version__, "numpy": np.__version__,
            "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            **blas_dispatch.record(), **limits}
    for r in records:
        r["limits"] = meta
    out.write_text(json.dumps(records, indent=1))
    plot(records, n, out.with_suffix(".png"))
    met = [r for r in records if r["ratio"] >= 1]
    behind = [f"{r['kernel']} {r['shape']} {r['ratio']:.2f} ({r['ratio_q1']:.2f}-"
              f"{r['ratio_q3']:.2f})" for r in records if r["ratio"] < 1]
    print(f"\n{len(met)}/{len(records)} kernels at least as fast as PyTorch (median paired "
          f"ratio); wrote {out} and {out.with_suffix('.png')}")
    if behind:
        print("behind (ratio, quartiles): " + "; ".join(behind))


if __name__ == "__main__":
    main()
