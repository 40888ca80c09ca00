"""GGUF files out: a trained model as the single file llama.cpp (and the tools built on it)
loads, written through the ``gguf`` package (``pip install 'adtape[hf]'``).

The file holds what llama.cpp's own converter, ``convert_hf_to_gguf.py``, writes for the
Hugging Face directory ``gpt2.hf.save_dir`` would write for the same model:

* architecture: ``llama`` (LlamaForCausalLM), ``qwen2`` (Qwen2ForCausalLM: a Llama-family
  config with q/k/v biases) or ``gpt2`` (GPT2LMHeadModel);
* tensors: each family's Hugging Face key map (``gpt2.families``) names them, and gguf's
  ``TensorNameMap`` turns the names into GGUF's (``token_embd``, ``blk.N.attn_q``, ...).
  The padding rows of the vocabulary are dropped; a tied LM head is not written (llama.cpp
  reuses ``token_embd``).  For ``llama``, the q and k rows of each head are permuted from
  Hugging Face's rotate-half order to llama.cpp's interleaved pairs (``rope_permute``, the
  converter's ``LlamaModel.permute``); ``qwen2`` keeps them.  Llama 3's rope scaling is the
  ``rope_freqs`` tensor of per-frequency factors (``LlamaModel.generate_extra_tensors``);
* types: ``f32``, ``f16``, ``bf16`` or ``q8_0`` for the 2-D weights; norms, biases, 1-D
  tensors and GPT-2's position embedding stay F32, and a weight whose rows do not split
  into Q8_0's 32-value blocks falls back to F16, as in the converter;
* metadata: block count, context length, widths, head counts, rope base and dimensions,
  norm epsilon, vocabulary size, file type;
* tokenizer (``tokenizer_dir``, a Hugging Face model directory or tokenizer file):
  a byte-level BPE ``tokenizer.json`` as ``tokenizer.ggml.model`` "gpt2", with its tokens,
  token types, merges and pre-tokenizer name; a SentencePiece ``tokenizer.model`` as
  "llama" with scores (for llama and qwen2, a directory's ``tokenizer.model`` comes first,
  as the converter prefers it); with either, the special-token ids, the add-BOS/EOS flags
  and the chat template of the directory's ``tokenizer_config.json`` (gguf's
  ``SpecialVocab``).  Without a tokenizer (a model trained on bytes) the file says so
  ("none") and llama.cpp runs it on token ids.

Where the converter identifies a BPE pre-tokenizer by hashing the token ids of a test
text (which needs the published vocabulary), this module reads the pre-tokenizer that
tokenizer.json declares and names the llama.cpp pre-tokenizer that runs the same split
(GPT-2's, SmolLM's, Llama 3's, Qwen2's); any other is refused by name.

The file is written under a temporary name beside ``path`` and renamed once complete: a
failure (a full disk, a bad tokenizer) leaves no partial file, and an older file at
``path`` stays as it was.  ``python -m gpt2.gguf_export`` converts a checkpoint or a
Hugging Face directory (``main``).
"""
import argparse
import contextlib
import json
import math
import os
import sys
import tempfile

import numpy as np

# --gguf-type -> (the weights' GGML type name, the file type name): gguf.LlamaFileType's.
GGUF_TYPES = {"f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"),
              "bf16": ("BF16", "MOSTLY_BF16"), "q8_0": ("Q8_0", "MOSTLY_Q8_0")}
# Hugging Face architecture -> GGUF architecture, for the models llama.cpp's converter reads
# as LlamaModel, Qwen2Model and GPT2Model.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "GPT2LMHeadModel": "gpt2"}
# The families whose blocks those architectures compute.
GGUF_FAMILIES = ("gpt2", "llama")
# Rows quantized at once: bounds the temporaries of Q8_0 and BF16 to a few times this.
ENCODE_CHUNK_VALUES = 1 << 24

# The pre-tokenizers llama.cpp implements, as tokenizer.json declares them: the splits in
# order (a byte-level pre-tokenizer with use_regex is GPT-2's split) -> llama.cpp's name.
GPT2_SPLIT = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
LLAMA3_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?"
                "[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
QWEN2_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?"
               "[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
DIGITS_SPLIT = "\\p{N}"
PRE_TOKENIZERS = {(GPT2_SPLIT,): "gpt-2", (DIGITS_SPLIT, GPT2_SPLIT): "smollm",
                  (LLAMA3_SPLIT,): "llama-bpe", (QWEN2_SPLIT,): "qwen2"}
# The normalizers accepted: none, or Qwen2's NFC, which llama.cpp leaves out as the
# converter does (NFC text, the usual input, tokenizes the same).
HARMLESS_NORMALIZERS = (None, "NFC")


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("writing a GGUF file needs the gguf package: "
                          "pip install 'adtape[hf]'") from None
    return gguf


def rope_permute(w, n_head):
    """Rows of each of ``n_head`` heads from Hugging Face's rotate-half order (the first
    halves of the rotated pairs, then the second halves) to llama.cpp's interleaved one
    (pair i at rows 2i, 2i+1): ``LlamaModel.permute`` of convert_hf_to_gguf.py."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def architecture(config):
    """The GGUF architecture of ``config``: its Hugging Face architecture's, or a ValueError
    naming the family llama.cpp's converter does not read."""
    from gpt2 import families
    family = families.family_of(config)
    # The family, not only its config.json: another family may share Llama's layout and
    # key map but not its block (llama.cpp would compute another model).
    hf_architecture = None
    if family.name in GGUF_FAMILIES:
        hf_architecture = family.hf_config_dict(config)["architectures"][0]
    if hf_architecture not in ARCHITECTURES:
        raise ValueError(f"the {family.title} family ({family.name!r}) has no GGUF "
                         f"architecture: GGUF export writes the {' and '.join(GGUF_FAMILIES)} "
                         f"families ({', '.join(ARCHITECTURES)})")
    arch = ARCHITECTURES[hf_architecture]
    if arch == "qwen2" and config.rope_scaling is not None:
        # The converter's Qwen2Model writes no rope_freqs: the scaling would be lost.
        raise ValueError("a Qwen2 model (q/k/v biases) with Llama 3's rope scaling has no "
                         "GGUF form: llama.cpp's qwen2 takes no rope_freqs")
    return arch


def _hf_names(config):
    """Hugging Face tensor name -> (our parameter, layer or None, row slice), in llama.cpp's
    order: the embeddings, block 0's tensors, block 1's, ..., the final norm, the head."""
    arch = architecture(config)
    if arch == "gpt2":
        from gpt2.families.gpt2 import HF_GLOBAL_NAMES, HF_LAYER_NAMES
        names = {"wte.weight": ("wte", None, slice(0, config.vocab_size)),
                 HF_GLOBAL_NAMES["wpe"]: ("wpe", None, slice(None))}
        for layer in range(config.n_layer):
            # Our GPT-2 weights are (out, in): the converter's transposed Conv1D layout.
            names.update({f"h.{layer}.{suffix}": (ours, layer, slice(None))
                          for ours, (suffix, _) in HF_LAYER_NAMES.items()})
        names.update({HF_GLOBAL_NAMES[ours]: (ours, None, slice(None))
                      for ours in ("lnfw", "lnfb")})
        return names
    from gpt2.families.llama import GLOBAL_KEYS, hf_tensors
    expected = {name: (ours, layer, piece)
                for name, (ours, layer, piece, _) in hf_tensors(config).items()}
    last = [GLOBAL_KEYS[k] for k in ("rmsfw", "lm_head") if GLOBAL_KEYS[k] in expected]
    first = [GLOBAL_KEYS["wte"]]
    middle = [name for name in expected if name not in first + last]
    return {name: expected[name] for name in first + middle + last}


def llama3_rope_factors(config):
    """Llama 3's rope scaling as llama.cpp takes it: the factor dividing each of the
    head_dim / 2 rotary frequencies (1 for the high ones, ``factor`` for the low ones, a
    smooth blend between), computed in float32 as ``LlamaModel.generate_extra_tensors``."""
    scaling = dict(config.rope_scaling)
    dim = config.head_dim
    freqs = np.float32(1.0) / (np.float32(config.rope_theta)
                               ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    old_context = scaling["original_max_position_embeddings"]
    low, high, factor = (scaling["low_freq_factor"], scaling["high_freq_factor"],
                         scaling["factor"])
    wavelen = np.float32(2 * math.pi) / freqs
    smooth = (np.float32(old_context) / wavelen - np.float32(low)) / np.float32(high - low)
    blend = np.float32(1) / ((np.float32(1) - smooth) / np.float32(factor) + smooth)
    return np.where(wavelen < old_context / high, np.float32(1),
                    np.where(wavelen > old_context / low, np.float32(factor), blend)
                    ).astype(np.float32)


class _Tensor:
    """One tensor of the file: its GGUF name, GGML type, shape, and how to read its float32
    values from the parameters (``values(params)``)."""

    def __init__(self, name, qtype, shape, values):
        self.name, self.qtype, self.shape, self.values = name, qtype, tuple(shape), values

    def nbytes(self):
        gguf = _gguf()
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape[:-1]) * (self.shape[-1] // block) * type_size


def _tensor_type(gguf, name, shape, weights_type):
    """The GGML type the converter gives tensor ``name``: F32 for 1-D tensors, norms,
    anything not a ``.weight`` and the position embedding; the file's type for the other
    weights, F16 where their rows do not split into its blocks."""
    F32 = gguf.GGMLQuantizationType.F32
    if (len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight")
            or name == gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.POS_EMBD] + ".weight"):
        return F32
    block, _ = gguf.GGML_QUANT_SIZES[weights_type]
    if shape[-1] % block:
        return gguf.GGMLQuantizationType.F16
    return weights_type


def _tensors(config, weights_type):
    """The file's tensors, in order."""
    gguf = _gguf()
    arch = architecture(config)
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    name_map = gguf.get_tensor_name_map(model_arch, config.n_layer)
    shapes = config.param_shapes()
    out = []
    if arch == "llama" and config.rope_scaling is not None:
        factors = llama3_rope_factors(config)
        out.append(_Tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                           gguf.GGMLQuantizationType.F32, factors.shape,
                           lambda params, factors=factors: factors))
    for hf_name, (ours, layer, piece) in _hf_names(config).items():
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"gguf has no {arch} tensor name for {hf_name!r}")
        shape = shapes[ours] if layer is None else shapes[ours][1:]
        shape = (len(range(shape[0])[piece]),) + tuple(shape[1:])
        heads = None
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config.n_head
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.n_kv_head

        def values(params, ours=ours, layer=layer, piece=piece, heads=heads):
            view = params.views[ours] if layer is None else params.views[ours][layer]
            view = view[piece]
            return view if heads is None else rope_permute(view, heads)

        out.append(_Tensor(name, _tensor_type(gguf, name, shape, weights_type), shape, values))
    return out


def _encode(values, qtype):
    """``values`` (float32) as the bytes of GGML type ``qtype``, a few rows at a time."""
    gguf = _gguf()
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype == gguf.GGMLQuantizationType.F32:
        return values
    if qtype == gguf.GGMLQuantizationType.F16:
        return values.astype(np.float16)
    rows = values.reshape(-1, values.shape[-1])
    byte_shape = gguf.quant_shape_to_byte_shape(rows.shape, qtype)
    out = np.empty(byte_shape, dtype=np.uint8)
    step = max(1, ENCODE_CHUNK_VALUES // rows.shape[1])
    for start in range(0, rows.shape[0], step):
        out[start:start + step] = gguf.quants.quantize(rows[start:start + step], qtype)
    return out


# -- the tokenizer -------------------------------------------------------------------------

def _read_json(path, what):
    try:
        with open(path, "rb") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path!r} is not valid JSON ({what}): {e}") from None


def _tokenizer_file(tokenizer, arch):
    """The tokenizer file ``tokenizer`` names: itself, or in a directory (or beside a file
    named tokenizer.json) the one the converter reads: for llama and qwen2 tokenizer.model
    before tokenizer.json."""
    tokenizer = os.fspath(tokenizer)
    if os.path.basename(tokenizer) == "tokenizer.json" and os.path.isfile(tokenizer):
        # A model directory's own (a run's --init-from): its directory, where the converter
        # prefers a SentencePiece tokenizer.model (TinyLlama's tokenizer.json is that
        # model's pieces, not a byte-level BPE).
        tokenizer = os.path.dirname(os.path.abspath(tokenizer))
    if not os.path.isdir(tokenizer):
        if not os.path.isfile(tokenizer):
            raise ValueError(f"tokenizer {tokenizer!r} does not exist")
        return tokenizer
    names = ("tokenizer.json",) if arch == "gpt2" else ("tokenizer.model", "tokenizer.json")
    for name in names:
        if os.path.isfile(os.path.join(tokenizer, name)):
            return os.path.join(tokenizer, name)
    raise ValueError(f"tokenizer directory {tokenizer!r} holds no {' or '.join(names)}")


def _pre_tokenizer(tokenizer_json, path):
    """llama.cpp's name for the pre-tokenizer of a byte-level BPE tokenizer.json, or a
    ValueError saying what it declares."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    splits, byte_level = [], False
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel" and not step.get("add_prefix_space", False):
            byte_level = True
            if step.get("use_regex", True):
                splits.append(GPT2_SPLIT)
        elif kind == "Digits" and step.get("individual_digits"):
            splits.append(DIGITS_SPLIT)
        elif (kind == "Split" and step.get("behavior") == "Isolated" and not step.get("invert")
              and "Regex" in (step.get("pattern") or {})):
            splits.append(step["pattern"]["Regex"])
        else:
            splits = None
            break
    normalizer = (tokenizer_json.get("normalizer") or {}).get("type")
    name = PRE_TOKENIZERS.get(tuple(splits)) if splits and byte_level else None
    if name is None or normalizer not in HARMLESS_NORMALIZERS:
        raise ValueError(f"{path!r}: its pre-tokenizer ({json.dumps(pre)[:200]}) and "
                         f"normalizer ({normalizer}) are not one llama.cpp implements; "
                         f"known: the byte-level splits of {', '.join(PRE_TOKENIZERS.values())}")
    return name


def _looks_special(text):
    """The converter's ``does_token_look_special``: added tokens that are control tokens
    although not marked special."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<｜") and text.endswith("｜>"))
            or (text.startswith("<unused") and text.endswith(">")))


def _bpe_vocab(gguf, path, vocab_size):
    """(pre-tokenizer name, tokens, token types) of a byte-level BPE tokenizer.json, padded
    to ``vocab_size`` with unused ``[PADi]`` tokens (the converter's ``get_vocab_base``)."""
    data = _read_json(path, "a tokenizer.json")
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or model.get("byte_fallback") \
            or (data.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError(f"{path!r} is not a byte-level BPE tokenizer.json (model type "
                         f"{(model or {}).get('type')!r}, decoder "
                         f"{(data.get('decoder') or {}).get('type')!r}): GGUF export reads "
                         f"those and SentencePiece tokenizer.model files")
    pre = _pre_tokenizer(data, path)
    text_of = {i: text for text, i in model.get("vocab", {}).items()}
    added = {}
    for token in data.get("added_tokens") or []:
        text_of[token["id"]] = token["content"]
        added[token["id"]] = token
    if text_of and max(text_of) >= vocab_size:
        raise ValueError(f"{path!r} has token id {max(text_of)}, beyond the model's "
                         f"vocabulary of {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        text = text_of.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            if added[i].get("special") or _looks_special(text):
                types.append(gguf.TokenType.CONTROL)
            else:
                text = text.replace("\u2581", " ")    # pre-normalized user-defined spaces
                types.append(gguf.TokenType.USER_DEFINED)
            tokens.append(text)
        else:
            tokens.append(text)
            types.append(gguf.TokenType.NORMAL)
    return pre, tokens, types


def _sentencepiece_vocab(gguf, path, vocab_size):
    """(tokens, scores, token types) of a SentencePiece model padded to ``vocab_size``,
    with the added tokens of tokenizer_config.json beside it (the converter's
    ``_create_vocab_sentencepiece``)."""
    from gpt2.tokenizer import _optional_import
    sentencepiece = _optional_import("sentencepiece", f"the tokenizer file {path!r}")
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.LoadFromFile(path)
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{path!r} is not a SentencePiece model: {e}") from None
    if processor.vocab_size() > vocab_size:
        raise ValueError(f"{path!r} has {processor.vocab_size()} tokens, more than the "
                         f"model's vocabulary of {vocab_size}")
    T = gguf.TokenType
    tokens = [f"[PAD{i}]".encode("utf-8") for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [T.UNUSED] * vocab_size
    for i in range(processor.vocab_size()):
        tokens[i] = processor.IdToPiece(i).encode("utf-8")
        scores[i] = processor.GetScore(i)
        types[i] = (T.UNKNOWN if processor.IsUnknown(i) else T.CONTROL if processor.IsControl(i)
                    else T.UNUSED if processor.IsUnused(i) else T.BYTE if processor.IsByte(i)
                    else T.NORMAL)
    directory = os.path.dirname(path)
    added_file = os.path.join(directory, "added_tokens.json")
    added = _read_json(added_file, "added tokens") if os.path.isfile(added_file) else {}
    for text, i in added.items():
        if isinstance(i, int) and 0 <= i < vocab_size:
            tokens[i], scores[i], types[i] = text.encode("utf-8"), -1000.0, T.USER_DEFINED
    config_file = os.path.join(directory, "tokenizer_config.json")
    settings = _read_json(config_file, "tokenizer settings") if os.path.isfile(config_file) else {}
    for key, token in (settings.get("added_tokens_decoder") or {}).items():
        i, text = int(key), token["content"]
        if i >= vocab_size:
            continue
        if token.get("special") or _looks_special(text):
            types[i] = T.CONTROL
        else:
            text = text.replace("\u2581", " ")
            types[i] = T.USER_DEFINED
        tokens[i], scores[i] = text.encode("utf-8"), -1000.0
    return tokens, scores, types


@contextlib.contextmanager
def _as_named(path, name):
    """A directory in which ``path`` is called ``name`` (gguf's SpecialVocab reads a
    directory's tokenizer.json): its own where it is, else a temporary one linking to it."""
    if os.path.basename(path) == name:
        yield os.path.dirname(os.path.abspath(path))
        return
    with tempfile.TemporaryDirectory(prefix="gguf-tokenizer-") as directory:
        os.symlink(os.path.abspath(path), os.path.join(directory, name))
        yield directory


class _Tokenizer:
    """What the file says of the tokenizer, read and checked before anything is written."""

    def __init__(self, tokenizer, config, arch):
        gguf = _gguf()
        self.arch = arch
        self.vocab_size = config.vocab_size
        self.path = None if tokenizer is None else _tokenizer_file(tokenizer, arch)
        self.scores = self.pre = None
        if self.path is None:
            return
        from gpt2.tokenizer import HFTokenizer, SentencePieceTokenizer, load_tokenizer
        kind = type(load_tokenizer(self.path))
        if kind is HFTokenizer:
            self.model = "gpt2"
            self.pre, self.tokens, self.types = _bpe_vocab(gguf, self.path, config.vocab_size)
        elif kind is SentencePieceTokenizer and arch != "gpt2":
            self.model, self.pre = "llama", "default"
            self.tokens, self.scores, self.types = _sentencepiece_vocab(gguf, self.path,
                                                                        config.vocab_size)
        else:
            takes = ("a byte-level BPE tokenizer.json" if arch == "gpt2" else
                     "a byte-level BPE tokenizer.json or a SentencePiece tokenizer.model")
            raise ValueError(f"{self.path!r}: a {arch} GGUF file takes {takes} (as llama.cpp's "
                             f"converter), not a {kind.__name__}'s file")
        name = "tokenizer.json" if self.model == "gpt2" else "tokenizer.model"
        with _as_named(self.path, name) as directory:
            self.special = gguf.SpecialVocab(directory, load_merges=self.model == "gpt2",
                                             n_vocab=config.vocab_size)
            settings_file = os.path.join(directory, "tokenizer_config.json")
            self.settings = (_read_json(settings_file, "tokenizer settings")
                             if os.path.isfile(settings_file) else {})
        if self.model == "gpt2" and not self.special.merges:
            raise ValueError(f"{self.path!r} has no merges: llama.cpp cannot load a BPE "
                             f"tokenizer without them")

    def add_to(self, writer):
        if self.path is None:
            # No tokenizer (bytes): llama.cpp reads the vocabulary size and runs on token ids.
            writer.add_tokenizer_model("none")
            return
        add_prefix_space = self.settings.get("add_prefix_space")
        if self.arch == "llama" and isinstance(add_prefix_space, bool):
            writer.add_add_space_prefix(add_prefix_space)
        writer.add_tokenizer_model(self.model)
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        writer.add_token_types(self.types)
        self.special.add_to_gguf(writer, quiet=True)
        if self.arch == "llama" and self.vocab_size == 49152:
            # The converter's rule for Llama vocabularies of 49152 (Granite's, SmolLM's).
            writer.add_add_bos_token(False)


# -- the file ------------------------------------------------------------------------------

def _metadata(writer, config, arch, file_type):
    """The converter's hyperparameters: TextModel's, then LlamaModel's or GPT2Model's."""
    writer.add_block_count(config.n_layer)
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    if arch == "gpt2":
        writer.add_feed_forward_length(4 * config.n_embd)
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(1e-5)
        writer.add_file_type(file_type)
        return
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.n_kv_head)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_file_type(file_type)
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(config.head_dim)


def _check_path(path):
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{path!r} is a directory, not a file name for the GGUF file")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"the directory of {path!r} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"the directory of {path!r} is not writable")
    return path


def _check_type(dtype):
    if dtype not in GGUF_TYPES:
        raise ValueError(f"unknown GGUF type {dtype!r}; known: {', '.join(GGUF_TYPES)}")


def check_gguf_export(path, config, dtype="f16", tokenizer=None):
    """Check, writing nothing, that ``save_gguf`` can write ``config``'s model to ``path``
    in ``dtype`` with ``tokenizer``: a ValueError naming what cannot be (the type, the
    family, the path, the tokenizer)."""
    _check_type(dtype)
    arch = architecture(config)
    _check_path(path)
    _Tokenizer(tokenizer, config, arch)


def save_gguf(path, config, params, dtype="f16", tokenizer_dir=None, name=None):
    """Write ``params`` (a ParamArena of ``config``, or a LoRA model's
    ``gpt2.lora.MergedParams``) to the GGUF file ``path`` as llama.cpp's
    converter would write the model (see the module's docstring).

    dtype: f32, f16, bf16 or q8_0, the type of the 2-D weights; tokenizer_dir: a Hugging
    Face model directory, or a tokenizer.json / tokenizer.model file (with the
    tokenizer_config.json and config.json beside it), or None for no tokenizer; name:
    general.name (default: the file's name without its extension).  Returns ``path``.
    """
    from gpt2.checkpoint import atomic_writer
    from gpt2.lora import MergedParams
    from gpt2.params import ParamArena
    gguf = _gguf()
    _check_type(dtype)
    kinds = (ParamArena, MergedParams)     # MergedParams: merged a block at a time
    if not isinstance(params, kinds) or params.config != config:
        raise ValueError(f"params must be a ParamArena of the config given, got "
                         f"{type(params).__name__}"
                         + (" of another config" if isinstance(params, kinds) else ""))
    arch = architecture(config)
    path = _check_path(path)
    vocab = _Tokenizer(tokenizer_dir, config, arch)
    weights_type = gguf.GGMLQuantizationType[GGUF_TYPES[dtype][0]]
    tensors = _tensors(config, weights_type)

    writer = gguf.GGUFWriter(None, arch)
    for t in tensors:
        # The logical shape with a float32 dtype: add_tensor_info takes it as it is.
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes(),
                               raw_dtype=t.qtype)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or os.path.splitext(os.path.basename(path))[0])
    writer.add_size_label(gguf.size_label(*writer.get_total_parameter_count()))
    _metadata(writer, config, arch, gguf.LlamaFileType[GGUF_TYPES[dtype][1]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if vocab.path is None and arch != "llama":     # llama's metadata has it already
        writer.add_vocab_size(config.vocab_size)
    vocab.add_to(writer)

    with atomic_writer(path) as f:
        # The writer writes through the temporary file atomic_writer renames at the end.
        writer.fout, writer.state = [f], gguf.gguf_writer.WriterState.EMPTY
        try:
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for t in tensors:
                data = _encode(t.values(params), t.qtype)
                # GGUFWriter.write_tensor_data's padding, but f.write rather than numpy's
                # tofile: a full disk is then ENOSPC, not "N requested and M written".
                writer.write_padding(f, f.tell())
                f.write(memoryview(data).cast("B"))
                writer.write_padding(f, data.nbytes)
        finally:
            writer.fout = None      # atomic_writer closes (and on failure removes) the file
    return path


# -- python -m gpt2.gguf_export ------------------------------------------------------------

def _load(source):
    """(params, the tokenizer it came with or None) of a checkpoint or a Hugging Face
    directory."""
    from gpt2 import checkpoint as ckpt, hf
    if os.path.isdir(source):
        from gpt2.tokenizer import find_tokenizer
        return hf.load_dir(source), (source if find_tokenizer(source) else None)
    state = ckpt.load_checkpoint(source, optimizer=False)
    saved = ((state.extra or {}).get("args") or {}).get("tokenizer")
    return state.params, (None if saved in (None, "bytes") else saved)


def main(argv=None):
    """``python -m gpt2.gguf_export SOURCE OUT.gguf``: a checkpoint (its run's tokenizer)
    or a Hugging Face model directory (its own tokenizer) as a GGUF file; 2 and one
    ``error:`` line on bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m gpt2.gguf_export",
        description="Write a gpt2-train checkpoint or a Hugging Face model directory as a "
                    "GGUF file for llama.cpp.")
    parser.add_argument("source", help="checkpoint.bin of a run, or a Hugging Face model "
                                       "directory")
    parser.add_argument("out", help="the GGUF file to write")
    parser.add_argument("--gguf-type", choices=tuple(GGUF_TYPES), default="f16",
                        help="the type of the weights (default: %(default)s)")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="the tokenizer to write: a model directory, tokenizer.json or "
                             "tokenizer.model (default: the source's; 'bytes': none)")
    parser.add_argument("--name", default=None, help="general.name (default: OUT's name)")
    args = parser.parse_args(argv)
    try:
        params, tokenizer = _load(args.source)
        if args.tokenizer is not None:
            tokenizer = None if args.tokenizer == "bytes" else args.tokenizer
        save_gguf(args.out, params.config, params, dtype=args.gguf_type,
                  tokenizer_dir=tokenizer, name=args.name)
    except (ValueError, OSError, ImportError) as e:
        print(f"{parser.prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({args.gguf_type})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
