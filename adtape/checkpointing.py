"""Checkpointing: trade recomputation for tape memory.

``checkpoint(fn, *args)`` runs ``fn`` without recording and puts one node on
the tape that keeps only ``fn``'s inputs; the backward pass re-runs ``fn`` on
a nested graph and sweeps it.

``checkpoint_loop(step, x, n_steps, snapshots)`` reverses ``x -> step(x)``
applied ``n_steps`` times with at most ``snapshots`` stored states besides the
input, following the binomial schedule of Griewank's treeverse / Revolve: to
reverse steps [l, r) with ``s`` free snapshots from the state at ``l``, advance
to a split point ``m``, store that state, reverse [m, r) with ``s - 1``, then
reverse [l, m) with ``s``.  The split is chosen so that the total number of
step evaluations is the minimum (``revolve_cost``).

Steps may read parameters (leaf tensors) from their closure: the nested sweeps
add into those leaves' ``.grad``.  An intermediate tensor from outside cannot be
read that way (its gradient would be lost); pass it as an argument.
"""
from math import comb

import numpy as np

from adtape.tensor import (Primitive, Tensor, _constant, _record, _state, defvjp_accumulate, nested_graph,
                           no_grad)

__all__ = ["checkpoint", "checkpoint_loop", "revolve_cost", "revolve_schedule"]

CHECKPOINT = Primitive("checkpoint", ("*args",))
CHECKPOINT_LOOP = Primitive("checkpoint_loop", ("x",))


def _check_output(out, what):
    if type(out) is not Tensor:
        raise TypeError(f"{what} must return an adtape Tensor, got {type(out).__name__}")
    return out


def checkpoint(fn, *args):
    """``fn(*args)`` with only ``args`` kept for the backward pass (``fn`` is re-run there)."""
    with no_grad():
        out = _check_output(fn(*args), "the checkpointed function")
    if not _state.enabled:
        return out
    # Recorded even when no argument needs a gradient: fn may read parameters it closes over.
    was_tensor = tuple(type(a) is Tensor for a in args)
    return _record(CHECKPOINT, out.data, args, (fn, was_tensor) + args, None)


def _checkpoint_bwd(g, dests, fn, was_tensor, *args):
    with nested_graph():
        inputs = [Tensor(a, requires_grad=True) if d is not None
                  else (_constant(a) if tensor else a)
                  for a, d, tensor in zip(args, dests, was_tensor)]
        out = _check_output(fn(*inputs), "the checkpointed function")
        if out.requires_grad:
            out.backward(seed=g)
    for inp, d in zip(inputs, dests):
        if d is not None and inp.grad is not None:
            d += inp.grad


defvjp_accumulate(CHECKPOINT, _checkpoint_bwd)


def revolve_cost(n_steps, snapshots):
    """Minimum number of step evaluations that reverse ``n_steps`` steps from the
    stored input with ``snapshots`` extra states (each step is also evaluated
    once with recording): ``n + t n - C(s + t + 1, t - 1)`` for the smallest
    ``t`` with ``C(s + 1 + t, t) >= n`` (Griewank and Walther, Alg. 799)."""
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    if snapshots < 0:
        raise ValueError(f"snapshots must be >= 0, got {snapshots}")
    t = 0
    while comb(snapshots + 1 + t, t) < n_steps:
        t += 1
    return n_steps + t * n_steps - (comb(snapshots + 1 + t, t - 1) if t >= 1 else 0)


def _split(n, s):
    """A split point ``m`` (0 < m < n) at which reversing n steps with s snapshots
    costs ``revolve_cost(n, s)``; the largest one, so the stored state is near the end."""
    best = revolve_cost(n, s)
    for m in range(n - 1, 0, -1):
        if m + revolve_cost(n - m, s - 1) + revolve_cost(m, s) == best:
            return m
    raise AssertionError(f"no optimal split for n={n}, s={s}")


def revolve_schedule(n_steps, snapshots):
    """The schedule ``checkpoint_loop`` follows, as a dict: ``forward_snapshots``
    (step indices whose state the forward sweep stores), ``forward_steps``
    (= n_steps), ``backward_steps`` (step evaluations in the backward pass,
    recording ones included) and ``total_steps``."""
    spine = _spine(n_steps, snapshots)
    last = spine[-1] if spine else 0
    backward = revolve_cost(n_steps, snapshots) - last
    return {"forward_snapshots": spine, "forward_steps": n_steps,
            "backward_steps": backward, "total_steps": n_steps + backward}


def _spine(n, s):
    positions = []
    pos = 0
    while n - pos > 1 and s > 0:
        pos += _split(n - pos, s)
        positions.append(pos)
        s -= 1
    return positions


def checkpoint_loop(step, x, n_steps, snapshots, pass_index=False):
    """Apply ``x = step(x)`` ``n_steps`` times (``x = step(i, x)`` for step ``i`` with
    ``pass_index``); backward recomputes along a binomial schedule storing at most
    ``snapshots`` states (besides ``x``) on the tape."""
    if not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"n_steps must be a positive int, got {n_steps!r}")
    if not isinstance(snapshots, int) or snapshots < 0:
        raise ValueError(f"snapshots must be a non-negative int, got {snapshots!r}")
    if type(x) is not Tensor:
        x = Tensor(x)
    spine = _spine(n_steps, snapshots) if _state.enabled else []
    stored = []
    if not pass_index:
        step = _ignore_index(step)
    state = x
    with no_grad():
        for i in range(n_steps):
            state = _check_output(step(i, state), "the loop step")
            if i + 1 in spine:
                stored.append(state.data)
    if not _state.enabled:
        return state
    return _record(CHECKPOINT_LOOP, state.data, (x,),
                   (step, n_steps, snapshots, x) + tuple(stored), None)


def _ignore_index(step):
    def indexed(i, state):
        return step(state)
    return indexed


def _advance(step, data, start, k):
    """The state after steps start .. start + k - 1, without recording."""
    state = Tensor(data)
    with no_grad():
        for i in range(start, start + k):
            state = step(i, state)
    return state.data


def _backprop_step(step, i, data, g):
    with nested_graph():
        leaf = Tensor(data, requires_grad=True)
        out = _check_output(step(i, leaf), "the loop step")
        if out.requires_grad:
            out.backward(seed=g)
    return leaf.grad if leaf.grad is not None else np.zeros_like(data)


def _reverse(step, lo, hi, s, state, g, stored):
    """Gradient w.r.t. the state at ``lo`` given ``g`` w.r.t. the state at ``hi``."""
    while hi - lo > 1:
        if s == 0:
            for j in range(hi - 1, lo, -1):
                g = _backprop_step(step, j, _advance(step, state, lo, j - lo), g)
            hi = lo + 1
            break
        mid = lo + _split(hi - lo, s)
        mid_state = stored.pop(mid) if mid in stored else _advance(step, state, lo, mid - lo)
        g = _reverse(step, mid, hi, s - 1, mid_state, g, stored)
        hi = mid
    return _backprop_step(step, lo, state, g)


def _checkpoint_loop_bwd(g, dests, step, n_steps, snapshots, x, *stored):
    spine = _spine(n_steps, snapshots)
    gx = _reverse(step, 0, n_steps, snapshots, x, g, dict(zip(spine, stored)))
    if dests[0] is not None:
        dests[0] += gx


defvjp_accumulate(CHECKPOINT_LOOP, _checkpoint_loop_bwd)
