"""A LoRA model's outputs without a float32 copy of its base: generation runs the adapters
unmerged over the base (float32 or bf16), and the exports (--save-hf, --save-gguf) merge
one block at a time as they write it (gpt2.lora.MergedParams), byte for byte what merging
the whole model first writes; a bf16-base run's float32 base is the rounded one it
trained on."""
import numpy as np
import pytest

from gpt2 import checkpoint as ckpt
from gpt2 import hf, lora
from gpt2.config import GPT2Config, LlamaConfig
from gpt2.generate import Decoder, Weights, generate
from gpt2.lora import Bf16Base, LoraConfig, MergedParams
from gpt2.model import Model
from gpt2.params import ParamArena

QWEN2_LIKE = LlamaConfig(**{**LlamaConfig.preset("llama-tiny").to_dict(), "qkv_bias": True,
                            "tie_embeddings": False})
CONFIGS = {"llama-tiny": LlamaConfig.preset("llama-tiny"), "qwen2-like": QWEN2_LIKE,
           "gpt2-tiny": GPT2Config.preset("tiny")}


def lora_model(config, base_dtype, seed=0):
    """A LoRA model (r 4, q/v/down or c_attn/c_fc adapted) whose B's are not zero."""
    targets = ("c_attn", "c_fc") if isinstance(config, GPT2Config) else ("q_proj", "v_proj",
                                                                         "down_proj")
    model = Model(config, seed=seed, lora=LoraConfig(r=4, alpha=8, targets=targets),
                  base_dtype=base_dtype)
    flat = model.adapter.params.flat
    flat[...] = np.random.default_rng(seed).normal(0, 0.1, flat.size)
    return model


def refuse_copies(monkeypatch):
    """Fail on anything that makes a float32 copy of the whole model."""
    def refuse(*args, **kwargs):
        raise AssertionError("a float32 copy of the whole model")
    monkeypatch.setattr(MergedParams, "to_arena", refuse)
    monkeypatch.setattr(Bf16Base, "to_arena", refuse)
    monkeypatch.setattr(ParamArena, "__init__", refuse)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("base_dtype", ["fp32", "bf16"])
def test_generation_runs_the_adapters_unmerged(name, base_dtype, monkeypatch):
    model = lora_model(CONFIGS[name], base_dtype)
    try:
        merged = Weights(model.param_arena())
        ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 20)
        want = Decoder(merged, capacity=20).extend(ids, all_positions=True)
        greedy = generate(merged, ids[:5].tolist(), 12, temperature=0)
        refuse_copies(monkeypatch)
        decoder = Decoder(model, capacity=20)
        got = np.concatenate([decoder.extend(ids[:7], all_positions=True)]
                             + [decoder.extend(ids[t:t + 1]) for t in range(7, 20)])
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        assert generate(model, ids[:5].tolist(), 12, temperature=0) == greedy
    finally:
        model.close()


@pytest.mark.parametrize("base_dtype", ["fp32", "bf16"])
def test_the_merged_model_is_the_base_plus_every_update(base_dtype):
    model = lora_model(QWEN2_LIKE, base_dtype)
    try:
        base = model.base if base_dtype == "fp32" else model.base.to_arena()
        want = ParamArena(QWEN2_LIKE).copy_(base)
        state = model.adapter
        for weight in ("qkvw", "downw"):
            for layer in range(QWEN2_LIKE.n_layer):
                for (start, rows), d in state.delta(weight, layer).items():
                    want.views[weight][layer, start:start + rows] += d
        got = model.param_arena()
        for name, view in want.views.items():
            assert np.array_equal(got.views[name], view), name
        assert not np.array_equal(got.views["qkvw"], base.views["qkvw"])
    finally:
        model.close()


@pytest.mark.parametrize("name", ["qwen2-like", "gpt2-tiny"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_exports_merge_a_block_at_a_time(name, dtype, tmp_path, monkeypatch):
    from gpt2.gguf_export import save_gguf
    config = CONFIGS[name]
    model = lora_model(config, "bf16")
    try:
        whole = model.param_arena()
        hf.save_dir(tmp_path / "whole", whole, dtype=dtype)
        save_gguf(tmp_path / "whole.gguf", config, whole, dtype="q8_0", name="m")
        if name == "qwen2-like":     # GPT-2 (at most 1.5B) is merged whole to be written
            refuse_copies(monkeypatch)
        hf.save_dir(tmp_path / "blocks", model.merged_params(), dtype=dtype)
        save_gguf(tmp_path / "blocks.gguf", config, model.merged_params(), dtype="q8_0",
                  name="m")
    finally:
        monkeypatch.undo()
        model.close()
    for file in ("model.safetensors", "config.json"):
        assert (tmp_path / "whole" / file).read_bytes() == (tmp_path / "blocks" / file).read_bytes()
    assert (tmp_path / "whole.gguf").read_bytes() == (tmp_path / "blocks.gguf").read_bytes()


def test_merged_params_is_read_a_block_at_a_time():
    model = lora_model(QWEN2_LIKE, "bf16")
    try:
        merged = model.merged_params()
        assert merged.in_llmc_order() is merged and set(merged.views) == set(
            QWEN2_LIKE.param_shapes())
        assert merged.views["wte"].dtype == np.float32
        blocks = merged.views["qkvw"]
        assert len(blocks) == QWEN2_LIKE.n_layer and blocks[1].shape == blocks.shape[1:]
        with pytest.raises(TypeError, match="qkvw of a merged model is read a block at a time"):
            blocks[:]
    finally:
        model.close()


def test_a_deferred_tensor_of_another_shape_leaves_no_file(tmp_path):
    path = tmp_path / "x.safetensors"
    bad = {"a": np.ones(3, np.float32),
           "b": ckpt.Deferred((2, 2), np.float32, lambda: np.ones((3, 2), np.float32))}
    with pytest.raises(ValueError, match=r"a deferred tensor read as \(3, 2\), not \(2, 2\)"):
        ckpt.write_safetensors(path, bad)
    assert list(tmp_path.iterdir()) == []
    good = {"b": ckpt.Deferred((2, 2), np.float32, lambda: np.full((2, 2), 3, np.float32))}
    ckpt.write_safetensors(path, good, dtype="BF16")
    assert ckpt.SafetensorsFile(path).read("b").tolist() == [[3, 3], [3, 3]]


def test_a_bf16_base_run_merges_into_the_rounded_base():
    # A run with --base-dtype bf16 trained on the rounded base; its float32 model is that.
    config = QWEN2_LIKE
    base = lora.load_base(None, config, seed=3, trained_in="bf16")
    assert isinstance(base, ParamArena)
    want = Bf16Base.random(config, seed=3)
    assert np.array_equal(base.flat, want.to_arena().flat)
    bf16 = lora.load_base(None, config, seed=3, dtype="bf16")
    for name, view in want.views.items():
        assert np.array_equal(bf16.views[name], view), name
    plain = lora.load_base(None, config, seed=3)
    assert not np.array_equal(plain.flat, base.flat)
