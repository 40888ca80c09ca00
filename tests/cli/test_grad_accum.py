"""Gradient accumulation (--grad-accum N): N micro-batches of B/N rows per optimizer step
give the unaccumulated run's loss curve and weights, with B/N-sized activations."""
import csv
import json

import numpy as np
import pytest

from gpt2 import checkpoint as ckpt
from gpt2.config import GPT2Config
from gpt2.families import preset
from gpt2.model import GPT2
from gpt2.train import main, run

RTOL = 1e-6


def _batches(config, steps, B=8, T=16, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, config.vocab_size, (B, T)).astype(np.int32),
             rng.integers(0, config.vocab_size, (B, T)).astype(np.int32))
            for _ in range(steps)]


def _max_rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_accumulated_steps_give_the_unaccumulated_losses_and_weights(name):
    config = preset(name)
    batches = _batches(config, 4)
    runs = {}
    for n in (1, 2, 4):
        model = GPT2(config, seed=3)
        losses, norms = [], []
        for x, y in batches:
            loss, norm = model.train_step(x, y, lr=1e-3, weight_decay=0.1, grad_clip=1.0,
                                          grad_accum=n)
            losses.append(loss)
            norms.append(norm)
        runs[n] = (losses, norms, model.params.flat.copy(),
                   model._tape_engine.last_forward_bytes)
        model.close()
        # The first step's gradient, summed over the micro-batches: N times the batch's.
        model = GPT2(config, seed=3)
        model.train_step(*batches[0], lr=0.0, grad_accum=n)
        runs[n] += (model.grads.flat / n,)
        model.close()
    losses1, norms1, weights1, bytes1, grads1 = runs[1]
    for n in (2, 4):
        losses, norms, weights, nbytes, grads = runs[n]
        assert _max_rel(losses, losses1) <= RTOL, (n, losses, losses1)
        assert _max_rel(norms, norms1) <= 1e-6, (n, norms, norms1)
        # Float32 sums in another order: up to 5e-7 of the largest gradient (measured).
        np.testing.assert_allclose(grads, grads1, rtol=0, atol=2e-6 * np.abs(grads1).max())
        # 4 AdamW steps of lr 1e-3 move a weight up to 4e-3; Adam's g / sqrt(v) makes the
        # near-zero gradients' rounding visible: up to 1.2e-5 measured (llama-tiny, N=2).
        np.testing.assert_allclose(weights, weights1, rtol=0, atol=3e-5)
        # A micro-batch's activations: B/N rows.
        assert nbytes <= bytes1 / n * 1.1, (n, nbytes, bytes1)
    assert runs[2][3] < runs[1][3] * 0.6 and runs[4][3] < runs[2][3] * 0.6


def test_the_manual_engine_accumulates_too():
    config = GPT2Config.preset("tiny")
    batches = _batches(config, 3)
    out = {}
    for n in (1, 2):
        model = GPT2(config, seed=1, engine="manual")
        out[n] = [model.train_step(x, y, lr=1e-3, grad_clip=1.0, grad_accum=n)[0]
                  for x, y in batches], model.params.flat.copy()
        model.close()
    assert _max_rel(out[2][0], out[1][0]) <= RTOL
    np.testing.assert_allclose(out[2][1], out[1][1], rtol=0, atol=3e-5)


def test_a_batch_the_micro_batches_do_not_divide_is_refused():
    model = GPT2(GPT2Config.preset("tiny"))
    x = np.zeros((6, 8), np.int32)
    with pytest.raises(ValueError, match="6 rows does not split into 4"):
        model.train_step(x, x, lr=1e-3, grad_accum=4)
    model.close()


def _run_args(out, n, name="tiny", *extra):
    return ["--model", name, "-B", "8", "-T", "16", "--steps", "4", "--corpus-bytes", "50k",
            "--eval-interval", "0", "--val-fraction", "0", "--sample-tokens", "0",
            "--no-progress", "--out-dir", str(out), "--grad-accum", str(n), *extra]


def _log_losses(out):
    with open(out / "log.csv") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_the_command_line_gives_the_unaccumulated_loss_curve(tmp_path, capsys, name):
    curves, weights = {}, {}
    for n in (1, 2, 4):
        out = tmp_path / f"n{n}"
        summary = run(_run_args(out, n, name))
        assert summary["grad_accum"] == n
        assert json.loads((out / "summary.json").read_text())["grad_accum"] == n
        curves[n] = _log_losses(out)
        weights[n] = ckpt.load_checkpoint(str(out / "checkpoint.bin")).params.flat.copy()
        printed = capsys.readouterr().out
        if n > 1:
            assert f"--grad-accum {n}: micro-batches of {8 // n}" in printed
    for n in (2, 4):
        assert len(curves[n]) == 4
        assert _max_rel(curves[n], curves[1]) <= RTOL, (n, curves[n], curves[1])
        np.testing.assert_allclose(weights[n], weights[1], rtol=0, atol=3e-5)


def test_resume_keeps_grad_accum_and_stays_on_the_curve(tmp_path):
    # 2 steps with --grad-accum 2, resumed to 4: the loader advances B rows a step either way.
    out = tmp_path / "r"
    args = _run_args(out, 2)
    args[args.index("--steps") + 1] = "2"
    run(args)
    resumed = run(["--resume", str(out / "checkpoint.bin"), "--steps", "4", "--no-progress"])
    assert resumed["grad_accum"] == 2
    whole = tmp_path / "w"
    run(_run_args(whole, 2))
    assert _log_losses(out) == _log_losses(whole)


@pytest.mark.parametrize("n", ["3", "16"])
def test_a_grad_accum_that_does_not_divide_b_is_one_error_line(tmp_path, capsys, n):
    assert main(_run_args(tmp_path / "bad", n)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert f"--grad-accum {n}: -B 8 does not split into {n} equal micro-batches; use a -B that divides by {n}" in err[0]
    assert not (tmp_path / "bad").exists()


def test_grad_accum_zero_is_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(_run_args(tmp_path / "bad", "0"))
    assert e.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
