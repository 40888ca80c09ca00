"""The AD engine of every family: the forward pass in adtape ops, the backward pass
derived by the tape.  A family differs only in its ``embed``, ``block`` and ``head``
(its ops, ``gpt2.families``).

Every parameter is a leaf ``Tensor`` over a view of the model's parameter arena,
whose ``.grad`` is the matching view of the gradient arena, so the reverse sweep
adds each backward kernel's result straight into the arena (nothing is copied
or allocated per parameter).  The values the backward kernels need are saved on
the engine's ``OpTape``: with a ``memory_budget`` they are copied onto its byte
tape, which spills the oldest activations to disk and prefetches them back during
the sweep; without one they are held by reference (read-only until the sweep).

Checkpointing (``checkpointing=``): ``"layer"`` keeps only each block's input
and recomputes the block in the backward pass; ``"binomial"`` reverses the
stack of blocks with at most ``snapshots`` stored block inputs along Revolve's
binomial schedule.
"""
import functools

import numpy as np

from adtape import nn
from kernels import _openmp
from adtape.checkpointing import checkpoint, checkpoint_loop
from adtape.tensor import OpTape, Primitive, Tensor, apply_deferred_zero, defvjp
from gpt2.families import family_of
from gpt2.lora import LORA_RECORDED, LoraWeight
from gpt2.state import ArenaState


def _marker_fwd(x, on_backward):
    return x, ()


def _marker_vjp(g, on_backward):
    on_backward()
    return g


_MARKER = defvjp(Primitive("offload_marker", ("x",), _marker_fwd), _marker_vjp)


def _marker(x, on_backward):
    """``x`` itself (no copy), recorded so that the reverse sweep calls ``on_backward()``
    when it passes this point."""
    return _MARKER(x, on_backward=on_backward)


def _frozen(value):
    """A constant Tensor over ``value`` (uint16 too: a bf16 base weight), no copy."""
    t = Tensor(np.empty(0, np.float32))
    t.data = value
    return t


def _leaf(value, grad):
    t = Tensor(value, requires_grad=True)
    t.grad = grad
    return t


class TapeEngine:
    """Loss and gradient of a ``Model`` through the AD runtime."""

    def __init__(self, model, tape_kwargs=None, checkpointing="none", snapshots=2):
        self.model = model
        self.config = model.config
        self.checkpointing = checkpointing
        self.snapshots = snapshots
        tape_kwargs = dict(tape_kwargs or {})
        if tape_kwargs.get("memory_budget") is None:
            # Nothing to spill: the activations stay where the kernels wrote them
            # (residuals="reference"), instead of being copied onto the byte tape
            # and back (7.6% of the step at B=4, T=256).  The byte tape still takes
            # any residual when asked, and keeps its slabs from step to step.
            tape_kwargs.setdefault("residuals", "reference")
            tape_kwargs.setdefault("keep_free_slabs", 1 << 30)
        self.optape = OpTape(**tape_kwargs)
        # Each step allocates and frees the same activation and gradient buffers;
        # glibc would map the large ones afresh and fault them in every step (22%
        # of the step at B=4, T=64).  Process-wide, as gpt2.train sets it too.
        _openmp.set_malloc_retention()
        per_layer = self.config.per_layer
        state = self.state = model.state
        if model.lora is not None:
            self._lora_leaves(model)
        elif state.streams_blocks:
            # Block l's leaves are views of its slot in the offload (gpt2.offload.FullOffload).
            offload = state.offload
            self.globals = {name: _leaf(p, offload.global_grads[name])
                            for name, p in offload.global_params.items()}
            self.layers = [{name: _leaf(p, g) for name, (p, g) in state.layer_arrays(l).items()}
                           for l in range(self.config.n_layer)]
            self.trainable = None
        else:
            p, g = model.params, model.grads

            def leaf(name, l=None):
                value = p.views[name] if l is None else p.views[name][l]
                if g is None:           # Model.for_inference: no gradients, constants
                    return _frozen(value)
                return _leaf(value, g.views[name] if l is None else g.views[name][l])
            # The parameters outside the blocks (GPT-2: wte, wpe, lnfw, lnfb), by name.
            self.globals = {name: leaf(name) for name in p.views if name not in per_layer}
            self.layers = [{name: leaf(name, l) for name in per_layer}
                           for l in range(self.config.n_layer)]
            self.trainable = None
        self.ops = family_of(self.config).ops(
            self.config, *(() if model.lora is None else (LORA_RECORDED,)))
        self.last_forward_bytes = 0    # residual bytes saved by the last forward pass
        if state.offload is not None:
            # One disk queue: the offloaded state moves through this tape's I/O thread,
            # beside the activations it spills (its stats count both).
            state.offload.file.attach(self.optape.tape)

    def _lora_leaves(self, model):
        # The base's parameters are constants (no gradient); each adapted weight becomes
        # a LoraWeight whose A and B are leaves over the adapter arenas.
        base, state, lora = model.params, model.adapter, model.lora
        per_layer = self.config.per_layer
        self.globals = {name: _frozen(v) for name, v in base.views.items()
                        if name not in per_layer}
        self.layers = [{name: _frozen(base.views[name][l]) for name in per_layer}
                       for l in range(self.config.n_layer)]
        self.trainable = []
        for weight, parts in lora.groups(self.config):
            splits = tuple((start, rows) for _, _, start, rows in parts)
            pa, pb = (state.params.views[f"{weight}.lora_{x}"] for x in "AB")
            ga, gb = (state.grads.views[f"{weight}.lora_{x}"] for x in "AB")
            for l, layer in enumerate(self.layers):
                a, b = _leaf(pa[l], ga[l]), _leaf(pb[l], gb[l])
                self.trainable += [a, b]
                layer[weight] = LoraWeight(layer[weight], a, b, splits, lora.scale,
                                           lora.dropout, state.rng)

    def _ready(self, stage):
        # An AdamW update still pending (offloaded, or a bf16 step's: gpt2.state) updates
        # each stage's parameters as the forward pass reaches it; a bf16 step's hands the
        # weights' bf16 copies it wrote to the products.
        self.state.ready(stage)
        if stage == "embed" and isinstance(self.state, ArenaState):
            fresh = self.state.take_bf16_copies() is not None
            if self._bf16_pairs is None and (fresh or nn.get_precision() == "bf16"):
                # the products' copies go where the deferred update writes them: one set
                # of copies, the state's
                self._bf16_pairs = self._bf16_views(self.state.bf16_arena())
                nn.set_bf16_targets(self._bf16_pairs)
            if fresh:
                for w, wb in self._bf16_pairs:
                    nn.provide_bf16_copy(w, wb)

    _bf16_pairs = None      # (leaf array, its slice of the state's bf16 arena), once known

    def _bf16_views(self, copies):
        # each trained leaf with its bf16 copy: the slice of ``copies`` (the parameter
        # arena's rounding) at the leaf's offset in the arena
        flat = self.state.params.flat
        base, end = flat.ctypes.data, flat.ctypes.data + flat.nbytes
        out = []
        for leaf in self.leaves():
            w = leaf.data
            at = w.ctypes.data
            if w.dtype == np.float32 and w.flags.c_contiguous and base <= at < end:
                start = (at - base) // w.itemsize
                out.append((w, copies[start:start + w.size].reshape(w.shape)))
        return out

    def block(self, l, x):
        """Transformer block ``l`` of the model's family."""
        self._ready(l)
        if not self.state.streams_blocks:
            return self.ops.block(self.layers[l], x)
        # Markers the sweep passes on its way: at the block's output before the block's
        # backward (its parameters are read back), at its input after it (its gradients
        # are final and written).
        state = self.state
        x = _marker(x, on_backward=functools.partial(state.backward_done, l))
        y = self.ops.block(self.layers[l], x)
        return _marker(y, on_backward=functools.partial(state.backward_begin, l))

    def forward_logits(self, inputs):
        """The logits (B, T, padded vocabulary) as a recorded Tensor."""
        return self.ops.head(self._hidden(inputs), self.globals)

    def _hidden(self, inputs):
        # the last block's output (B, T, C), the head's parameters ready
        cfg = self.config
        nn.weights_changed()        # bf16 products: the weights' copies are made anew
        self._ready("embed")
        x = self.ops.embed(inputs, self.globals)
        if self.checkpointing == "none":
            for l in range(cfg.n_layer):
                x = self.block(l, x)
        elif self.checkpointing == "layer":
            for l in range(cfg.n_layer):
                x = checkpoint(functools.partial(self.block, l), x)
        else:
            x = checkpoint_loop(self.block, x, cfg.n_layer, self.snapshots, pass_index=True)
        self._ready("head")
        return x

    def forward_loss(self, inputs, targets, denominator=None):
        """The mean loss over the targets that are not IGNORE_INDEX (or their sum over
        ``denominator``: ``nn.mean_cross_entropy``) as a recorded Tensor (call inside
        ``with self.optape``).  Where some targets are IGNORE_INDEX (a chat's prompts),
        the head (final norm, LM head, loss) runs on the other rows only: the skipped
        rows have neither loss nor gradient, and their logits cost the LM head's
        products and a row of the vocabulary's width on the tape each."""
        x = self._hidden(inputs)
        flat = np.asarray(targets).reshape(-1)
        kept = np.flatnonzero(flat != nn.IGNORE_INDEX)
        if 0 < kept.size < flat.size:
            x, targets = nn.take_rows(x, kept), flat[kept]
        logits = self.ops.head(x, self.globals)
        return nn.mean_cross_entropy(logits, targets, self.config.vocab_size, denominator)

    def loss_and_grad(self, inputs, targets, fresh=False, denominator=None):
        """The mean loss (``forward_loss``); its gradient is added into the leaves'
        ``.grad`` (written over them when ``fresh``: they count as zero)."""
        leaves = self.leaves()
        if fresh:
            for leaf in leaves:
                leaf.zero_grad(deferred=True)
        try:
            with self.optape:
                loss = self.forward_loss(inputs, targets, denominator)
            self.state.finish()     # the backward writes the gradients it reads
            self.state.read_ahead()
            self.last_forward_bytes = self.optape.saved_bytes
            loss.backward()
        finally:
            # Any leaf the sweep did not reach (or all, if it failed) reads as zeros.
            apply_deferred_zero(leaves)
        return float(loss.data)

    def leaves(self):
        """Every trained leaf: those outside the blocks, then block by block (with LoRA:
        the adapters)."""
        if self.trainable is not None:
            return list(self.trainable)
        out = list(self.globals.values())
        for layer in self.layers:
            out.extend(layer.values())
        return out

    def close(self):
        if self._bf16_pairs is not None:
            nn.drop_bf16_targets(w for w, _ in self._bf16_pairs)
            self._bf16_pairs = None
        if self.state.offload is not None and not self.optape.closed:
            self.state.offload.file.detach()
        self.optape.close()
