"""What every family shares: the ``Family`` interface the rest of the package asks, and
``RECORDED``, the operations a family's forward pass is written in for training.

A family's ops (``embed``, ``block``, ``head``) are written once against an operations
object ``f``: ``RECORDED`` runs them as ``adtape.nn`` ops recorded on the tape (the tape
engine derives the backward pass), ``gpt2.generate.Decoder`` runs the same code on arrays
with attention over its key/value cache.  The operations:

* ``embed(ids, wte, wpe)``: token rows plus position rows (``wpe`` None: no positions)
* ``layernorm(x, weight, bias)``, ``rmsnorm(x, weight, eps)``
* ``linear(x, weight, bias)``, ``residual(x, y)`` (x + y), ``gelu(x)``
* ``swiglu_linear(gate_up, weight)``: ``linear(silu(gate) * up, weight, None)``
* ``rope(qkv, rotary, n_rot_heads)``: rotary embedding of the first heads of each row,
  the tables from ``rotary.tables(positions)``
* ``attention(qkv, n_head, n_kv_head=None)``: causal attention of the packed q|k|v rows
  (n_kv_head None: one key/value head per query head)
* ``logits(h, weight)``: the LM head's product
"""
import numpy as np

from adtape import nn

VOCAB_PAD_MULTIPLE = 128


def padded(vocab_size):
    """``vocab_size`` rounded up to a multiple of 128 (rows of wte), as llm.c pads it."""
    m = VOCAB_PAD_MULTIPLE
    return (vocab_size + m - 1) // m * m


class Recorded:
    """The operations as ``adtape.nn`` ops over (B, T, C) Tensors, recorded on the tape."""

    layernorm = staticmethod(nn.layernorm)
    rmsnorm = staticmethod(nn.rmsnorm)
    linear = staticmethod(nn.linear)
    residual = staticmethod(nn.residual)
    gelu = staticmethod(nn.gelu)
    swiglu_linear = staticmethod(nn.swiglu_linear)

    @staticmethod
    def embed(ids, wte, wpe):
        if wpe is None:
            # The encoder kernel adds a position row to each token's: here a zero row,
            # which costs one add per element and gives the embedding its in-place
            # row-scatter backward into the (possibly tied) token-embedding gradient.
            wpe = np.zeros((ids.shape[1], wte.shape[1]), np.float32)
        return nn.encoder(ids, wte, wpe)

    @staticmethod
    def rope(qkv, rotary, n_rot_heads):
        cos, sin = rotary.tables(qkv.shape[1])
        return nn.rope(qkv, cos, sin, n_rot_heads)

    @staticmethod
    def attention(qkv, n_head, n_kv_head=None):
        return nn.attention(qkv, n_head, n_kv_head=n_kv_head)

    @staticmethod
    def logits(h, weight):
        return nn.linear(h, weight, None)


RECORDED = Recorded()


class Family:
    """A model family as the rest of the package sees it.  A family module subclasses it
    (``config``: its config class, ``ops``: its ops class, and the Hugging Face and
    performance-model hooks) and ``gpt2.families`` registers one instance."""

    config = None           # the config class: a frozen dataclass with family, family_name, presets
    ops = None              # ops(config, f=RECORDED): embed(ids, leaves), block(w, x), head(x, leaves)
    hand_sequenced = False  # gpt2.model has llm.c's hand-written engine for it (engine="manual")
    loads_into_bf16 = False  # load_hf(..., into=Bf16Base) fills a bf16 base tensor by tensor
    # config.json "architectures" entries and "model_type" values it reads -> the variant
    # passed to config_from_hf.
    hf_architectures = {}
    hf_model_types = {}

    @property
    def name(self):
        """The registry's key, the configs' ``family``."""
        return self.config.family

    @property
    def title(self):
        """The family's name for people ("GPT-2")."""
        return self.config.family_name

    @property
    def presets(self):
        """Preset name -> sizes."""
        return self.config.presets

    def config_from_hf(self, hf, variant):
        """Our config from a Hugging Face config.json (a dict), or a ValueError naming the
        field that is wrong."""
        raise NotImplementedError(f"the {self.title} family reads no Hugging Face config.json")

    def hf_config_dict(self, config):
        """config.json describing ``config``."""
        raise NotImplementedError(f"the {self.title} family writes no Hugging Face config.json")

    def load_hf(self, directory, config):
        """A ParamArena of ``config`` from a Hugging Face model directory."""
        raise NotImplementedError(f"the {self.title} family reads no Hugging Face directory")

    def save_hf(self, directory, params, dtype="F32", extra_config=None):
        """Write ``params`` as a Hugging Face model directory (config.json and weights in
        ``dtype``, a safetensors float name; ``extra_config``: fields added to config.json)."""
        raise NotImplementedError(f"the {self.title} family writes no Hugging Face directory")

    def lora_targets(self, config):
        """What LoRA can adapt: ``{our weight: ((module, hf_module, start, rows), ...)}``,
        each projection a weight of ours packs (its output rows ``start:start + rows``):
        ``module`` the name peft's ``target_modules`` matches, ``hf_module`` its full
        Hugging Face module path with ``{layer}`` for the block."""
        raise NotImplementedError(f"the {self.title} family has no LoRA targets")

    def spec_fields(self, config):
        """The ``gpt2.perfmodel.ModelSpec`` fields of ``config``."""
        raise NotImplementedError(f"the {self.title} family has no performance-model spec")

    def __repr__(self):
        return f"<family {self.name}: {', '.join(self.presets)}>"
