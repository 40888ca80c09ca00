"""gpt2-train as a user meets it: one-line errors with status 2, --help, samples of models
without their tokenizer, a full or read-only disk."""
import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import adtape
import gpt2
from gpt2 import train as train_cli
from gpt2.checkpoint import export_hf_gpt2, export_llmc, save_checkpoint
from gpt2.config import GPT2Config
from gpt2.data import DataLoader, write_llmc_tokens
from gpt2.params import ParamArena, init_params_
from gpt2.tokenizer import write_tiktoken_ranks

PACKAGE_ROOTS = os.pathsep.join({os.path.dirname(os.path.dirname(m.__file__))
                                 for m in (adtape, gpt2)})
QUICK = ["--model", "tiny", "-B", "2", "-T", "16", "--steps", "2", "--corpus-bytes", "50k",
         "--eval-interval", "0", "--sample-tokens", "3", "--no-progress"]


def run_cli(cwd, *args, program=("-m", "gpt2.train"), timeout=120):
    """The command run from ``cwd``: never from the source tree, whose unbuilt packages
    ``-m`` would put first on sys.path."""
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOTS)
    return subprocess.run([sys.executable, *program, *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=timeout)


def assert_one_line_error(proc, *expected):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


def tiny_params(config, seed=0):
    return init_params_(ParamArena(config), seed)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Files the bad-input cases point at, in a directory outside the source tree."""
    d = tmp_path_factory.mktemp("inputs")
    (d / "small.txt").write_text("hello world\n")
    (d / "empty.txt").write_text("")
    (d / "garbage.bin").write_bytes(bytes(range(100)))
    (d / "garbage.safetensors").write_text("not a model")
    (d / "afile").write_text("x")
    (d / "adir").mkdir()
    (d / "nocfg").mkdir()
    export_hf_gpt2(d / "nocfg" / "model.safetensors", tiny_params(GPT2Config.preset("tiny")))
    export_llmc(d / "tiny.bin", tiny_params(GPT2Config.preset("tiny")))
    # A tokenizer of 257 tokens ("ab" merged) over data full of "ab": ids beyond tiny's 256.
    ranks = {bytes([b]): b for b in range(256)}
    ranks[b"ab"] = 256
    write_tiktoken_ranks(d / "ab.tiktoken", ranks)
    (d / "ab.txt").write_text("ab " * 2000)
    # A checkpoint of a B=2, T=16 run at step 1, to resume with other settings.
    config = GPT2Config.preset("tiny")
    tokens = np.arange(20000) % 256
    loader = DataLoader(tokens, 2, 16, 256)
    write_llmc_tokens(d / "tokens.bin", tokens)
    params = tiny_params(config)
    save_checkpoint(d / "ck.bin", params, step=1, adam_m=tiny_params(config, 1),
                    adam_v=ParamArena(config), adam_step=1, data_state=loader.state(),
                    extra={"args": {"data": str(d / "tokens.bin"), "batch_size": 2,
                                    "seq_len": 16, "steps": 5, "val_fraction": 0.1}})
    (d / "foreign").mkdir()
    (d / "foreign" / "ck.bin").write_bytes((d / "ck.bin").read_bytes())
    (d / "foreign" / "log.csv").write_text("epoch,accuracy\n1,0.5\n")
    return d


BAD_INPUTS = {
    "data missing": (["--data", "missing.txt"], ["--data", "missing.txt"]),
    "data empty": (["--data", "empty.txt"], ["empty"]),
    "data a directory": (["--data", "adir"], ["--data", "Is a directory"]),
    "data too small for a batch": (["--data", "small.txt"], ["11 tokens", "-B 2 x -T 16"]),
    "data not an llm.c token file": (["--data", "garbage.bin"], ["garbage.bin"]),
    "data beyond the vocabulary": (["--data", "ab.txt", "--tokenizer", "ab.tiktoken"],
                                   ["token id 256", "vocabulary of 256"]),
    "validation too small": (["--val-fraction", "0.0001", "--eval-interval", "1"],
                             ["validation data has 5 tokens"]),
    "model unknown": (["--model", "nano"], ["--model", "nano"]),
    "model not the file's": (["--init-from", "tiny.bin", "--model", "small"],
                             ["--model small does not match", "n_layer=2"]),
    "resume garbage": (["--resume", "garbage.bin"], ["not an adtape GPT-2 checkpoint"]),
    "resume missing": (["--resume", "missing.bin"], ["--resume", "No such file"]),
    "resume with init-from": (["--resume", "ck.bin", "--init-from", "tiny.bin"],
                              ["exclude each other"]),
    "resume with another -B": (["--resume", "ck.bin", "-B", "3"], ["batch_size: saved 2"]),
    "resume beside a foreign log": (["--resume", "foreign/ck.bin"],
                                    ["log.csv is not a log of this program"]),
    "init-from garbage llm.c": (["--init-from", "garbage.bin"], ["--init-from", "truncated"]),
    "init-from garbage safetensors": (["--init-from", "garbage.safetensors"],
                                      ["not a safetensors file"]),
    "init-from missing": (["--init-from", "missing.bin"], ["No such file"]),
    "safetensors without config.json": (["--init-from", "nocfg/model.safetensors"],
                                         ["config.json", "beside it"]),
    "val-fraction 0 with evaluation": (["--val-fraction", "0", "--eval-interval", "5"],
                                       ["--val-fraction 0", "--eval-interval 0"]),
    "val-fraction 1": (["--val-fraction", "1"], ["--val-fraction", "[0, 1)"]),
    "val-fraction negative": (["--val-fraction", "-0.5"], ["--val-fraction"]),
    "lr negative": (["--lr", "-1"], ["--lr", "got -1"]),
    "lr nan": (["--lr", "nan"], ["--lr"]),
    "lr inf": (["--lr", "inf"], ["--lr"]),
    "min-lr negative": (["--min-lr", "-0.1"], ["--min-lr"]),
    "B 0": (["-B", "0"], ["-B"]),
    "T 0": (["-T", "0"], ["-T"]),
    "T beyond block_size": (["-T", "65"], ["-T 65", "block_size 64"]),
    "steps 0": (["--steps", "0"], ["--steps"]),
    "steps negative": (["--steps", "-1"], ["--steps"]),
    "warmup negative": (["--warmup", "-5"], ["--warmup"]),
    "weight-decay negative": (["--weight-decay", "-1"], ["--weight-decay"]),
    "grad-clip negative": (["--grad-clip", "-1"], ["--grad-clip"]),
    "seed negative": (["--seed", "-1"], ["--seed"]),
    "threads 0": (["--threads", "0"], ["--threads"]),
    "threads 100000": (["--threads", "100000"], ["--threads"]),
    "tape-budget garbage": (["--tape-budget", "4X"], ["--tape-budget", "4X"]),
    "tape-budget infinite": (["--tape-budget", "1e999"], ["--tape-budget"]),
    "spill-dir missing": (["--spill-dir", "nowhere"], ["--spill-dir nowhere", "no such"]),
    "spill-dir a file": (["--spill-dir", "afile"], ["--spill-dir afile", "not a directory"]),
    "out-dir a file": (["--out-dir", "afile"], ["--out-dir", "afile"]),
    "out-dir below a file": (["--out-dir", "afile/run"], ["--out-dir", "Not a directory"]),
    "tokenizer missing": (["--tokenizer", "missing.tiktoken"], ["--tokenizer", "No such"]),
    "tokenizer garbage": (["--tokenizer", "garbage.bin"], ["--tokenizer", "tiktoken"]),
    "corpus-bytes 0": (["--corpus-bytes", "0"], ["--corpus-bytes"]),
    "corpus-bytes too small": (["--corpus-bytes", "10"], ["--corpus-bytes"]),
    "eval-interval negative": (["--eval-interval", "-1"], ["--eval-interval"]),
    "eval-batches 0": (["--eval-batches", "0"], ["--eval-batches"]),
    "checkpoint-interval negative": (["--checkpoint-interval", "-1"],
                                     ["--checkpoint-interval"]),
    "sample-tokens negative": (["--sample-tokens", "-1"], ["--sample-tokens"]),
    "temperature negative": (["--temperature", "-1"], ["--temperature"]),
    "top-k negative": (["--top-k", "-1"], ["--top-k"]),
    "snapshots 0": (["--checkpointing", "binomial", "--snapshots", "0"], ["--snapshots"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_error_line_with_status_2(inputs, tmp_path, case):
    args, expected = BAD_INPUTS[case]
    proc = run_cli(inputs, *QUICK, "--out-dir", tmp_path / "out", *args)
    line = assert_one_line_error(proc, *expected)
    if case == "safetensors without config.json":
        # It used to name import_hf_gpt2's arguments, which the command line does not have.
        assert "n_head=" not in line and "config=" not in line
    assert not (tmp_path / "out").exists(), "a failed start wrote output"


def test_debug_shows_the_traceback(tmp_path):
    proc = run_cli(tmp_path, *QUICK, "--data", "missing.txt", "--debug")
    assert proc.returncode == 1 and "Traceback" in proc.stderr
    assert "FileNotFoundError" in proc.stderr and "UsageError" in proc.stderr


def test_errors_of_the_thread_setup_are_user_errors(monkeypatch, capsys):
    """kernels.threads rejects counts above its cap with ValueError; the CLI reports it."""
    from kernels import threads

    def capped(n=None):
        raise ValueError(f"n_threads must be an integer in [1, 4096], got {n!r}")

    monkeypatch.setattr(threads, "set_num_threads", capped)
    assert train_cli.main([*QUICK, "--threads", "5000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("error: --threads: n_threads must be an integer in [1, 4096], got 5000")
    assert "\n" not in err


def test_full_and_read_only_disks_are_one_error_line(tmp_path, tmpfs):
    full = tmpfs(tmp_path / "full", "size=2m")
    read_only = tmpfs(tmp_path / "ro", "ro,size=1m")
    # B=8, T=64 saves about 3 MiB of activations a step, all spilled: more than 2 MiB.
    proc = run_cli(tmp_path, "--model", "tiny", "-B", "8", "-T", "64", "--steps", "2",
                   "--corpus-bytes", "100k", "--tape-budget", "1k", "--spill-dir", full,
                   "--eval-interval", "0", "--no-progress", "--out-dir", tmp_path / "a")
    assert_one_line_error(proc, "training", "No space left on device")
    proc = run_cli(tmp_path, *QUICK, "--out-dir", read_only / "run")
    assert_one_line_error(proc, "--out-dir", "Read-only file system")


def test_help_names_the_program_and_documents_every_option(tmp_path):
    launcher = tmp_path / "gpt2-train"  # as the console script is named
    launcher.write_text("import sys\nfrom gpt2.train import main\nsys.exit(main())\n")
    proc = run_cli(tmp_path, "--help", program=(str(launcher),))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: gpt2-train ")
    assert "``" not in proc.stdout and ":func:" not in proc.stdout
    assert "gpt2_run in the current directory" in proc.stdout
    module = run_cli(tmp_path, "--help")
    assert module.stdout.startswith("usage: python -m gpt2.train ")

    for action in train_cli.build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help"
        if action.default not in (None, False, argparse.SUPPRESS):
            assert "default" in action.help, f"{action.option_strings} hides its default"


@pytest.mark.parametrize("fmt", ["llmc", "safetensors"])
def test_sample_of_a_model_without_its_tokenizer_prints_token_ids(tmp_path, fmt):
    """A 4000-token model and no --tokenizer: bytes cannot decode its ids beyond 255."""
    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=4000, block_size=32)
    params = tiny_params(config, 3)
    if fmt == "llmc":
        path = tmp_path / "model.bin"
        export_llmc(path, params)
    else:
        path = tmp_path / "model.safetensors"
        export_hf_gpt2(path, params, write_config=True)
    proc = run_cli(tmp_path, "--init-from", path, "--steps", "1", "-B", "1", "-T", "16",
                   "--corpus-bytes", "20k", "--eval-interval", "0", "--sample-tokens", "8",
                   "--no-progress", "--out-dir", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    sample = proc.stdout.split("----- sample -----\n")[1].splitlines()
    assert "token ids" in sample[0] and "--tokenizer" in sample[0]
    ids = [int(t) for t in sample[1].split()]
    assert len(ids) == len("\n") + 8 and max(ids) >= 256    # bytes start from a newline
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model"] == str(path) and summary["init_from"] == str(path)
    assert summary["config"] == config.to_dict()


def test_success_exits_zero_and_the_summary_names_the_weights(tmp_path):
    path = tmp_path / "tiny.bin"
    export_llmc(path, tiny_params(GPT2Config.preset("tiny")))
    proc = run_cli(tmp_path, *QUICK, "--init-from", path, "--out-dir", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert "loss" in proc.stdout and "----- sample -----" in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # It said "small" (the --model default) whatever the weights were.
    assert summary["model"] == "tiny" and summary["init_from"] == str(path)
