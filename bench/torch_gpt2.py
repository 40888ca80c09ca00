"""PyTorch GPT-2 reference built from our parameter layout (oracle for tests, baseline for benchmarks).

An idiomatic eager-mode model (nn.Linear / nn.LayerNorm per block, tied wte,
``F.scaled_dot_product_attention(is_causal=True)``, tanh GELU, layernorm eps 1e-5) whose
weights are copied from a dict name -> array in the layout of gpt2/params.py (or a ParamArena).
Logits cover the padded vocabulary, as in our model; the loss uses only the first vocab_size
columns.  Gradients and parameters come back as numpy in our layout.
"""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2.params import ParamArena

LAYERNORM_EPS = 1e-5


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd, eps=LAYERNORM_EPS)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.attproj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd, eps=LAYERNORM_EPS)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fcproj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        # (B, T, C) -> (B, NH, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attproj(att.transpose(1, 2).reshape(B, T, C))
        return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


# our stacked per-layer name -> (block attribute, "weight" or "bias")
LAYER_PARAMS = {
    "ln1w": ("ln1", "weight"), "ln1b": ("ln1", "bias"),
    "qkvw": ("qkv", "weight"), "qkvb": ("qkv", "bias"),
    "attprojw": ("attproj", "weight"), "attprojb": ("attproj", "bias"),
    "ln2w": ("ln2", "weight"), "ln2b": ("ln2", "bias"),
    "fcw": ("fc", "weight"), "fcb": ("fc", "bias"),
    "fcprojw": ("fcproj", "weight"), "fcprojb": ("fcproj", "bias"),
}


class LayoutModule(nn.Module):
    """A PyTorch model whose parameters map to our layout: ``_param(name, layer)`` gives
    the tensor of one (per-layer) parameter, ``LAYER_PARAMS`` names the per-layer ones.
    Shared by TorchGPT2 and torch_llama.TorchLlama, which name the others in
    ``_global_param``."""

    def _param(self, name, layer):
        if name in self.LAYER_PARAMS:
            module, attr = self.LAYER_PARAMS[name]
            return getattr(getattr(self.blocks[layer], module), attr)
        return self._global_param(name)

    def _with_loss(self, logits, targets):
        """(logits, None) or (logits, the mean cross-entropy over the real vocabulary)."""
        if targets is None:
            return logits, None
        B, T = targets.shape
        # a strided view of the real columns, not a copy of the (B*T, V) logits
        real = logits.view(B * T, -1)[:, :self.config.vocab_size]
        return logits, F.cross_entropy(real, targets.reshape(-1))

    def _tensors_by_layout(self, pick):
        """dict name -> numpy array in our layout, per-layer tensors stacked along axis 0."""
        out = {}
        for name in self.config.param_shapes():
            if name in self.LAYER_PARAMS:
                out[name] = np.stack([pick(self._param(name, l))
                                      for l in range(self.config.n_layer)])
            else:
                out[name] = pick(self._param(name, None))
        return out

    @torch.no_grad()
    def load_layout_(self, params):
        """Copy parameters from a ParamArena or dict name -> array in our layout."""
        views = params.views if isinstance(params, ParamArena) else params
        shapes = self.config.param_shapes()
        for name, shape in shapes.items():
            if name not in views:
                raise KeyError(f"parameter {name!r} missing from the layout dict")
            arr = np.asarray(views[name])
            if arr.shape != shape:
                raise ValueError(f"parameter {name!r} has shape {arr.shape}, expected {shape}")
            if name in self.LAYER_PARAMS:
                for l in range(self.config.n_layer):
                    self._param(name, l).copy_(torch.from_numpy(np.ascontiguousarray(arr[l])))
            else:
                self._param(name, None).copy_(torch.from_numpy(np.ascontiguousarray(arr)))
        return self

    def params_numpy(self):
        return self._tensors_by_layout(lambda p: p.detach().numpy().copy())

    def grads_numpy(self):
        """Gradients in our layout; a parameter without a gradient yet counts as zero."""
        return self._tensors_by_layout(
            lambda p: (torch.zeros_like(p) if p.grad is None else p.grad).detach().numpy().copy())


class TorchGPT2(LayoutModule):
    LAYER_PARAMS = LAYER_PARAMS

    def __init__(self, config):
        super().__init__()
        self.config = config
        C = config.n_embd
        self.wte = nn.Parameter(torch.zeros(config.padded_vocab_size, C))
        self.wpe = nn.Parameter(torch.zeros(config.block_size, C))
        self.blocks = nn.ModuleList(Block(C, config.n_head) for _ in range(config.n_layer))
        self.lnf = nn.LayerNorm(C, eps=LAYERNORM_EPS)

    def forward(self, idx, targets=None):
        """logits (B, T, Vp) and, with targets, the mean cross-entropy over the real vocab."""
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        x = F.embedding(idx, self.wte) + self.wpe[:T]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.lnf(x), self.wte)  # tied LM head, (B, T, Vp)
        return self._with_loss(logits, targets)

    def _global_param(self, name):
        return {"wte": self.wte, "wpe": self.wpe, "lnfw": self.lnf.weight,
                "lnfb": self.lnf.bias}[name]

def build_model(config, params, dtype=torch.float32):
    """TorchGPT2 with weights copied from our layout (ParamArena or dict name -> array)."""
    return TorchGPT2(config).to(dtype).load_layout_(params)


def as_index_tensor(arr, name="tokens"):
    """int64 torch tensor of a (B, T) integer numpy array of token ids."""
    arr = np.asarray(arr)
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be an integer array of shape (B, T), got {arr.dtype} "
                         f"{arr.shape}")
    return torch.from_numpy(arr.astype(np.int64))


def forward(model, inputs, targets=None):
    """(logits as numpy (B, T, Vp), loss as float or None), without building a graph."""
    with torch.no_grad():
        logits, loss = model(as_index_tensor(inputs, "inputs"),
                             None if targets is None else as_index_tensor(targets, "targets"))
    return logits.numpy(), None if loss is None else loss.item()


def loss_and_grads(model, inputs, targets):
    """(loss, grads dict in our layout) of one forward/backward from zero gradients."""
    model.zero_grad(set_to_none=True)
    _, loss = model(as_index_tensor(inputs, "inputs"), as_index_tensor(targets, "targets"))
    loss.backward()
    return loss.item(), model.grads_numpy()


def make_adamw(model, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
    """torch.optim.AdamW over all parameters (weight decay on every one, as in our trainer)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps,
                             weight_decay=weight_decay)


def train_step(model, optimizer, inputs, targets, autocast=None, grad_clip=None):
    """One timed training step: zero grads, forward, backward, AdamW update; returns the loss.

    inputs/targets: int64 torch tensors (B, T) from ``as_index_tensor``, converted once
    outside the timed loop.  ``autocast=torch.bfloat16``: PyTorch's mixed precision, the
    forward and loss under ``torch.autocast("cpu", dtype)`` (float32 weights, gradients
    and AdamW; the backward outside it, as PyTorch's recipe has it).  ``grad_clip``:
    ``clip_grad_norm_`` to that global norm before the update.
    """
    optimizer.zero_grad(set_to_none=True)
    if autocast is None:
        _, loss = model(inputs, targets)
    else:
        with torch.autocast("cpu", dtype=autocast):
            _, loss = model(inputs, targets)
    loss.backward()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.item()


def configure_torch(num_threads, flush_denormal):
    """Thread count and flush-to-zero for a fair comparison (see BENCHMARKS.md)."""
    torch.set_num_threads(num_threads)
    torch.set_flush_denormal(flush_denormal)
