"""gpt2-train --lora end to end on a random Llama that transformers saved: the adapter
written to OUT_DIR/adapter/ loads in peft on transformers' own model and gives the logits
of our merged --save-hf directory; a resumed run continues where the uninterrupted one
is; --lora-from starts from a peft adapter; a bf16 base; what LoRA refuses, in one line."""
import json

import numpy as np
import peft
import pytest
import torch
import transformers

from gpt2 import checkpoint as ckpt
from gpt2 import train
from gpt2.config import LlamaConfig
from gpt2.train_options import UsageError
from hf_models import saved_hf_model

CONFIG = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96,
                     vocab_size=256, block_size=64, tie_embeddings=False, qkv_bias=True)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A random Qwen2-style model (biases, untied head) saved by transformers."""
    path = tmp_path_factory.mktemp("base")
    saved_hf_model(CONFIG, path, spread=False)
    return path


def common(base_dir, out, *extra):
    return ["--init-from", str(base_dir), "--tokenizer", "bytes", "-B", "2", "-T", "16",
            "--lr", "1e-2", "--warmup", "0", "--schedule", "constant", "--eval-interval", "0", "--sample-tokens", "0",
            "--no-progress", "--out-dir", str(out), *extra]


def test_the_adapter_loads_in_peft_and_equals_the_merged_model(base_dir, tmp_path):
    summary = train.run(common(base_dir, tmp_path / "run", "--lora", "4", "--steps", "4",
                               "--lora-targets", "q_proj,v_proj,down_proj",
                               "--save-hf", str(tmp_path / "merged")))
    assert summary["lora"]["r"] == 4 and summary["lora"]["alpha"] == 8.0
    assert summary["lora"]["trained_parameters"] == 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4
                                                         + 4 * 96 + 64 * 4)
    adapter = tmp_path / "run" / "adapter"
    fields = json.loads((adapter / "adapter_config.json").read_text())
    assert fields["peft_type"] == "LORA" and sorted(fields["target_modules"]) == [
        "down_proj", "q_proj", "v_proj"]
    assert fields["base_model_name_or_path"] == str(base_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir)).eval()
    tuned = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(str(base_dir)), str(adapter)).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = tuned(ids).logits.numpy(), merged(ids).logits.numpy()
        assert np.abs(want - base(ids).logits.numpy()).max() > 1e-3    # the adapter trained
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_resumed_run_continues_the_uninterrupted_one(base_dir, tmp_path):
    straight = train.run(common(base_dir, tmp_path / "a", "--lora", "2", "--steps", "6"))
    train.run(common(base_dir, tmp_path / "b", "--lora", "2", "--steps", "3"))
    resumed = train.run(["--resume", str(tmp_path / "b" / "checkpoint.bin"), "--steps", "6",
                         "--no-progress"])
    assert resumed["final_loss"] == straight["final_loss"]
    a = ckpt.load_checkpoint(tmp_path / "a" / "checkpoint.bin", lora=True)
    b = ckpt.load_checkpoint(tmp_path / "b" / "checkpoint.bin", lora=True)
    assert a.step == b.step == 6 and a.lora == b.lora
    assert np.array_equal(a.params.flat, b.params.flat)
    assert np.array_equal(a.adam_v.flat, b.adam_v.flat)
    with pytest.raises(UsageError, match="--lora: the run in .* has its adapters"):
        train.run(["--resume", str(tmp_path / "b" / "checkpoint.bin"), "--lora", "3",
                   "--steps", "7"])


def test_lora_from_a_peft_adapter_and_a_bf16_base(base_dir, tmp_path):
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir))
    theirs = peft.get_peft_model(base, peft.LoraConfig(r=3, lora_alpha=6,
                                                       target_modules=["k_proj", "o_proj"]))
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    theirs.save_pretrained(str(tmp_path / "theirs"))
    summary = train.run(common(base_dir, tmp_path / "run", "--lora-from",
                               str(tmp_path / "theirs"), "--steps", "2", "--base-dtype", "bf16",
                               "--lr", "0"))
    assert summary["lora"]["r"] == 3 and sorted(summary["lora"]["targets"]) == ["k_proj", "o_proj"]
    assert summary["lora"]["base_dtype"] == "bf16"
    # At lr 0 the adapter written is the one read.
    again = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(str(base_dir)),
        str(tmp_path / "run" / "adapter"))
    mine, its = dict(again.named_parameters()), dict(theirs.named_parameters())
    for name, p in its.items():
        if "lora_" in name:
            assert torch.equal(mine[name], p), name


@pytest.mark.parametrize("argv,match", [
    (["--base-dtype", "bf16"], "--base-dtype is a LoRA option: add --lora R"),
    (["--lora", "2", "--offload", "moments"], "--lora runs without --offload moments"),
    (["--lora", "2", "--engine", "manual"], "--lora runs without --engine manual"),
    (["--lora", "2", "--lora-targets", "q_proj,c_attn"], "'c_attn' are not projections"),
    (["--lora-from", "nowhere"], "--lora-from: nowhere: no adapter_config.json"),
])
def test_what_lora_refuses(base_dir, tmp_path, argv, match):
    with pytest.raises(UsageError, match=match):
        train.run(common(base_dir, tmp_path / "x", "--steps", "1", *argv))
    assert not (tmp_path / "x").exists()


def test_generate_and_eval_read_a_lora_run_as_its_merged_model(base_dir, tmp_path, capsys):
    from gpt2 import evaluate, generate_cli
    train.run(common(base_dir, tmp_path / "run", "--lora", "4", "--steps", "3",
                     "--save-hf", str(tmp_path / "merged")))
    capsys.readouterr()
    text = tmp_path / "text.txt"
    text.write_text("LoRA adapters merged into their base give the same model.\n" * 6)
    losses = []
    for model in (tmp_path / "run" / "checkpoint.bin", tmp_path / "run" / "adapter",
                  tmp_path / "merged"):
        assert evaluate.main([str(model), "--data", str(text), "--tokenizer", "bytes",
                              "--json", "--no-progress", "-T", "16"]) == 0
        losses.append(json.loads(capsys.readouterr().out)["loss"])
    assert losses[0] == losses[1] == losses[2]
    outs = []
    for model in (tmp_path / "run" / "checkpoint.bin", tmp_path / "run" / "adapter",
                  tmp_path / "merged"):
        assert generate_cli.main([str(model), "--tokenizer", "bytes", "-p", "LoRA", "-n", "12",
                                  "--temperature", "0", "--print-ids"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2] and outs[0].strip()


def test_a_bf16_base_run_generates_evaluates_and_exports_in_bf16(base_dir, tmp_path, capsys):
    # A run on a bf16 base: its checkpoint and adapter read with --dtype bf16 (the base in
    # bf16, the adapters unmerged over it) give the loss and tokens of the float32 model it
    # trained (the rounded base, the adapters merged), and so does its --save-hf directory.
    from gpt2 import evaluate, generate_cli
    train.run(common(base_dir, tmp_path / "run", "--lora", "4", "--steps", "3",
                     "--base-dtype", "bf16", "--save-hf", str(tmp_path / "merged")))
    capsys.readouterr()
    text = tmp_path / "text.txt"
    text.write_text("A bf16 base keeps every bit of its adapters' update.\n" * 6)
    sources = (tmp_path / "run" / "checkpoint.bin", tmp_path / "run" / "adapter")
    runs = [(source, dtype) for source in sources for dtype in ("fp32", "bf16")]
    runs.append((tmp_path / "merged", "fp32"))
    losses, outs = [], []
    for model, dtype in runs:
        assert evaluate.main([str(model), "--data", str(text), "--tokenizer", "bytes",
                              "--json", "--no-progress", "-T", "16", "--dtype", dtype]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["dtype"] == dtype
        losses.append(result["loss"])
        assert generate_cli.main([str(model), "--tokenizer", "bytes", "-p", "LoRA", "-n", "12",
                                  "--temperature", "0", "--print-ids", "--dtype", dtype]) == 0
        outs.append(capsys.readouterr().out)
    assert max(losses) - min(losses) <= 1e-5 * losses[0], losses
    assert all(out == outs[0] for out in outs) and outs[0].strip()
