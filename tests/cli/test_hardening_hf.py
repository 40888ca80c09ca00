"""Hugging Face directories and a resumed run's log as gpt2-train meets them when they are
wrong (issue 40, items 5 and 9): --save-hf into a directory that holds another model's
weights is refused before any training, and with --overwrite leaves a directory that
transformers and --init-from read identically; a directory whose model.safetensors and
shards differ is refused; a config.json field of the wrong type, value or size is named in
one error line before anything is allocated; a log.csv that is not ours is named on --resume.
"""
import hashlib
import json
import os
import random
import resource
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

import adtape
import gpt2
from gpt2 import hf
from gpt2.config import LlamaConfig
from gpt2.families.llama import hf_tensors
from gpt2.train import main
from hf_models import hf_model

PACKAGE_ROOTS = os.pathsep.join({os.path.dirname(os.path.dirname(m.__file__))
                                 for m in (adtape, gpt2)})
QUICK = ["-B", "1", "-T", "16", "--steps", "1", "--corpus-bytes", "20k", "--eval-interval",
         "0", "--sample-tokens", "0", "--no-progress"]
LLAMA_TINY = LlamaConfig.preset("llama-tiny")


def save_llama(directory, seed=0, **save_kwargs):
    """transformers' llama-tiny with random weights (norms too), saved by save_pretrained."""
    model = hf_model(LLAMA_TINY, seed)
    model.save_pretrained(directory, **save_kwargs)
    return model


def snapshot(directory):
    """name -> digest of every file under ``directory``: what a refusal must leave alone."""
    return {os.path.relpath(os.path.join(root, name), directory):
            hashlib.sha256(open(os.path.join(root, name), "rb").read()).hexdigest()
            for root, _, names in os.walk(directory) for name in names}


def one_error_line(capsys, *expected):
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


def assert_loads_identically(directory):
    """transformers and load_dir read the same tensors from ``directory``, bit for bit."""
    ours = hf.load_dir(directory)
    cls = (transformers.GPT2LMHeadModel if ours.config.family == "gpt2"
           else transformers.LlamaForCausalLM)
    theirs, info = cls.from_pretrained(directory, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    state = {k: v.detach().float().numpy() for k, v in theirs.state_dict().items()}
    if ours.config.family == "gpt2":
        np.testing.assert_array_equal(state["transformer.h.1.attn.c_attn.weight"].T,
                                      ours.qkvw[1])
        np.testing.assert_array_equal(state["transformer.wte.weight"],
                                      ours.wte[:ours.config.vocab_size])
        return ours
    for name, (key, layer, piece, _) in hf_tensors(ours.config).items():
        view = ours.views[key] if layer is None else ours.views[key][layer]
        np.testing.assert_array_equal(state[name], view[piece], err_msg=name)
    return ours


# --------------------------------------------------------------------------------------------
# Item 5: --save-hf into a directory holding another model
# --------------------------------------------------------------------------------------------

def other_model(directory, layout):
    """A directory holding another model's weights in one of the layouts met in practice."""
    if layout == "sharded":
        save_llama(directory, seed=1, max_shard_size="200KB")
        assert len(set(json.loads((directory / hf.INDEX_NAME).read_text())
                       ["weight_map"].values())) > 1
    elif layout == "single":
        save_llama(directory, seed=1)
    else:   # a PyTorch pickle beside its config and tokenizer
        model = save_llama(directory, seed=1)
        os.unlink(directory / hf.WEIGHTS_NAME)
        torch.save(model.state_dict(), directory / "pytorch_model.bin")
    (directory / "tokenizer.json").write_text("{}")


@pytest.mark.parametrize("layout", ["sharded", "single", "pytorch"])
def test_save_hf_refuses_another_models_directory_before_training(layout, tmp_path, capsys):
    other_model(tmp_path / "other", layout)
    before = snapshot(tmp_path / "other")
    assert main(["--model", "llama-tiny", *QUICK, "--out-dir", str(tmp_path / "run"),
                 "--save-hf", str(tmp_path / "other")]) == 2
    line = one_error_line(capsys, f"--save-hf {tmp_path / 'other'} holds another model's "
                                  f"weights (", "pass --overwrite to replace them")
    assert ("model-00001-of-" in line if layout == "sharded"
            else ("pytorch_model.bin" if layout == "pytorch" else "model.safetensors") in line)
    assert snapshot(tmp_path / "other") == before
    assert not (tmp_path / "run").exists(), "the refused run trained or wrote output"


def test_save_hf_into_a_file_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["--model", "llama-tiny", *QUICK, "--out-dir", str(tmp_path / "run"),
                 "--save-hf", str(tmp_path / "afile")]) == 2
    one_error_line(capsys, "--save-hf", "not a directory")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("model", ["llama-tiny", "tiny"])
def test_save_hf_overwrite_leaves_only_the_new_weights(model, tmp_path):
    other_model(tmp_path / "out", "sharded")
    (tmp_path / "out" / "pytorch_model.bin").write_bytes(b"stale")
    assert main(["--model", model, *QUICK, "--out-dir", str(tmp_path / "run"),
                 "--save-hf", str(tmp_path / "out"), "--overwrite"]) == 0
    # The tokenizer and generation settings are not weights: they stay.
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "generation_config.json",
                                                    "model.safetensors", "tokenizer.json"]
    ours = assert_loads_identically(tmp_path / "out")
    assert ours.config.preset_name() == model


def test_a_directory_whose_shards_and_single_file_differ_is_refused(tmp_path, capsys):
    save_llama(tmp_path / "m", seed=1, max_shard_size="200KB")
    save_llama(tmp_path / "single", seed=2)
    shutil.copy(tmp_path / "single" / hf.WEIGHTS_NAME, tmp_path / "m" / hf.WEIGHTS_NAME)
    assert main(["--init-from", str(tmp_path / "m"), *QUICK,
                 "--out-dir", str(tmp_path / "run")]) == 2
    one_error_line(capsys, "--init-from", "holds two models", "model.safetensors and the shards "
                   "of model.safetensors.index.json differ", "remove the stale one")
    assert not (tmp_path / "run").exists()
    # The same tensors both ways are one model: read from model.safetensors, as transformers does.
    save_llama(tmp_path / "same", seed=1, max_shard_size="200KB")
    save_llama(tmp_path / "same-single", seed=1)
    shutil.copy(tmp_path / "same-single" / hf.WEIGHTS_NAME, tmp_path / "same" / hf.WEIGHTS_NAME)
    np.testing.assert_array_equal(assert_loads_identically(tmp_path / "same").flat,
                                  hf.load_dir(tmp_path / "same-single").flat)


# --------------------------------------------------------------------------------------------
# Item 9: config.json sanity before allocation
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    save_llama(directory)
    return directory


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    from gpt2.config import GPT2Config
    from gpt2.params import ParamArena, init_params_
    directory = tmp_path_factory.mktemp("gpt2")
    hf.save_dir(directory, init_params_(ParamArena(GPT2Config.preset("tiny")), 0))
    return directory


def with_config(source, target, **changes):
    """A copy of the model directory ``source`` whose config.json has ``changes`` (None:
    the field removed)."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (target / "config.json").write_text(json.dumps(config))
    return target


LLAMA_FIELDS = {
    "hidden_size huge": ({"hidden_size": 10**12}, "hidden_size is 1000000000000, but "
                         "model.embed_tokens.weight has 64 columns"),
    "hidden_size negative": ({"hidden_size": -64}, "hidden_size must be a positive integer, "
                             "got -64"),
    "hidden_size zero": ({"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
    "hidden_size a string": ({"hidden_size": "64"}, 'hidden_size must be a positive integer, '
                             'got "64"'),
    "num_hidden_layers a bool": ({"num_hidden_layers": True}, "num_hidden_layers must be a "
                                 "positive integer, got true"),
    "intermediate_size a float": ({"intermediate_size": 160.0}, "intermediate_size must be a "
                                  "positive integer, got 160.0"),
    "intermediate_size huge": ({"intermediate_size": 10**9}, "intermediate_size is 1000000000, "
                               "but model.layers.0.mlp.gate_proj.weight has 160 rows"),
    "heads not dividing hidden_size": ({"num_attention_heads": 5, "head_dim": None},
                                       "num_attention_heads (5) must divide hidden_size (64)"),
    "kv heads not dividing heads": ({"num_key_value_heads": 3}, "num_key_value_heads (3) must "
                                    "divide num_attention_heads (4)"),
    "heads not the weights'": ({"num_attention_heads": 8, "num_key_value_heads": 4},
                               "num_attention_heads x head_dim is 8 x 16 = 128, but "
                               "model.layers.0.self_attn.q_proj.weight has 64 rows"),
    "vocab_size zero": ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
    "vocab_size negative": ({"vocab_size": -1}, "vocab_size must be a positive integer, got -1"),
    "vocab_size huge": ({"vocab_size": 10**12}, "vocab_size is 1000000000000, but "
                        "model.embed_tokens.weight has 256 rows"),
    # transformers 5 writes rope_parameters; config.json files published before, rope_scaling.
    "rope_scaling a string": ({"rope_parameters": None, "rope_scaling": "linear"},
                              'rope_scaling must be null or an object with "rope_type" (or '
                              '"type") "default", or "llama3" with "factor"'),
    "rope_parameters a string": ({"rope_parameters": "linear"}, "rope_parameters must be null "
                                 "or an object with"),
    "rope_scaling linear": ({"rope_parameters": None,
                             "rope_scaling": {"type": "linear", "factor": 2.0}},
                            "rope_scaling: rope_type 'linear' is not supported"),
    "rope_scaling llama3 without factor": ({"rope_parameters": None,
                                            "rope_scaling": {"rope_type": "llama3"}},
                                           "rope_scaling.factor is missing"),
    "rope_theta a string": ({"rope_theta": "1e4"}, 'rope_theta must be a positive number, '
                            'got "1e4"'),
    "rms_norm_eps huge int": ({"rms_norm_eps": 10**400}, "rms_norm_eps must be a positive "
                              "number"),
    "tie_word_embeddings a string": ({"tie_word_embeddings": "false"}, "tie_word_embeddings "
                                     'must be true or false, got "false"'),
}


@pytest.mark.parametrize("case", list(LLAMA_FIELDS))
def test_a_bad_llama_config_field_is_named(case, llama_dir, tmp_path, capsys):
    changes, expected = LLAMA_FIELDS[case]
    directory = with_config(llama_dir, tmp_path / "m", **changes)
    assert main(["--init-from", str(directory), *QUICK, "--out-dir", str(tmp_path / "run")]) == 2
    one_error_line(capsys, f"error: --init-from: '{directory / 'config.json'}': {expected}")
    assert not (tmp_path / "run").exists()


GPT2_FIELDS = {
    "n_layer huge": ({"n_layer": 10**9}, "holds weights for n_layer=2, not the "
                     "n_layer=1000000000 of its config"),
    "n_positions huge": ({"n_positions": 10**9}, "holds weights for n_positions=64, not the "
                         "n_positions=1000000000 of its config"),
    "n_head not dividing n_embd": ({"n_head": 5}, "n_head (5) must divide n_embd (32)"),
    "n_embd a string": ({"n_embd": "32"}, 'n_embd must be a positive integer, got "32"'),
    "vocab_size zero": ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
}


@pytest.mark.parametrize("case", list(GPT2_FIELDS))
def test_a_bad_gpt2_config_field_is_named(case, gpt2_dir, tmp_path, capsys):
    changes, expected = GPT2_FIELDS[case]
    directory = with_config(gpt2_dir, tmp_path / "m", **changes)
    assert main(["--init-from", str(directory), *QUICK, "--out-dir", str(tmp_path / "run")]) == 2
    one_error_line(capsys, "error: --init-from: ", expected)
    assert not (tmp_path / "run").exists()


def test_a_billion_layers_are_refused_at_once_by_name(llama_dir, tmp_path):
    """Before: 30 s and 3.6 GB, then 'MemoryError'.  The child may not map 2 GiB, so a
    loader that trusts the field fails with a MemoryError instead of naming it."""
    directory = with_config(llama_dir, tmp_path / "m", num_hidden_layers=10**9)

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    proc = subprocess.run([sys.executable, "-m", "gpt2.train", "--init-from", directory,
                           *QUICK, "--out-dir", tmp_path / "run", "--threads", "1"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env=dict(os.environ, PYTHONPATH=PACKAGE_ROOTS),
                          preexec_fn=limit_memory)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert ("num_hidden_layers is 1000000000, but the weights hold 2 layers" in errors[0]
            ), errors[0]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_model_beyond_the_memory_is_refused_before_it_is_read(family, llama_dir, gpt2_dir,
                                                                 tmp_path, capsys, monkeypatch):
    import psutil

    class Scarce:
        available = free = 64 << 10

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Scarce)
    monkeypatch.setattr(psutil, "swap_memory", lambda: Scarce)
    directory = llama_dir if family == "llama" else gpt2_dir
    assert main(["--init-from", str(directory), *QUICK, "--out-dir", str(tmp_path / "run")]) == 2
    one_error_line(capsys, "error: --init-from: ", "parameters take", "GiB as float32, more "
                   "than the 0.0 GiB of memory available")


# --------------------------------------------------------------------------------------------
# Item 9: a log.csv that is not ours beside the checkpoint on --resume
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A one-step run of tiny with its checkpoint and log."""
    directory = tmp_path_factory.mktemp("run")
    assert main(["--model", "tiny", *QUICK, "--out-dir", str(directory)]) == 0
    return directory


BAD_LOGS = {
    "random bytes": random.Random(0).randbytes(4096),
    "NUL bytes": b"step,loss,lr,ms,tokens_per_s,grad_norm,val_loss\n1,\x00,0,0,0,0,\n",
    "wrong columns, no rows": b"epoch,accuracy\n",
    "wrong columns": b"epoch,accuracy\n1,0.5\n",
    "non-numeric values": b"step,loss,lr,ms,tokens_per_s,grad_norm,val_loss\n1,abc,0,0,0,0,\n",
    "a field beyond csv's limit": (b"step,loss,lr,ms,tokens_per_s,grad_norm,val_loss\n1,"
                                   + b"9" * 200_000 + b",0,0,0,0,\n"),
}


@pytest.mark.parametrize("case", list(BAD_LOGS))
def test_a_log_that_is_not_ours_is_named_on_resume(case, finished_run, tmp_path, capsys):
    run = shutil.copytree(finished_run, tmp_path / "run")
    (run / "log.csv").write_bytes(BAD_LOGS[case])
    before = snapshot(run)
    assert main(["--resume", str(run / "checkpoint.bin"), "--steps", "2"]) == 2
    line = one_error_line(capsys, "error: --resume: ", str(run / "log.csv"),
                          "move it away to resume without the history")
    assert len(line) < 400, line
    assert snapshot(run) == before
