"""The Llama family (Llama, SmolLM2, TinyLlama, Qwen2): its config and presets, its block
(RMSNorm, rotary embeddings on the packed q|k|v projection, grouped-query causal attention,
a SwiGLU MLP) and its Hugging Face key map for ``LlamaForCausalLM`` and
``Qwen2ForCausalLM`` directories.

The Hugging Face map packs each block's q, k and v projections into our one ``qkvw`` (rows
q | k | v, Hugging Face's rotate-half layout kept as it is, so no permutation), gate and up
into ``gateupw`` (rows gate | up).
"""
import functools
import json
import math
import os
from dataclasses import asdict, dataclass, fields

import numpy as np

from gpt2.families.base import RECORDED, Family, padded
from kernels.llama import rope_tables

# Published configurations (config.json of each model's Hugging Face repository);
# llama-tiny is ours, for tests: a few layers with grouped-query attention.
PRESETS = {
    "llama-tiny": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=160,
                       vocab_size=256, block_size=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                       tie_embeddings=True),
    "smollm2-135m": dict(n_layer=30, n_head=9, n_kv_head=3, n_embd=576, intermediate_size=1536,
                         vocab_size=49152, block_size=8192, rope_theta=100000.0,
                         rms_norm_eps=1e-5, tie_embeddings=True),
    "smollm2-360m": dict(n_layer=32, n_head=15, n_kv_head=5, n_embd=960, intermediate_size=2560,
                         vocab_size=49152, block_size=8192, rope_theta=100000.0,
                         rms_norm_eps=1e-5, tie_embeddings=True),
    "tinyllama-1.1b": dict(n_layer=22, n_head=32, n_kv_head=4, n_embd=2048,
                           intermediate_size=5632, vocab_size=32000, block_size=2048,
                           rope_theta=10000.0, rms_norm_eps=1e-5, tie_embeddings=False),
    "llama-3.2-1b": dict(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, intermediate_size=8192,
                         vocab_size=128256, block_size=131072, rope_theta=500000.0,
                         rms_norm_eps=1e-5, tie_embeddings=True,
                         rope_scaling=(("factor", 32.0), ("high_freq_factor", 4.0),
                                       ("low_freq_factor", 1.0),
                                       ("original_max_position_embeddings", 8192),
                                       ("rope_type", "llama3"))),
    "qwen2.5-0.5b": dict(n_layer=24, n_head=14, n_kv_head=2, n_embd=896, intermediate_size=4864,
                         vocab_size=151936, block_size=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_embeddings=True, qkv_bias=True),
    "qwen2.5-1.5b": dict(n_layer=28, n_head=12, n_kv_head=2, n_embd=1536, intermediate_size=8960,
                         vocab_size=151936, block_size=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_embeddings=True, qkv_bias=True),
    "qwen2.5-7b": dict(n_layer=28, n_head=28, n_kv_head=4, n_embd=3584, intermediate_size=18944,
                       vocab_size=152064, block_size=131072, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_embeddings=False, qkv_bias=True),
    "llama-3.1-8b": dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                         vocab_size=128256, block_size=131072, rope_theta=500000.0,
                         rms_norm_eps=1e-5, tie_embeddings=False,
                         rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0),
                                       ("low_freq_factor", 1.0),
                                       ("original_max_position_embeddings", 8192),
                                       ("rope_type", "llama3"))),
}


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a Llama-family model (Llama, SmolLM2, TinyLlama, Qwen2): RMSNorm, rotary
    position embeddings, a SwiGLU MLP and grouped-query attention.

    n_layer: blocks; n_head / n_kv_head: query / key-value heads (n_kv_head divides
    n_head); n_embd: hidden size; intermediate_size: the MLP's width; vocab_size; block_size:
    longest sequence (max_position_embeddings); head_dim (default n_embd // n_head);
    rope_theta and rope_scaling (Llama 3's, as sorted (key, value) pairs, or None);
    rms_norm_eps; tie_embeddings: the LM head is the token embedding; qkv_bias: biases on
    the q, k and v projections (Qwen2).
    """

    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    head_dim: int = None
    rope_theta: float = 10000.0
    rope_scaling: tuple = None
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False

    family = "llama"
    family_name = "Llama"
    presets = PRESETS
    norm_weights = ("rms1w", "rms2w", "rmsfw")
    biases = ("qkvb",)
    residual_projections = ()

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.n_embd // max(1, self.n_head))
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size",
                     "vocab_size", "block_size", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"LlamaConfig.{name} must be a positive number, got {value!r}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"LlamaConfig.n_kv_head ({self.n_kv_head}) must divide n_head "
                             f"({self.n_head})")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even for rotary embeddings, got "
                             f"{self.head_dim}")
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            needed = {"factor", "low_freq_factor", "high_freq_factor",
                      "original_max_position_embeddings"}
            if scaling.get("rope_type") != "llama3" or not needed <= set(scaling):
                raise ValueError(f"LlamaConfig.rope_scaling: only Llama 3's (rope_type "
                                 f"'llama3' with {sorted(needed)}) is supported, got {scaling}")

    @property
    def padded_vocab_size(self):
        return padded(self.vocab_size)

    @property
    def qkv_width(self):
        """Columns of the packed q|k|v projection: (n_head + 2 n_kv_head) head_dim."""
        return (self.n_head + 2 * self.n_kv_head) * self.head_dim

    @property
    def per_layer(self):
        names = ["rms1w", "qkvw"] + (["qkvb"] if self.qkv_bias else [])
        return tuple(names + ["attprojw", "rms2w", "gateupw", "downw"])

    def param_shapes(self):
        """Ordered dict name -> shape: wte, the blocks' parameters (q|k|v and gate|up each
        packed into one projection), rmsfw, and lm_head unless tied."""
        L, C, I, Vp = self.n_layer, self.n_embd, self.intermediate_size, self.padded_vocab_size
        shapes = {"wte": (Vp, C), "rms1w": (L, C), "qkvw": (L, self.qkv_width, C)}
        if self.qkv_bias:
            shapes["qkvb"] = (L, self.qkv_width)
        shapes.update({"attprojw": (L, C, self.n_head * self.head_dim), "rms2w": (L, C),
                       "gateupw": (L, 2 * I, C), "downw": (L, C, I), "rmsfw": (C,)})
        if not self.tie_embeddings:
            shapes["lm_head"] = (Vp, C)
        return shapes

    def describe(self):
        return (f"L={self.n_layer} H={self.n_head} KV={self.n_kv_head} C={self.n_embd} "
                f"I={self.intermediate_size} V={self.vocab_size}")

    @classmethod
    def preset(cls, name):
        try:
            return cls(**cls.presets[name])
        except KeyError:
            raise ValueError(f"unknown {cls.family_name} preset {name!r}; known presets: "
                             f"{', '.join(cls.presets)}") from None

    def preset_name(self):
        return next((name for name in self.presets if type(self).preset(name) == self), None)

    def to_dict(self):
        d = asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return d

    @classmethod
    def from_dict(cls, d):
        if not isinstance(d, dict):
            raise ValueError(f"LlamaConfig.from_dict needs a dict, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"LlamaConfig.from_dict: unknown keys {unknown}")
        return cls(**d)


class Rotary:
    """The rotary tables (cos, sin) of a config, each float32 (T, head_dim / 2), computed
    once for the longest sequence asked for."""

    def __init__(self, config):
        self.config = config
        self._tables = (0, None, None)

    def tables(self, T):
        """(cos, sin) with at least T rows: positions 0..T-1 and maybe more."""
        if self._tables[0] < T:
            cfg = self.config
            cos, sin = rope_tables(cfg.head_dim, T, cfg.rope_theta,
                                   dict(cfg.rope_scaling) if cfg.rope_scaling else None)
            self._tables = (T, cos, sin)
        return self._tables[1], self._tables[2]


class LlamaOps:
    """Llama's ``embed``, ``block`` and ``head`` in the operations ``f`` (``RECORDED`` for
    training, the decoder's for generation)."""

    def __init__(self, config, f=RECORDED):
        self.config = config
        self.f = f
        self.rotary = Rotary(config)

    def embed(self, inputs, leaves):
        return self.f.embed(inputs, leaves["wte"], None)

    def block(self, w, x):
        """One block: x + o(attention(rope(qkv(rmsnorm(x))))), then
        x + down(swiglu(gate|up(rmsnorm(x))))."""
        f, cfg = self.f, self.config
        h = f.rmsnorm(x, w["rms1w"], cfg.rms_norm_eps)
        qkv = f.linear(h, w["qkvw"], w.get("qkvb"))
        qkv = f.rope(qkv, self.rotary, cfg.n_head + cfg.n_kv_head)
        a = f.attention(qkv, cfg.n_head, cfg.n_kv_head)
        x = f.residual(x, f.linear(a, w["attprojw"], None))
        h = f.rmsnorm(x, w["rms2w"], cfg.rms_norm_eps)
        # The down projection recomputes swiglu(gate|up) in its backward rather than keep
        # it: I floats less per token and block (a fifth of SmolLM2's saved activations).
        return f.residual(x, f.swiglu_linear(f.linear(h, w["gateupw"], None), w["downw"]))

    def head(self, x, leaves):
        h = self.f.rmsnorm(x, leaves["rmsfw"], self.config.rms_norm_eps)
        return self.f.logits(h, leaves["wte" if self.config.tie_embeddings else "lm_head"])


# -- Hugging Face LlamaForCausalLM and Qwen2ForCausalLM ---------------------------------------

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
# The rotary settings we read, for the messages that refuse others.
ROPE_FORMS = ('null or an object with "rope_type" (or "type") "default", or "llama3" with '
              '"factor", "low_freq_factor", "high_freq_factor" and '
              '"original_max_position_embeddings"')


def _rope(hf):
    """(rope_theta, Llama 3's scaling or None): transformers 5 keeps the rotary settings in
    rope_parameters; earlier versions (and most config.json files published) in
    rope_theta and rope_scaling."""
    from gpt2.hf import number_field, shown, size_field
    key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    rope = hf.get(key)
    if rope is None:
        rope = {}
    if not isinstance(rope, dict):
        raise ValueError(f"{key} must be {ROPE_FORMS}; got {shown(rope)}")
    theta = number_field(hf, "rope_theta", None)
    if theta is None:
        theta = number_field(rope, "rope_theta", 10000.0, f"{key}.")
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
        scaling[name] = number_field(rope, name, None, f"{key}.")
    scaling["original_max_position_embeddings"] = size_field(
        rope, "original_max_position_embeddings", where=f"{key}.")
    return theta, scaling


def config_from_hf(hf, kind, config_class=LlamaConfig):
    """Our config from a Llama (``kind`` "llama") or Qwen2 ("qwen2") config.json; a field of
    the wrong type or value is refused by its name."""
    from gpt2.hf import number_field, shown, size_field
    n_layer, n_head, n_embd, intermediate_size, vocab_size, block_size = (
        size_field(hf, key) for key in ("num_hidden_layers", "num_attention_heads", "hidden_size",
                                   "intermediate_size", "vocab_size",
                                   "max_position_embeddings"))
    if hf.get("head_dim") is None and n_embd % n_head:
        raise ValueError(f"num_attention_heads ({n_head}) must divide hidden_size ({n_embd}) "
                         f"where head_dim is not given")
    head_dim = size_field(hf, "head_dim", n_embd // n_head)
    n_kv_head = size_field(hf, "num_key_value_heads", n_head)
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
        raise ValueError(f"tie_word_embeddings must be true or false, got {shown(tie)}")
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
    return config_class(
        n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd,
        intermediate_size=intermediate_size, vocab_size=vocab_size, block_size=block_size,
        head_dim=head_dim, rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=number_field(hf, "rms_norm_eps", 1e-6), tie_embeddings=tie,
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


def hf_tensors(config):
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


def import_hf_llama(directory, config=None, into=None):
    """A ParamArena from a Hugging Face Llama or Qwen2 directory (``config`` defaults to
    the one its config.json describes; the weights must match it exactly).  ``into``: a
    ``gpt2.lora.Bf16Base`` of ``config`` filled instead, one tensor at a time (no float32
    copy of the model)."""
    from gpt2.checkpoint import check_fits_in_memory
    from gpt2.hf import read_config, tensor_files
    from gpt2.params import ParamArena
    directory = os.fspath(directory)
    config = config or read_config(directory)
    files = tensor_files(directory)
    _check_sizes_against_weights(config, files, os.path.join(directory, "config.json"))
    names = {n for n in files if not n.endswith(IGNORED_SUFFIXES)}
    expected = hf_tensors(config)
    tied_head = config.tie_embeddings and GLOBAL_KEYS["lm_head"] in names
    missing = sorted(set(expected) - names)
    unknown = sorted(names - set(expected) - ({GLOBAL_KEYS["lm_head"]} if tied_head else set()))
    if missing or unknown:
        raise ValueError(f"{directory!r} does not hold the weights its config describes: "
                         f"missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
                         f"unexpected {unknown[:6]}{'...' if len(unknown) > 6 else ''}")
    check_fits_in_memory(config, directory, 4 if into is None else 2)
    arena = ParamArena(config) if into is None else into
    for name, (ours, layer, piece, shape) in expected.items():
        found = files[name].entries[name].shape
        if tuple(found) != shape:
            raise ValueError(f"{files[name].path!r}: tensor {name!r} has shape {list(found)}, "
                             f"expected {list(shape)}")
        view = arena.views[ours] if layer is None else arena.views[ours][layer]
        if view.dtype == np.uint16:
            from kernels.bf16 import to_bf16
            to_bf16(view[piece], np.ascontiguousarray(files[name].read(name)))
        else:
            view[piece] = files[name].read(name)
    if tied_head:
        head = files[GLOBAL_KEYS["lm_head"]].read(GLOBAL_KEYS["lm_head"])
        wte = arena.views["wte"][:config.vocab_size]
        if into is not None and wte.dtype == np.uint16:
            from kernels.bf16 import to_bf16
            rounded = np.empty(head.shape, np.uint16)
            to_bf16(rounded, np.ascontiguousarray(head))
            head, wte = rounded, wte
        if head.shape != (config.vocab_size, config.n_embd) or not np.array_equal(
                head, wte):
            raise ValueError(f"{directory!r}: config.json ties the embeddings, but "
                             f"lm_head.weight differs from the token embedding")
    return arena


def export_hf_llama(directory, params, dtype="F32", extra_config=None):
    """Write ``params`` as a Hugging Face directory (config.json, model.safetensors in
    ``dtype``: F32, F16 or BF16) that transformers loads with
    ``AutoModelForCausalLM.from_pretrained``; ``extra_config`` adds fields to config.json."""
    from gpt2.checkpoint import Deferred, atomic_writer, write_safetensors
    from gpt2.hf import WEIGHTS_NAME
    config = params.config
    os.makedirs(directory, exist_ok=True)
    def read(ours, layer, piece):
        return (params.views[ours] if layer is None else params.views[ours][layer])[piece]

    # Read as written: a gpt2.lora.MergedParams merges a block when it is written.
    tensors = {name: Deferred(shape, np.float32, functools.partial(read, ours, layer, piece))
               for name, (ours, layer, piece, shape) in hf_tensors(config).items()}
    write_safetensors(os.path.join(directory, WEIGHTS_NAME), tensors, metadata={"format": "pt"},
                      dtype=dtype)
    with atomic_writer(os.path.join(directory, "config.json")) as f:
        f.write(json.dumps({**hf_config_dict(config), **(extra_config or {})},
                           indent=2).encode("utf-8"))


class LlamaFamily(Family):
    config = LlamaConfig
    ops = LlamaOps
    hf_architectures = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
    hf_model_types = {"llama": "llama", "qwen2": "qwen2"}

    def config_from_hf(self, hf, variant):
        return config_from_hf(hf, variant, self.config)

    def hf_config_dict(self, config):
        return hf_config_dict(config)

    loads_into_bf16 = True

    def load_hf(self, directory, config, into=None):
        return import_hf_llama(directory, config, into)

    def save_hf(self, directory, params, dtype="F32", extra_config=None):
        export_hf_llama(directory, params, dtype=dtype, extra_config=extra_config)

    def lora_targets(self, config):
        q, kv = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
        C, I = config.n_embd, config.intermediate_size
        attn, mlp = "model.layers.{layer}.self_attn.", "model.layers.{layer}.mlp."
        return {"qkvw": (("q_proj", attn + "q_proj", 0, q), ("k_proj", attn + "k_proj", q, kv),
                         ("v_proj", attn + "v_proj", q + kv, kv)),
                "attprojw": (("o_proj", attn + "o_proj", 0, C),),
                "gateupw": (("gate_proj", mlp + "gate_proj", 0, I),
                            ("up_proj", mlp + "up_proj", I, I)),
                "downw": (("down_proj", mlp + "down_proj", 0, C),)}

    def spec_fields(self, config):
        """The sizes, key/value heads, head size, MLP width, tied head and q/k/v biases;
        RMSNorm, rotary positions, SwiGLU and no other biases."""
        fields = {k: getattr(config, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size",
                                                  "block_size")}
        fields.update(n_kv_head=config.n_kv_head, head_dim=config.head_dim,
                      intermediate_size=config.intermediate_size, norm="rmsnorm", mlp="swiglu",
                      positions="rope", tied_head=config.tie_embeddings, linear_bias=False,
                      qkv_bias=config.qkv_bias)
        return fields


FAMILY = LlamaFamily()
