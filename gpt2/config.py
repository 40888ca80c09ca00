"""GPT-2 model configuration: sizes, validation and the named presets."""
from dataclasses import asdict, dataclass, fields

VOCAB_PAD_MULTIPLE = 128

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

    @property
    def padded_vocab_size(self):
        """vocab_size rounded up to a multiple of 128 (rows of wte), as llm.c pads it."""
        m = VOCAB_PAD_MULTIPLE
        return (self.vocab_size + m - 1) // m * m

    @property
    def head_size(self):
        return self.n_embd // self.n_head

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
