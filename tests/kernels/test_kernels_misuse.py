"""Kernels misused through their Python entry points: zero sizes, absurd thread counts,
read-only outputs and outputs that overlap inputs or each other.  Each either does the
right thing or raises ValueError naming the argument; none may crash, write where it
was not asked to, or return a wrong result.

Cases that used to crash the interpreter (SIGFPE at C=0, SIGSEGV or libgomp's exit for
65536 threads) run in child processes: one child runs a batch of cases and reports each
as it finishes, so a crash fails its own case, and the batch goes on in a new child.
"""
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from kernels import _openmp, gemm, layers, loss, matmul, optim, threads

# --------------------------------------------------------------------------- kernels

F32 = np.float32


def _rand(rng, shape, dtype=F32):
    return rng.standard_normal(shape).astype(dtype)


def _ln_stats(x):
    mean = x.mean(-1)
    rstd = 1.0 / np.sqrt(x.var(-1) + 1e-5)
    return mean.astype(x.dtype), rstd.astype(x.dtype)


# Every kernel: its sizes (with the default each takes), its outputs' names, and
# build(rng, sizes, dtype) -> (outputs dict, inputs dict, call(fn, outputs, inputs, **kw)).
# The default sizes are small but not tiny, so that an aliasing bug shows.

def _encoder_forward(rng, s, dt):
    B, T, C, Vp, maxT = s["B"], s["T"], s["C"], s["Vp"], s["maxT"]
    ins = dict(ids=rng.integers(0, max(Vp, 1), (B, T)).astype(np.int32),
               wte=_rand(rng, (Vp, C), dt), wpe=_rand(rng, (maxT, C), dt))
    outs = dict(out=_rand(rng, (B, T, C), dt))
    return outs, ins, lambda f, o, i, **kw: f(o["out"], i["ids"], i["wte"], i["wpe"], **kw)


def _encoder_backward(rng, s, dt):
    B, T, C, Vp, maxT = s["B"], s["T"], s["C"], s["Vp"], s["maxT"]
    ins = dict(dout=_rand(rng, (B, T, C), dt),
               ids=rng.integers(0, max(Vp, 1), (B, T)).astype(np.int32))
    outs = dict(dwte=_rand(rng, (Vp, C), dt), dwpe=_rand(rng, (maxT, C), dt))
    return outs, ins, lambda f, o, i, **kw: f(o["dwte"], o["dwpe"], i["dout"], i["ids"], **kw)


def _layernorm_forward(rng, s, dt):
    B, T, C = s["B"], s["T"], s["C"]
    ins = dict(inp=_rand(rng, (B, T, C), dt), weight=_rand(rng, C, dt), bias=_rand(rng, C, dt))
    outs = dict(out=_rand(rng, (B, T, C), dt), mean=_rand(rng, (B, T), dt),
                rstd=_rand(rng, (B, T), dt))
    return outs, ins, lambda f, o, i, **kw: f(o["out"], o["mean"], o["rstd"], i["inp"],
                                              i["weight"], i["bias"], **kw)


def _layernorm_backward(rng, s, dt):
    B, T, C = s["B"], s["T"], s["C"]
    inp = _rand(rng, (B, T, C), dt)
    mean, rstd = _ln_stats(inp)
    ins = dict(dout=_rand(rng, (B, T, C), dt), inp=inp, weight=_rand(rng, C, dt),
               mean=mean, rstd=rstd)
    outs = dict(dinp=_rand(rng, (B, T, C), dt), dweight=_rand(rng, C, dt),
                dbias=_rand(rng, C, dt))
    return outs, ins, lambda f, o, i, **kw: f(o["dinp"], o["dweight"], o["dbias"], i["dout"],
                                              i["inp"], i["weight"], i["mean"], i["rstd"], **kw)


def _gelu_forward(rng, s, dt):
    shape = (s["B"], s["T"], s["C"])
    return (dict(out=_rand(rng, shape, dt)), dict(inp=_rand(rng, shape, dt)),
            lambda f, o, i, **kw: f(o["out"], i["inp"], **kw))


def _gelu_backward(rng, s, dt):
    shape = (s["B"], s["T"], s["C"])
    return (dict(dinp=_rand(rng, shape, dt)),
            dict(inp=_rand(rng, shape, dt), dout=_rand(rng, shape, dt)),
            lambda f, o, i, **kw: f(o["dinp"], i["inp"], i["dout"], **kw))


def _residual_forward(rng, s, dt):
    shape = (s["B"], s["T"], s["C"])
    return (dict(out=_rand(rng, shape, dt)),
            dict(inp1=_rand(rng, shape, dt), inp2=_rand(rng, shape, dt)),
            lambda f, o, i, **kw: f(o["out"], i["inp1"], i["inp2"], **kw))


def _residual_backward(rng, s, dt):
    shape = (s["B"], s["T"], s["C"])
    return (dict(dinp1=_rand(rng, shape, dt), dinp2=_rand(rng, shape, dt)),
            dict(dout=_rand(rng, shape, dt)),
            lambda f, o, i, **kw: f(o["dinp1"], o["dinp2"], i["dout"], **kw))


def _matmul_forward(rng, s, dt):
    B, T, C, OC = s["B"], s["T"], s["C"], s["OC"]
    ins = dict(inp=_rand(rng, (B, T, C), dt), weight=_rand(rng, (OC, C), dt),
               bias=_rand(rng, OC, dt))
    outs = dict(out=_rand(rng, (B, T, OC), dt))
    return outs, ins, lambda f, o, i, **kw: f(o["out"], i["inp"], i["weight"], i["bias"], **kw)


def _matmul_backward(rng, s, dt):
    B, T, C, OC = s["B"], s["T"], s["C"], s["OC"]
    ins = dict(dout=_rand(rng, (B, T, OC), dt), inp=_rand(rng, (B, T, C), dt),
               weight=_rand(rng, (OC, C), dt))
    outs = dict(dinp=_rand(rng, (B, T, C), dt), dweight=_rand(rng, (OC, C), dt),
                dbias=_rand(rng, OC, dt))
    return outs, ins, lambda f, o, i, **kw: f(o["dinp"], o["dweight"], o["dbias"], i["dout"],
                                              i["inp"], i["weight"], **kw)


def _gemm(rng, s, dt):
    M, N, K = s["M"], s["N"], s["K"]
    ins = dict(a=_rand(rng, (K, M), dt), b=_rand(rng, (K, N), dt), bias=_rand(rng, N, dt))
    outs = dict(c=_rand(rng, (M, N), dt))
    return outs, ins, lambda f, o, i, **kw: f(o["c"], i["a"], i["b"], i["bias"], trans_a=True,
                                              beta=0.5, **kw)


def _ce_inputs(rng, s, dt):
    B, T, V, Vp = s["B"], s["T"], s["V"], s["Vp"]
    logits = _rand(rng, (B, T, Vp), dt)
    targets = rng.integers(0, max(V, 1), (B, T)).astype(np.int32)
    m = logits[..., :V].max(-1, initial=0) if V else np.zeros((B, T), dt)
    lse = (m + np.log(np.exp(logits[..., :V] - m[..., None]).sum(-1))).astype(dt)
    return logits, targets, lse


def _ce_forward(rng, s, dt):
    logits, targets, _ = _ce_inputs(rng, s, dt)
    lead = logits.shape[:-1]
    return (dict(losses=_rand(rng, lead, dt), lse=_rand(rng, lead, dt)),
            dict(logits=logits, targets=targets),
            lambda f, o, i, **kw: f(o["losses"], o["lse"], i["logits"], i["targets"], s["V"],
                                    **kw))


def _ce_backward(rng, s, dt):
    logits, targets, lse = _ce_inputs(rng, s, dt)
    return (dict(dlogits=_rand(rng, logits.shape, dt)),
            dict(dlosses=_rand(rng, logits.shape[:-1], dt), logits=logits, lse=lse,
                 targets=targets),
            lambda f, o, i, **kw: f(o["dlogits"], i["dlosses"], i["logits"], i["lse"],
                                    i["targets"], s["V"], **kw))


def _adamw(rng, s, dt):
    n = s["n"]
    return (dict(params=_rand(rng, n, dt), m=_rand(rng, n, dt),
                 v=np.abs(_rand(rng, n, dt))),
            dict(grads=_rand(rng, n, dt)),
            lambda f, o, i, **kw: f(o["params"], i["grads"], o["m"], o["v"], 3, 1e-3,
                                    weight_decay=0.1, **kw))


def _zero_grad(rng, s, dt):
    return (dict(grads=_rand(rng, s["n"], dt)), {}, lambda f, o, i, **kw: f(o["grads"], **kw))


def _grad_norm(rng, s, dt):
    return ({}, dict(grads=_rand(rng, s["n"], dt)), lambda f, o, i, **kw: f(i["grads"], **kw))


def _clip_grad_norm(rng, s, dt):
    return (dict(grads=_rand(rng, s["n"], dt)), {},
            lambda f, o, i, **kw: f(o["grads"], 0.5, **kw))


BTC = dict(B=2, T=3, C=20)
# name: (fast kernel, naive twin or None, builder, default sizes, has an overwrite flag)
KERNELS = {
    "encoder_forward": (layers.encoder_forward, layers.encoder_forward_naive,
                        _encoder_forward, dict(BTC, Vp=7, maxT=5), False),
    "encoder_backward": (layers.encoder_backward, layers.encoder_backward_naive,
                         _encoder_backward, dict(BTC, Vp=7, maxT=5), True),
    "layernorm_forward": (layers.layernorm_forward, layers.layernorm_forward_naive,
                          _layernorm_forward, BTC, False),
    "layernorm_backward": (layers.layernorm_backward, layers.layernorm_backward_naive,
                           _layernorm_backward, BTC, True),
    "gelu_forward": (layers.gelu_forward, layers.gelu_forward_naive, _gelu_forward, BTC, False),
    "gelu_backward": (layers.gelu_backward, layers.gelu_backward_naive, _gelu_backward, BTC,
                      True),
    "residual_forward": (layers.residual_forward, layers.residual_forward_naive,
                         _residual_forward, BTC, False),
    "residual_backward": (layers.residual_backward, layers.residual_backward_naive,
                          _residual_backward, BTC, True),
    "matmul_forward": (matmul.matmul_forward, matmul.matmul_forward_naive, _matmul_forward,
                       dict(BTC, OC=24), False),
    "matmul_backward": (matmul.matmul_backward, matmul.matmul_backward_naive, _matmul_backward,
                        dict(BTC, OC=24), True),
    "gemm_rowmajor": (gemm.gemm_rowmajor, None, _gemm, dict(M=6, N=24, K=20), False),
    "softmax_crossentropy_forward": (loss.softmax_crossentropy_forward,
                                     loss.softmax_crossentropy_forward_naive, _ce_forward,
                                     dict(B=2, T=3, V=11, Vp=16), False),
    "softmax_crossentropy_backward": (loss.softmax_crossentropy_backward,
                                      loss.softmax_crossentropy_backward_naive, _ce_backward,
                                      dict(B=2, T=3, V=11, Vp=16), True),
    "adamw_step": (optim.adamw_step, optim.adamw_step_naive, _adamw, dict(n=40), False),
    "zero_grad": (optim.zero_grad, optim.zero_grad_naive, _zero_grad, dict(n=40), False),
    "grad_norm": (optim.grad_norm, optim.grad_norm_naive, _grad_norm, dict(n=40), False),
    "clip_grad_norm": (optim.clip_grad_norm, optim.clip_grad_norm_naive, _clip_grad_norm,
                       dict(n=40), False),
}


def _gemm_reference(c, a, b, bias, *, trans_a, beta, n_threads=None):
    c[...] = a.astype(float).T @ b.astype(float) + beta * c.astype(float) + bias
    return c


def _naive_of(name):
    fast, naive = KERNELS[name][:2]
    return naive if naive is not None else _gemm_reference


def _copies(arrays):
    return {k: v.copy() for k, v in arrays.items()}


def _outcome(call):
    """'ok', or the exception as 'TypeName: message'."""
    try:
        call()
    except Exception as e:      # noqa: BLE001 - the outcome is the test's subject
        return f"{type(e).__name__}: {e}"
    return "ok"


# --------------------------------------------------------------------------- cases

def case_zero(name, size, overwrite, n_threads):
    """``name`` with ``size`` set to 0: the fast kernel gives what its naive twin gives
    (outputs and return value), or both raise the same ValueError."""
    fast, naive, build, sizes, _ = KERNELS[name]
    sizes = {k: 0 if size in (k, "all") else v for k, v in sizes.items()}
    kw = {"overwrite": overwrite} if overwrite is not None else {}
    outs, ins, call = build(np.random.default_rng(1), sizes, F32)
    ref_outs, ref_ins = _copies(outs), _copies(ins)
    result = {}
    got = _outcome(lambda: result.setdefault("fast", call(fast, outs, ins, n_threads=n_threads,
                                                          **kw)))
    want = _outcome(lambda: result.setdefault("naive", call(_naive_of(name), ref_outs, ref_ins,
                                                            **kw)))
    if got != want:
        return f"fast: {got} / naive: {want}"
    if got != "ok":
        return got
    for key in outs:
        if not np.allclose(outs[key], ref_outs[key], rtol=1e-4, atol=1e-5):
            return f"{key} differs from the naive twin's"
    if not np.allclose(result["fast"] if result["fast"] is not None else 0,
                       result["naive"] if result["naive"] is not None else 0, rtol=1e-5):
        return f"returned {result['fast']}, naive {result['naive']}"
    return "ok"


def case_threads(name, twin, n_threads):
    fast, naive, build, sizes, _ = KERNELS[name]
    kernel = fast if twin == "fast" else naive
    outs, ins, call = build(np.random.default_rng(2), sizes, F32)
    return _outcome(lambda: call(kernel, outs, ins, n_threads=n_threads))


def case_set_num_threads(n):
    return _outcome(lambda: threads.set_num_threads(n))


def case_flush_denormal(n):
    return _outcome(lambda: _openmp.set_flush_denormal(True, n))


CASES = {"zero": case_zero, "threads": case_threads, "set_num_threads": case_set_num_threads,
         "flush_denormal": case_flush_denormal}


def _child_main(batch):
    for key, args in batch:
        print("START", key, flush=True)
        print("RESULT", key, CASES[args[0]](*args[1:]), flush=True)


TESTS_DIR = str(pathlib.Path(__file__).resolve().parent)
CHILD = ("import sys, json; sys.path.insert(0, {tests!r}); import test_kernels_misuse as m; "
         "m._child_main(json.loads(sys.argv[1]))")


def run_batch(batch, timeout=120):
    """{key: outcome} for [(key, (case, *args))], each in a child process; a case that
    kills its child gets 'crash: ...', and the rest go on in a new child."""
    import json
    import kernels
    root = str(pathlib.Path(kernels.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results = {}
    todo = list(batch)
    while todo:
        try:
            run = subprocess.run([sys.executable, "-c", CHILD.format(tests=TESTS_DIR),
                                  json.dumps(todo)], capture_output=True, text=True,
                                 timeout=timeout, env=env)
            stdout, died = run.stdout, f"rc {run.returncode}: {run.stderr.strip()[-300:]}"
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            died = f"timed out after {timeout} s"
        started = None
        for line in stdout.splitlines():
            word, _, rest = line.partition(" ")
            key, _, outcome = rest.partition(" ")
            if word == "START":
                started = key
            elif word == "RESULT":
                results[key] = outcome
                started = None
        if started is None:
            if all(key in results for key, _ in todo):
                break
            raise AssertionError(f"the child died outside any case: {died}")
        results[started] = f"crash ({died})"
        todo = [(k, a) for k, a in todo if k not in results]
    return results


# --------------------------------------------------------------------------- item 6

ZERO_CASES = [(name, size, ow, nt)
              for name, (_, _, _, sizes, has_ow) in KERNELS.items()
              for size in (*sizes, "all")
              for ow in ((False, True) if has_ow else (None,))
              for nt in (None, 3)]

# The zero sizes a kernel rejects, with what its ValueError says; every other zero
# size must give what the naive twin gives.  No row can be normalised over C = 0
# channels, nor a softmax taken over V = 0 classes; with Vp = 0 rows of wte no id is
# valid, and wpe needs a row per position.
ZERO_ERRORS = {
    ("encoder_forward", "Vp"): r"ids must lie in \[0, 0\)",
    ("encoder_forward", "maxT"): r"wpe must have shape \(maxT, 20\) with maxT >= T=3",
    ("encoder_backward", "Vp"): r"ids must lie in \[0, 0\)",
    ("encoder_backward", "maxT"): r"dwpe must have shape \(maxT, 20\) with maxT >= T=3",
    ("layernorm_forward", "C"): r"with C >= 1, got \(2, 3, 0\)",
    ("layernorm_forward", "all"): r"with C >= 1, got \(0, 0, 0\)",
    ("layernorm_backward", "C"): r"with C >= 1, got \(2, 3, 0\)",
    ("layernorm_backward", "all"): r"with C >= 1, got \(0, 0, 0\)",
    ("softmax_crossentropy_forward", "V"): r"V must be an integer in \[1, Vp=16\], got 0",
    ("softmax_crossentropy_forward", "Vp"): r"V must be an integer in \[1, Vp=0\], got 11",
    ("softmax_crossentropy_forward", "all"): r"V must be an integer in \[1, Vp=0\], got 0",
    ("softmax_crossentropy_backward", "V"): r"V must be an integer in \[1, Vp=16\], got 0",
    ("softmax_crossentropy_backward", "Vp"): r"V must be an integer in \[1, Vp=0\], got 11",
    ("softmax_crossentropy_backward", "all"): r"V must be an integer in \[1, Vp=0\], got 0",
}


def _key(*parts):
    return "/".join(str(p) for p in parts)


@pytest.fixture(scope="module")
def zero_results():
    return run_batch([(_key(*c), ("zero", *c)) for c in ZERO_CASES])


@pytest.mark.parametrize("name,size,overwrite,n_threads", ZERO_CASES, ids=_key)
def test_zero_size_gives_the_naive_result_or_a_value_error(zero_results, name, size,
                                                           overwrite, n_threads):
    outcome = zero_results[_key(name, size, overwrite, n_threads)]
    error = ZERO_ERRORS.get((name, size))
    if error is None:
        assert outcome == "ok"
    else:
        assert re.fullmatch("ValueError: .*" + error + ".*", outcome), outcome


# --------------------------------------------------------------------------- item 7

CAP = 4096          # kernels.threads.MAX_THREADS
THREAD_COUNTS = (CAP + 1, 65536, 0, -1, True, 2.0)
THREAD_CASES = [(name, twin, n) for name, k in KERNELS.items()
                for twin in (("fast", "naive") if k[1] is not None else ("fast",))
                for n in THREAD_COUNTS]


def _thread_error(n, name="n_threads"):
    return (f"ValueError: {name} must be an integer in [1, {CAP}] "
            f"(kernels.threads.MAX_THREADS), got {n!r}")


@pytest.fixture(scope="module")
def thread_results():
    batch = [(_key(*c), ("threads", *c)) for c in THREAD_CASES]
    batch += [(_key("set_num_threads", n), ("set_num_threads", n)) for n in THREAD_COUNTS]
    batch += [(_key("set_flush_denormal", n), ("flush_denormal", n)) for n in THREAD_COUNTS]
    return run_batch(batch)


def test_thread_cap_is_documented():
    assert threads.MAX_THREADS == _openmp.MAX_THREADS == CAP


@pytest.mark.parametrize("name,twin,n_threads", THREAD_CASES, ids=_key)
def test_thread_count_out_of_range_is_a_value_error(thread_results, name, twin, n_threads):
    assert thread_results[_key(name, twin, n_threads)] == _thread_error(n_threads)


@pytest.mark.parametrize("n", THREAD_COUNTS)
def test_set_num_threads_out_of_range_is_a_value_error(thread_results, n):
    assert thread_results[_key("set_num_threads", n)] == _thread_error(
        n, "the number of threads")


@pytest.mark.parametrize("n", THREAD_COUNTS)
def test_set_flush_denormal_thread_count_out_of_range_is_a_value_error(thread_results, n):
    assert thread_results[_key("set_flush_denormal", n)] == _thread_error(n)


def _child(code, **env):
    import kernels
    root = str(pathlib.Path(kernels.__file__).resolve().parent.parent)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=root, **env))


def test_omp_num_threads_above_the_cap_is_a_value_error():
    run = _child("from kernels import threads; threads.get_num_threads()",
                 OMP_NUM_THREADS="40000")
    assert run.returncode == 1
    assert run.stderr.strip().endswith(_thread_error(40000, "OMP_NUM_THREADS")), run.stderr


def test_the_cap_itself_runs():
    # A parallel region starts its whole team whatever the work: MAX_THREADS threads
    # start here (libgomp ends the process where it cannot) and give the one-thread
    # result.
    run = _child("import numpy as np\n"
                 "from kernels import layers, threads, _openmp\n"
                 "a = np.arange(1 << 16, dtype=np.float32); b = a[::-1].copy()\n"
                 "one, many = np.empty_like(a), np.empty_like(a)\n"
                 "layers.residual_forward(one, a, b, n_threads=1)\n"
                 "layers.residual_forward(many, a, b, n_threads=threads.MAX_THREADS)\n"
                 "assert (one == many).all() and (one == 65535).all()\n"
                 "assert threads.set_num_threads(threads.MAX_THREADS) == threads.MAX_THREADS\n"
                 "assert _openmp.set_flush_denormal(True, threads.MAX_THREADS)\n")
    assert run.returncode == 0, run.stderr


def test_malloc_retention_keeps_large_buffers_for_the_next_step():
    # Two 300 MB arrays written, freed and allocated again (a Llama head's logits and
    # their gradient, step after step): with the retention set they come back from the
    # heap, no page faulted in again (past a 256 MiB mmap threshold each was mapped
    # afresh, ~150 k faults a round, and on a VM a host fault each).  In a child: the
    # setting is process-wide.
    run = _child("import resource\n"
                 "from adtape import buffers\n"
                 "from kernels import _openmp\n"
                 "assert _openmp.malloc_mmap_threshold() is None\n"
                 "assert _openmp.set_malloc_retention()\n"
                 "assert _openmp.malloc_mmap_threshold() == 1 << 30\n"
                 "def round_():\n"
                 "    a = buffers.empty(75 << 20); a[...] = 1.0\n"
                 "    b = buffers.empty(75 << 20); b[...] = 2.0\n"
                 "    del a, b\n"
                 "round_()\n"
                 "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
                 "round_(); round_()\n"
                 "faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before\n"
                 "assert faults < 1000, faults\n"
                 "for bad in (-1, 1 << 31):\n"
                 "    try:\n"
                 "        _openmp.set_malloc_retention(bad)\n"
                 "    except ValueError as e:\n"
                 "        assert 'nbytes must lie in' in str(e)\n"
                 "    else:\n"
                 "        raise AssertionError(bad)\n")
    assert run.returncode == 0, run.stderr


# --------------------------------------------------------------------------- item 9

def case_read_only(name, twin, output):
    """``output`` read-only: ValueError naming it, and nothing written anywhere."""
    fast, naive, build, sizes, _ = KERNELS[name]
    outs, ins, call = build(np.random.default_rng(3), sizes, F32)
    before = _copies({**outs, **ins})
    outs[output].flags.writeable = False
    got = _outcome(lambda: call(fast if twin == "fast" else naive, outs, ins))
    if any(not np.array_equal(a, before[k]) for k, a in {**outs, **ins}.items()):
        return got + " (and wrote)"
    return got


def _placed_together(first, second, offset):
    """Copies of two arrays in one buffer, the second starting ``offset`` floats into
    the first (each keeps its values where they do not overlap)."""
    nbytes = max(first.nbytes, 4 * offset + second.nbytes)
    buf = np.zeros(nbytes // 4, np.float32)
    a = buf[:first.size].view(first.dtype).reshape(first.shape)
    b = buf[offset:offset + second.size].view(second.dtype).reshape(second.shape)
    a[...] = first
    b[...] = second
    return a, b


def case_alias(name, twin, output, other, offset):
    """``output`` placed over ``other`` (an input or another output), ``offset`` floats
    apart: what the kernel says."""
    fast, naive, build, sizes, _ = KERNELS[name]
    outs, ins, call = build(np.random.default_rng(4), sizes, F32)
    where = outs if other in outs else ins
    outs[output], where[other] = _placed_together(outs[output], where[other], offset)
    return _outcome(lambda: call(fast if twin == "fast" else naive, outs, ins))


CASES.update(read_only=case_read_only, alias=case_alias)


def _twins(name):
    return ("fast", "naive") if KERNELS[name][1] is not None else ("fast",)


def _arrays(name):
    fast, naive, build, sizes, _ = KERNELS[name]
    outs, ins, _ = build(np.random.default_rng(0), sizes, F32)
    return outs, ins


READ_ONLY_CASES = [(name, twin, output) for name in KERNELS for twin in _twins(name)
                   for output in _arrays(name)[0]]

# Pairs a kernel documents as in place, when they are the very same memory.
SAME_OK = {("residual_forward", "out", "inp1"), ("residual_forward", "out", "inp2"),
           ("softmax_crossentropy_backward", "dlogits", "logits"),
           ("layernorm_backward", "dweight", "dbias"), ("matmul_backward", "dinp", "dweight")}


def _alias_cases():
    cases = []
    for name in KERNELS:
        outs, ins = _arrays(name)
        names = list(outs) + list(ins)
        for i, output in enumerate(outs):
            for other in names[i + 1:]:
                smaller = min(outs[output].size, {**outs, **ins}[other].size)
                for offset in sorted({0, smaller // 2, smaller - 1}):
                    for twin in _twins(name):
                        cases.append((name, twin, output, other, offset))
    return cases


ALIAS_CASES = _alias_cases()


@pytest.fixture(scope="module")
def misuse_results():
    return run_batch([(_key(*c), ("read_only", *c)) for c in READ_ONLY_CASES]
                     + [(_key(*c), ("alias", *c)) for c in ALIAS_CASES])


@pytest.mark.parametrize("name,twin,output", READ_ONLY_CASES, ids=_key)
def test_read_only_output_is_a_value_error(misuse_results, name, twin, output):
    assert misuse_results[_key(name, twin, output)] == (
        f"ValueError: {output} must be writable (it is an output)")


def test_gemm_does_not_write_into_bytes():
    a = np.ones((4, 4), np.float32)
    frozen = bytes(64)
    c = np.frombuffer(frozen, np.float32).reshape(4, 4)
    with pytest.raises(ValueError, match="^c must be writable"):
        gemm.gemm_rowmajor(c, a, a)
    assert frozen == bytes(64)


@pytest.mark.parametrize("name,twin,output,other,offset", ALIAS_CASES, ids=_key)
def test_output_overlapping_an_input_or_output_is_a_value_error(misuse_results, name, twin,
                                                                output, other, offset):
    outcome = misuse_results[_key(name, twin, output, other, offset)]
    outs, ins = _arrays(name)
    same = offset == 0 and outs[output].nbytes == {**outs, **ins}[other].nbytes
    if same and (name, output, other) in SAME_OK:
        assert outcome == "ok"
    else:
        assert outcome.startswith(f"ValueError: {output} overlaps {other}: "), outcome


def _shared_grads(kernel, call, shape, flags):
    """The gradient a kernel leaves in one array given as both of two outputs
    (overwrite ``flags`` for them), and what two separate arrays give added up."""
    rng = np.random.default_rng(5)
    prior = _rand(rng, shape)
    first, second = np.zeros(shape, F32), np.zeros(shape, F32)
    call(kernel, first, second, (False, False))
    shared = np.full(shape, np.nan, F32) if flags[0] else prior.copy()
    call(kernel, shared, shared, flags)
    return shared, (0 if flags[0] else prior) + first + second


@pytest.mark.parametrize("flags", [(False, False), (True, False)])
@pytest.mark.parametrize("twin", ["fast", "naive"])
def test_layernorm_dweight_may_be_dbias(flags, twin):
    rng = np.random.default_rng(6)
    outs, ins, _ = _layernorm_backward(rng, BTC, F32)
    kernel = KERNELS["layernorm_backward"][0 if twin == "fast" else 1]

    def call(k, dw, db, ow):
        k(outs["dinp"], dw, db, ins["dout"], ins["inp"], ins["weight"], ins["mean"],
          ins["rstd"], overwrite=(False, *ow))
    got, want = _shared_grads(kernel, call, (BTC["C"],), flags)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags", [(False, False), (True, False)])
@pytest.mark.parametrize("twin", ["fast", "naive"])
def test_matmul_dinp_may_be_dweight(flags, twin):
    rng = np.random.default_rng(7)
    C = 20
    x, dout = _rand(rng, (C, C)), _rand(rng, (C, C))     # N = OC: dinp and dweight alike
    kernel = KERNELS["matmul_backward"][0 if twin == "fast" else 1]

    def call(k, dinp, dw, ow):
        k(dinp, dw, None, dout, x, x, overwrite=(*ow, False))
    got, want = _shared_grads(kernel, call, (C, C), flags)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("twin", ["fast", "naive"])
def test_second_of_one_shared_output_may_not_be_overwritten(twin):
    rng = np.random.default_rng(8)
    outs, ins, _ = _layernorm_backward(rng, BTC, F32)
    kernel = KERNELS["layernorm_backward"][0 if twin == "fast" else 1]
    dw = outs["dweight"]
    with pytest.raises(ValueError, match="^dbias is dweight: overwrite may be set for dweight"):
        kernel(outs["dinp"], dw, dw, ins["dout"], ins["inp"], ins["weight"], ins["mean"],
               ins["rstd"], overwrite=(False, True, True))
    x = _rand(rng, (4, 4))
    kernel = KERNELS["matmul_backward"][0 if twin == "fast" else 1]
    d = np.zeros((4, 4), F32)
    with pytest.raises(ValueError, match="^dweight is dinp: overwrite may be set for dinp"):
        kernel(d, d, None, x, x, x, overwrite=(False, True, False))


@pytest.mark.parametrize("twin", ["fast", "naive"])
@pytest.mark.parametrize("which", ["inp1", "inp2"])
def test_residual_forward_in_place(twin, which):
    rng = np.random.default_rng(9)
    a, b = _rand(rng, 50), _rand(rng, 50)
    want = a + b
    kernel = KERNELS["residual_forward"][0 if twin == "fast" else 1]
    out = a if which == "inp1" else b
    kernel(out, a, b)
    np.testing.assert_array_equal(out, want)
