"""Hugging Face model directories of the Llama family in and out: ``LlamaForCausalLM``
(Llama, SmolLM2, TinyLlama) and ``Qwen2ForCausalLM`` (Qwen2.5).

A directory holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``; F32, F16 and BF16 tensors load as float32.  One key
map: each block's q, k and v projections are packed into our one ``qkvw`` (rows q | k | v,
Hugging Face's rotate-half layout kept as it is, so no permutation), gate and up into
``gateupw`` (rows gate | up).  GPT-2 directories go through ``gpt2.checkpoint``'s
``import_hf_gpt2``/``export_hf_gpt2``; ``load_dir`` and ``save_dir`` serve both families.

config.json is checked field by field before anything is allocated: every size a positive
integer, the heads dividing what they split, the rotary settings in a form we read, and the
sizes against the shapes in the weights' headers, so that a wrong field is named instead of
surfacing as a MemoryError.  Where a directory holds both ``model.safetensors`` and a
sharded index, transformers reads ``model.safetensors``; so do we, once the shards are found
to hold the same tensors (a directory where they differ is refused).
"""
import contextlib
import json
import math
import os
import re

import numpy as np

from gpt2.checkpoint import (SafetensorsFile, atomic_writer, check_fits_in_memory,
                             export_hf_gpt2, import_hf_gpt2, write_safetensors)
from gpt2.config import GPT2Config, LlamaConfig
from gpt2.params import ParamArena

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "GPT2LMHeadModel": "gpt2"}
INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "model.safetensors"
# Per block: our name -> the Hugging Face names packed into it, in row order.
LAYER_KEYS = {
    "rms1w": ("input_layernorm.weight",),
    "qkvw": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "qkvb": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "attprojw": ("self_attn.o_proj.weight",),
    "rms2w": ("post_attention_layernorm.weight",),
    "gateupw": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "downw": ("mlp.down_proj.weight",),
}
GLOBAL_KEYS = {"wte": "model.embed_tokens.weight", "rmsfw": "model.norm.weight",
               "lm_head": "lm_head.weight"}
# Buffers some checkpoints carry that are not parameters.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# The weight files transformers reads, with a variant (model.fp16.safetensors), as shards
# (model-00001-of-00002.safetensors) or as the index of shards.
WEIGHT_FILE = re.compile(r"(model|pytorch_model|tf_model|flax_model)(\.[\w-]+)?(-\d+-of-\d+)?"
                         r"\.(safetensors|bin|h5|msgpack)(\.index\.json)?")
# The rotary settings we read, for the messages that refuse others.
ROPE_FORMS = ('null or an object with "rope_type" (or "type") "default", or "llama3" with '
              '"factor", "low_freq_factor", "high_freq_factor" and '
              '"original_max_position_embeddings"')


def read_config(directory):
    """Our config from a Hugging Face ``config.json`` (Llama, Qwen2 or GPT-2); a field of
    the wrong type or value is refused by its name."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path, "rb") as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{directory!r} is not a Hugging Face model directory: it has no "
                         f"config.json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path!r} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path!r} is not a model configuration (not a JSON object)")
    architectures = hf.get("architectures") or []
    if not isinstance(architectures, list):
        architectures = [architectures]
    kind = next((ARCHITECTURES[a] for a in architectures
                 if isinstance(a, str) and a in ARCHITECTURES), None)
    model_type = hf.get("model_type")
    if kind is None and isinstance(model_type, str):
        kind = {"llama": "llama", "qwen2": "qwen2", "gpt2": "gpt2"}.get(model_type)
    if kind is None:
        raise ValueError(f"{path!r}: architecture {architectures or model_type!r} is "
                         f"not supported (supported: {', '.join(ARCHITECTURES)})")
    try:
        if kind == "gpt2":
            return _gpt2_config(hf)
        return _llama_config(hf, kind)
    except ValueError as e:
        raise ValueError(f"{path!r}: {e}") from None


def _shown(value):
    """``value`` as config.json spells it, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _size(mapping, key, default=None, where=""):
    """mapping[key] as a size: a positive integer (a bool is not one); ``default`` where the
    field is absent or null, if the field has one."""
    value = mapping.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"{where}{key} is missing" if key not in mapping
                             else f"{where}{key} must be a positive integer, got null")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}{key} must be a positive integer, got {_shown(value)}")
    return value


def _positive_number(mapping, key, default, where=""):
    """mapping[key] as a positive finite number, ``default`` where absent or null."""
    value = mapping.get(key)
    if value is None:
        return default
    try:
        finite = (not isinstance(value, bool) and isinstance(value, (int, float))
                  and math.isfinite(value) and value > 0)
    except OverflowError:   # an integer beyond any float
        finite = False
    if not finite:
        raise ValueError(f"{where}{key} must be a positive number, got {_shown(value)}")
    return float(value)


def _gpt2_config(hf):
    sizes = {key: _size(hf, key) for key in ("n_layer", "n_head", "n_embd", "vocab_size",
                                             "n_positions")}
    if sizes["n_embd"] % sizes["n_head"]:
        raise ValueError(f"n_head ({sizes['n_head']}) must divide n_embd ({sizes['n_embd']})")
    return GPT2Config(n_layer=sizes["n_layer"], n_head=sizes["n_head"], n_embd=sizes["n_embd"],
                      vocab_size=sizes["vocab_size"], block_size=sizes["n_positions"])


def _rope(hf):
    """(rope_theta, Llama 3's scaling or None): transformers 5 keeps the rotary settings in
    rope_parameters; earlier versions (and most config.json files published) in
    rope_theta and rope_scaling."""
    key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    rope = hf.get(key)
    if rope is None:
        rope = {}
    if not isinstance(rope, dict):
        raise ValueError(f"{key} must be {ROPE_FORMS}; got {_shown(rope)}")
    theta = _positive_number(hf, "rope_theta", None)
    if theta is None:
        theta = _positive_number(rope, "rope_theta", 10000.0, f"{key}.")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"{key}: rope_type {rope_type!r} is not supported (default and "
                         f"llama3 are: {key} must be {ROPE_FORMS})")
    scaling = {"rope_type": "llama3"}
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        if rope.get(name) is None:
            raise ValueError(f"{key}.{name} is missing (rope_type llama3 needs it)")
        scaling[name] = _positive_number(rope, name, None, f"{key}.")
    scaling["original_max_position_embeddings"] = _size(
        rope, "original_max_position_embeddings", where=f"{key}.")
    return theta, scaling


def _llama_config(hf, kind):
    n_layer, n_head, n_embd, intermediate_size, vocab_size, block_size = (
        _size(hf, key) for key in ("num_hidden_layers", "num_attention_heads", "hidden_size",
                                   "intermediate_size", "vocab_size",
                                   "max_position_embeddings"))
    if hf.get("head_dim") is None and n_embd % n_head:
        raise ValueError(f"num_attention_heads ({n_head}) must divide hidden_size ({n_embd}) "
                         f"where head_dim is not given")
    head_dim = _size(hf, "head_dim", n_embd // n_head)
    n_kv_head = _size(hf, "num_key_value_heads", n_head)
    if n_head % n_kv_head:
        raise ValueError(f"num_key_value_heads ({n_kv_head}) must divide num_attention_heads "
                         f"({n_head})")
    if head_dim % 2:
        raise ValueError(f"head_dim ({head_dim}) must be even for rotary embeddings")
    theta, scaling = _rope(hf)
    tie = hf.get("tie_word_embeddings")
    if tie is None:
        tie = kind != "llama"
    if not isinstance(tie, bool):
        raise ValueError(f"tie_word_embeddings must be true or false, got {_shown(tie)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (silu is)")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias is not supported")
    if kind == "qwen2" and hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window: sliding-window attention is not supported")
    if kind == "llama" and hf.get("attention_bias"):
        # Llama's flag puts a bias on the output projection too, which our layout lacks.
        raise ValueError("attention_bias: biases on Llama's attention projections are not "
                         "supported (Qwen2's q/k/v biases are)")
    return LlamaConfig(
        n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd,
        intermediate_size=intermediate_size, vocab_size=vocab_size, block_size=block_size,
        head_dim=head_dim, rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=_positive_number(hf, "rms_norm_eps", 1e-6), tie_embeddings=tie,
        qkv_bias=kind == "qwen2")


def hf_config_dict(config):
    """config.json for ``config``: a Qwen2 model where q/k/v carry biases, else Llama."""
    qwen = config.qkv_bias
    hf = {"architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
          "model_type": "qwen2" if qwen else "llama",
          "hidden_size": config.n_embd, "intermediate_size": config.intermediate_size,
          "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
          "num_key_value_heads": config.n_kv_head, "head_dim": config.head_dim,
          "vocab_size": config.vocab_size, "max_position_embeddings": config.block_size,
          "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
          "rope_scaling": dict(config.rope_scaling) if config.rope_scaling else None,
          "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu",
          "torch_dtype": "float32"}
    if not qwen:
        hf.update(attention_bias=False, mlp_bias=False)
    else:
        hf.update(use_sliding_window=False)
    return hf


def _index_files(index):
    """name -> SafetensorsFile holding it, from the shards ``index`` lists."""
    directory = os.path.dirname(index)
    try:
        with open(index, "rb") as f:
            weight_map = json.load(f)["weight_map"]
        files = {name: str(file) for name, file in weight_map.items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise ValueError(f"{index!r} is not a safetensors index: {e}") from None
    opened = {f: SafetensorsFile(os.path.join(directory, f)) for f in set(files.values())}
    out = {}
    for name, file in files.items():
        if name not in opened[file].entries:
            raise ValueError(f"{index!r} places {name!r} in {file}, which lacks it")
        out[name] = opened[file]
    return out


def _first_difference(single, sharded):
    """How two name -> SafetensorsFile maps differ (names, dtypes, shapes, then bytes),
    or None where they hold the same tensors."""
    if set(single) != set(sharded):
        only = sorted(set(single) - set(sharded))
        other = sorted(set(sharded) - set(single))
        return f"tensors only in {WEIGHTS_NAME}: {only[:3]}, only in the shards: {other[:3]}"
    for name in sorted(single):
        a, b = single[name], sharded[name]
        if os.path.samefile(a.path, b.path):
            continue
        ea, eb = a.entries[name], b.entries[name]
        if (ea.dtype, ea.shape) != (eb.dtype, eb.shape):
            return (f"{name!r} is {ea.dtype} {list(ea.shape)} in {WEIGHTS_NAME}, {eb.dtype} "
                    f"{list(eb.shape)} in {os.path.basename(b.path)}")
        if a.read(name, as_float32=False).tobytes() != b.read(name, as_float32=False).tobytes():
            return f"{name!r} differs between {WEIGHTS_NAME} and {os.path.basename(b.path)}"
    return None


def _tensor_files(directory):
    """name -> SafetensorsFile holding it: ``model.safetensors`` where there is one (as
    transformers prefers it), else the shards of ``model.safetensors.index.json``.  A
    directory with both is refused unless they hold the same tensors."""
    index = os.path.join(directory, INDEX_NAME)
    single = os.path.join(directory, WEIGHTS_NAME)
    if not os.path.exists(single):
        if not os.path.exists(index):
            raise ValueError(f"{directory!r} holds neither {WEIGHTS_NAME} nor {INDEX_NAME}")
        return _index_files(index)
    st = SafetensorsFile(single)
    files = dict.fromkeys(st.entries, st)
    if os.path.exists(index):
        difference = _first_difference(files, _index_files(index))
        if difference:
            raise ValueError(f"{directory!r} holds two models: {WEIGHTS_NAME} and the shards "
                             f"of {INDEX_NAME} differ ({difference}); transformers reads "
                             f"{WEIGHTS_NAME}: remove the stale one")
    return files


def _check_sizes_against_weights(config, files, config_path):
    """Name the config.json field that disagrees with the shapes in the weights' headers,
    before the config's sizes are trusted with any allocation."""
    layers = {int(parts[2]) for parts in (name.split(".") for name in files)
              if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit()}
    if len(layers) != config.n_layer:
        raise ValueError(f"{config_path!r}: num_hidden_layers is {config.n_layer}, but the "
                         f"weights hold {len(layers)} layers")
    C, hd = config.n_embd, config.head_dim
    checks = (
        ("model.embed_tokens.weight", 0, "vocab_size", f"{config.vocab_size}",
         config.vocab_size),
        ("model.embed_tokens.weight", 1, "hidden_size", f"{C}", C),
        ("model.layers.0.self_attn.q_proj.weight", 0, "num_attention_heads x head_dim",
         f"{config.n_head} x {hd} = {config.n_head * hd}", config.n_head * hd),
        ("model.layers.0.self_attn.k_proj.weight", 0, "num_key_value_heads x head_dim",
         f"{config.n_kv_head} x {hd} = {config.n_kv_head * hd}", config.n_kv_head * hd),
        ("model.layers.0.mlp.gate_proj.weight", 0, "intermediate_size",
         f"{config.intermediate_size}", config.intermediate_size),
    )
    for name, axis, field, value, expected in checks:
        shape = files[name].entries[name].shape if name in files else ()
        if len(shape) == 2 and shape[axis] != expected:
            raise ValueError(f"{config_path!r}: {field} is {value}, but {name} has "
                             f"{shape[axis]} {('rows', 'columns')[axis]}")


def _llama_expected(config):
    """Hugging Face name -> (our name, layer or None, row slice, shape)."""
    C, hd, I = config.n_embd, config.head_dim, config.intermediate_size
    rows = {"qkvw": (config.n_head * hd, config.n_kv_head * hd, config.n_kv_head * hd),
            "gateupw": (I, I)}
    rows["qkvb"] = rows["qkvw"]
    expected = {GLOBAL_KEYS["wte"]: ("wte", None, slice(0, config.vocab_size),
                                     (config.vocab_size, C)),
                GLOBAL_KEYS["rmsfw"]: ("rmsfw", None, slice(None), (C,))}
    if not config.tie_embeddings:
        expected[GLOBAL_KEYS["lm_head"]] = ("lm_head", None, slice(0, config.vocab_size),
                                            (config.vocab_size, C))
    shapes = config.param_shapes()
    for l in range(config.n_layer):
        for ours in config.per_layer:
            keys, start = LAYER_KEYS[ours], 0
            for key, n in zip(keys, rows.get(ours, (None,))):
                shape = shapes[ours][1:]
                if n is not None:
                    shape = (n,) + shape[1:]
                    piece = slice(start, start + n)
                    start += n
                else:
                    piece = slice(None)
                expected[f"model.layers.{l}.{key}"] = (ours, l, piece, shape)
    return expected


def import_hf_llama(directory, config=None):
    """A ParamArena from a Hugging Face Llama or Qwen2 directory (``config`` defaults to
    the one its config.json describes; the weights must match it exactly)."""
    directory = os.fspath(directory)
    config = config or read_config(directory)
    files = _tensor_files(directory)
    _check_sizes_against_weights(config, files, os.path.join(directory, "config.json"))
    names = {n for n in files if not n.endswith(IGNORED_SUFFIXES)}
    expected = _llama_expected(config)
    tied_head = config.tie_embeddings and GLOBAL_KEYS["lm_head"] in names
    missing = sorted(set(expected) - names)
    unknown = sorted(names - set(expected) - ({GLOBAL_KEYS["lm_head"]} if tied_head else set()))
    if missing or unknown:
        raise ValueError(f"{directory!r} does not hold the weights its config describes: "
                         f"missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
                         f"unexpected {unknown[:6]}{'...' if len(unknown) > 6 else ''}")
    check_fits_in_memory(config, directory)
    arena = ParamArena(config)
    for name, (ours, layer, piece, shape) in expected.items():
        found = files[name].entries[name].shape
        if tuple(found) != shape:
            raise ValueError(f"{files[name].path!r}: tensor {name!r} has shape {list(found)}, "
                             f"expected {list(shape)}")
        view = arena.views[ours] if layer is None else arena.views[ours][layer]
        view[piece] = files[name].read(name)
    if tied_head:
        head = files[GLOBAL_KEYS["lm_head"]].read(GLOBAL_KEYS["lm_head"])
        if head.shape != (config.vocab_size, config.n_embd) or not np.array_equal(
                head, arena.wte[:config.vocab_size]):
            raise ValueError(f"{directory!r}: config.json ties the embeddings, but "
                             f"lm_head.weight differs from the token embedding")
    return arena


def export_hf_llama(directory, params):
    """Write ``params`` as a Hugging Face directory (config.json, model.safetensors in F32)
    that transformers loads with ``AutoModelForCausalLM.from_pretrained``."""
    config = params.config
    os.makedirs(directory, exist_ok=True)
    tensors = {}
    for name, (ours, layer, piece, _) in _llama_expected(config).items():
        view = params.views[ours] if layer is None else params.views[ours][layer]
        tensors[name] = view[piece]
    write_safetensors(os.path.join(directory, WEIGHTS_NAME), tensors, metadata={"format": "pt"})
    _write_config(directory, hf_config_dict(config))


def _write_config(directory, hf):
    with atomic_writer(os.path.join(directory, "config.json")) as f:
        f.write(json.dumps(hf, indent=2).encode("utf-8"))


def load_dir(directory):
    """A ParamArena of either family from a Hugging Face model directory."""
    directory = os.fspath(directory)
    config = read_config(directory)
    if isinstance(config, GPT2Config):
        _tensor_files(directory)    # refuses shards that disagree with model.safetensors
        single = os.path.join(directory, WEIGHTS_NAME)
        if not os.path.exists(single):
            raise ValueError(f"{directory!r}: a GPT-2 model is read from {WEIGHTS_NAME}; "
                             f"sharded GPT-2 directories are not supported")
        return import_hf_gpt2(single, config=config)
    return import_hf_llama(directory, config)


def weight_files(directory):
    """Names of the model weight files in ``directory`` (any format transformers reads,
    shards and their indexes included), sorted; [] where there is no such directory."""
    try:
        names = set(os.listdir(directory))
    except FileNotFoundError:
        return []
    found = {n for n in names if WEIGHT_FILE.fullmatch(n)}
    for index in [n for n in found if n.endswith(".index.json")]:
        # Shards may be named anything: the index says which they are.
        try:
            with open(os.path.join(directory, index), "rb") as f:
                found.update(n for n in json.load(f)["weight_map"].values()
                             if isinstance(n, str) and n in names)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass    # not an index we can read: its own name is all it tells
    return sorted(found)


def save_dir(directory, params, overwrite=False):
    """A Hugging Face model directory of ``params`` (either family).

    A directory that holds another model's weights is refused unless ``overwrite``; then
    the others (shards, their index, pytorch_model.bin, ...) are removed once the new
    ``model.safetensors`` is written, so that transformers and ``load_dir`` both read the
    new weights and nothing else.
    """
    directory = os.fspath(directory)
    others = weight_files(directory)
    if others and not overwrite:
        raise ValueError(f"{directory!r} holds another model's weights "
                         f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})")
    if isinstance(params.config, GPT2Config):
        os.makedirs(directory, exist_ok=True)
        export_hf_gpt2(os.path.join(directory, WEIGHTS_NAME), params.in_llmc_order(),
                       write_config=True)
    else:
        export_hf_llama(directory, params.in_llmc_order())
    for name in others:
        if name != WEIGHTS_NAME:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))


def num_parameters(config):
    """Parameters as Hugging Face counts them (vocabulary unpadded, a tied head once)."""
    return sum(math.prod(shape) for _, _, _, shape in _llama_expected(config).values())
