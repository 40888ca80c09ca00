"""Llama-family training on the same runtime as GPT-2: every memory policy (tape budget
spilling to disk, per-layer and binomial checkpointing) gives the in-memory losses to the
bit, and gpt2-train starts from a Hugging Face directory, resumes, and writes one back."""
import json

import numpy as np
import pytest
import transformers

from gpt2 import hf
from gpt2.config import LlamaConfig
from gpt2.model import GPT2
from gpt2.train import run
from hf_models import saved_hf_model


def losses(config, steps=4, **kwargs):
    model = GPT2(config, seed=1, **kwargs)
    rng = np.random.default_rng(0)
    x = rng.integers(0, config.vocab_size, (2, 48)).astype(np.int32)
    y = rng.integers(0, config.vocab_size, (2, 48)).astype(np.int32)
    out = [model.train_step(x, y, lr=1e-3, weight_decay=0.1, grad_clip=1.0)[0]
           for _ in range(steps)]
    stats = model.tape_stats
    model.close()
    return out, stats


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_memory_policies_give_the_in_memory_losses(qkv_bias, tmp_path):
    config = LlamaConfig(**{**LlamaConfig.preset("llama-tiny").to_dict(), "n_layer": 4,
                            "qkv_bias": qkv_bias})
    reference, _ = losses(config)
    spilled, stats = losses(config, tape_kwargs={"memory_budget": 32 << 10,
                                                 "spill_dir": str(tmp_path)})
    assert spilled == reference and stats["bytes_written"] > 0
    assert losses(config, checkpointing="layer")[0] == reference
    assert losses(config, checkpointing="binomial", snapshots=1)[0] == reference


def test_manual_engine_is_gpt2s():
    with pytest.raises(ValueError, match="hand-sequenced engine is GPT-2's"):
        GPT2(LlamaConfig.preset("llama-tiny"), engine="manual")


def test_train_from_a_hugging_face_directory_resume_and_write_one(tmp_path):
    config = LlamaConfig.preset("llama-tiny")
    saved_hf_model(config, tmp_path / "start", spread=False)
    out = tmp_path / "run"
    args = ["--init-from", str(tmp_path / "start"), "-B", "2", "-T", "32", "--corpus-bytes",
            "50k", "--eval-interval", "0", "--sample-tokens", "5", "--no-progress",
            "--out-dir", str(out)]
    first = run(args + ["--steps", "3"])
    assert first["model"] == "llama-tiny" and first["config"] == config.to_dict()
    resumed = run(["--resume", str(out / "checkpoint.bin"), "--steps", "5", "--save-hf",
                   str(tmp_path / "end")])
    assert resumed["start_step"] == 3
    back, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "end",
                                                               output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    saved = json.loads((tmp_path / "end" / "config.json").read_text())
    assert saved["num_key_value_heads"] == 2 and saved["tie_word_embeddings"] is True
    # The weights written are the trained ones: they moved away from the start.
    start = hf.load_dir(tmp_path / "start")
    end = hf.load_dir(tmp_path / "end")
    assert end.config == start.config and not np.array_equal(end.flat, start.flat)


def test_a_configuration_we_cannot_run_is_one_error_line_naming_the_field(tmp_path, capsys):
    from gpt2.train import main
    config = hf.hf_config_dict(LlamaConfig.preset("llama-tiny"))
    (tmp_path / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    assert main(["--init-from", str(tmp_path), "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: --init-from" in err[0] and "attention_bias" in err[0]
