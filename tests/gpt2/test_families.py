"""The family registry (gpt2.families): a new family is its module and one ``register``
line.  Here the module is a few lines: a GPT-NeoX-style parallel residual block over the
Llama family's layout, which gpt2-train trains, checkpoints and resumes, and whose
key/value-cache decoding (the same block run on the decoder's operations) gives the full
forward's logits."""
from dataclasses import dataclass

import numpy as np
import pytest

from gpt2 import families, hf
from gpt2.checkpoint import read_checkpoint_header
from gpt2.config import GPT2Config, LlamaConfig
from gpt2.families.llama import LlamaFamily, LlamaOps
from gpt2.generate import Decoder, generate
from gpt2.model import GPT2, Model
from gpt2.train import run


# -- the new family's module ------------------------------------------------------------------

@dataclass(frozen=True)
class ParallelConfig(LlamaConfig):
    family, family_name = "parallel", "Parallel-residual"
    presets = {"parallel-tiny": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                                     intermediate_size=64, vocab_size=256, block_size=64)}


class ParallelOps(LlamaOps):
    def block(self, w, x):
        """x + attention(norm1(x)) + mlp(norm2(x)), both halves reading the block's input."""
        f, cfg = self.f, self.config
        qkv = f.linear(f.rmsnorm(x, w["rms1w"], cfg.rms_norm_eps), w["qkvw"], w.get("qkvb"))
        qkv = f.rope(qkv, self.rotary, cfg.n_head + cfg.n_kv_head)
        a = f.linear(f.attention(qkv, cfg.n_head, cfg.n_kv_head), w["attprojw"], None)
        gate_up = f.linear(f.rmsnorm(x, w["rms2w"], cfg.rms_norm_eps), w["gateupw"], None)
        return f.residual(f.residual(x, a), f.swiglu_linear(gate_up, w["downw"]))


class ParallelFamily(LlamaFamily):
    config, ops = ParallelConfig, ParallelOps
    hf_architectures = hf_model_types = {}      # no Hugging Face architecture of its own


# -- its registry line ------------------------------------------------------------------------

@pytest.fixture
def parallel():
    family = families.register(ParallelFamily())
    yield family
    families.unregister(family.name)


QUICK = ["-B", "2", "-T", "16", "--corpus-bytes", "50k", "--eval-interval", "0",
         "--sample-tokens", "4", "--no-progress"]


def test_gpt2_train_trains_checkpoints_and_resumes_a_new_family(parallel, tmp_path):
    first = run(["--model", "parallel-tiny", "--steps", "2", "--out-dir", str(tmp_path),
                 *QUICK])
    assert first["model"] == "parallel-tiny"
    assert first["config"] == ParallelConfig.preset("parallel-tiny").to_dict()
    assert np.isfinite(first["final_loss"])
    header = read_checkpoint_header(tmp_path / "checkpoint.bin")
    assert type(header.config) is ParallelConfig and header.step == 2
    resumed = run(["--resume", str(tmp_path / "checkpoint.bin"), "--steps", "3", *QUICK])
    assert resumed["start_step"] == 2


def test_a_new_familys_block_serves_training_and_the_cached_decoder(parallel):
    config = ParallelConfig.preset("parallel-tiny")
    model = Model(config, seed=0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, config.vocab_size, (2, 24))
    before = model.train_step(x[:, :-1], x[:, 1:], lr=1e-2)[0]
    assert model.train_step(x[:, :-1], x[:, 1:], lr=1e-2)[0] < before
    ids = rng.integers(0, config.vocab_size, 20)
    decoder = Decoder(model)
    cached = np.concatenate([decoder.extend(ids[:5], all_positions=True)]
                            + [decoder.extend(ids[t:t + 1]) for t in range(5, 20)])
    full = model.forward(ids[None])[0][0, :, :config.vocab_size]
    assert np.abs(cached - full).max() <= 1e-4 * np.abs(full).max()
    greedy = generate(model, ids[:3], 6, temperature=0)
    assert len(greedy) == 9 and greedy[:3] == list(ids[:3])
    model.close()


def test_the_registry_finds_a_family_by_config_preset_and_architecture(parallel):
    assert families.family_of(ParallelConfig.preset("parallel-tiny")) is parallel
    assert families.family_of(LlamaConfig.preset("llama-tiny")).name == "llama"
    assert families.preset("parallel-tiny") == ParallelConfig.preset("parallel-tiny")
    assert families.all_presets()["gpt2"].name == "gpt2"
    assert families.from_hf(["Qwen2ForCausalLM"], None)[1] == "qwen2"
    assert families.from_hf([], "gpt2")[0].name == "gpt2"
    assert families.from_hf(["Foo"], "bar") is None
    d = ParallelConfig.preset("parallel-tiny").to_dict()
    assert type(families.config_from_dict(d, "parallel")) is ParallelConfig
    # Checkpoints written before families had names: told apart by their fields.
    assert type(families.config_from_dict(d)) is LlamaConfig
    assert type(families.config_from_dict(GPT2Config.preset("tiny").to_dict())) is GPT2Config


def test_a_family_may_not_take_another_familys_name_preset_or_architecture(parallel):
    with pytest.raises(ValueError, match="already registered"):
        families.register(ParallelFamily())

    class Clash(LlamaFamily):
        config = type("ClashConfig", (ParallelConfig,), {"family": "clash",
                                                         "presets": {"tiny": {}}})
        hf_architectures = hf_model_types = {}
    with pytest.raises(ValueError, match="'tiny' already"):
        families.register(Clash())
    with pytest.raises(ValueError, match="'LlamaForCausalLM' already"):
        families.register(type("Twin", (ParallelFamily,), {
            "config": type("TwinConfig", (ParallelConfig,), {"family": "twin", "presets": {}}),
            "hf_architectures": {"LlamaForCausalLM": "llama"}})())
    assert "clash" not in [f.name for f in families.families()]
    with pytest.raises(TypeError, match="config must be a GPT2Config or LlamaConfig"):
        families.family_of({"n_layer": 2})
    with pytest.raises(ValueError, match="unknown model preset 'nano'"):
        families.preset("nano")


def test_model_is_the_class_and_gpt2_its_old_name():
    assert GPT2 is Model
    config = GPT2Config.preset("tiny")
    assert hf.hf_config_dict(config)["architectures"] == ["GPT2LMHeadModel"]
    assert hf.num_parameters(config) == 32 * (256 + 64 + 2) + 2 * 12 * 32 * 32 + 2 * 13 * 32
