"""Checkpointing: gradients equal the full tape's exactly, the number of recomputed
steps is the binomial optimum, peak tape memory falls as predicted; and a program
whose residuals exceed the memory budget keeps the same gradients with bounded RSS."""
import json
import os
import subprocess
import sys
import textwrap
from functools import lru_cache

import numpy as np
import pytest

import adtape as ad
from adtape.tensor import Tensor


@lru_cache(maxsize=None)
def optimal_evaluations(n, s):
    """Minimum step evaluations to reverse n steps from a stored input with s extra
    snapshots, by exhaustive dynamic programming (independent of the closed form)."""
    if n == 1:
        return 1
    if s == 0:
        return n * (n + 1) // 2
    return min(m + optimal_evaluations(n - m, s - 1) + optimal_evaluations(m, s)
               for m in range(1, n))


@pytest.mark.parametrize("s", range(5))
def test_revolve_cost_is_the_optimum(s):
    for n in range(1, 60):
        assert ad.revolve_cost(n, s) == optimal_evaluations(n, s), (n, s)


def _loop_program(n, snapshots, x0, W):
    calls = {"n": 0}
    x = Tensor(x0, requires_grad=True)
    w = Tensor(W, requires_grad=True)

    def step(s):
        calls["n"] += 1
        return ad.tanh(s @ w) + s * 0.5

    if snapshots is None:
        y = x
        for _ in range(n):
            y = step(y)
    else:
        y = ad.checkpoint_loop(step, x, n, snapshots)
    forward_calls = calls["n"]
    calls["n"] = 0
    ad.tanh(y).sum().backward()
    return x.grad, w.grad, forward_calls, calls["n"]


@pytest.mark.parametrize("n,s", [(1, 0), (2, 1), (7, 0), (10, 1), (13, 2), (30, 3), (31, 8),
                                 (64, 4)])
def test_checkpoint_loop_is_exact_and_recomputes_as_scheduled(n, s):
    rng = np.random.default_rng(n * 10 + s)
    x0, W = rng.standard_normal((3, 5)), rng.standard_normal((5, 5)) * 0.5
    gx, gw, _, _ = _loop_program(n, None, x0, W)
    cx, cw, fwd, bwd = _loop_program(n, s, x0, W)
    np.testing.assert_array_equal(cx, gx)
    np.testing.assert_array_equal(cw, gw)
    schedule = ad.revolve_schedule(n, s)
    assert fwd == n == schedule["forward_steps"]
    assert bwd == schedule["backward_steps"]
    # The forward sweep advanced along the snapshots; together with the backward
    # evaluations that is the optimum of the exhaustive search.
    spine_end = schedule["forward_snapshots"][-1] if schedule["forward_snapshots"] else 0
    assert bwd + spine_end == optimal_evaluations(n, s)
    assert len(schedule["forward_snapshots"]) <= s


def test_checkpoint_segment_is_exact_and_recomputes_once():
    rng = np.random.default_rng(5)
    x0, W = rng.standard_normal((4, 6)), rng.standard_normal((6, 6)) * 0.3
    runs = {"n": 0}

    def block(h, w):
        runs["n"] += 1
        return ad.tanh(h @ w) * h

    def loss(x, w, use_checkpoint):
        h = x
        for _ in range(3):
            h = ad.checkpoint(block, h, w) if use_checkpoint else block(h, w)
        return (h * h).sum()

    g_full = ad.grad(lambda x, w: loss(x, w, False), (0, 1))(x0, W)
    runs["n"] = 0
    g_ckpt = ad.grad(lambda x, w: loss(x, w, True), (0, 1))(x0, W)
    assert runs["n"] == 6
    for a, b in zip(g_full, g_ckpt):
        np.testing.assert_array_equal(a, b)


def test_checkpoint_reads_closed_over_parameters():
    rng = np.random.default_rng(6)
    w = Tensor(rng.standard_normal((3, 3)), requires_grad=True)
    x = rng.standard_normal((2, 3))
    out = ad.checkpoint(lambda h: ad.tanh(h @ w), Tensor(x))
    out.sum().backward()
    expected = x.T @ (1 - np.tanh(x @ w.data) ** 2)
    np.testing.assert_allclose(w.grad, expected, rtol=1e-12)


def test_checkpoint_refuses_an_outer_intermediate_from_its_closure():
    x = Tensor(np.ones(3), requires_grad=True)
    hidden = x * 2.0
    out = ad.checkpoint(lambda h: h * hidden, Tensor(np.ones(3)))
    with pytest.raises(RuntimeError, match="another graph"):
        out.sum().backward()


def test_peak_tape_memory_falls_as_predicted():
    rng = np.random.default_rng(7)
    n, s = 48, 3
    x0, W = rng.standard_normal((64, 64)), rng.standard_normal((64, 64)) / 8
    state_bytes = x0.nbytes
    peaks = {}
    for snapshots in (None, s):
        with ad.OpTape(slab_size=1024) as t:
            _loop_program(n, snapshots, x0, W)
            peaks[snapshots] = t.tape.stats["peak_resident_bytes"]
        t.close()
    # Full tape: every step keeps two state-sized residuals (the matmul input, tanh's
    # output), the loss one more (tanh's output).  Checkpointed: the s snapshots and
    # the loss's residual in the forward pass, then one step's residuals at a time.
    full = (2 * n + 1) * state_bytes
    checkpointed = max((s + 1) * state_bytes, 2 * state_bytes)
    slab = 1024 * 8
    assert full * 0.95 <= peaks[None] <= full * 1.1 + 4 * slab
    assert peaks[s] <= checkpointed * 1.1 + 4 * slab
    assert peaks[None] / peaks[s] >= 0.8 * full / checkpointed


RSS_PROGRAM = textwrap.dedent("""
    import json, sys
    import numpy as np
    import adtape as ad
    from plan_worker import harness
    budget = None if sys.argv[1] == "none" else int(sys.argv[1])
    rng = np.random.default_rng(0)
    W = rng.standard_normal((256, 256)) / 16
    x0 = rng.standard_normal((512, 256))
    with ad.OpTape(memory_budget=budget, spill_dir=sys.argv[2]) as t:
        with harness().RssSampler(interval=0.001) as rss:
            x = ad.Tensor(x0, requires_grad=True)
            w = ad.Tensor(W, requires_grad=True)
            y = x
            for _ in range(60):
                y = ad.tanh(y @ w)
            saved = t.tape.nbytes
            y.sum().backward()
        spills = t.tape.stats["spills"]
    np.save(sys.argv[3], np.concatenate([x.grad.ravel(), w.grad.ravel()]))
    print(json.dumps({"saved": saved, "peak_growth": rss.growth, "spills": spills}))
""")


def _run_rss_program(budget, tmp_path, name):
    root = os.path.dirname(os.path.dirname(os.path.abspath(ad.__file__)))
    out = tmp_path / f"{name}.npy"
    # tests/perfmodel/ for plan_worker's harness (bench/harness.py by its path)
    workers = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perfmodel")
    res = subprocess.run([sys.executable, "-c", RSS_PROGRAM, str(budget), str(tmp_path), str(out)],
                         cwd=root, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=workers))
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1]), np.load(out)


def test_memory_budget_bounds_rss_and_keeps_gradients(tmp_path):
    budget = 8 << 20
    bounded, g_bounded = _run_rss_program(budget, tmp_path, "bounded")
    unbounded, g_unbounded = _run_rss_program("none", tmp_path, "unbounded")
    np.testing.assert_array_equal(g_bounded, g_unbounded)
    assert bounded["saved"] > 100 << 20 and bounded["spills"] > 0
    # Unbounded, RSS grows with the residuals; bounded, by the budget plus a few
    # state-sized arrays in flight (1 MiB each) and the spill I/O buffers.
    assert unbounded["peak_growth"] > 0.8 * unbounded["saved"]
    assert bounded["peak_growth"] < budget + (24 << 20), bounded


def test_checkpoint_loop_passes_the_step_index():
    rng = np.random.default_rng(8)
    n = 9
    weights = [Tensor(rng.standard_normal((4, 4)) * 0.5, requires_grad=True) for _ in range(n)]
    x0 = rng.standard_normal((2, 4))

    def block(i, h):
        return ad.tanh(h @ weights[i])

    def grads(snapshots):
        for w in weights:
            w.grad = None
        x = Tensor(x0, requires_grad=True)
        if snapshots is None:
            y = x
            for i in range(n):
                y = block(i, y)
        else:
            y = ad.checkpoint_loop(block, x, n, snapshots, pass_index=True)
        y.sum().backward()
        return [x.grad] + [w.grad for w in weights]

    for a, b in zip(grads(None), grads(2)):
        np.testing.assert_array_equal(a, b)
