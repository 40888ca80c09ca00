"""LoRA under mpiexec (loopback, 2 ranks): only the adapters' gradients cross between the
ranks, and the run is one process's on the same global batch.

gpt2-train --lora on llama-tiny: 2 ranks (also --zero 1 with --grad-accum 2) log the one
process's loss curve and gradient norms and save its adapters and moments, with the peft
adapter directory beside the checkpoint; a 2-rank run resumes under 2 ranks and in one
process where the one process is; bad combinations are one error line.  The trainer
(tests/cli/lora_dp_worker.py): every rank gets rank 0's frozen base (fp32 and bf16), the
sweep's hooks launch every adapter bucket, ZeRO-1 shards the adapter moments, a
checkpoint of other adapters is refused, and each rank draws its own dropout masks.
They need the ``mpi`` extra (``pip install '.[mpi]'``) and never skip.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

import gpt2
from gpt2 import checkpoint as ckpt
from gpt2.lora import LoraState, load_adapter

RANKS = 2
TIMEOUT = 120
HERE = pathlib.Path(__file__).resolve().parent
ENV = dict(os.environ, OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join([str(pathlib.Path(gpt2.__file__).parent.parent),
                                       os.environ.get("PYTHONPATH", "")]))
# --grad-clip 0.1: below the first steps' gradient norms, so the clipping is at work.
ARGS = ["--model", "llama-tiny", "--lora", "2", "-B", "4", "-T", "32", "--corpus-bytes", "100K",
        "--schedule", "constant", "--warmup", "0", "--lr", "1e-2", "--grad-clip", "0.1",
        "--eval-interval", "0", "--sample-tokens", "0", "--no-progress"]
TRAIN = [sys.executable, "-m", "gpt2.train"]
STEPS = 6


def mpiexec():
    path = shutil.which("mpiexec")
    assert path, "mpiexec not found: install the mpi extra (pip install '.[mpi]')"
    return path


def run(command, ranks=None):
    if ranks:
        command = [mpiexec(), "-n", str(ranks), *command]
    return subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)


def train(out, *extra, ranks=None):
    proc = run([*TRAIN, *ARGS, *extra, "--out-dir", str(out)], ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    return proc


def logged(out, column):
    lines = (out / "log.csv").read_text().splitlines()
    index = lines[0].split(",").index(column)
    return [float(line.split(",")[index]) for line in lines[1:]]


def relative(a, b):
    """|a - b| / |b| over the whole curve or arena."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def saved(out):
    return ckpt.load_checkpoint(out / "checkpoint.bin", lora=True)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    train(out, "--steps", str(STEPS))
    return out


@pytest.mark.parametrize("extra", [[], ["--zero", "1", "--grad-accum", "2"]],
                         ids=["zero0", "zero1-accum2"])
def test_two_ranks_train_the_adapters_as_one_process(one_process, tmp_path, extra):
    out = tmp_path / "two"
    proc = train(out, "--steps", str(STEPS), *extra, ranks=RANKS)
    assert proc.stdout.count("data parallel: 2 ranks") == 1     # rank 0 alone prints
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["ranks"], summary["lora"]["r"]) == (RANKS, 2)
    for column in ("loss", "grad_norm"):
        assert relative(logged(out, column), logged(one_process, column)) < 1e-6, column
    assert min(logged(one_process, "grad_norm")) > 0.1
    mine, alone = saved(out), saved(one_process)
    assert mine.extra["ranks"] == RANKS and mine.lora == alone.lora
    for name in ("params", "adam_m", "adam_v"):
        assert relative(getattr(mine, name).flat, getattr(alone, name).flat) < 1e-6, name
    # Rank 0 wrote the peft directory of the checkpoint's adapters.
    state = LoraState(mine.config, mine.lora)
    load_adapter(out / "adapter", state)
    assert np.array_equal(state.params.flat, mine.params.flat)


def test_a_two_rank_run_resumes_under_two_ranks_and_in_one_process(one_process, tmp_path):
    half = tmp_path / "half"
    train(half, "--steps", str(STEPS // 2), "--zero", "1", ranks=RANKS)
    for out, ranks in ((tmp_path / "two", RANKS), (tmp_path / "one", None)):
        shutil.copytree(half, out)
        proc = run([*TRAIN, "--resume", str(out / "checkpoint.bin"), "--steps", str(STEPS),
                    "--no-progress"], ranks=ranks)
        assert proc.returncode == 0, proc.stderr
        assert logged(out, "loss")[:STEPS // 2] == logged(half, "loss")
        assert relative(logged(out, "loss"), logged(one_process, "loss")) < 1e-6
        assert relative(saved(out).params.flat, saved(one_process).params.flat) < 1e-6
    assert saved(tmp_path / "two").extra["ranks"] == RANKS


def test_the_trainer_reduces_and_shards_only_the_adapters(tmp_path):
    result = tmp_path / "result.json"
    proc = run([sys.executable, str(HERE / "lora_dp_worker.py"), str(result)], ranks=RANKS)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(result.read_text())
    # The one process ran the ranks' rows as 2 micro-batches, in rank order (see the
    # worker): the same sums as the ranks' reduction, to the bit.
    for case, bound in (("zero0/fp32", 1e-12), ("zero1/fp32", 1e-12), ("zero1/bf16", 1e-12)):
        c = got[case]
        # Rank 1 was built from another seed: the trainer gave it rank 0's base and adapters.
        assert c["base_equal_across_ranks"] and c["adapters_equal_across_ranks"], case
        assert c["buckets"] > 4 and c["buckets_in_backward"] == c["buckets"], case
        assert c["clipped"] and c["losses"] < bound and c["norms"] < 10 * bound, case
        assert c["adapters_equal"], case
        for name in ("adapters", "saved_adapters", "saved_adam_v"):
            assert c[name] < 10 * bound, (case, name, c[name])
        assert c["saved_extra"] == {"ranks": RANKS, "zero": int(case[4])}
        padded = c["padded"]
        assert 0 <= padded - c["adapter_parameters"] < RANKS * 16
        if case.startswith("zero1"):
            assert c["trainer_moments"] == padded // RANKS and not c["model_moments"]
        else:
            assert c["trainer_moments"] == c["adapter_parameters"] and c["model_moments"]
    assert got["reloaded"] == {"step": 4, "adam_step": 4, "adapters_restored": True}
    assert "holds adapters of LoraConfig(r=2, alpha=4.0" in got["other_adapters"]
    assert "this model's are LoraConfig(r=2, alpha=8.0" in got["other_adapters"]
    assert got["dropout"] == {"ranks_differ": True, "rank0_is_one_process": True}


def error_lines(proc):
    return [line for line in proc.stderr.splitlines() if line.strip()]


def test_bad_combinations_are_one_error_line(tmp_path):
    out = str(tmp_path / "x")
    # Every rank refuses the same option: rank 0 alone says it.
    proc = run([*TRAIN, *ARGS, "--steps", "1", "--offload", "moments", "--out-dir", out],
               ranks=RANKS)
    assert proc.returncode == 2
    assert error_lines(proc) == ["python -m gpt2.train: error: --lora runs without --offload "
                                 "moments (the adapters' state is small; --base-dtype bf16 "
                                 "halves the base, --checkpointing and --tape-budget bound "
                                 "the activations)"], proc.stderr
    # One rank refuses its option: rank 0 says which rank and why.
    proc = subprocess.run([mpiexec(), "-n", "1", *TRAIN, *ARGS, "--steps", "1", "--out-dir", out,
                           ":", "-n", "1", *TRAIN, *ARGS, "--steps", "1", "--out-dir", out,
                           "--lora-targets", "c_attn"],
                          env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 2
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith(
        "python -m gpt2.train: error: rank 1 of 2: --lora-targets: LoRA target(s) 'c_attn' "
        "are not projections of a Llama model"), proc.stderr
    # The ranks' adapters differ.
    proc = subprocess.run([mpiexec(), "-n", "1", *TRAIN, *ARGS, "--steps", "1", "--out-dir", out,
                           ":", "-n", "1", *TRAIN, *ARGS, "--steps", "1", "--out-dir", out,
                           "--lora-alpha", "8"],
                          env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 2
    assert error_lines(proc) == ["error: the ranks were started with different settings: "
                                 "lora alpha: rank 0 has 4.0, rank 1 has 8.0"], proc.stderr
    assert not os.path.exists(os.path.join(out, "checkpoint.bin"))
