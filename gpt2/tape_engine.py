"""The AD engine of GPT-2: the forward pass in adtape ops, the backward pass derived by the tape.

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

from adtape import nn
from kernels import _openmp
from adtape.checkpointing import checkpoint, checkpoint_loop
from adtape.tensor import OpTape, Tensor, apply_deferred_zero
from gpt2.params import PER_LAYER



def _leaf(value, grad):
    t = Tensor(value, requires_grad=True)
    t.grad = grad
    return t


class TapeEngine:
    """Loss and gradient of a ``GPT2`` through the AD runtime."""

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
        p, g = model.params, model.grads
        self.wte = _leaf(p.wte, g.wte)
        self.wpe = _leaf(p.wpe, g.wpe)
        self.lnfw = _leaf(p.lnfw, g.lnfw)
        self.lnfb = _leaf(p.lnfb, g.lnfb)
        self.layers = [{name: _leaf(p.views[name][l], g.views[name][l]) for name in PER_LAYER}
                       for l in range(self.config.n_layer)]
        self.last_forward_bytes = 0    # residual bytes saved by the last forward pass

    def block(self, l, x):
        """Transformer block ``l``: pre-norm attention and MLP, each with a residual."""
        w = self.layers[l]
        h = nn.layernorm(x, w["ln1w"], w["ln1b"])
        qkv = nn.linear(h, w["qkvw"], w["qkvb"])
        a = nn.attention(qkv, self.config.n_head)
        x = nn.residual(x, nn.linear(a, w["attprojw"], w["attprojb"]))
        h = nn.layernorm(x, w["ln2w"], w["ln2b"])
        h = nn.gelu(nn.linear(h, w["fcw"], w["fcb"]))
        return nn.residual(x, nn.linear(h, w["fcprojw"], w["fcprojb"]))

    def forward_loss(self, inputs, targets):
        """The mean loss as a recorded Tensor (call inside ``with self.optape``)."""
        cfg = self.config
        x = nn.encoder(inputs, self.wte, self.wpe)
        if self.checkpointing == "none":
            for l in range(cfg.n_layer):
                x = self.block(l, x)
        elif self.checkpointing == "layer":
            for l in range(cfg.n_layer):
                x = checkpoint(functools.partial(self.block, l), x)
        else:
            x = checkpoint_loop(self.block, x, cfg.n_layer, self.snapshots, pass_index=True)
        h = nn.layernorm(x, self.lnfw, self.lnfb)
        logits = nn.linear(h, self.wte, None)
        losses = nn.softmax_cross_entropy(logits, targets, cfg.vocab_size)
        return losses.mean()

    def loss_and_grad(self, inputs, targets, fresh=False):
        """The mean loss; its gradient is added into the leaves' ``.grad`` (written over
        them when ``fresh``: they count as zero)."""
        leaves = self.leaves()
        if fresh:
            for leaf in leaves:
                leaf.zero_grad(deferred=True)
        try:
            with self.optape:
                loss = self.forward_loss(inputs, targets)
            self.last_forward_bytes = self.optape.saved_bytes
            loss.backward()
        finally:
            # Any leaf the sweep did not reach (or all, if it failed) reads as zeros.
            apply_deferred_zero(leaves)
        return float(loss.data)

    def leaves(self):
        """Every parameter leaf: wte, wpe, block by block, lnfw, lnfb."""
        out = [self.wte, self.wpe]
        for layer in self.layers:
            out.extend(layer[name] for name in PER_LAYER)
        out.extend((self.lnfw, self.lnfb))
        return out

    def close(self):
        self.optape.close()
