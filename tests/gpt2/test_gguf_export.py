"""GGUF export (gpt2.gguf_export) against what llama.cpp's converter, convert_hf_to_gguf.py,
writes: small random Llama (Llama 3 rope scaling, tied and untied), Qwen2 and GPT-2 models
built by transformers, read by us, written in f32, f16, bf16 and q8_0, and read back with
gguf's GGUFReader.  Every tensor's name, shape and type is the converter's; every value is
transformers' (exactly, or as numpy / torch round it, or within Q8_0's bound), with
Llama's q/k rows un-permuted first; the metadata and the tokenizer (tokens, types, merges,
pre-tokenizer, special ids, chat template) are those of the directory.  gpt2-train
--save-gguf writes the trained weights; bad paths, types, families and tokenizers are one
clear error that leaves no file behind.  The llamacpp-marked test runs the files in
llama.cpp (ADTAPE_LLAMACPP=1, with llama-cpp-python installed)."""
import dataclasses
import io
import json
import os
import re
import subprocess
import sys

import gguf
import numpy as np
import pytest
import sentencepiece
import tokenizers
import torch

from gpt2 import families, hf
from gpt2.checkpoint import load_checkpoint
from gpt2.config import GPT2Config, LlamaConfig
from gpt2.families.llama import LlamaFamily
from gpt2.gguf_export import check_gguf_export, save_gguf
from gpt2.params import ParamArena, init_params_
from gpt2.train import main as train_main
from hf_models import hf_model

Q = gguf.GGMLQuantizationType
TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}     # llama.cpp's LLAMA_FTYPE_*

VOCAB = 320
LLAMA3 = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=176,
                     vocab_size=VOCAB, block_size=128, rope_theta=10000.0,
                     rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0,
                                       original_max_position_embeddings=64),
                     rms_norm_eps=1e-5, tie_embeddings=True)
LLAMA_UNTIED = LlamaConfig(n_layer=2, n_head=4, n_kv_head=4, n_embd=64, intermediate_size=128,
                           vocab_size=VOCAB, block_size=64, rope_theta=500000.0,
                           rms_norm_eps=1e-6, tie_embeddings=False)
QWEN2 = LlamaConfig(n_layer=2, n_head=4, n_kv_head=1, n_embd=64, intermediate_size=160,
                    vocab_size=VOCAB, block_size=64, rope_theta=1000000.0, rms_norm_eps=1e-6,
                    tie_embeddings=True, qkv_bias=True)
GPT2_SMALL = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, block_size=64)
# Each model, its GGUF architecture and the pre-tokenizer its tokenizer.json declares.
MODELS = {"llama3": (LLAMA3, "llama", "llama-bpe"), "llama-untied": (LLAMA_UNTIED, "llama", "smollm"),
          "qwen2": (QWEN2, "qwen2", "qwen2"), "gpt2": (GPT2_SMALL, "gpt2", "gpt-2")}

# The splits of the published tokenizer.json files (Llama 3's, Qwen2's).
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?"
               r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEXT = ("The quick brown fox jumps over the lazy dog 1234567 times.\n"
        "def f(x):\n    return x * 2  # doubled\n"
        "I've been told he's there, 'RE you sure? We'll see.\n") * 20
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}")
# Per kind: (special tokens: bos, eos; other added tokens: special, not special).
SPECIALS = {"llama-bpe": ("<|begin_of_text|>", "<|end_of_text|>"),
            "qwen2": (None, "<|im_end|>"), "smollm": ("<|im_start|>", "<|im_end|>"),
            "gpt-2": ("<|endoftext|>", "<|endoftext|>")}


def pre_tokenizer(kind):
    pre = tokenizers.pre_tokenizers
    if kind == "gpt-2":
        return pre.ByteLevel(add_prefix_space=False)
    if kind == "smollm":
        return pre.Sequence([pre.Digits(individual_digits=True),
                             pre.ByteLevel(add_prefix_space=False)])
    regex = LLAMA3_REGEX if kind == "llama-bpe" else QWEN2_REGEX
    return pre.Sequence([pre.Split(tokenizers.Regex(regex), behavior="isolated", invert=False),
                         pre.ByteLevel(add_prefix_space=False, use_regex=False)])


def write_tokenizer(directory, kind):
    """A byte-level BPE tokenizer.json of about 300 tokens with ``kind``'s pre-tokenizer,
    its special tokens, a control-looking and a plain added token, and its
    tokenizer_config.json (bos/eos, the chat template)."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    if kind == "qwen2":
        tok.normalizer = tokenizers.normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizer(kind)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator([TEXT], tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    bos, eos = SPECIALS[kind]
    tok.add_special_tokens(sorted({t for t in (bos, eos) if t}))
    tok.add_tokens(["<|tool|>", "<think>"])     # looks special: CONTROL; else USER_DEFINED
    if kind == "llama-bpe":
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    settings = {"bos_token": bos, "eos_token": eos, "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast"}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(settings, f)
    return tok


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (Hugging Face directory with its tokenizer, transformers' model)."""
    out = {}
    for name, (config, _, kind) in MODELS.items():
        directory = tmp_path_factory.mktemp(name)
        model = hf_model(config)
        model.save_pretrained(directory)
        write_tokenizer(directory, kind)
        out[name] = (str(directory), model)
    return out


# -- what the converter writes -----------------------------------------------------------------

LLAMA_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GPT2_NAMES = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
              "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}


def gguf_name(hf_name):
    """convert_hf_to_gguf's name of a transformers tensor (None: not written)."""
    parts = hf_name.split(".")
    if parts[0] == "transformer":
        parts = parts[1:]
    if parts[0] == "model":
        parts = parts[1:]
    suffix = parts[-1]
    if parts[0] in ("layers", "h"):
        names = LLAMA_NAMES if parts[0] == "layers" else GPT2_NAMES
        return f"blk.{parts[1]}.{names['.'.join(parts[2:-1])]}.{suffix}"
    return {"embed_tokens": "token_embd", "wte": "token_embd", "wpe": "position_embd",
            "norm": "output_norm", "ln_f": "output_norm", "lm_head": "output"}[parts[0]] \
        + f".{suffix}"


def converter_type(name, shape, dtype):
    """The converter's rule: F32 for 1-D tensors, norms, biases and position embeddings;
    the file's type for other weights, F16 where Q8_0's 32-value blocks do not fit."""
    if len(shape) == 1 or name.endswith(("_norm.weight", ".bias")) or name.startswith(
            ("position_embd", "rope_freqs")):
        return Q.F32
    if dtype == "q8_0" and shape[-1] % 32:
        return Q.F16
    return TYPES[dtype]


def hf_tensors(model, config):
    """GGUF name -> transformers' value (float32, the converter's (out, in) layout)."""
    tied = getattr(config, "tie_embeddings", True)
    out = {}
    for name, value in model.state_dict().items():
        if name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
            continue
        if name == "lm_head.weight" and tied:
            continue
        value = value.float().numpy()
        if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            value = value.T     # GPT-2's Conv1D keeps (in, out)
        out[gguf_name(name)] = value
    return out


def unpermute(w, n_head):
    """llama.cpp's interleaved rotary rows back to Hugging Face's rotate-half order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def read(path):
    """GGUF name -> (GGML type, numpy shape, float32 values) of a file."""
    reader = gguf.GGUFReader(path)
    return reader, {t.name: (t.tensor_type, tuple(int(n) for n in reversed(t.shape)),
                             gguf.quants.dequantize(t.data, t.tensor_type).reshape(
                                 tuple(int(n) for n in reversed(t.shape))))
                    for t in reader.tensors}


def check_values(name, got, expected, qtype):
    """``got`` (read back) against transformers' ``expected``, as the type rounds it."""
    if qtype == Q.F32:
        np.testing.assert_array_equal(got, expected, err_msg=name)
    elif qtype == Q.F16:
        np.testing.assert_array_equal(got, expected.astype(np.float16).astype(np.float32),
                                      err_msg=name)
    elif qtype == Q.BF16:
        rounded = torch.from_numpy(np.ascontiguousarray(expected)).bfloat16().float().numpy()
        np.testing.assert_array_equal(got, rounded, err_msg=name)
    else:   # Q8_0: blocks of 32 with scale d = max|x| / 127 stored as f16, round(x / d)
        blocks = expected.reshape(-1, 32)
        scale = np.abs(blocks).max(axis=1, keepdims=True) / 127
        error = np.abs(got.reshape(-1, 32) - blocks)
        # Half a step of rounding, plus up to 127 steps of the scale's f16 rounding (2^-11).
        assert np.all(error <= scale * (0.5 + 127 / 2048) + 1e-12), name
        assert np.abs(got).max() > 0, name


@pytest.mark.parametrize("dtype", list(TYPES))
@pytest.mark.parametrize("name", list(MODELS))
def test_tensors_are_the_converters_with_transformers_values(models, name, dtype, tmp_path):
    config, arch, _ = MODELS[name]
    directory, model = models[name]
    params = hf.load_dir(directory)
    assert params.config == config
    path = save_gguf(tmp_path / "m.gguf", config, params, dtype=dtype, tokenizer_dir=directory)
    reader, tensors = read(path)
    expected = hf_tensors(model, config)
    if arch == "llama" and config.rope_scaling:
        expected["rope_freqs.weight"] = None
    assert sorted(tensors) == sorted(expected)
    assert ("output.weight" in tensors) == (not getattr(config, "tie_embeddings", True))
    for tensor_name, (qtype, shape, values) in tensors.items():
        if tensor_name == "rope_freqs.weight":
            assert qtype == Q.F32 and shape == (config.head_dim // 2,)
            continue
        want = expected[tensor_name]
        assert shape == want.shape, tensor_name
        assert qtype == converter_type(tensor_name, shape, dtype), tensor_name
        if arch == "llama" and ".attn_q." in tensor_name:
            values = unpermute(values, config.n_head)
        elif arch == "llama" and ".attn_k." in tensor_name:
            values = unpermute(values, config.n_kv_head)
        check_values(tensor_name, values, want, qtype)
    assert field(reader, "general.file_type") == FILE_TYPES[dtype]


def test_llama3_rope_freqs_turn_the_frequencies_into_transformers_scaled_ones(models, tmp_path):
    directory, model = models["llama3"]
    path = save_gguf(tmp_path / "m.gguf", LLAMA3, hf.load_dir(directory), dtype="f32")
    _, tensors = read(path)
    factors = tensors["rope_freqs.weight"][2]
    dim = LLAMA3.head_dim
    base = 1.0 / (LLAMA3.rope_theta ** (np.arange(0, dim, 2) / dim))
    scaled = model.model.rotary_emb.inv_freq.double().numpy()
    np.testing.assert_allclose(base / factors, scaled, rtol=2e-6)
    assert factors.min() == 1 and factors.max() == 8 and len(np.unique(factors)) > 2


def rope_pairs(x, positions, theta, interleaved):
    """Rotary embedding of rows x (T, head_dim): llama.cpp's pairs (2i, 2i+1) where
    ``interleaved``, else transformers' rotate-half pairs (i, i + head_dim / 2)."""
    half = x.shape[1] // 2
    angle = positions[:, None] * theta ** (-np.arange(half) / half)
    cos, sin = np.cos(angle), np.sin(angle)
    a, b = (x[:, 0::2], x[:, 1::2]) if interleaved else (x[:, :half], x[:, half:])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = np.empty_like(x)
    if interleaved:
        out[:, 0::2], out[:, 1::2] = ra, rb
    else:
        out[:, :half], out[:, half:] = ra, rb
    return out


def test_permuted_rows_under_llamas_rope_give_transformers_attention_scores(models, tmp_path):
    config = LLAMA_UNTIED
    directory, model = models["llama-untied"]
    path = save_gguf(tmp_path / "m.gguf", config, hf.load_dir(directory), dtype="f32")
    _, tensors = read(path)
    state = model.state_dict()
    x = np.random.default_rng(0).standard_normal((9, config.n_embd))
    positions = np.arange(9.0)
    hd = config.head_dim
    for which, heads in (("q", config.n_head), ("k", config.n_kv_head)):
        ours = x @ tensors[f"blk.1.attn_{which}.weight"][2].T.astype(np.float64)
        theirs = x @ state[f"model.layers.1.self_attn.{which}_proj.weight"].double().numpy().T
        for h in range(heads):
            cols = slice(h * hd, (h + 1) * hd)
            a = rope_pairs(ours[:, cols], positions, config.rope_theta, interleaved=True)
            b = rope_pairs(theirs[:, cols], positions, config.rope_theta, interleaved=False)
            np.testing.assert_allclose(a @ a.T, b @ b.T, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", list(MODELS))
def test_metadata_and_tokenizer_are_the_directorys(models, name, tmp_path):
    config, arch, kind = MODELS[name]
    directory, _ = models[name]
    path = save_gguf(tmp_path / "m.gguf", config, hf.load_dir(directory), dtype="f16",
                     tokenizer_dir=directory, name="tiny")
    reader = gguf.GGUFReader(path)
    assert field(reader, "general.architecture") == arch
    assert field(reader, "general.name") == "tiny"
    assert field(reader, "general.type") == "model"
    sizes = {"block_count": config.n_layer, "context_length": config.block_size,
             "embedding_length": config.n_embd, "attention.head_count": config.n_head}
    if arch == "gpt2":
        sizes.update({"feed_forward_length": 4 * config.n_embd})
        assert field(reader, "gpt2.attention.layer_norm_epsilon") == pytest.approx(1e-5)
    else:
        sizes.update({"feed_forward_length": config.intermediate_size,
                      "attention.head_count_kv": config.n_kv_head,
                      "attention.key_length": config.head_dim,
                      "attention.value_length": config.head_dim})
        assert field(reader, f"{arch}.rope.freq_base") == config.rope_theta
        assert field(reader, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(
            config.rms_norm_eps, rel=1e-6)
    if arch == "llama":     # LlamaModel's own; Qwen2Model writes neither
        sizes.update({"vocab_size": VOCAB, "rope.dimension_count": config.head_dim})
    for key, value in sizes.items():
        assert field(reader, f"{arch}.{key}") == value, key
    assert field(reader, f"{arch}.vocab_size") == (VOCAB if arch == "llama" else None)
    assert field(reader, f"{arch}.rope.scaling.type") is None   # llama3's is rope_freqs

    tok = tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    text_of = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == kind
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert tokens == [text_of.get(i, f"[PAD{i}]") for i in range(VOCAB)]
    types = field(reader, "tokenizer.ggml.token_type")
    T = gguf.TokenType
    specials = {t for t in SPECIALS[kind] if t}
    for i, token_type in enumerate(types):
        text = text_of.get(i)
        want = (T.UNUSED if text is None else T.CONTROL if text in specials | {"<|tool|>"}
                else T.USER_DEFINED if text == "<think>" else T.NORMAL)
        assert token_type == want, (i, text)
    with open(os.path.join(directory, "tokenizer.json")) as f:
        merges = json.load(f)["model"]["merges"]
    assert field(reader, "tokenizer.ggml.merges") == [
        m if isinstance(m, str) else " ".join(m) for m in merges]
    bos, eos = SPECIALS[kind]
    assert field(reader, "tokenizer.ggml.bos_token_id") == (tok.token_to_id(bos) if bos else None)
    assert field(reader, "tokenizer.ggml.eos_token_id") == tok.token_to_id(eos)
    assert field(reader, "tokenizer.chat_template") == CHAT_TEMPLATE
    if kind == "llama-bpe":     # its post-processor adds BOS
        assert field(reader, "tokenizer.ggml.add_bos_token") is True


def write_sentencepiece(path):
    """A SentencePiece BPE model of 312 pieces with byte fallback (as Llama 2's); its
    processor."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT.splitlines()), model_writer=model, vocab_size=312,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, minloglevel=2)
    path.write_bytes(model.getvalue())
    return sentencepiece.SentencePieceProcessor(model_file=str(path))


def test_a_sentencepiece_tokenizer_is_llamas_with_scores(tmp_path):
    sp = write_sentencepiece(tmp_path / "tokenizer.model")
    # As the converter, the directory's tokenizer.model before its tokenizer.json, also
    # where the tokenizer.json is named (the tokenizer an --init-from run used).
    write_tokenizer(tmp_path, "llama-bpe")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}))
    # A model directory's config.json says the ids (SpecialVocab reads them there).
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": sp.bos_id(),
                                                      "eos_token_id": sp.eos_id()}))
    params = init_params_(ParamArena(LLAMA_UNTIED), 0)
    path = save_gguf(tmp_path / "m.gguf", LLAMA_UNTIED, params,
                     tokenizer_dir=tmp_path / "tokenizer.json")
    reader = gguf.GGUFReader(path)
    assert field(reader, "tokenizer.ggml.model") == "llama"
    assert field(reader, "tokenizer.ggml.pre") == "default"
    n = sp.vocab_size()
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert tokens == [sp.IdToPiece(i) for i in range(n)] + [f"[PAD{i}]" for i in range(n, VOCAB)]
    np.testing.assert_array_equal(field(reader, "tokenizer.ggml.scores"),
                                  np.float32([sp.GetScore(i) for i in range(n)]
                                             + [-10000.0] * (VOCAB - n)))
    T = gguf.TokenType
    types = field(reader, "tokenizer.ggml.token_type")
    assert types[sp.unk_id()] == T.UNKNOWN and types[sp.bos_id()] == T.CONTROL
    assert types[sp.PieceToId("<0x41>")] == T.BYTE and types[n] == T.UNUSED
    assert field(reader, "tokenizer.ggml.bos_token_id") == sp.bos_id()
    assert field(reader, "tokenizer.ggml.eos_token_id") == sp.eos_id()
    assert field(reader, "tokenizer.chat_template") == CHAT_TEMPLATE


def test_without_a_tokenizer_the_file_says_none_and_keeps_the_vocabulary_size(tmp_path):
    params = init_params_(ParamArena(QWEN2), 0)
    reader = gguf.GGUFReader(save_gguf(tmp_path / "m.gguf", QWEN2, params, dtype="f32"))
    assert field(reader, "tokenizer.ggml.model") == "none"
    assert field(reader, "qwen2.vocab_size") == VOCAB
    assert field(reader, "tokenizer.ggml.tokens") is None
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    np.testing.assert_array_equal(embd.data, params.wte[:VOCAB])    # padding rows dropped


# -- errors ------------------------------------------------------------------------------------

def test_bad_types_paths_and_params_are_named_and_write_nothing(tmp_path):
    params = init_params_(ParamArena(QWEN2), 0)
    with pytest.raises(ValueError, match="unknown GGUF type 'q4_0'; known: f32, f16, bf16, q8_0"):
        save_gguf(tmp_path / "m.gguf", QWEN2, params, dtype="q4_0")
    with pytest.raises(ValueError, match="is a directory"):
        save_gguf(tmp_path, QWEN2, params)
    with pytest.raises(ValueError, match="directory of .* does not exist"):
        save_gguf(tmp_path / "no" / "m.gguf", QWEN2, params)
    with pytest.raises(ValueError, match="ParamArena of the config given"):
        save_gguf(tmp_path / "m.gguf", LLAMA3, params)
    with pytest.raises(ValueError, match="tokenizer directory .* holds no tokenizer.model "
                                         "or tokenizer.json"):
        save_gguf(tmp_path / "m.gguf", QWEN2, params, tokenizer_dir=tmp_path)
    assert os.listdir(tmp_path) == []


def test_a_family_llama_cpp_does_not_compute_is_refused(tmp_path):
    @dataclasses.dataclass(frozen=True)
    class OtherConfig(LlamaConfig):
        family, family_name = "other-block", "Other-block"
        presets = {}

    class OtherFamily(LlamaFamily):     # Llama's layout and config.json, another block
        config = OtherConfig
        hf_architectures = hf_model_types = {}

    family = families.register(OtherFamily())
    try:
        config = OtherConfig(**{k: getattr(LLAMA3, k) for k in
                                ("n_layer", "n_head", "n_kv_head", "n_embd",
                                 "intermediate_size", "vocab_size", "block_size")})
        with pytest.raises(ValueError, match="Other-block family .* has no GGUF architecture"):
            save_gguf(tmp_path / "m.gguf", config, ParamArena(config))
    finally:
        families.unregister(family.name)
    assert os.listdir(tmp_path) == []


def test_tokenizers_llama_cpp_cannot_run_are_refused(tmp_path):
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator([TEXT], tokenizers.trainers.BpeTrainer(vocab_size=100,
                                                                   show_progress=False))
    tok.save(str(tmp_path / "whitespace.json"))
    params = init_params_(ParamArena(QWEN2), 0)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="pre-tokenizer .*Whitespace.* not one llama.cpp "
                                         "implements"):
        save_gguf(out / "m.gguf", QWEN2, params, tokenizer_dir=tmp_path / "whitespace.json")
    wide = dataclasses.replace(QWEN2, vocab_size=200)
    write_tokenizer(tmp_path / "wide", "qwen2")     # ids up to ~303
    with pytest.raises(ValueError, match="token id 30[0-9], beyond the model's vocabulary of "
                                         "200"):
        check_gguf_export(out / "m.gguf", wide, "f16", tmp_path / "wide")
    write_sentencepiece(tmp_path / "sp.model")
    with pytest.raises(ValueError, match="a gpt2 GGUF file takes a byte-level BPE "
                                         "tokenizer.json .* not a SentencePieceTokenizer's"):
        check_gguf_export(out / "m.gguf", GPT2_SMALL, "f16", tmp_path / "sp.model")
    scaled = dataclasses.replace(QWEN2, rope_scaling=LLAMA3.rope_scaling)
    with pytest.raises(ValueError, match="Qwen2 model .* with Llama 3's rope scaling has no "
                                         "GGUF form"):
        check_gguf_export(out / "m.gguf", scaled, "f16")
    assert os.listdir(out) == []


def test_a_full_disk_leaves_the_old_file_and_no_temporary(tmpfs, tmp_path):
    disk = tmpfs(tmp_path / "small", "size=64k")
    (disk / "m.gguf").write_bytes(b"the old file")
    params = init_params_(ParamArena(LLAMA_UNTIED), 0)       # 0.5 MB in f32
    with pytest.raises(OSError) as e:
        save_gguf(disk / "m.gguf", LLAMA_UNTIED, params, dtype="f32")
    assert "No space left" in str(e.value)
    assert os.listdir(disk) == ["m.gguf"]
    assert (disk / "m.gguf").read_bytes() == b"the old file"
    read_only = tmpfs(tmp_path / "ro", "ro,size=64k")
    with pytest.raises(ValueError, match="is not writable"):
        save_gguf(read_only / "m.gguf", LLAMA_UNTIED, params)


# -- gpt2-train --save-gguf and python -m gpt2.gguf_export --------------------------------------

RUN = ["--model", "llama-tiny", "-B", "2", "-T", "32", "--steps", "1", "--corpus-bytes", "50k",
       "--eval-interval", "0", "--sample-tokens", "0", "--no-progress"]


def test_gpt2_train_save_gguf_writes_the_trained_weights(tmp_path, capsys):
    out = tmp_path / "model.gguf"
    assert train_main([*RUN, "--out-dir", str(tmp_path / "run"), "--save-gguf", str(out),
                       "--gguf-type", "f32"]) == 0
    assert f"and the GGUF file {out} (f32)" in capsys.readouterr().out
    trained = load_checkpoint(str(tmp_path / "run" / "checkpoint.bin"), optimizer=False).params
    reader, tensors = read(out)
    assert field(reader, "general.architecture") == "llama"
    assert field(reader, "tokenizer.ggml.model") == "none"     # trained on bytes
    np.testing.assert_array_equal(tensors["token_embd.weight"][2], trained.wte[:256])
    np.testing.assert_array_equal(tensors["blk.1.ffn_down.weight"][2], trained.downw[1])
    # The converter entry point writes the same file from the checkpoint.
    again = tmp_path / "again.gguf"
    proc = subprocess.run([sys.executable, "-m", "gpt2.gguf_export",
                           str(tmp_path / "run" / "checkpoint.bin"), str(again), "--gguf-type",
                           "f32", "--name", "model"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert again.read_bytes() == out.read_bytes()


def test_gpt2_train_save_gguf_writes_the_runs_tokenizer(tmp_path):
    tok_dir = tmp_path / "tok"
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator([TEXT], tokenizers.trainers.BpeTrainer(
        vocab_size=256, initial_alphabet=[], show_progress=False))
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tok.json"))     # not named tokenizer.json
    out = tmp_path / "model.gguf"
    assert train_main([*RUN, "--tokenizer", str(tok_dir / "tok.json"), "--out-dir",
                       str(tmp_path / "run"), "--save-gguf", str(out), "--gguf-type",
                       "q8_0"]) == 0
    reader, tensors = read(out)
    assert field(reader, "tokenizer.ggml.pre") == "gpt-2"
    vocab = tok.get_vocab()
    assert field(reader, "tokenizer.ggml.tokens")[:len(vocab)] == sorted(vocab, key=vocab.get)
    assert tensors["blk.0.attn_q.weight"][0] == Q.Q8_0
    assert os.listdir(tok_dir) == ["tok.json"]


@pytest.mark.parametrize("where, message", [
    ("missing/m.gguf", "the directory of '.*missing/m.gguf' does not exist"),
    (".", "is a directory, not a file name for the GGUF file")])
def test_gpt2_train_refuses_a_bad_save_gguf_before_training(tmp_path, capsys, where, message):
    status = train_main([*RUN, "--out-dir", str(tmp_path / "run"), "--save-gguf",
                         str(tmp_path / where)])
    err = capsys.readouterr().err
    assert status == 2
    assert len(err.strip().splitlines()) == 1
    assert ": error: --save-gguf " in err and re.search(message, err), err
    assert not (tmp_path / "run").exists()      # refused before the run wrote anything


def test_the_converter_entry_point_reports_a_bad_source_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gpt2.gguf_export", str(tmp_path / "none.bin"),
                           str(tmp_path / "m.gguf")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "error:" in proc.stderr
    assert os.listdir(tmp_path) == []


# -- llama.cpp itself (opt-in) ---------------------------------------------------------------

@pytest.mark.llamacpp
@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
@pytest.mark.parametrize("name", list(MODELS))
def test_llama_cpp_logits_match_transformers(models, name, dtype, tmp_path):
    import llama_cpp
    config, _, _ = MODELS[name]
    directory, model = models[name]
    path = save_gguf(tmp_path / "m.gguf", config, hf.load_dir(directory), dtype=dtype,
                     tokenizer_dir=directory)
    ids = np.random.default_rng(1).integers(0, 300, 24).tolist()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=32, logits_all=True, verbose=False,
                          n_threads=2, n_batch=32)
    llm.eval(ids)
    ours = np.asarray(llm.scores[:len(ids)], dtype=np.float64)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].double().numpy()
    # About 1e-4 here in f32 (1e-2 in q8_0); without Llama's q/k permutation, 5e-3 and more.
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < (1e-3 if dtype == "f32" else 3e-2)
    # llama.cpp's tokenizer, from the file's tokens, merges and pre-tokenizer name, splits
    # text as the tokenizers library does.
    tok = tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    for text in (TEXT[:300], "Numbers 1234567 and  spaces\n\n\tend", "héllo wörld ✓"):
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == \
            tok.encode(text, add_special_tokens=False).ids, text


@pytest.mark.llamacpp
def test_llama_cpp_tokenizes_a_sentencepiece_vocabulary_as_sentencepiece(tmp_path):
    import llama_cpp
    sp = write_sentencepiece(tmp_path / "tokenizer.model")
    path = save_gguf(tmp_path / "m.gguf", LLAMA_UNTIED, init_params_(ParamArena(LLAMA_UNTIED), 0),
                     tokenizer_dir=tmp_path)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in ("The quick brown fox 123", "héllo ✓ wörld"):     # the second: byte fallback
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == sp.encode(text)
