"""The GPT-2 family: its config and presets, its block (LayerNorm, learned positions, a GELU
MLP, biases, the token embedding as LM head), its Hugging Face GPT-2 key map and the
header of llm.c's model files, whose parameter order is ours.
"""
import json
import os
from dataclasses import asdict, dataclass, fields

import numpy as np

from gpt2.families.base import RECORDED, Family, padded

PRESETS = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=64),
    "small": dict(n_layer=4, n_head=4, n_embd=128, vocab_size=256, block_size=128),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, vocab_size=50257, block_size=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, vocab_size=50257, block_size=1024),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, vocab_size=50257, block_size=1024),
}


@dataclass(frozen=True)
class GPT2Config:
    """Sizes of a GPT-2 model; immutable so a config shared by model, data and checkpoint cannot drift.

    n_layer: transformer blocks (L); n_head: attention heads (NH); n_embd: channels (C);
    vocab_size: real vocabulary (V); block_size: longest sequence, rows of wpe (maxT).
    """

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    block_size: int

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            # bool is an int subclass; True as a layer count is a bug, not a size.
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"GPT2Config.{f.name} must be an int, got {value!r} "
                                 f"({type(value).__name__})")
            if value <= 0:
                raise ValueError(f"GPT2Config.{f.name} must be positive, got {value}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"GPT2Config.n_embd ({self.n_embd}) must be divisible by "
                             f"n_head ({self.n_head})")

    family = "gpt2"
    family_name = "GPT-2"
    presets = PRESETS
    # Parameter names (llm.c order); those between wte/wpe and lnfw/lnfb are per block.
    per_layer = ("ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
                 "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb")
    norm_weights = ("ln1w", "ln2w", "lnfw")
    biases = ("ln1b", "qkvb", "attprojb", "ln2b", "fcb", "fcprojb", "lnfb")
    # Residual-stream output projections: GPT-2 scales their init by 1/sqrt(2 * n_layer).
    residual_projections = ("attprojw", "fcprojw")

    @property
    def padded_vocab_size(self):
        """vocab_size rounded up to a multiple of 128 (rows of wte), as llm.c pads it."""
        return padded(self.vocab_size)

    def param_shapes(self):
        """Ordered dict name -> shape of every parameter tensor, in llm.c order."""
        L, C, Vp, maxT = self.n_layer, self.n_embd, self.padded_vocab_size, self.block_size
        return {
            "wte": (Vp, C), "wpe": (maxT, C),
            "ln1w": (L, C), "ln1b": (L, C),
            "qkvw": (L, 3 * C, C), "qkvb": (L, 3 * C),
            "attprojw": (L, C, C), "attprojb": (L, C),
            "ln2w": (L, C), "ln2b": (L, C),
            "fcw": (L, 4 * C, C), "fcb": (L, 4 * C),
            "fcprojw": (L, C, 4 * C), "fcprojb": (L, C),
            "lnfw": (C,), "lnfb": (C,),
        }

    @property
    def head_size(self):
        return self.n_embd // self.n_head

    # Multi-head attention is grouped-query attention with a key/value head per query head.
    head_dim = head_size

    @property
    def n_kv_head(self):
        return self.n_head

    def describe(self):
        return f"L={self.n_layer} H={self.n_head} C={self.n_embd} V={self.vocab_size}"

    @classmethod
    def preset(cls, name):
        """The named configuration: one of tiny, small, gpt2, gpt2-medium, gpt2-large, gpt2-xl."""
        try:
            sizes = cls.presets[name]
        except KeyError:
            raise ValueError(f"unknown {cls.family_name} preset {name!r}; known presets: "
                             f"{', '.join(cls.presets)}") from None
        return cls(**sizes)

    def preset_name(self):
        """The name of the preset with exactly these sizes, or None."""
        return next((name for name, sizes in self.presets.items() if sizes == self.to_dict()),
                    None)

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        """Config from a dict with exactly the five size keys (as written by to_dict)."""
        if not isinstance(d, dict):
            raise ValueError(f"GPT2Config.from_dict needs a dict, got {type(d).__name__}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in d]
        unknown = [k for k in d if k not in names]
        if missing or unknown:
            raise ValueError(f"GPT2Config.from_dict: missing keys {missing}, unknown keys {unknown}")
        return cls(**d)


class GPT2Ops:
    """GPT-2's ``embed``, ``block`` and ``head`` in the operations ``f`` (``RECORDED`` for
    training, the decoder's for generation)."""

    def __init__(self, config, f=RECORDED):
        self.config = config
        self.f = f

    def embed(self, inputs, leaves):
        return self.f.embed(inputs, leaves["wte"], leaves["wpe"])

    def block(self, w, x):
        """Transformer block: pre-norm attention and MLP, each with a residual."""
        f = self.f
        h = f.layernorm(x, w["ln1w"], w["ln1b"])
        qkv = f.linear(h, w["qkvw"], w["qkvb"])
        a = f.attention(qkv, self.config.n_head)
        x = f.residual(x, f.linear(a, w["attprojw"], w["attprojb"]))
        h = f.layernorm(x, w["ln2w"], w["ln2b"])
        h = f.gelu(f.linear(h, w["fcw"], w["fcb"]))
        return f.residual(x, f.linear(h, w["fcprojw"], w["fcprojb"]))

    def head(self, x, leaves):
        h = self.f.layernorm(x, leaves["lnfw"], leaves["lnfb"])
        return self.f.logits(h, leaves["wte"])


# -- Hugging Face GPT-2 (transformers' GPT2Model / GPT2LMHeadModel names) ----------------------

# our per-layer name -> (HF suffix under h.{i}., transposed: HF Conv1D stores (in, out))
HF_LAYER_NAMES = {
    "ln1w": ("ln_1.weight", False), "ln1b": ("ln_1.bias", False),
    "qkvw": ("attn.c_attn.weight", True), "qkvb": ("attn.c_attn.bias", False),
    "attprojw": ("attn.c_proj.weight", True), "attprojb": ("attn.c_proj.bias", False),
    "ln2w": ("ln_2.weight", False), "ln2b": ("ln_2.bias", False),
    "fcw": ("mlp.c_fc.weight", True), "fcb": ("mlp.c_fc.bias", False),
    "fcprojw": ("mlp.c_proj.weight", True), "fcprojb": ("mlp.c_proj.bias", False),
}
HF_GLOBAL_NAMES = {"wpe": "wpe.weight", "lnfw": "ln_f.weight", "lnfb": "ln_f.bias"}
_HF_PREFIX = "transformer."
_HF_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers, not parameters
# config.json's GPT-2 sizes and ours.
_HF_GPT2_SIZES = (("n_layer", "n_layer"), ("n_embd", "n_embd"), ("vocab_size", "vocab_size"),
                  ("n_positions", "block_size"))


def hf_config_dict(config):
    """A transformers GPT2Config (config.json) describing our model."""
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
            "n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd,
            "vocab_size": config.vocab_size, "n_positions": config.block_size,
            "n_ctx": config.block_size, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}


def config_from_hf(hf):
    """Our config from a GPT-2 config.json; a field of the wrong type or value is refused by
    its name."""
    from gpt2.hf import size_field
    sizes = {key: size_field(hf, key) for key in ("n_layer", "n_head", "n_embd", "vocab_size",
                                             "n_positions")}
    if sizes["n_embd"] % sizes["n_head"]:
        raise ValueError(f"n_head ({sizes['n_head']}) must divide n_embd ({sizes['n_embd']})")
    return GPT2Config(n_layer=sizes["n_layer"], n_head=sizes["n_head"], n_embd=sizes["n_embd"],
                      vocab_size=sizes["vocab_size"], block_size=sizes["n_positions"])


def export_hf_gpt2(path, params, write_config=False, dtype="F32", extra_config=None):
    """Write ``params`` as a Hugging Face GPT-2 ``model.safetensors`` (no prefix) in
    ``dtype`` (F32, F16 or BF16).

    wte is written with its vocab_size real rows. With write_config, a ``config.json`` is
    written beside it so the directory loads with ``GPT2LMHeadModel.from_pretrained``, with
    ``extra_config`` (e.g. torch_dtype, the special-token ids) added to its fields.
    """
    from gpt2.checkpoint import atomic_writer, hf_config_path, write_safetensors
    from gpt2.params import ParamArena
    if hasattr(params, "to_arena") and not isinstance(params, ParamArena):
        params = params.to_arena()      # a merged LoRA model (at most GPT-2 XL's 6 GB)
    if not isinstance(params, ParamArena):
        raise TypeError(f"params must be a ParamArena, got {type(params).__name__}")
    c = params.config
    tensors = {"wte.weight": params.wte[:c.vocab_size]}
    tensors["wpe.weight"] = params.wpe
    for i in range(c.n_layer):
        for ours, (suffix, transposed) in HF_LAYER_NAMES.items():
            w = params.views[ours][i]
            tensors[f"h.{i}.{suffix}"] = w.T if transposed else w
    tensors["ln_f.weight"] = params.lnfw
    tensors["ln_f.bias"] = params.lnfb
    write_safetensors(path, tensors, metadata={"format": "pt"}, dtype=dtype)
    if write_config:
        with atomic_writer(hf_config_path(path)) as f:
            f.write(json.dumps({**hf_config_dict(c), **(extra_config or {})},
                               indent=2).encode("utf-8"))


def _hf_n_head(path, n_head, inferred):
    """n_head from the argument or from config.json beside the file (weights cannot tell it)."""
    from gpt2.checkpoint import hf_config_path
    if n_head is not None:
        return n_head
    config_path = hf_config_path(path)
    if not os.path.exists(config_path):
        raise ValueError(f"cannot tell n_head of {path!r}: pass n_head= or config=, or put the "
                         "model's config.json beside it")
    try:
        with open(config_path, "rb") as f:
            hf = json.load(f)
        n_head = int(hf["n_head"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{config_path!r} is not a GPT-2 config.json with n_head: {e}") from None
    for key, ours in _HF_GPT2_SIZES:
        if key in hf and hf[key] != inferred[ours]:
            raise ValueError(f"{config_path!r} says {key}={hf[key]}, but {path!r} holds "
                             f"weights for {ours}={inferred[ours]}")
    return n_head


def import_hf_gpt2(path, config=None, n_head=None):
    """Read a Hugging Face GPT-2 ``model.safetensors`` into a new ParamArena.

    Names may carry the ``transformer.`` prefix (GPT2LMHeadModel) or not (GPT2Model); the
    attention mask buffers are ignored; an ``lm_head.weight`` must equal wte (tied).
    Sizes come from the weights; n_head from ``config``, ``n_head`` or ``config.json`` beside
    the file. F32, F16, BF16 and F64 tensors are converted to float32.
    """
    from gpt2.checkpoint import SafetensorsFile, check_fits_in_memory
    from gpt2.params import ParamArena
    st = SafetensorsFile(path)
    names, lm_head = {}, None
    for full in st.entries:
        name = full[len(_HF_PREFIX):] if full.startswith(_HF_PREFIX) else full
        if name.endswith(_HF_BUFFERS):
            continue
        if name == "lm_head.weight":
            lm_head = full
            continue
        if name in names:
            raise ValueError(f"safetensors file {st.path!r} holds {name!r} twice (with and "
                             "without the transformer. prefix)")
        names[name] = full
    if "wte.weight" not in names or "wpe.weight" not in names:
        raise ValueError(f"{st.path!r} is not a GPT-2 model: it lacks wte.weight/wpe.weight "
                         f"(tensors: {sorted(st.entries)[:8]}...)")
    vocab, n_embd = (st.entries[names["wte.weight"]].shape + (0, 0))[:2]
    block = st.entries[names["wpe.weight"]].shape[0]
    layers = {int(n.split(".")[1]) for n in names if n.startswith("h.") and n.split(".")[1].isdigit()}
    n_layer = len(layers)
    if layers != set(range(n_layer)):
        raise ValueError(f"safetensors file {st.path!r}: layer indices {sorted(layers)} are not "
                         f"0..{n_layer - 1}")
    inferred = dict(n_layer=n_layer, n_embd=n_embd, vocab_size=vocab, block_size=block)
    if config is None:
        try:
            config = GPT2Config(n_head=_hf_n_head(st.path, n_head, inferred), **inferred)
        except ValueError as e:
            raise ValueError(f"{st.path!r}: cannot build a GPT-2 config from its weights: "
                             f"{e}") from None
    else:
        for key, ours in _HF_GPT2_SIZES:
            if getattr(config, ours) != inferred[ours]:
                raise ValueError(f"{st.path!r} holds weights for {key}={inferred[ours]}, "
                                 f"not the {key}={getattr(config, ours)} of its config")
    C = config.n_embd
    expected = {"wte.weight": (config.vocab_size, C), "wpe.weight": (config.block_size, C),
                "ln_f.weight": (C,), "ln_f.bias": (C,)}
    layer_shapes = {"ln1w": (C,), "ln1b": (C,), "qkvw": (C, 3 * C), "qkvb": (3 * C,),
                    "attprojw": (C, C), "attprojb": (C,), "ln2w": (C,), "ln2b": (C,),
                    "fcw": (C, 4 * C), "fcb": (4 * C,), "fcprojw": (4 * C, C), "fcprojb": (C,)}
    for i in range(config.n_layer):
        for ours, (suffix, _) in HF_LAYER_NAMES.items():
            expected[f"h.{i}.{suffix}"] = layer_shapes[ours]
    missing = sorted(set(expected) - set(names))
    unknown = sorted(set(names) - set(expected))
    if missing or unknown:
        raise ValueError(f"safetensors file {st.path!r} does not match GPT-2 {config}: missing "
                         f"{missing[:8]}, unexpected {unknown[:8]}")
    for name, shape in expected.items():
        found = st.entries[names[name]].shape
        if found != shape:
            raise ValueError(f"safetensors file {st.path!r}: tensor {names[name]!r} has shape "
                             f"{list(found)}, expected {list(shape)}")

    check_fits_in_memory(config, st.path)
    arena = ParamArena(config)
    arena.wte[:config.vocab_size] = st.read(names["wte.weight"])
    for ours, hf in HF_GLOBAL_NAMES.items():
        arena.views[ours][...] = st.read(names[hf])
    for i in range(config.n_layer):
        for ours, (suffix, transposed) in HF_LAYER_NAMES.items():
            w = st.read(names[f"h.{i}.{suffix}"])
            arena.views[ours][i] = w.T if transposed else w
    if lm_head is not None:
        head = st.read(lm_head)
        if head.shape != (config.vocab_size, C) or not np.array_equal(
                head, arena.wte[:config.vocab_size]):
            raise ValueError(f"safetensors file {st.path!r}: lm_head.weight differs from "
                             "wte.weight; only tied GPT-2 heads are supported")
    return arena


# -- llm.c model files (gpt2_124M.bin) ------------------------------------------------------

# The header's sizes after its magic and version, in order; the parameters follow in ours.
LLMC_HEADER = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "padded_vocab_size")


class GPT2Family(Family):
    config = GPT2Config
    ops = GPT2Ops
    hand_sequenced = True
    hf_architectures = {"GPT2LMHeadModel": "gpt2"}
    hf_model_types = {"gpt2": "gpt2"}

    def config_from_hf(self, hf, variant):
        return config_from_hf(hf)

    def hf_config_dict(self, config):
        return hf_config_dict(config)

    def load_hf(self, directory, config):
        from gpt2.hf import WEIGHTS_NAME, tensor_files
        tensor_files(directory)     # refuses shards that disagree with model.safetensors
        single = os.path.join(directory, WEIGHTS_NAME)
        if not os.path.exists(single):
            raise ValueError(f"{directory!r}: a GPT-2 model is read from {WEIGHTS_NAME}; "
                             f"sharded GPT-2 directories are not supported")
        return import_hf_gpt2(single, config=config)

    def save_hf(self, directory, params, dtype="F32", extra_config=None):
        from gpt2.hf import WEIGHTS_NAME
        os.makedirs(directory, exist_ok=True)
        export_hf_gpt2(os.path.join(directory, WEIGHTS_NAME), params, write_config=True,
                       dtype=dtype, extra_config=extra_config)

    def lora_targets(self, config):
        C = config.n_embd
        block = "transformer.h.{layer}."
        return {"qkvw": (("c_attn", block + "attn.c_attn", 0, 3 * C),),
                "attprojw": (("c_proj", block + "attn.c_proj", 0, C),),
                "fcw": (("c_fc", block + "mlp.c_fc", 0, 4 * C),),
                "fcprojw": (("c_proj", block + "mlp.c_proj", 0, C),)}

    def spec_fields(self, config):
        return {k: getattr(config, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size",
                                                "block_size")}


FAMILY = GPT2Family()
