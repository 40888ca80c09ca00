"""Autoregressive generation with a key/value cache, for every family.

``Decoder`` runs a model's forward pass over one sequence a chunk at a time (the prompt
in one pass, then one token per step) and keeps every layer's keys and values, so a step
costs one pass over the weights, not a forward over the whole context.  The forward pass
is the family's own ``embed``, ``block`` and ``head`` (``gpt2.families``), the code the
tape engine trains, run on the decoder's operations: the training kernels for the
projections, norms, GELU, rotary embedding and SwiGLU over the model's parameter arena as
it is (q|k|v rows packed in ``qkvw``, gate|up in ``gateupw``); only the attention of the
new rows over the cache is NumPy.

Each token is conditioned on the last ``block_size`` tokens, as the full forward over
them would be.  Once the sequence outgrows block_size the window slides, and a cache is of
no more use: the keys and values of every layer past the first depend on the token that
just left the window (and with GPT-2's learned positions every position moves too).  So
from then on ``generate`` runs the model's full forward over the window, once per token.

``generate`` picks each token as ``gpt2.train`` always has: the logits divided by the
temperature, cut to the ``top_k`` likeliest, then (``top_p`` < 1) to the nucleus, one
``rng.choice`` per token; temperature 0 takes the likeliest token and draws nothing.  It
stops early after one of ``stop_ids`` and hands each token to ``on_token`` as it comes
(the gpt2-generate command, ``gpt2.generate_cli``, streams them so).

``Weights`` is a model to generate from and nothing else: parameters read from a file,
without the gradients and optimizer state of ``gpt2.model.Model``.  Its matrices may be
bf16 (``gpt2.lora.Bf16Base``, gpt2-generate's ``--dtype bf16``): half the memory, and a
decoding step, which reads every weight once, takes the products with the weights
widened in registers (``kernels.bf16.matmul_forward_w16``, float32 activations and
sums).

``python -m gpt2.generate`` is the gpt2-generate command.
"""
import os
import sys

if __name__ == "__main__":
    # python -m gpt2.generate: Ctrl-C while the modules below load exits quietly.
    import signal

    from gpt2.generate_cli import exit_while_starting
    signal.signal(signal.SIGINT, exit_while_starting)

import numpy as np

from gpt2.families import family_of
from gpt2.lora import LoraWeight, block_weights
from kernels import bf16, layers, llama, lora, matmul


class Decoder:
    """The forward pass of one sequence, a chunk at a time, with a key/value cache of
    ``capacity`` positions (at most the model's block_size).

    It is the operations its family's ops run on (``gpt2.families.base``): each takes and
    gives float32 (n, C) arrays of the n new positions, ``attention`` reads and extends the
    cache of the block being run.  ``model``: a ``gpt2.model.Model`` or ``Weights``, whose
    ``decoder_weights()`` give the parameters (``gpt2.lora.block_weights``)."""

    def __init__(self, model, capacity=None):
        cfg = model.config
        self.config = cfg
        self.leaves, self.layers = model.decoder_weights()
        self.ops = family_of(cfg).ops(cfg, self)
        self.n_kv_head = cfg.n_kv_head
        self.head_dim = cfg.head_dim
        self.capacity = cfg.block_size if capacity is None else min(cfg.block_size, capacity)
        if self.capacity < 1:
            raise ValueError(f"Decoder capacity must be at least 1, got {capacity}")
        shape = (cfg.n_layer, self.n_kv_head, self.capacity, self.head_dim)
        self.keys = np.empty(shape, np.float32)
        self.values = np.empty(shape, np.float32)
        self.length = 0         # positions held, the position of the next token
        self._layer = 0         # the block being run

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
        x = self.ops.embed(ids, self.leaves)
        for layer in range(cfg.n_layer):
            self._layer = layer
            x = self.ops.block(self.layers[layer], x)
        self.length += ids.size
        return self.ops.head(x if all_positions else x[-1:], self.leaves)

    # -- the operations ---------------------------------------------------------------

    def embed(self, ids, wte, wpe):
        x = _float32(wte[ids])
        if wpe is not None:
            x += _float32(wpe[self.length:self.length + ids.size])
        return x

    @staticmethod
    def linear(x, weight, bias):
        adapted = type(weight) is LoraWeight
        base = weight.base if adapted else weight
        out = np.empty((x.shape[0], base.shape[0]), np.float32)
        if base.dtype == np.uint16:        # bf16: widened in registers
            bf16.matmul_forward_w16(out, x, base, bias)
        else:
            matmul.matmul_forward(out, x, base, bias)
        if adapted:     # + scale * (x A^T) B^T in the adapted rows, in float32
            xa = np.empty((x.shape[0], weight.a.shape[0]), np.float32)
            matmul.matmul_forward(xa, x, weight.a, None)
            xa *= np.float32(weight.scale)
            lora.lora_forward(out, xa, weight.b, weight.splits)
        return out

    @staticmethod
    def layernorm(x, weight, bias):
        out = np.empty_like(x)
        stats = np.empty((2, x.shape[0]), np.float32)
        layers.layernorm_forward(out, stats[0], stats[1], x, weight, bias)
        return out

    @staticmethod
    def rmsnorm(x, weight, eps):
        out = np.empty_like(x)
        llama.rmsnorm_forward(out, np.empty(x.shape[0], np.float32), x, weight, eps)
        return out

    @staticmethod
    def residual(x, y):
        return x + y

    @staticmethod
    def gelu(x):
        out = np.empty_like(x)
        layers.gelu_forward(out, x)
        return out

    def swiglu_linear(self, gate_up, weight):
        swiglu = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
        llama.swiglu_forward(swiglu, gate_up)
        return self.linear(swiglu, weight, None)

    def rope(self, qkv, rotary, n_rot_heads):
        # The tables of the whole cache, computed once; the new rows are at self.length on.
        cos, sin = rotary.tables(self.capacity)
        out = np.empty_like(qkv)
        llama.rope_forward(out.reshape(1, *out.shape), qkv.reshape(1, *qkv.shape),
                           cos[self.length:], sin[self.length:], n_rot_heads)
        return out

    def attention(self, qkv, n_head, n_kv_head=None):
        return self._attend(self._layer, qkv)

    def logits(self, h, weight):
        return self.linear(h, weight[:self.config.vocab_size], None)

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


def _float32(rows):
    """Rows of a float32 or bf16 (uint16) matrix, as float32 (bf16 widened: a copy)."""
    if rows.dtype != np.uint16:
        return rows
    out = np.empty(rows.shape, np.float32)
    bf16.from_bf16(out, np.ascontiguousarray(rows))
    return out


class Weights:
    """A model to generate from: a ParamArena (or a bf16 ``gpt2.lora.Bf16Base``) and its
    config, no gradients nor optimizer state; with ``adapters`` (a ``gpt2.lora.LoraState``)
    the base and its LoRA adapters, run unmerged (no copy of the base; a bf16 base keeps
    every bit of the adapters' update, which merging would round away).  Its ``forward``
    (for when generation outgrows the cache) is a fresh Decoder's over the sequence."""

    def __init__(self, params, adapters=None):
        self.config = params.config
        self.params = params
        self.adapters = adapters

    def decoder_weights(self):
        return block_weights(self.params, self.adapters)

    def forward(self, inputs, targets=None, logits=True):
        """(logits (B, T, V) or None, the mean loss over the targets that are not
        IGNORE_INDEX or None) of the sequences ``inputs`` (B, T), each a fresh Decoder's
        pass, as ``gpt2.model.Model.forward`` gives them (gpt2-eval --dtype bf16 runs it)."""
        from kernels import loss as loss_kernels
        inputs = np.asarray(inputs)
        if inputs.ndim != 2 or (targets is not None and np.shape(targets) != inputs.shape):
            raise ValueError(f"inputs must be (B, T) and targets the same shape, got "
                             f"{inputs.shape} and {np.shape(targets)}")
        rows, total, counted = [], 0.0, 0
        for b, ids in enumerate(inputs):
            out = Decoder(self, capacity=ids.size).extend(ids, all_positions=True)
            if targets is not None:
                row = np.ascontiguousarray(targets[b], dtype=np.int32)
                losses, lse = np.empty((2, row.size), np.float32)
                loss_kernels.softmax_crossentropy_forward(losses, lse, out, row,
                                                          self.config.vocab_size)
                total += float(losses.sum(dtype=np.float64))
                counted += int(np.count_nonzero(row != loss_kernels.IGNORE_INDEX))
            if logits:
                rows.append(out)
        loss = None
        if targets is not None:
            loss = np.float32(total / counted) if counted else np.float32(0)
        return (np.stack(rows) if logits else None), loss

    def close(self):
        pass


def read_weights(path, dtype="fp32"):
    """(the weights: a ParamArena, or with dtype "bf16" a gpt2.lora.Bf16Base; a LoRA
    source's adapters (a gpt2.lora.LoraState, run unmerged over those weights) or None;
    the tokenizer the file names or None; the Hugging Face directory or None).  A Hugging
    Face directory (or an adapter's base) in bf16 is read tensor by tensor: no float32
    copy of the model."""
    from gpt2 import checkpoint as ckpt
    from gpt2 import lora
    from gpt2 import tokenizer as tok
    from gpt2.lora import Bf16Base
    from gpt2.train_options import blame
    with blame(path):
        if lora.is_adapter_dir(path):     # a peft adapter over its base
            params, adapters, base_dir = lora.adapter_parts(path, dtype)
            return params, adapters, tok.find_tokenizer(base_dir), base_dir
        if os.path.isdir(path):
            from gpt2 import hf
            params = Bf16Base.load_hf(path) if dtype == "bf16" else hf.load_dir(path)
            return params, None, tok.find_tokenizer(path), path
        with open(path, "rb") as f:
            head = f.read(len(ckpt.CHECKPOINT_MAGIC))
        if head == ckpt.CHECKPOINT_MAGIC:
            header = ckpt.read_checkpoint_header(path)
            tokenizer = ((header.extra or {}).get("args") or {}).get("tokenizer")
            if header.lora is not None:     # a LoRA run: its base and the adapters
                params, adapters = lora.checkpoint_parts(path, header, dtype)
                return params, adapters, tokenizer, None
            params = ckpt.load_checkpoint(path, optimizer=False).params
            directory = None
        elif int.from_bytes(head[:4], "little") == ckpt.LLMC_MODEL_MAGIC:
            params, tokenizer, directory = ckpt.import_llmc(path), None, None
        elif path.endswith(".safetensors"):
            if not os.path.exists(ckpt.hf_config_path(path)):
                raise ValueError(f"a safetensors file needs the model's config.json beside it, "
                                 f"at {ckpt.hf_config_path(path)}")
            directory = os.path.dirname(path) or "."
            params, tokenizer = ckpt.import_hf_gpt2(path), tok.find_tokenizer(directory)
        else:
            raise ValueError("not a model: neither a checkpoint.bin, an llm.c model file, a "
                             ".safetensors file nor a Hugging Face model directory")
    if dtype == "bf16":
        params = Bf16Base.from_arena(params)
    return params, None, tokenizer, directory


def pick_token(logits, temperature, top_k, rng, top_p=1.0):
    """The next token from a row of logits: the likeliest at temperature 0, else drawn
    with ``rng`` from the softmax of logits / temperature over the ``top_k`` likeliest
    (0: all), cut to the nucleus where ``top_p`` < 1: the likeliest tokens whose
    probabilities sum to at least top_p (at least one), renormalized."""
    if temperature == 0:
        return int(np.argmax(logits))
    row = np.asarray(logits, np.float64) / max(temperature, 1e-6)
    if 0 < top_k < row.size:
        cut = np.partition(row, -top_k)[-top_k]
        row[row < cut] = -np.inf
    row -= row.max()
    probs = np.exp(row)
    probs /= probs.sum()
    if top_p < 1:
        order = np.argsort(-probs, kind="stable")
        kept = int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1
        probs[order[kept:]] = 0
        probs /= probs.sum()
    return int(rng.choice(row.size, p=probs))


def generate(model, prompt_ids, n_tokens, temperature=1.0, top_k=0, rng=None, top_p=1.0,
             stop_ids=(), on_token=None):
    """The prompt's token ids (``[0]`` for an empty prompt) followed by up to ``n_tokens``
    generated ones, each conditioned on the last block_size tokens before it; ``rng`` (a
    numpy Generator, None: an unseeded one) draws them unless temperature is 0.  A token
    in ``stop_ids`` ends the generation (it is the last id returned); ``on_token(id)`` is
    called with each token as it is picked."""
    cfg = model.config
    block = cfg.block_size
    ids = [int(i) for i in prompt_ids] or [0]
    if n_tokens == 0:
        return ids
    if temperature != 0 and rng is None:
        rng = np.random.default_rng()
    stop_ids = frozenset(int(i) for i in stop_ids)
    # The last token generated is never run: len(ids) + n_tokens - 1 positions at most.
    decoder = Decoder(model, capacity=len(ids) + n_tokens - 1)
    logits = decoder.extend(ids[-block:])
    for i in range(n_tokens):
        ids.append(pick_token(logits[-1], temperature, top_k, rng, top_p))
        if on_token is not None:
            on_token(ids[-1])
        if i + 1 == n_tokens or ids[-1] in stop_ids:
            break
        if decoder.full:    # the window slides: the cache is stale
            logits = model.forward(np.asarray([ids[-block:]], np.int32))[0][0, -1:, :cfg.vocab_size]
        else:
            logits = decoder.extend(ids[-1:])
    return ids


def sequence_ids(tokenizer, special_tokens=None, model_dir=None):
    """(the ids that end a text, the id that starts one or None) for ``tokenizer``.

    The end: the model directory's generation_config.json eos_token_id (else its
    config.json's), and the tokenizer's end-of-sequence token (``special_tokens``' eos_token,
    the names of its directory's tokenizer_config.json: ``gpt2.chat.special_tokens``; else
    the tokenizer's own, a tiktoken or SentencePiece file's).  The start: ``special_tokens``'
    bos_token, else config.json's bos_token_id, else the tokenizer's usual one
    (``gpt2.tokenizer.special_ids``).  A malformed file is a UsageError naming it."""
    from gpt2 import tokenizer as tok
    special_tokens = special_tokens or {}

    def named(name):
        text = special_tokens.get(name)
        if text is None or not hasattr(tokenizer, "token_id"):
            return None
        return tokenizer.token_id(text)

    eos_ids = []
    if model_dir is not None:
        for name in ("generation_config.json", "config.json"):
            path = os.path.join(model_dir, name)
            if os.path.exists(path):
                eos_ids = _id_field(path, "eos_token_id")
                break
    tokenizer_eos = named("eos_token")
    if tokenizer_eos is None:
        tokenizer_eos = getattr(tokenizer, "eot_token", None)
    if tokenizer_eos is not None:
        eos_ids.append(tokenizer_eos)
    bos = named("bos_token")
    if bos is None and model_dir is not None:
        path = os.path.join(model_dir, "config.json")
        ids = _id_field(path, "bos_token_id") if os.path.exists(path) else []
        bos = ids[0] if ids else None
    if bos is None:
        bos = tok.special_ids(tokenizer).get("bos", (None, None))[1]
    return sorted(set(eos_ids)), bos


def _id_field(path, key):
    """A token id field of a JSON file (an id, a list of them, or null) as a list."""
    import json

    from gpt2.train_options import blame
    with blame(path):
        try:
            with open(path, "rb") as f:
                value = json.load(f).get(key)
        except (ValueError, UnicodeDecodeError, AttributeError) as e:
            raise ValueError(f"not a JSON object: {e}") from None
        values = value if isinstance(value, list) else [] if value is None else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise ValueError(f"{key} must be a token id or a list of them, got "
                             f"{json.dumps(value)}")
    return list(values)


if __name__ == "__main__":
    from gpt2.generate_cli import main
    sys.exit(main())
