"""Hugging Face model directories of the Llama family in and out: ``LlamaForCausalLM``
(Llama, SmolLM2, TinyLlama) and ``Qwen2ForCausalLM`` (Qwen2.5).

A directory holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``; F32, F16 and BF16 tensors load as float32.  One key
map: each block's q, k and v projections are packed into our one ``qkvw`` (rows q | k | v,
Hugging Face's rotate-half layout kept as it is, so no permutation), gate and up into
``gateupw`` (rows gate | up).  GPT-2 directories go through ``gpt2.checkpoint``'s
``import_hf_gpt2``/``export_hf_gpt2``; ``load_dir`` and ``save_dir`` serve both families.
"""
import json
import math
import os

import numpy as np

from gpt2.checkpoint import (SafetensorsFile, atomic_writer, export_hf_gpt2, import_hf_gpt2,
                             write_safetensors)
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


def read_config(directory):
    """Our config from a Hugging Face ``config.json`` (Llama, Qwen2 or GPT-2)."""
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
    kind = next((ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES), None)
    kind = kind or {"llama": "llama", "qwen2": "qwen2", "gpt2": "gpt2"}.get(hf.get("model_type"))
    if kind is None:
        raise ValueError(f"{path!r}: architecture {architectures or hf.get('model_type')!r} is "
                         f"not supported (supported: {', '.join(ARCHITECTURES)})")
    try:
        if kind == "gpt2":
            return GPT2Config(n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"],
                              vocab_size=hf["vocab_size"], block_size=hf["n_positions"])
        return _llama_config(hf, kind)
    except KeyError as e:
        raise ValueError(f"{path!r} lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path!r}: {e}") from None


def _llama_config(hf, kind):
    # transformers 5 keeps the rotary settings in rope_parameters; earlier versions (and
    # most config.json files published) in rope_theta and rope_scaling.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type == "llama3":
        scaling = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                        "original_max_position_embeddings")}
        scaling["rope_type"] = "llama3"
    elif rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (default and llama3 are)")
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
    n_head = hf["num_attention_heads"]
    return LlamaConfig(
        n_layer=hf["num_hidden_layers"], n_head=n_head,
        n_kv_head=hf.get("num_key_value_heads") or n_head, n_embd=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        block_size=hf["max_position_embeddings"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head, rope_theta=float(theta),
        rope_scaling=scaling, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", kind != "llama")),
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


def _tensor_files(directory):
    """name -> SafetensorsFile holding it, from the index or the single weights file."""
    index = os.path.join(directory, INDEX_NAME)
    if os.path.exists(index):
        try:
            with open(index, "rb") as f:
                weight_map = json.load(f)["weight_map"]
            files = {name: str(file) for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ValueError(f"{index!r} is not a safetensors index: {e}") from None
        opened = {f: SafetensorsFile(os.path.join(directory, f)) for f in set(files.values())}
        out = {}
        for name, file in files.items():
            if name not in opened[file].entries:
                raise ValueError(f"{index!r} places {name!r} in {file}, which lacks it")
            out[name] = opened[file]
        return out
    single = os.path.join(directory, WEIGHTS_NAME)
    if not os.path.exists(single):
        raise ValueError(f"{directory!r} holds neither {WEIGHTS_NAME} nor {INDEX_NAME}")
    st = SafetensorsFile(single)
    return dict.fromkeys(st.entries, st)


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
    names = {n for n in files if not n.endswith(IGNORED_SUFFIXES)}
    expected = _llama_expected(config)
    tied_head = config.tie_embeddings and GLOBAL_KEYS["lm_head"] in names
    missing = sorted(set(expected) - names)
    unknown = sorted(names - set(expected) - ({GLOBAL_KEYS["lm_head"]} if tied_head else set()))
    if missing or unknown:
        raise ValueError(f"{directory!r} does not hold the weights its config describes: "
                         f"missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
                         f"unexpected {unknown[:6]}{'...' if len(unknown) > 6 else ''}")
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
    config = read_config(directory)
    if isinstance(config, GPT2Config):
        return import_hf_gpt2(os.path.join(directory, WEIGHTS_NAME), config=config)
    return import_hf_llama(directory, config)


def save_dir(directory, params):
    """A Hugging Face model directory of ``params`` (either family)."""
    if isinstance(params.config, GPT2Config):
        os.makedirs(directory, exist_ok=True)
        export_hf_gpt2(os.path.join(directory, WEIGHTS_NAME), params.in_llmc_order(),
                       write_config=True)
        return
    export_hf_llama(directory, params.in_llmc_order())


def num_parameters(config):
    """Parameters as Hugging Face counts them (vocabulary unpadded, a tied head once)."""
    return sum(math.prod(shape) for _, _, _, shape in _llama_expected(config).values())
