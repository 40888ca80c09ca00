"""Generation with a key/value cache (gpt2.generate), GPT-2 and the Llama family (GQA,
Llama 3 rotary scaling, Qwen2's q/k/v biases with an untied head): the cached logits are the
full forward's at every position, greedy decoding is the full forward's argmax step by step
(past block_size too, where the window slides), and sampling draws as the loop over full
forwards did."""
import numpy as np
import pytest

from gpt2.config import GPT2Config, LlamaConfig
from gpt2.generate import Decoder, generate, pick_token
from gpt2.model import GPT2

LLAMA_TINY = LlamaConfig.preset("llama-tiny")
LLAMA3_ROPE = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
               ("original_max_position_embeddings", 16), ("rope_type", "llama3"))
CONFIGS = {
    "gpt2-tiny": GPT2Config.preset("tiny"),
    "llama-tiny": LLAMA_TINY,
    "qwen2-like": LlamaConfig(**{**LLAMA_TINY.to_dict(), "qkv_bias": True,
                                 "tie_embeddings": False}),
    "llama3-mqa": LlamaConfig(**{**LLAMA_TINY.to_dict(), "n_kv_head": 1,
                                 "rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
}
# Short windows, so that generation runs past block_size.
SHORT = {"gpt2": GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=16),
         "llama": LlamaConfig(**{**LLAMA_TINY.to_dict(), "block_size": 16})}


@pytest.fixture
def make_model():
    made = []

    def make(config, seed=0):
        """A model whose every parameter (biases too) is perturbed away from its init."""
        model = GPT2(config, seed=seed)
        rng = np.random.default_rng(seed)
        model.params.flat += rng.normal(0, 0.05, model.params.flat.size).astype(np.float32)
        made.append(model)
        return model

    yield make
    for model in made:
        model.close()


def full_logits(model, ids):
    """The full forward's logits over the real vocabulary, (len(ids), V)."""
    logits, _ = model.forward(np.asarray([ids], dtype=np.int32))
    return logits[0, :, :model.config.vocab_size].copy()


def assert_close(got, want):
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-4 * scale, np.abs(got - want).max() / scale


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("prefill", [1, 7, 40])
def test_cached_logits_are_the_full_forwards_at_every_position(make_model, name, prefill):
    model = make_model(CONFIGS[name])
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 40)
    decoder = Decoder(model, capacity=40)
    got = [decoder.extend(ids[:prefill], all_positions=True)]
    got += [decoder.extend(ids[t:t + 1]) for t in range(prefill, 40)]
    assert decoder.full and decoder.length == 40
    assert_close(np.concatenate(got), full_logits(model, ids))
    # Without all_positions only the last token's row.
    assert_close(Decoder(model).extend(ids[:prefill]), full_logits(model, ids[:prefill])[-1:])


def greedy_by_full_forward(model, prompt, n_tokens):
    block = model.config.block_size
    ids = list(prompt)
    for _ in range(n_tokens):
        ids.append(int(np.argmax(full_logits(model, ids[-block:])[-1])))
    return ids


@pytest.mark.parametrize("config", list(CONFIGS.values()) + list(SHORT.values()),
                         ids=list(CONFIGS) + [f"{k}-block16" for k in SHORT])
@pytest.mark.parametrize("prompt_len", [1, 5, 20])
def test_greedy_decoding_is_the_full_forwards_argmax(make_model, config, prompt_len):
    model = make_model(config, seed=2)
    prompt = np.random.default_rng(3).integers(0, config.vocab_size, prompt_len).tolist()
    n_tokens = 40
    assert generate(model, prompt, n_tokens, temperature=0) == \
        greedy_by_full_forward(model, prompt, n_tokens)


def sample_by_full_forward(model, prompt, n_tokens, temperature, top_k, rng):
    """gpt2.train's sample before the cache: one full forward per token."""
    block = model.config.block_size
    ids = list(prompt) or [0]
    for _ in range(n_tokens):
        ids.append(pick_token(full_logits(model, ids[-block:])[-1], temperature, top_k, rng))
    return ids


@pytest.mark.parametrize("name", ["gpt2-tiny", "qwen2-like"])
@pytest.mark.parametrize("temperature, top_k", [(0.8, 40), (1.5, 0), (1.0, 1)])
def test_sampling_draws_as_the_full_forward_loop(make_model, name, temperature, top_k):
    model = make_model(CONFIGS[name], seed=4)
    got = generate(model, [], 30, temperature, top_k, np.random.default_rng(5))
    assert got[0] == 0 and len(got) == 31
    assert got == sample_by_full_forward(model, [], 30, temperature, top_k,
                                         np.random.default_rng(5))
    assert got == generate(model, [], 30, temperature, top_k, np.random.default_rng(5))
    assert got != generate(model, [], 30, temperature, top_k, np.random.default_rng(6)) \
        or top_k == 1


def test_pick_token():
    logits = np.array([0.0, 3.0, 1.0, 2.9], np.float32)
    assert pick_token(logits, 0, 0, None) == 1
    assert pick_token(logits, 1.0, 1, np.random.default_rng(0)) == 1
    rng = np.random.default_rng(0)
    picks = {pick_token(logits, 1.0, 2, rng) for _ in range(200)}
    assert picks == {1, 3}


def test_generate_edges(make_model):
    model = make_model(SHORT["llama"])
    assert generate(model, [7, 8], 0) == [7, 8]
    # A prompt longer than block_size: only its last block_size tokens condition the next.
    long_prompt = list(range(30))
    assert generate(model, long_prompt, 3, temperature=0)[30:] == \
        greedy_by_full_forward(model, long_prompt[-16:], 3)[16:]


def test_decoder_refuses_bad_input(make_model):
    model = make_model(SHORT["gpt2"])
    decoder = Decoder(model)
    assert decoder.capacity == 16
    assert Decoder(model, capacity=100).capacity == 16
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        decoder.extend([3, 256])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        decoder.extend([])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        decoder.extend([[1, 2]])
    decoder.extend(list(range(10)))
    with pytest.raises(ValueError, match="overflow the cache of 16 positions"):
        decoder.extend(list(range(7)))
    assert decoder.length == 10     # nothing taken from the refused call


def bf16_exact(model):
    """Round the model's parameters to bf16 values in place (float32 arena), and return a
    Weights of its bf16 copy (gpt2.lora.Bf16Base: matrices uint16, the rest float32)."""
    from gpt2.generate import Weights
    from gpt2.lora import Bf16Base
    from kernels import bf16
    flat = model.params.flat
    rounded = np.empty(flat.shape, np.uint16)
    bf16.to_bf16(rounded, flat)
    bf16.from_bf16(flat, rounded)
    return Weights(Bf16Base.from_arena(model.params))


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("prefill", [1, 7])
def test_bf16_weights_give_the_float32_models_logits(make_model, name, prefill):
    # A model whose weights are bf16 values: held as bf16 (half the bytes, the products
    # widening them in registers), its cached logits are the float32 model's.
    model = make_model(CONFIGS[name])
    weights = bf16_exact(model)
    assert weights.params.views["wte"].dtype == np.uint16
    ids = np.random.default_rng(4).integers(0, model.config.vocab_size, 24)
    decoder = Decoder(weights, capacity=24)
    got = [decoder.extend(ids[:prefill], all_positions=True)]
    got += [decoder.extend(ids[t:t + 1]) for t in range(prefill, 24)]
    assert_close(np.concatenate(got), full_logits(model, ids))


@pytest.mark.parametrize("config", [CONFIGS["gpt2-tiny"], CONFIGS["llama3-mqa"], SHORT["llama"]],
                         ids=["gpt2-tiny", "llama3-mqa", "llama-block16"])
def test_bf16_weights_decode_greedily_as_float32(make_model, config):
    model = make_model(config, seed=5)
    weights = bf16_exact(model)
    prompt = np.random.default_rng(6).integers(0, config.vocab_size, 5).tolist()
    assert generate(weights, prompt, 30, temperature=0) == generate(model, prompt, 30,
                                                                     temperature=0)
