"""Model configurations of the two families, GPT-2 and Llama: sizes, validation, the
named presets and the parameter layout each family's arenas are carved into.

A config is plain data (frozen dataclass).  What the rest of the code needs to know of
a family's parameters it asks the config: ``param_shapes()`` (name -> shape, in file
order), ``per_layer`` (the names with one slice per block), ``norm_weights``,
``biases`` and ``residual_projections`` (how initialization treats them).
"""
import math
from dataclasses import asdict, dataclass, fields

VOCAB_PAD_MULTIPLE = 128


def _padded(vocab_size):
    m = VOCAB_PAD_MULTIPLE
    return (vocab_size + m - 1) // m * m

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
        return _padded(self.vocab_size)

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

    def describe(self):
        return f"L={self.n_layer} H={self.n_head} C={self.n_embd} V={self.vocab_size}"

    @classmethod
    def preset(cls, name):
        """The named configuration: one of tiny, small, gpt2, gpt2-medium, gpt2-large, gpt2-xl."""
        try:
            sizes = PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown GPT-2 preset {name!r}; known presets: "
                             f"{', '.join(PRESETS)}") from None
        return cls(**sizes)

    def preset_name(self):
        """The name of the preset with exactly these sizes, or None."""
        return next((name for name, sizes in PRESETS.items() if sizes == self.to_dict()), None)

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


# Published configurations (config.json of each model's Hugging Face repository);
# llama-tiny is ours, for tests: a few layers with grouped-query attention.
LLAMA_PRESETS = {
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
        return _padded(self.vocab_size)

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
            return cls(**LLAMA_PRESETS[name])
        except KeyError:
            raise ValueError(f"unknown Llama preset {name!r}; known presets: "
                             f"{', '.join(LLAMA_PRESETS)}") from None

    def preset_name(self):
        return next((name for name in LLAMA_PRESETS if LlamaConfig.preset(name) == self), None)

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


ALL_PRESETS = {**{name: GPT2Config for name in PRESETS},
               **{name: LlamaConfig for name in LLAMA_PRESETS}}


def preset(name):
    """The configuration of any family's preset (``gpt2``, ``smollm2-135m``, ...)."""
    if name not in ALL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: "
                         f"{', '.join(ALL_PRESETS)}")
    return ALL_PRESETS[name].preset(name)


def config_from_dict(d):
    """A config of either family from its ``to_dict()`` form (a Llama config has
    ``n_kv_head``)."""
    return (LlamaConfig if isinstance(d, dict) and "n_kv_head" in d else GPT2Config).from_dict(d)
