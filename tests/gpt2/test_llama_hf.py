"""The Llama family against transformers (the oracle): every preset's configuration at a
reduced size (2 blocks, head_dim 16, a small vocabulary; the heads, KV heads, rope theta
and scaling, tying, biases and eps as published), random weights saved by transformers'
own save_pretrained.  Our logits, loss and every gradient match its model on the same
weights and tokens, both ways (its directory read by us, ours by it, no key missing or
unexpected); half-precision and sharded directories load; a few AdamW steps track
torch.optim.AdamW."""
import json

import numpy as np
import pytest
import torch
import transformers

from gpt2 import hf
from gpt2.config import GPT2Config, LLAMA_PRESETS, LlamaConfig
from gpt2.families.llama import hf_tensors
from gpt2.model import GPT2
from gpt2.params import ParamArena, init_params_, num_parameters
from hf_models import hf_model, reduced

def batch(config, B=2, T=37, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, config.vocab_size, (B, T)).astype(np.int32),
            rng.integers(0, config.vocab_size, (B, T)).astype(np.int32))


def hf_logits(model, x):
    with torch.no_grad():
        return model(torch.from_numpy(x.astype(np.int64))).logits.numpy()


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", [n for n in LLAMA_PRESETS if n != "llama-tiny"])
def test_logits_match_transformers_both_ways(name, tmp_path):
    config = reduced(name)
    theirs = hf_model(config)
    theirs.save_pretrained(tmp_path / "hf")
    params = hf.load_dir(tmp_path / "hf")
    assert params.config == config
    model = GPT2(config)
    model.params.copy_(params)
    x, _ = batch(config)
    logits, _ = model.forward(x)
    expected = hf_logits(theirs, x)
    assert rel_err(logits[..., :config.vocab_size], expected) < 2e-5
    # Ours written, theirs reading: every key, nothing else, the same logits.
    hf.save_dir(tmp_path / "ours", model.params)
    cls = type(theirs)
    back, info = cls.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    np.testing.assert_array_equal(hf_logits(back.float().eval(), x), expected)
    model.close()


def hf_grads(model, config):
    """transformers' parameter gradients packed into our layout (an arena)."""
    grads = ParamArena(config)
    named = dict(model.named_parameters())
    for key, (ours, layer, piece, _) in hf_tensors(config).items():
        view = grads.views[ours] if layer is None else grads.views[ours][layer]
        view[piece] = named[key].grad.numpy()
    if config.tie_embeddings and "lm_head.weight" in named and named["lm_head.weight"] is not \
            named["model.embed_tokens.weight"]:
        grads.wte[:config.vocab_size] += named["lm_head.weight"].grad.numpy()
    return grads


@pytest.mark.parametrize("name", ["smollm2-135m", "tinyllama-1.1b", "qwen2.5-0.5b"])
def test_loss_gradients_and_adamw_steps_match_transformers(name, tmp_path):
    config = reduced(name)
    theirs = hf_model(config, seed=1)
    theirs.save_pretrained(tmp_path / "hf")
    model = GPT2(config)
    model.params.copy_(hf.load_dir(tmp_path / "hf"))
    x, y = batch(config, seed=1)
    tx, ty = torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64))

    def torch_loss():
        logits = theirs(tx).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 ty.reshape(-1))

    model.zero_grad()
    loss = model.loss_and_grad(x, y)
    theirs.zero_grad()
    ref = torch_loss()
    ref.backward()
    assert abs(loss - ref.item()) < 1e-5
    expected = hf_grads(theirs, config)
    for key, grad in model.grads.views.items():
        assert rel_err(grad, expected.views[key]) < 1e-4, key

    opt = torch.optim.AdamW(theirs.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.1)
    ours, ref_losses = [], []
    for _ in range(5):
        ours.append(model.train_step(x, y, lr=1e-3, weight_decay=0.1)[0])
        opt.zero_grad()
        step_loss = torch_loss()
        step_loss.backward()
        opt.step()
        ref_losses.append(step_loss.item())
    assert ref_losses[-1] < ref_losses[0]
    np.testing.assert_allclose(ours, ref_losses, atol=1e-4, rtol=0)
    model.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_and_sharded_directories_load_as_float32(dtype, tmp_path):
    config = reduced("llama-3.2-1b")
    theirs = hf_model(config).to(dtype)
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    index = json.loads((tmp_path / "hf" / hf.INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1
    params = hf.load_dir(tmp_path / "hf")
    named = dict(theirs.named_parameters())
    q = named["model.layers.1.self_attn.q_proj.weight"].detach().float().numpy()
    np.testing.assert_array_equal(params.qkvw[1][:q.shape[0]], q)
    np.testing.assert_array_equal(params.wte[:config.vocab_size],
                                  named["model.embed_tokens.weight"].detach().float().numpy())


def test_bad_directories_are_clear_errors(tmp_path):
    config = reduced("smollm2-135m")
    hf_model(config).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="no config.json"):
        hf.load_dir(tmp_path)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="num_hidden_layers is 3, but the weights hold 2 layers"):
        hf.load_dir(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "architectures": ["Foo"],
                                                             "model_type": "foo"}))
    with pytest.raises(ValueError, match="'Foo'.* is not supported"):
        hf.load_dir(tmp_path / "hf")
    for field, value, message in (("attention_bias", True, "attention_bias: biases"),
                                  ("rope_parameters", {"rope_type": "yarn", "factor": 4.0},
                                   "rope_type 'yarn' is not supported"),
                                  ("hidden_act", "gelu", "hidden_act 'gelu'")):
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(ValueError, match=message):
            hf.load_dir(tmp_path / "hf")


def test_gpt2_directories_round_trip_through_transformers(tmp_path):
    config = GPT2Config.preset("tiny")
    params = init_params_(ParamArena(config), 3)
    hf.save_dir(tmp_path / "gpt2", params)
    model, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2",
                                                               output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    back = hf.load_dir(tmp_path / "gpt2")
    np.testing.assert_array_equal(back.flat, params.flat)


# The published totals (the models' Hugging Face weights), embeddings and an untied head
# included.
PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "qwen2.5-0.5b": 494_032_768,
             "llama-3.1-8b": 8_030_261_248, "qwen2.5-1.5b": 1_543_714_304,
             "qwen2.5-7b": 7_615_616_512}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_full_size_presets_are_the_published_models(name):
    # Counted, never allocated: transformers builds its model on the meta device from the
    # config.json we write.
    config = LlamaConfig.preset(name)
    assert num_parameters(config) == PUBLISHED[name]    # vocabularies are multiples of 128
    hf_config = hf.hf_config_dict(config)
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in hf_config.items()
                                               if k != "architectures"})
    with torch.device("meta"):
        theirs = getattr(transformers, hf_config["architectures"][0])(cfg)
    assert sum(p.numel() for p in theirs.parameters()) == PUBLISHED[name]
    assert all(p.is_meta for p in theirs.parameters())
    assert (cfg.tie_word_embeddings, cfg.max_position_embeddings) == \
        (config.tie_embeddings, config.block_size)
    # transformers 5 gathers rope_theta and rope_scaling into rope_parameters.
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta,
                                                     **(cfg.rope_scaling or {})}
    assert rope["rope_theta"] == config.rope_theta
    assert {k: rope[k] for k in dict(config.rope_scaling or ())} == \
        dict(config.rope_scaling or ())
