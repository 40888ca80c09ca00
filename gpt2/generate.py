"""Autoregressive generation with a key/value cache, for both families.

``Decoder`` runs a model's forward pass over one sequence a chunk at a time (the prompt
in one pass, then one token per step) and keeps every layer's keys and values, so a step
costs one pass over the weights, not a forward over the whole context.  It reads the
model's parameter arena as it is (q|k|v rows packed in ``qkvw``, gate|up in ``gateupw``)
and calls the training kernels for the projections, norms, GELU, rotary embedding and
SwiGLU; only the attention of the new rows over the cache is NumPy.

Each token is conditioned on the last ``block_size`` tokens, as the full forward over
them would be.  Once the sequence outgrows block_size the window slides, and a cache is of
no more use: the keys and values of every layer past the first depend on the token that
just left the window (and with GPT-2's learned positions every position moves too).  So
from then on ``generate`` runs the model's full forward over the window, once per token.

``generate`` picks each token as ``gpt2.train`` always has: the logits divided by the
temperature, cut to the ``top_k`` likeliest, one ``rng.choice`` per token; temperature 0
takes the likeliest token and draws nothing.
"""
import numpy as np

from kernels import layers, llama, matmul
from kernels.llama import rope_tables


class Decoder:
    """The forward pass of one sequence, a chunk at a time, with a key/value cache of
    ``capacity`` positions (at most the model's block_size)."""

    def __init__(self, model, capacity=None):
        cfg = model.config
        self.config = cfg
        self.views = model.param_arena().views
        self.rotary = cfg.family == "llama"
        self.n_kv_head = cfg.n_kv_head if self.rotary else cfg.n_head
        self.head_dim = cfg.head_dim if self.rotary else cfg.head_size
        self.capacity = cfg.block_size if capacity is None else min(cfg.block_size, capacity)
        if self.capacity < 1:
            raise ValueError(f"Decoder capacity must be at least 1, got {capacity}")
        shape = (cfg.n_layer, self.n_kv_head, self.capacity, self.head_dim)
        self.keys = np.empty(shape, np.float32)
        self.values = np.empty(shape, np.float32)
        self._cos = self._sin = np.empty((0, self.head_dim // 2), np.float32)
        self.length = 0         # positions held, the position of the next token

    @property
    def full(self):
        return self.length == self.capacity

    def extend(self, ids, all_positions=False):
        """Run the tokens ``ids`` at the next positions; their keys and values join the
        cache.  Returns float32 logits over the vocabulary: of the last token (1, V), or of
        every one of ``ids`` (n, V) with ``all_positions``."""
        cfg = self.config
        ids = np.asarray(ids)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"Decoder.extend needs a non-empty 1-D sequence of token ids, "
                             f"got {ids.dtype} array of shape {ids.shape}")
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}), got ids in "
                             f"[{ids.min()}, {ids.max()}]")
        if self.length + ids.size > self.capacity:
            raise ValueError(f"{ids.size} more token(s) overflow the cache of {self.capacity} "
                             f"positions ({self.length} held)")
        x = self._embed(ids)
        for layer in range(cfg.n_layer):
            x = self._block(layer, x)
        self.length += ids.size
        return self._head(x if all_positions else x[-1:])

    # -- the two families ---------------------------------------------------------

    def _embed(self, ids):
        v, p = self.views, self.length
        x = v["wte"][ids]
        if not self.rotary:
            x += v["wpe"][p:p + ids.size]
        return x

    def _block(self, layer, x):
        v = self.views
        if not self.rotary:
            h = _layernorm(x, v["ln1w"][layer], v["ln1b"][layer])
            qkv = _linear(h, v["qkvw"][layer], v["qkvb"][layer])
            x += _linear(self._attend(layer, qkv), v["attprojw"][layer], v["attprojb"][layer])
            h = _linear(_layernorm(x, v["ln2w"][layer], v["ln2b"][layer]), v["fcw"][layer],
                        v["fcb"][layer])
            gelu = np.empty_like(h)
            layers.gelu_forward(gelu, h)
            x += _linear(gelu, v["fcprojw"][layer], v["fcprojb"][layer])
            return x
        cfg = self.config
        h = _rmsnorm(x, v["rms1w"][layer], cfg.rms_norm_eps)
        qkv = _linear(h, v["qkvw"][layer], v["qkvb"][layer] if cfg.qkv_bias else None)
        cos, sin = self._rotary_tables()
        rows = qkv.reshape(1, *qkv.shape)
        llama.rope_forward(rows, rows, cos[self.length:], sin[self.length:],
                           cfg.n_head + cfg.n_kv_head)
        x += _linear(self._attend(layer, qkv), v["attprojw"][layer], None)
        gate_up = _linear(_rmsnorm(x, v["rms2w"][layer], cfg.rms_norm_eps), v["gateupw"][layer],
                          None)
        swiglu = np.empty((x.shape[0], cfg.intermediate_size), np.float32)
        llama.swiglu_forward(swiglu, gate_up)
        x += _linear(swiglu, v["downw"][layer], None)
        return x

    def _head(self, x):
        cfg, v = self.config, self.views
        if self.rotary:
            h = _rmsnorm(x, v["rmsfw"], cfg.rms_norm_eps)
            weight = v["wte" if cfg.tie_embeddings else "lm_head"]
        else:
            h = _layernorm(x, v["lnfw"], v["lnfb"])
            weight = v["wte"]
        return _linear(h, weight[:cfg.vocab_size], None)

    def _rotary_tables(self):
        """cos, sin of the cache's positions, computed on first use."""
        if self._cos.shape[0] < self.capacity:
            cfg = self.config
            self._cos, self._sin = rope_tables(
                self.head_dim, self.capacity, cfg.rope_theta,
                dict(cfg.rope_scaling) if cfg.rope_scaling else None)
        return self._cos, self._sin

    # -- attention over the cache -------------------------------------------------

    def _attend(self, layer, qkv):
        """Causal attention of the new rows ``qkv`` (n, (H + 2 KV) hd) over the cache,
        after storing their keys and values in it; (n, H hd)."""
        n, hd, kv = qkv.shape[0], self.head_dim, self.n_kv_head
        n_q = qkv.shape[1] // hd - 2 * kv
        group = n_q // kv
        start, held = self.length, self.length + n
        keys, values = self.keys[layer], self.values[layer]
        keys[:, start:held] = qkv[:, n_q * hd:(n_q + kv) * hd].reshape(n, kv, hd).transpose(1, 0, 2)
        values[:, start:held] = qkv[:, (n_q + kv) * hd:].reshape(n, kv, hd).transpose(1, 0, 2)
        # Query head h reads kv head h // group: q as (kv head, its group, row, hd).
        q = qkv[:, :n_q * hd].reshape(n, kv, group, hd).transpose(1, 2, 0, 3)
        scores = np.matmul(q.reshape(kv, group * n, hd), keys[:, :held].transpose(0, 2, 1))
        scores = scores.reshape(kv, group, n, held)
        scores *= np.float32(1 / np.sqrt(hd))
        if n > 1:   # row i of a chunk sees the positions up to its own
            future = np.arange(held)[None, :] > (start + np.arange(n))[:, None]
            scores[..., future] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out = np.matmul(scores.reshape(kv, group * n, held), values[:, :held])
        return np.ascontiguousarray(out.reshape(kv, group, n, hd).transpose(2, 0, 1, 3)
                                    .reshape(n, n_q * hd))


def _linear(x, weight, bias):
    out = np.empty((x.shape[0], weight.shape[0]), np.float32)
    matmul.matmul_forward(out, x, weight, bias)
    return out


def _layernorm(x, weight, bias):
    out = np.empty_like(x)
    stats = np.empty((2, x.shape[0]), np.float32)
    layers.layernorm_forward(out, stats[0], stats[1], x, weight, bias)
    return out


def _rmsnorm(x, weight, eps):
    out = np.empty_like(x)
    llama.rmsnorm_forward(out, np.empty(x.shape[0], np.float32), x, weight, eps)
    return out


def pick_token(logits, temperature, top_k, rng):
    """The next token from a row of logits: the likeliest at temperature 0, else drawn
    with ``rng`` from the softmax of logits / temperature over the ``top_k`` likeliest
    (0: all)."""
    if temperature == 0:
        return int(np.argmax(logits))
    row = np.asarray(logits, np.float64) / max(temperature, 1e-6)
    if 0 < top_k < row.size:
        cut = np.partition(row, -top_k)[-top_k]
        row[row < cut] = -np.inf
    row -= row.max()
    probs = np.exp(row)
    probs /= probs.sum()
    return int(rng.choice(row.size, p=probs))


def generate(model, prompt_ids, n_tokens, temperature=1.0, top_k=0, rng=None):
    """The prompt's token ids (``[0]`` for an empty prompt) followed by ``n_tokens``
    generated ones, each conditioned on the last block_size tokens before it; ``rng`` (a
    numpy Generator, None: an unseeded one) draws them unless temperature is 0."""
    cfg = model.config
    block = cfg.block_size
    ids = [int(i) for i in prompt_ids] or [0]
    if n_tokens == 0:
        return ids
    if temperature != 0 and rng is None:
        rng = np.random.default_rng()
    # The last token generated is never run: len(ids) + n_tokens - 1 positions at most.
    decoder = Decoder(model, capacity=len(ids) + n_tokens - 1)
    logits = decoder.extend(ids[-block:])
    for i in range(n_tokens):
        ids.append(pick_token(logits[-1], temperature, top_k, rng))
        if i + 1 == n_tokens:
            break
        if decoder.full:    # the window slides: the cache is stale
            logits = model.forward(np.asarray([ids[-block:]], np.int32))[0][0, -1:, :cfg.vocab_size]
        else:
            logits = decoder.extend(ids[-1:])
    return ids
