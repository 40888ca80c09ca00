"""The training script end to end, checkpointing policies, resume and the run's history."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from gpt2.config import GPT2Config
from gpt2.model import GPT2
from gpt2 import train as train_cli
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
    # What the disk tier did, per step, in the summary and one printed line.
    tape = summary["tape"]
    assert tape["memory_budget"] == 64 << 10
    assert tape["written_bytes_per_step"] >= tape["read_bytes_per_step"] > 64 << 10
    assert tape["prefetch_hits_per_step"] + tape["prefetch_misses_per_step"] > 0
    assert 0 < tape["peak_spilled_bytes"] <= tape["peak_spill_file_bytes"] <= (
        tape["peak_spilled_bytes"] + (1 << 20))
    assert "tape (budget 64.0 KiB): per step" in printed

    more = list(args)
    more[more.index("--steps") + 1] = "40"
    resumed = run(more + ["--resume", str(out / "checkpoint.bin")])
    steps = [int(line.split(",")[0]) for line in (out / "log.csv").read_text().splitlines()[1:]]
    assert steps == list(range(1, 41))   # the first run's 30 rows, then the resumed 10
    assert resumed["steps"] == 40 and resumed["start_step"] == 30


def test_schedule_and_sizes():
    class A:
        lr, min_lr, warmup, steps, decay_steps, schedule = 1.0, 0.1, 10, 200, 110, "cosine"
    assert learning_rate(0, A) == pytest.approx(0.1)
    assert learning_rate(9, A) == pytest.approx(1.0)
    assert learning_rate(10, A) == pytest.approx(1.0)
    assert learning_rate(60, A) == pytest.approx(0.55)
    assert learning_rate(110, A) == pytest.approx(0.1)
    assert learning_rate(150, A) == learning_rate(199, A) == pytest.approx(0.1)  # past the decay
    assert parse_size("64k") == 65536 and parse_size("2G") == 2 << 30 and parse_size("100") == 100


def quick_run_args(out, steps, *extra):
    return ["--model", "tiny", "-B", "2", "-T", "16", "--steps", str(steps), "--corpus-bytes",
            "50k", "--eval-interval", "2", "--eval-batches", "1", "--sample-tokens", "0",
            "--no-progress", "--out-dir", str(out), *extra]


def log_steps(out):
    return [int(line.split(",")[0]) for line in (out / "log.csv").read_text().splitlines()[1:]]


def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    run(quick_run_args(out, 4))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["checkpoint.bin", "log.csv", "loss.png", "summary.json"]
    capsys.readouterr()
    # Only --resume: the model, the data and --steps come from the checkpoint.
    assert run(["--resume", str(out / "checkpoint.bin")]) is None
    assert "at step 4 of --steps 4: nothing left to do" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_resume_appends_to_the_log_and_plots_and_summarizes_the_whole_run(tmp_path,
                                                                          monkeypatch):
    out = tmp_path / "run"
    first = run(quick_run_args(out, 4))
    first_log = (out / "log.csv").read_text()
    plotted = []
    monkeypatch.setattr(train_cli, "plot_losses",
                        lambda path, rows: plotted.append([r["step"] for r in rows]))
    resumed = run(["--resume", str(out / "checkpoint.bin"), "--steps", "7"])
    log = (out / "log.csv").read_text()
    assert log.startswith(first_log)   # the first run's rows, byte for byte
    assert log_steps(out) == list(range(1, 8))
    assert plotted == [list(range(1, 8))]
    assert resumed["first_loss"] == first["first_loss"] and resumed["start_step"] == 4
    assert json.loads((out / "summary.json").read_text())["first_loss"] == first["first_loss"]


def test_resume_from_an_earlier_checkpoint_drops_the_later_rows(tmp_path):
    out = tmp_path / "run"
    run(quick_run_args(out, 3))
    shutil.copy(out / "checkpoint.bin", tmp_path / "step3.bin")
    shutil.copy(out / "log.csv", tmp_path / "log.csv")
    run(["--resume", str(out / "checkpoint.bin"), "--steps", "6"])
    assert log_steps(out) == list(range(1, 7))
    # Step 3's checkpoint, resumed into a new directory, takes its history from beside it.
    again = tmp_path / "again"
    run(["--resume", str(tmp_path / "step3.bin"), "--steps", "5", "--out-dir", str(again)])
    assert log_steps(again) == list(range(1, 6))
    assert log_steps(out) == list(range(1, 7))   # the other run's log is untouched


def test_the_log_is_written_as_the_run_goes(tmp_path, monkeypatch):
    calls = []
    real_train_step = GPT2.train_step

    def dies_at_step_4(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("power cut")
        return real_train_step(self, *args, **kwargs)

    monkeypatch.setattr(GPT2, "train_step", dies_at_step_4)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="power cut"):
        run(quick_run_args(out, 10))
    assert log_steps(out) == [1, 2, 3]


def test_a_run_removes_the_temporaries_of_saves_that_were_killed(tmp_path):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
    out = tmp_path / "run"
    out.mkdir()
    stale = out / f".checkpoint.bin.{int(finished.stdout)}-0123abcd.tmp"
    stale.write_bytes(b"half a checkpoint")
    run(quick_run_args(out, 1, "--no-checkpoint"))
    assert not stale.exists()


def test_a_log_cut_short_by_a_crash_or_emptied_by_an_older_version_resumes(tmp_path):
    out = tmp_path / "run"
    run(quick_run_args(out, 3))
    log = out / "log.csv"
    full = log.read_text()
    log.write_text(full[:-10])   # the last row half written
    run(["--resume", str(out / "checkpoint.bin"), "--steps", "4"])
    assert log_steps(out) == [1, 2, 4]
    assert log.read_text().startswith(full.rsplit("\n", 2)[0])
    log.write_text("step\n")     # what a resume used to leave
    run(["--resume", str(out / "checkpoint.bin"), "--steps", "5"])
    assert log_steps(out) == [5]
    log.write_text(full.replace("\n2,", "\n2x,"))
    with pytest.raises(train_cli.UsageError, match="line 3: not a row of numbers"):
        run(["--resume", str(out / "checkpoint.bin"), "--steps", "6"])
