"""The training script end to end, checkpointing policies, resume and bad input."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import adtape
import gpt2
from gpt2.config import GPT2Config
from gpt2.model import GPT2
from gpt2.train import learning_rate, parse_size, run


@pytest.mark.parametrize("policy", ["layer", "binomial"])
def test_checkpointing_policies_give_the_full_tape_losses_with_less_tape(policy):
    config = GPT2Config(n_layer=4, n_head=2, n_embd=32, vocab_size=256, block_size=32)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (2, 32)).astype(np.int32)
    y = rng.integers(0, 256, (2, 32)).astype(np.int32)
    full = GPT2(config, seed=2)
    ckpt = GPT2(config, seed=2, checkpointing=policy, snapshots=1)
    for _ in range(3):
        lf, _ = full.train_step(x, y, lr=1e-3, weight_decay=0.1)
        lc, _ = ckpt.train_step(x, y, lr=1e-3, weight_decay=0.1)
        assert lf == lc
    np.testing.assert_array_equal(full.grads.flat, ckpt.grads.flat)
    assert ckpt._tape_engine.last_forward_bytes < full._tape_engine.last_forward_bytes / 2
    full.close()
    ckpt.close()


def test_checkpointing_needs_the_tape_engine():
    with pytest.raises(ValueError, match="tape"):
        GPT2(GPT2Config.preset("tiny"), engine="manual", checkpointing="layer")


def test_training_script_end_to_end_and_resume(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--model", "tiny", "-B", "4", "-T", "32", "--steps", "30", "--eval-interval", "15",
            "--eval-batches", "2", "--out-dir", str(out), "--sample-tokens", "20",
            "--no-progress", "--corpus-bytes", "200k", "--lr", "3e-3", "--warmup", "5",
            "--tape-budget", "64k", "--spill-dir", str(tmp_path)]
    from kernels import _openmp
    ftz_before = _openmp.flush_denormal_enabled()
    summary = run(args)
    assert _openmp.flush_denormal_enabled() == ftz_before  # the FP mode is restored
    printed = capsys.readouterr().out
    assert summary["final_loss"] < summary["first_loss"] - 0.5
    assert summary["final_val_loss"] is not None
    for name in ("log.csv", "summary.json", "loss.png", "checkpoint.bin"):
        assert (out / name).stat().st_size > 0
    assert "----- sample -----" in printed
    assert json.loads((out / "summary.json").read_text())["steps"] == 30
    assert [p for p in os.listdir(tmp_path) if p != "run"] == []  # no spill file left

    more = list(args)
    more[more.index("--steps") + 1] = "40"
    resumed = run(more + ["--resume", str(out / "checkpoint.bin")])
    log = (out / "log.csv").read_text().splitlines()
    assert log[1].startswith("31,")   # the resumed run starts at step 31
    assert resumed["steps"] == 40


def test_schedule_and_sizes():
    class A:
        lr, min_lr, warmup, steps, schedule = 1.0, 0.1, 10, 110, "cosine"
    assert learning_rate(0, A) == pytest.approx(0.1)
    assert learning_rate(9, A) == pytest.approx(1.0)
    assert learning_rate(10, A) == pytest.approx(1.0)
    assert learning_rate(60, A) == pytest.approx(0.55)
    assert learning_rate(110, A) == pytest.approx(0.1)
    assert parse_size("64k") == 65536 and parse_size("2G") == 2 << 30 and parse_size("100") == 100


def run_cli(cwd, *args):
    """``python -m gpt2.train`` run from ``cwd``: never from the source tree, whose
    unbuilt packages ``-m`` would put first on sys.path."""
    roots = {os.path.dirname(os.path.dirname(m.__file__)) for m in (adtape, gpt2)}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(roots))
    return subprocess.run([sys.executable, "-m", "gpt2.train", *args], capture_output=True,
                          text=True, env=env, cwd=cwd)


def test_cli_bad_input_gets_clear_errors(tmp_path):
    proc = run_cli(tmp_path, "--model", "tiny", "-T", "65", "--out-dir", str(tmp_path))
    assert proc.returncode != 0 and "block_size" in proc.stderr
    proc = run_cli(tmp_path, "--model", "nano", "--out-dir", str(tmp_path))
    assert proc.returncode != 0 and "unknown GPT-2 preset" in proc.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    proc = run_cli(tmp_path, "--model", "tiny", "--data", str(empty), "--out-dir", str(tmp_path))
    assert proc.returncode != 0 and "empty" in proc.stderr
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\0" * 100)
    proc = run_cli(tmp_path, "--model", "tiny", "--resume", str(bad), "--out-dir", str(tmp_path))
    assert proc.returncode != 0 and "not an adtape GPT-2 checkpoint" in proc.stderr
    proc = run_cli(tmp_path, "--model", "tiny", "--data", str(tmp_path / "missing.txt"))
    assert proc.returncode != 0 and "missing.txt" in proc.stderr


def test_cli_success_exits_zero(tmp_path):
    proc = run_cli(tmp_path, "--model", "tiny", "-B", "2", "-T", "16", "--steps", "2", "--eval-interval", "0",
                   "--corpus-bytes", "50k", "--sample-tokens", "5", "--no-progress",
                   "--out-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert "loss" in proc.stdout and "----- sample -----" in proc.stdout
