"""The Llama family's block in adtape ops: RMSNorm, rotary embeddings on the packed q|k|v
projection, grouped-query causal attention and a SwiGLU MLP, each a kernel pair from
``kernels`` behind an ``adtape.nn`` op, so the tape derives the backward pass.

The same code is GPT-2's in ``gpt2.tape_engine``: ``embed``, ``block`` and ``head``
differ by family, the engine around them (leaves over the arenas, checkpointing, the
tape, the sweep) does not.
"""
import numpy as np

from adtape import nn
from kernels.llama import rope_tables


class LlamaOps:
    """``embed(inputs, leaves)``, ``block(w, x)`` and ``head(x, leaves)`` of a Llama config;
    the rotary tables are computed once per sequence length."""

    def __init__(self, config):
        self.config = config
        self._tables = (0, None, None)

    def rotary(self, T):
        """(cos, sin) for positions 0..T-1, float32 (T, head_dim / 2)."""
        if self._tables[0] < T:
            cfg = self.config
            cos, sin = rope_tables(cfg.head_dim, T, cfg.rope_theta,
                                   dict(cfg.rope_scaling) if cfg.rope_scaling else None)
            self._tables = (T, cos, sin)
        return self._tables[1], self._tables[2]

    def embed(self, inputs, leaves):
        # The encoder kernel adds a position row to each token's: here a zero row, which
        # costs one add per element and gives the embedding its in-place row-scatter
        # backward into the (possibly tied) token-embedding gradient.
        T = inputs.shape[1]
        return nn.encoder(inputs, leaves["wte"], np.zeros((T, self.config.n_embd), np.float32))

    def block(self, w, x):
        """One block: x + o(attention(rope(qkv(rmsnorm(x))))), then
        x + down(swiglu(gate|up(rmsnorm(x))))."""
        cfg = self.config
        cos, sin = self.rotary(x.shape[1])
        h = nn.rmsnorm(x, w["rms1w"], cfg.rms_norm_eps)
        qkv = nn.linear(h, w["qkvw"], w.get("qkvb"))
        qkv = nn.rope(qkv, cos, sin, cfg.n_head + cfg.n_kv_head)
        a = nn.attention(qkv, cfg.n_head, n_kv_head=cfg.n_kv_head)
        x = nn.residual(x, nn.linear(a, w["attprojw"], None))
        h = nn.rmsnorm(x, w["rms2w"], cfg.rms_norm_eps)
        # The down projection recomputes swiglu(gate|up) in its backward rather than keep
        # it: I floats less per token and block (a fifth of SmolLM2's saved activations).
        return nn.residual(x, nn.swiglu_linear(nn.linear(h, w["gateupw"], None), w["downw"]))

    def head(self, x, leaves):
        h = nn.rmsnorm(x, leaves["rmsfw"], self.config.rms_norm_eps)
        return nn.linear(h, leaves["wte" if self.config.tie_embeddings else "lm_head"], None)
