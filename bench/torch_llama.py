"""PyTorch Llama-family reference built from our parameter layout (baseline for benchmarks).

A plain eager-mode model, as one would write it by hand: ``nn.RMSNorm``, one
``nn.Linear`` for the packed q|k|v projection and one for gate|up (our layout, Hugging
Face's row order, so the weights copy over as they are), rotary embeddings in the
rotate-half convention from tables computed once, ``F.scaled_dot_product_attention(...,
is_causal=True, enable_gqa=True)``, ``F.silu``, a tied or separate LM head.  Weights come
from a ``ParamArena`` (or dict name -> array) of a ``LlamaConfig``; logits cover the
padded vocabulary, the loss only its first vocab_size columns.

``build_transformers`` gives the other baseline, transformers' own model of the config
loaded from our weights, behind the same ``forward(idx, targets)``.  Training either
uses ``torch_gpt2``'s ``make_adamw`` and ``train_step``.
"""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_gpt2 import LayoutModule


def rotary_tables(config, T):
    """(cos, sin), float32 (T, head_dim): Hugging Face's default rope, each angle t *
    inv_freq repeated for both halves of a head."""
    if config.rope_scaling is not None:
        raise ValueError(f"torch_llama supports the default rope only, got rope_scaling "
                         f"{dict(config.rope_scaling)}")
    hd = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        C, hd, I = config.n_embd, config.head_dim, config.intermediate_size
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, hd
        self.rms1 = nn.RMSNorm(C, eps=config.rms_norm_eps)
        self.qkv = nn.Linear(C, config.qkv_width, bias=config.qkv_bias)
        self.attproj = nn.Linear(config.n_head * hd, C, bias=False)
        self.rms2 = nn.RMSNorm(C, eps=config.rms_norm_eps)
        self.gateup = nn.Linear(C, 2 * I, bias=False)
        self.down = nn.Linear(I, C, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        hd = self.head_dim
        q, k, v = self.qkv(self.rms1(x)).split(
            (self.n_head * hd, self.n_kv_head * hd, self.n_kv_head * hd), dim=2)
        # (B, T, heads * hd) -> (B, heads, T, hd)
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, hd).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.attproj(att.transpose(1, 2).reshape(B, T, self.n_head * hd))
        gate, up = self.gateup(self.rms2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


# our stacked per-layer name -> (block attribute, "weight" or "bias")
LAYER_PARAMS = {
    "rms1w": ("rms1", "weight"), "qkvw": ("qkv", "weight"), "qkvb": ("qkv", "bias"),
    "attprojw": ("attproj", "weight"), "rms2w": ("rms2", "weight"),
    "gateupw": ("gateup", "weight"), "downw": ("down", "weight"),
}


class TorchLlama(LayoutModule):
    LAYER_PARAMS = LAYER_PARAMS

    def __init__(self, config):
        super().__init__()
        self.config = config
        C, Vp = config.n_embd, config.padded_vocab_size
        self.wte = nn.Parameter(torch.zeros(Vp, C))
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.rmsf = nn.RMSNorm(C, eps=config.rms_norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Parameter(torch.zeros(Vp, C))
        self._rotary = (0, None, None)

    def rotary(self, T):
        if self._rotary[0] < T:
            self._rotary = (T, *rotary_tables(self.config, T))
        return self._rotary[1][:T], self._rotary[2][:T]

    def forward(self, idx, targets=None):
        """logits (B, T, Vp) and, with targets, the mean cross-entropy over the real vocab."""
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        cos, sin = self.rotary(T)
        x = F.embedding(idx, self.wte)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = F.linear(self.rmsf(x), self.wte if self.lm_head is None else self.lm_head)
        return self._with_loss(logits, targets)

    def _global_param(self, name):
        return {"wte": self.wte, "rmsfw": self.rmsf.weight, "lm_head": self.lm_head}[name]


def build_model(config, params, dtype=torch.float32):
    """TorchLlama with weights copied from our layout (ParamArena or dict name -> array)."""
    return TorchLlama(config).to(dtype).load_layout_(params)


class TransformersLM(nn.Module):
    """transformers' ``LlamaForCausalLM`` (or ``Qwen2ForCausalLM``) behind this module's
    ``forward(idx, targets) -> (logits, loss)``, the loss computed as ours (no shift: the
    targets are the next tokens already)."""

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model

    def forward(self, idx, targets=None):
        logits = self.hf(input_ids=idx).logits
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_transformers(config, params, attn_implementation="sdpa"):
    """transformers' model of ``config`` (``gpt2.hf.hf_config_dict``), loaded the way users
    load one: ``from_pretrained`` on a directory ``gpt2.hf.save_dir`` writes from ``params``;
    every key must load (none missing, unexpected or mismatched).  Returns a TransformersLM
    in training mode."""
    import tempfile

    import transformers

    from gpt2 import hf
    cls = getattr(transformers, hf.hf_config_dict(config)["architectures"][0])
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as directory:
        hf.save_dir(directory, params)
        model, info = cls.from_pretrained(directory, attn_implementation=attn_implementation,
                                          dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys",
                                                        "mismatched_keys")}
    if bad:
        raise RuntimeError(f"transformers did not load every weight of our model: {bad}")
    return TransformersLM(model.train())
