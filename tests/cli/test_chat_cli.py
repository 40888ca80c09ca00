"""gpt2-train and gpt2-eval on chat and instruction JSONL: a tiny Llama directory saved by
transformers, with a ChatML tokenizer and template, trains on conversations (validation,
--grad-accum, the header's counts of padding); a prompt/completion run resumes on its
curve, and 2 ranks under mpiexec (each its rows, of uneven masks) train as one process;
gpt2-eval's loss is the mean over the trained tokens; a bad line is one error line naming
the file and line."""
import csv
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tokenizers
import torch
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

import gpt2
from adtape import nn
from gpt2 import data, evaluate
from gpt2.hf import load_dir
from gpt2.model import Model
from gpt2.tokenizer import load_tokenizer
from gpt2.train import main, run

TEXT = ("hello world how are you today the quick brown fox jumps over the lazy dog "
        "what is two plus two it is four thank you very much good bye ") * 4
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
WORDS = TEXT.split()


def llama_dir(path):
    """A tiny random Llama with a byte-level BPE tokenizer and the ChatML template in its
    tokenizer_config.json, saved by transformers."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|im_end|>")
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    config = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).float().save_pretrained(path)


def conversations(n, seed=0):
    """``n`` conversations of random words, of one to three exchanges."""
    rng = np.random.default_rng(seed)

    def words(k):
        return " ".join(rng.choice(WORDS, k))
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": words(3)}] if rng.random() < 0.3 else []
        for _ in range(rng.integers(1, 4)):
            messages += [{"role": "user", "content": words(rng.integers(1, 6))},
                         {"role": "assistant", "content": words(rng.integers(1, 8))}]
        out.append({"messages": messages})
    return out


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    llama_dir(path)
    return path


def log_losses(out, key="loss"):
    with open(out / "log.csv") as f:
        return [float(r[key]) for r in csv.DictReader(f) if r[key]]


def test_training_on_conversations(model_dir, tmp_path, capsys):
    chats = write_jsonl(tmp_path / "chats.jsonl", conversations(60))
    out = tmp_path / "run"
    summary = run(["--init-from", str(model_dir), "--data", str(chats), "-B", "4", "-T", "96",
                   "--steps", "4", "--grad-accum", "2", "--eval-interval", "2",
                   "--eval-batches", "2", "--val-fraction", "0.2", "--lr", "3e-3",
                   "--sample-tokens", "0", "--no-progress", "--out-dir", str(out)])
    printed = capsys.readouterr().out
    assert "data 60 conversations" in printed
    loader = data.ExampleLoader(data.read_data(chats, load_tokenizer(model_dir), model_dir), 4,
                                96, 300, val_fraction=0.2)
    assert (f"training split: {loader.num_windows} examples of up to T+1=97 tokens: "
            f"{loader.truncated} truncated, {loader.dropped} dropped (no trained token within "
            f"them); {100 * loader.padding_fraction:.1f}% of the positions padding") in printed
    assert "validation: 2 batches of 4 examples = 8 of 12 (66.7%)" in printed
    assert np.isfinite(summary["final_loss"]) and np.isfinite(summary["final_val_loss"])
    assert len(log_losses(out)) == 4 and len(log_losses(out, "val_loss")) == 2


def test_prompt_completion_resumes_on_its_curve(tmp_path):
    records = [{"prompt": f"{a}+{b}=", "completion": str(a + b)}
               for a in range(12) for b in range(5)]
    pairs = write_jsonl(tmp_path / "sums.jsonl", records)
    args = ["--model", "tiny", "--data", str(pairs), "-B", "4", "-T", "16", "--steps", "4",
            "--eval-interval", "2", "--eval-batches", "3", "--val-fraction", "0.2", "--sample-tokens", "0",
            "--no-progress"]
    run(args + ["--out-dir", str(tmp_path / "whole")])
    half = args.copy()
    half[half.index("--steps") + 1] = "2"
    run(half + ["--out-dir", str(tmp_path / "half")])
    run(["--resume", str(tmp_path / "half" / "checkpoint.bin"), "--steps", "4",
         "--no-progress"])
    for key in ("loss", "val_loss"):
        assert log_losses(tmp_path / "half", key) == log_losses(tmp_path / "whole", key)


def test_two_ranks_weigh_their_rows_by_the_global_count(tmp_path):
    """Prompt/completion rows of very different trained lengths split over 2 ranks (with
    2 micro-batches each): every rank's loss sum divides by the global batch's count, so
    the losses are the one process's."""
    records = [{"prompt": f"{a} plus {b} is", "completion": " " + "ab" * (a % 7) + "."}
               for a in range(20) for b in range(3)]
    pairs = write_jsonl(tmp_path / "pairs.jsonl", records)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(pathlib.Path(gpt2.__file__).parent.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "gpt2.train", "--model", "tiny", "--data", str(pairs),
               "-B", "8", "-T", "24", "--steps", "4", "--eval-interval", "0",
               "--val-fraction", "0", "--sample-tokens", "0", "--no-progress"]
    mpiexec = shutil.which("mpiexec")
    assert mpiexec, "mpiexec not found: install the mpi extra (pip install '.[mpi]')"
    for out, prefix in ((tmp_path / "one", []), (tmp_path / "two", [mpiexec, "-n", "2"])):
        extra = ["--grad-accum", "2"] if prefix else []
        proc = subprocess.run(prefix + command + extra + ["--out-dir", str(out)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    one, two = log_losses(tmp_path / "one"), log_losses(tmp_path / "two")
    assert np.max(np.abs(np.subtract(two, one)) / np.abs(one)) < 1e-6, (one, two)


def test_a_bad_line_is_one_error_line(model_dir, tmp_path, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [conversations(1)[0], "",
                                              {"messages": [{"role": "user", "content": "hi"},
                                                            {"role": "robot", "content": "x"}]}])
    status = main(["--init-from", str(model_dir), "--data", str(bad), "--steps", "1",
                   "--no-progress", "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert err[0].endswith(f"error: --data: JSONL file {str(bad)!r} line 3: message 2 has the "
                           f"unknown role 'robot'; the roles are system, user, assistant, tool")
    assert not (tmp_path / "out").exists()
    # messages without a chat template: bytes
    status = main(["--model", "tiny", "--data", str(bad), "--steps", "1", "--no-progress",
                   "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "line 1: " in err[0] and "--tokenizer" in err[0]


def test_evaluation_counts_the_trained_tokens(model_dir, tmp_path, capsys):
    chats = write_jsonl(tmp_path / "chats.jsonl", conversations(11, seed=1))
    assert evaluate.main([str(model_dir), "--data", str(chats), "-T", "64", "-B", "4",
                          "--json", "--no-progress"]) == 0
    got = json.loads(capsys.readouterr().out)
    # The reference: every example in one batch, its masked mean.
    examples = data.read_data(chats, load_tokenizer(model_dir), model_dir)
    loader = data.ExampleLoader(examples, 11, 64, 300, split="all", shuffle=False)
    inputs, targets = loader.next_batch()
    model = Model(load_dir(model_dir).config)
    model.set_params(load_dir(model_dir))
    _, loss = model.forward(inputs, targets)
    model.close()
    assert got["tokens"] == got["predictable_tokens"] == \
        int(np.count_nonzero(targets != nn.IGNORE_INDEX))
    assert (got["batches"], got["whole_file"]) == (3, True)
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
