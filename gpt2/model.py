"""The model of any family over the OpenMP kernels: parameters, AdamW state and two
backward paths.

``Model.state`` holds what trains (``gpt2.state``: parameters, gradients, the two AdamW
moments and the step, as arenas of the family's layout in RAM, on disk, or a LoRA run's
adapters beside the frozen ``Model.base``).  A training step is
``loss = model.loss_and_grad(inputs, targets)`` followed by ``model.adamw_step``.

Two engines compute the loss and its gradient with the same kernels:
* ``"tape"`` (the default): the forward pass runs through ``adtape`` ops, which
  save what each backward kernel needs onto an ``adtape.Tape`` (so a
  ``memory_budget`` spills activations to disk) and the backward pass is the
  tape's reverse sweep - derived, not written out by hand.
* ``"manual"``: llm.c's hand-sequenced forward and backward over one
  preallocated activation arena (GPT-2's layout: the families with
  ``hand_sequenced``), kept as the baseline the tape path is checked and timed against.
"""
import math

import numpy as np

from adtape import buffers, nn
from gpt2 import families
from gpt2.params import ParamArena, init_params_
from gpt2.state import OFFLOAD_POLICIES, ArenaState, FrozenState, training_state
from kernels import attention, layers, loss as loss_kernels, matmul, optim


# A bf16 step's AdamW update waits for the next forward pass, which writes the weights'
# bf16 copies in the same pass (``Model.train_step``; False: at once, the copies made by
# the products; the same bits either way; for tests and benchmarks).
DEFER_BF16_UPDATE = True


class ActivationArena:
    """Every activation and activation gradient of one (B, T) forward/backward, in one allocation.

    Forward buffers are overwritten every step.  The gradient buffers hold one
    layer at a time; the first backward kernel into each writes it (its
    ``overwrite`` flag), so none is zeroed.
    """

    def __init__(self, config, B, T):
        L, C, NH = config.n_layer, config.n_embd, config.n_head
        Vp = config.padded_vocab_size
        shapes = {
            "encoded": (B, T, C),
            "ln1": (L, B, T, C), "ln1_mean": (L, B, T), "ln1_rstd": (L, B, T),
            "qkv": (L, B, T, 3 * C), "atty": (L, B, T, C), "att_lse": (L, B, NH, T),
            "attproj": (L, B, T, C), "residual2": (L, B, T, C),
            "ln2": (L, B, T, C), "ln2_mean": (L, B, T), "ln2_rstd": (L, B, T),
            "fch": (L, B, T, 4 * C), "fch_gelu": (L, B, T, 4 * C), "fcproj": (L, B, T, C),
            "residual3": (L, B, T, C),
            "lnf": (B, T, C), "lnf_mean": (B, T), "lnf_rstd": (B, T),
            "logits": (B, T, Vp), "losses": (B, T), "lse": (B, T),
        }
        # Gradient buffers: one layer's worth is reused for every layer, the
        # residual stream gradient is carried down.
        grad_shapes = {
            "d_residual": (B, T, C), "d_ln": (B, T, C), "d_qkv": (B, T, 3 * C),
            "d_atty": (B, T, C), "d_fch": (B, T, 4 * C), "d_fch_gelu": (B, T, 4 * C),
            "d_losses": (B, T),
        }
        self.B, self.T = B, T
        sizes = {**shapes, **grad_shapes}
        # Every buffer starts on a cache line (a multiple of 16 floats from the
        # arena's aligned start).
        padded = {name: -(-math.prod(s) // 16) * 16 for name, s in sizes.items()}
        self.flat = buffers.empty(sum(padded.values()))
        start = 0
        for name, shape in sizes.items():
            n = math.prod(shape)
            setattr(self, name, self.flat[start:start + n].reshape(shape))
            start += padded[name]


def micro_batches(batch_size, grad_accum):
    """The row slices of a batch of ``batch_size`` rows cut into ``grad_accum`` equal
    micro-batches; ValueError if they cannot be equal."""
    if not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be a positive integer, got {grad_accum!r}")
    if batch_size % grad_accum:
        raise ValueError(f"a batch of {batch_size} rows does not split into {grad_accum} "
                         f"equal micro-batches")
    m = batch_size // grad_accum
    return [slice(i * m, (i + 1) * m) for i in range(grad_accum)]


class Model:
    """A model of any family (its config: ``GPT2Config``, ``LlamaConfig``, ...) with its
    training state (``self.state``, a ``gpt2.state.TrainingState``).  Only the families
    with ``hand_sequenced`` (GPT-2) have the hand-sequenced engine."""

    def __init__(self, config, seed=0, engine="tape", tape_kwargs=None, checkpointing="none",
                 snapshots=2, offload=None, offload_dir=None, lora=None, base_dtype="fp32",
                 base=None, state=None):
        family = families.family_of(config)
        if engine not in ("tape", "manual"):
            raise ValueError(f"engine must be 'tape' or 'manual', got {engine!r}")
        if engine == "manual" and not family.hand_sequenced:
            owners = " and ".join(f"{f.title}'s" for f in families.families()
                                  if f.hand_sequenced)
            raise ValueError(f"the hand-sequenced engine is {owners}; a {config.family} model "
                             f"runs on engine='tape'")
        if checkpointing not in ("none", "layer", "binomial"):
            raise ValueError(f"checkpointing must be 'none', 'layer' or 'binomial', "
                             f"got {checkpointing!r}")
        if checkpointing != "none" and engine != "tape":
            raise ValueError("checkpointing recomputes through the tape: use engine='tape'")
        if offload not in OFFLOAD_POLICIES:
            raise ValueError(f"offload must be one of {', '.join(map(repr, OFFLOAD_POLICIES))}, "
                             f"got {offload!r}")
        if offload == "all" and (engine != "tape" or checkpointing != "none"):
            raise ValueError("offload='all' runs on engine='tape' without checkpointing")
        self.config = config
        self.family = family
        self.lora = lora
        self.offload = offload
        self.engine = engine
        self.tape_kwargs = dict(tape_kwargs or {})
        self.checkpointing = checkpointing
        self.snapshots = snapshots
        self._acts = None
        self._tape_engine = None
        # False: the gradients hold what the next backward adds to.  True: they count
        # as zero (zero_grad, or a train_step's deferred zeroing) and the next backward
        # writes over them instead - no pass over memory to zero them.
        self._grads_fresh = True
        # The frozen base of a LoRA model (its parameters that do not train), else None.
        self.base = None
        if state is not None:           # for_inference's (or a caller's own state)
            if lora is not None or base is not None or offload is not None:
                raise ValueError("state: a model built on a given state takes no lora, base "
                                 "or offload")
            self.state = state
        elif lora is not None or base is not None or base_dtype != "fp32":
            self._init_lora(lora, base_dtype, base, engine, offload, seed)
        else:
            # What trains, wherever it lives (gpt2.state): arenas in RAM, or with
            # offload="moments" the moments on disk, updated during the next forward
            # pass; offload="all" the blocks' parameters and gradients too, the engine's
            # leaves views of the offload's slots.
            self.state = training_state(config, seed, offload, offload_dir)

    @classmethod
    def for_inference(cls, params, **kwargs):
        """A model that only runs forward passes (``forward``: logits and loss) over
        ``params``, a ParamArena used in place, not copied: no gradients, no optimizer
        state (``gpt2.state.FrozenState``), 4 bytes per parameter where a training model
        holds 16.  ``kwargs``: ``engine``, ``tape_kwargs``, ``checkpointing``."""
        if not isinstance(params, ParamArena):
            raise TypeError(f"params must be a ParamArena, got {type(params).__name__}")
        return cls(params.config, state=FrozenState(params), **kwargs)

    def _init_lora(self, lora, base_dtype, base, engine, offload, seed):
        # A frozen base (float32 ParamArena or bf16 Bf16Base) and the adapters' state.
        from gpt2.lora import Bf16Base, LoraConfig, LoraState
        if not isinstance(lora, LoraConfig):
            raise ValueError(f"base_dtype and base are LoRA's: pass lora=LoraConfig(...), got "
                             f"lora={lora!r}")
        if base_dtype not in ("fp32", "bf16"):
            raise ValueError(f"base_dtype must be 'fp32' or 'bf16', got {base_dtype!r}")
        if engine != "tape":
            raise ValueError("LoRA runs on engine='tape'")
        if offload is not None:
            raise ValueError(f"LoRA trains no base weights: offload={offload!r} has nothing "
                             f"to offload (the adapters' state is small); use "
                             f"base_dtype='bf16' to halve the base")
        if base is None:
            if base_dtype == "bf16":
                base = Bf16Base.random(self.config, seed)
            else:
                base = init_params_(ParamArena(self.config), seed)
        elif isinstance(base, ParamArena):
            if base.config != self.config:
                raise ValueError("base: a ParamArena of another config")
            base = Bf16Base.from_arena(base) if base_dtype == "bf16" else base.in_llmc_order()
        elif not isinstance(base, Bf16Base) or base_dtype != "bf16":
            raise TypeError(f"base must be a ParamArena (or a Bf16Base with base_dtype='bf16'), "
                            f"got {type(base).__name__}")
        self.base_dtype = base_dtype
        self.base = base
        self.state = LoraState(self.config, lora, seed)

    # -- the training state (gpt2.state), by the names it has always had here --------

    @property
    def params(self):
        """The parameters: the state's arena (None with offload="all"), or with LoRA the
        frozen base; an update still pending is made first (``finish_update``)."""
        if self.base is None:
            self.state.finish()
            return self.state.params
        return self.base

    @property
    def grads(self):
        return self.state.grads if self.base is None else None

    @property
    def adam_m(self):
        self.state.finish()
        return self.state.adam_m if self.base is None else None

    @property
    def adam_v(self):
        self.state.finish()
        return self.state.adam_v if self.base is None else None

    @property
    def adapter(self):
        """A LoRA model's state (``gpt2.lora.LoraState``: the adapters), else None."""
        return self.state if self.base is not None else None

    @property
    def moments(self):
        """The offload moving the state to and from disk (``gpt2.offload``), or None."""
        return self.state.offload

    @moments.setter
    def moments(self, offload):
        self.state.offload = offload

    @property
    def adam_step(self):
        return self.state.step

    @adam_step.setter
    def adam_step(self, step):
        self.state.step = step

    # -- inputs ---------------------------------------------------------------

    def check_batch(self, inputs, targets=None):
        """Validate a batch: int32-convertible (B, T) ids in range, T <= block_size; a
        target may also be ``nn.IGNORE_INDEX`` (-100): a position without loss."""
        cfg = self.config
        inputs = np.asarray(inputs)
        if inputs.ndim != 2:
            raise ValueError(f"inputs must have shape (B, T), got {inputs.shape}")
        if not np.issubdtype(inputs.dtype, np.integer):
            raise TypeError(f"inputs must be integer token ids, got {inputs.dtype}")
        B, T = inputs.shape
        if B < 1 or T < 1:
            raise ValueError(f"inputs must have B >= 1 and T >= 1, got {inputs.shape}")
        if T > cfg.block_size:
            raise ValueError(f"sequence length T={T} exceeds the model's block_size "
                             f"{cfg.block_size}")
        if inputs.size and (inputs.min() < 0 or inputs.max() >= cfg.vocab_size):
            raise ValueError(f"input token ids must lie in [0, {cfg.vocab_size}), got ids in "
                             f"[{inputs.min()}, {inputs.max()}]")
        inputs = np.ascontiguousarray(inputs, dtype=np.int32)
        if targets is None:
            return inputs, None
        targets = np.asarray(targets)
        if targets.shape != inputs.shape:
            raise ValueError(f"targets shape {targets.shape} does not match inputs {inputs.shape}")
        if not np.issubdtype(targets.dtype, np.integer):
            raise TypeError(f"targets must be integer token ids, got {targets.dtype}")
        bad = ((targets < 0) | (targets >= cfg.vocab_size)) & (targets != nn.IGNORE_INDEX)
        if bad.any():
            raise ValueError(f"target token ids must lie in [0, {cfg.vocab_size}) or be "
                             f"IGNORE_INDEX ({nn.IGNORE_INDEX}: no loss), got "
                             f"{int(targets[bad][0])}")
        return inputs, np.ascontiguousarray(targets, dtype=np.int32)

    def _activations(self, B, T):
        if self._acts is None or (self._acts.B, self._acts.T) != (B, T):
            self._acts = None
            self._acts = ActivationArena(self.config, B, T)
        return self._acts

    # -- forward only -----------------------------------------------------------

    def forward(self, inputs, targets=None, logits=True):
        """Logits (B, T, Vp) - a view valid until the next call - and the mean loss if
        targets (over the targets that are not IGNORE_INDEX).  ``logits=False`` (with
        targets: a validation loss) may return None for the logits: the tape engine's
        head then runs only on the rows whose target counts."""
        inputs, targets = self.check_batch(inputs, targets)
        self.finish_update()
        # bf16 products run in the tape engine's ops only: the hand-sequenced forward
        # is float32's, and a bf16 run's validation loss is that of its own products.
        if (not self.family.hand_sequenced or self.offload == "all" or self.adapter is not None
                or nn.get_precision() != "fp32"):
            return self._forward_tape(inputs, targets, logits)
        B, T = inputs.shape
        a = self._activations(B, T)
        self._forward_manual(a, inputs, targets)
        return a.logits, (float(a.losses.sum() / nn.loss_denominator(targets))
                          if targets is not None else None)

    def _forward_tape(self, inputs, targets, logits=True):
        # The tape engine's ops with nothing recorded (the families without a
        # hand-sequenced forward); the loss alone where the logits are not wanted.
        from adtape.tensor import no_grad
        with no_grad():
            if not logits and targets is not None:
                return None, float(self._engine().forward_loss(inputs, targets).data)
            logits = self._engine().forward_logits(inputs)
            loss = (nn.mean_cross_entropy(logits, targets, self.config.vocab_size)
                    if targets is not None else None)
        return logits.data, (float(loss.data) if loss is not None else None)

    def _engine(self):
        if self._tape_engine is None:
            from gpt2.tape_engine import TapeEngine
            self._tape_engine = TapeEngine(self, self.tape_kwargs, self.checkpointing,
                                           self.snapshots)
        return self._tape_engine

    # -- loss and gradient --------------------------------------------------------

    def loss_and_grad(self, inputs, targets, loss_denominator=None):
        """Mean cross-entropy loss over the targets that are not IGNORE_INDEX (or their
        sum over ``loss_denominator``: ``nn.loss_denominator``); its gradient is
        accumulated into ``self.grads``."""
        if not self.state.trains:
            self.state.refuse()
        inputs, targets = self.check_batch(inputs, targets)
        denominator = nn.loss_denominator(targets, loss_denominator)
        if self.engine == "manual" or self._tape_engine is None:
            # The tape engine applies a pending offloaded update block by block as its
            # forward pass reaches each; the other paths apply it whole first.
            self.finish_update()
        fresh, self._grads_fresh = self._grads_fresh, False
        if not self.state.accumulates and not fresh:
            raise NotImplementedError("with offload='all' each backward pass writes the "
                                      "gradients anew: call zero_grad() before loss_and_grad "
                                      "(no accumulation over several backward passes)")
        if self.engine == "manual":
            B, T = inputs.shape
            a = self._activations(B, T)
            self._forward_manual(a, inputs, targets)
            try:
                self._backward_manual(a, inputs, targets, denominator, fresh)
            except BaseException:
                if fresh:       # part-written: make them zeros plus what was added
                    self.zero_grad()
                    self._grads_fresh = False
                raise
            return float(a.losses.sum() / denominator)
        return self._engine().loss_and_grad(inputs, targets, fresh, denominator)

    def zero_grad(self, deferred=False):
        """Zero the gradients; ``deferred=True`` only marks them as zero, and the next
        backward writes over them instead of adding to them (no pass over memory;
        ``self.grads`` keeps its old values until then)."""
        if not deferred:
            self.state.zero_grad()
        self._grads_fresh = True

    def clip_grad_norm(self, max_norm):
        """Scale gradients to global norm ``max_norm`` at most; returns the norm before."""
        return self.state.clip_grad_norm(max_norm)

    def adamw_step(self, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                   grad_scale=1.0, defer=False):
        """One AdamW update of every parameter (PyTorch semantics, decay on all of them),
        with the gradients multiplied by ``grad_scale`` as they are read.  ``defer``: the
        update may wait for the next forward pass (a state in RAM whose model runs bf16
        products: ``gpt2.state.ArenaState``); readers of the parameters make it first."""
        self.state.adamw(lr, beta1, beta2, eps, weight_decay, grad_scale, defer=defer)

    def finish_update(self):
        """Complete an offloaded AdamW update still pending (nothing otherwise): before
        anything but the next training step reads the parameters."""
        self.state.finish()

    def optimizer_moments(self):
        """(adam_m, adam_v) for ``gpt2.checkpoint``: the arenas, or with offloaded moments
        sections streamed from and to disk (``TrainingState.sections``)."""
        return self.state.sections()[1:]

    def checkpoint_params(self):
        """The parameters for ``gpt2.checkpoint`` (save and load): the arena, or with
        offload="all" a section streamed from and to disk."""
        return self.state.sections()[0]

    def param_arena(self):
        """Every parameter as a ParamArena: the model's own, or with offload="all" a copy
        read from disk, or with LoRA the base with the adapters merged (for sampling and
        exports)."""
        return self.merged_params().to_arena() if self.base is not None \
            else self.state.param_arena()

    def merged_params(self):
        """The model for an export that reads it a tensor at a time: ``param_arena()``, or
        with LoRA a ``gpt2.lora.MergedParams`` that merges each block as it is read (no
        float32 copy of the model: a bf16 8B base exports in its own 16 GB)."""
        if self.base is None:
            return self.state.param_arena()
        from gpt2.lora import MergedParams
        return MergedParams(self.base, self.state)

    def decoder_weights(self):
        """What ``gpt2.generate.Decoder`` runs: the parameters outside the blocks by name
        and each block's by name; with LoRA the base and its adapters unmerged (no float32
        copy of a bf16 base, none of a float32 one either)."""
        from gpt2.lora import block_weights
        if self.base is None:
            return block_weights(self.param_arena())
        return block_weights(self.base, self.state)

    def set_params(self, arena):
        """Copy a ParamArena's values into the model's parameters (with LoRA: its base)."""
        if self.base is None:
            self.state.set_params(arena)
        elif isinstance(self.base, ParamArena):
            self.base.copy_(arena)
        else:
            from kernels import bf16
            for name, view in self.base.views.items():
                src = np.ascontiguousarray(arena.views[name])
                if view.dtype == np.uint16:
                    bf16.to_bf16(view, src)
                else:
                    view[...] = src

    def train_step(self, inputs, targets, lr, weight_decay=0.0, grad_clip=None, grad_accum=1):
        """Zero grads, forward, backward, (clip), AdamW. Returns (loss, grad norm or None).

        ``grad_accum`` N > 1: the batch's B rows run as N micro-batches of B/N rows (the
        activations of one micro-batch at a time), their gradients summed in
        ``self.grads`` (the first backward writes them, the others add), then one
        clipping and one AdamW on the sum scaled by 1/N: the whole batch's gradient, as
        is the loss returned (see the last paragraph).

        The zeroing is deferred (``zero_grad(deferred=True)``): the backward kernels
        write the gradients instead of adding them into zeros, which saves two passes
        over the gradient arena.  Clipping (global norm at most ``grad_clip``) scales
        the gradients inside AdamW rather than rewriting them first, which saves two
        more; the update is the same to the bit.  After the step ``self.grads`` holds
        the gradient as the backward left it, before clipping.

        Targets of IGNORE_INDEX take no loss, and the loss is the mean over the others
        of the whole batch: each micro-batch's loss sum divides by 1/N of the whole
        batch's count (``loss_and_grad(..., loss_denominator=)``), so micro-batches
        with more counted targets weigh more, and the 1/N in AdamW (and over the
        returned losses) makes the sum the whole batch's mean.  With nothing ignored,
        1/N of the count is a micro-batch's own size: each is its plain mean, to the
        bit."""
        micro = micro_batches(np.shape(inputs)[0] if np.ndim(inputs) else 0, grad_accum)
        if grad_accum > 1 and not self.state.accumulates:
            raise NotImplementedError("with offload='all' each backward pass writes the "
                                      "gradients anew: no gradient accumulation")
        self.zero_grad(deferred=True)
        self.state.begin_step()
        if grad_accum == 1:
            loss = self.loss_and_grad(inputs, targets)
        else:
            share = nn.loss_denominator(targets) / grad_accum
            loss = sum(self.loss_and_grad(inputs[rows], targets[rows], loss_denominator=share)
                       for rows in micro) / grad_accum
        norm, scale = None, 1.0
        if grad_clip:
            norm = self.state.grad_norm()
            if grad_accum > 1:
                norm /= grad_accum      # the norm of the mean gradient
            scale = optim.clip_coefficient(norm, grad_clip)
        # With bf16 products on the tape engine the update waits for the next forward
        # pass, which writes the weights' bf16 copies in the same pass (gpt2.state.ArenaState);
        # every reader of the parameters makes it first.
        defer = (DEFER_BF16_UPDATE and self.engine == "tape" and self._tape_engine is not None
                 and self.base is None and type(self.state) is ArenaState
                 and nn.get_precision() == "bf16")
        self.adamw_step(lr, weight_decay=weight_decay, grad_scale=scale / grad_accum,
                        defer=defer)
        return loss, norm

    @property
    def tape_stats(self):
        """The tape engine's counters (``adtape.Tape.stats``: bytes spilled, written and
        read, I/O waits, prefetch hits; cumulative), or None before its first step and
        on the reference engine."""
        return self._tape_engine.optape.stats if self._tape_engine is not None else None

    def close(self):
        if self._tape_engine is not None:
            self._tape_engine.close()
            self._tape_engine = None
        self.state.close()

    # -- the hand-sequenced baseline (llm.c) ----------------------------------------

    def _forward_manual(self, a, inputs, targets):
        p, cfg = self.params, self.config
        NH = cfg.n_head
        layers.encoder_forward(a.encoded, inputs, p.wte, p.wpe)
        residual = a.encoded
        for l in range(cfg.n_layer):
            layers.layernorm_forward(a.ln1[l], a.ln1_mean[l], a.ln1_rstd[l], residual,
                                     p.ln1w[l], p.ln1b[l])
            matmul.matmul_forward(a.qkv[l], a.ln1[l], p.qkvw[l], p.qkvb[l])
            attention.attention_forward(a.atty[l], a.att_lse[l], a.qkv[l], NH)
            matmul.matmul_forward(a.attproj[l], a.atty[l], p.attprojw[l], p.attprojb[l])
            layers.residual_forward(a.residual2[l], residual, a.attproj[l])
            layers.layernorm_forward(a.ln2[l], a.ln2_mean[l], a.ln2_rstd[l], a.residual2[l],
                                     p.ln2w[l], p.ln2b[l])
            matmul.matmul_forward(a.fch[l], a.ln2[l], p.fcw[l], p.fcb[l])
            layers.gelu_forward(a.fch_gelu[l], a.fch[l])
            matmul.matmul_forward(a.fcproj[l], a.fch_gelu[l], p.fcprojw[l], p.fcprojb[l])
            layers.residual_forward(a.residual3[l], a.residual2[l], a.fcproj[l])
            residual = a.residual3[l]
        layers.layernorm_forward(a.lnf, a.lnf_mean, a.lnf_rstd, residual, p.lnfw, p.lnfb)
        matmul.matmul_forward(a.logits, a.lnf, p.wte, None)
        if targets is not None:
            loss_kernels.softmax_crossentropy_forward(a.losses, a.lse, a.logits, targets,
                                                      cfg.vocab_size)

    def _backward_manual(self, a, inputs, targets, denominator, fresh=False):
        # The gradient of the losses' sum over ``denominator``; fresh: the parameter
        # gradients count as zero, so each one's first write overwrites it.  Activation
        # gradients are always written first, then added to.
        p, g, cfg = self.params, self.grads, self.config
        NH = cfg.n_head
        a.d_losses.fill(1.0 / denominator)
        # dlogits overwrite the logits in place: they are not needed afterwards.
        loss_kernels.softmax_crossentropy_backward(a.logits, a.d_losses, a.logits, a.lse,
                                                   targets, cfg.vocab_size)
        dres = a.d_residual
        matmul.matmul_backward(a.d_ln, g.wte, None, a.logits, a.lnf, p.wte,
                               overwrite=(True, fresh, False))
        last = a.residual3[cfg.n_layer - 1] if cfg.n_layer else a.encoded
        layers.layernorm_backward(dres, g.lnfw, g.lnfb, a.d_ln, last, p.lnfw,
                                  a.lnf_mean, a.lnf_rstd, overwrite=(True, fresh, fresh))
        for l in reversed(range(cfg.n_layer)):
            residual = a.residual3[l - 1] if l > 0 else a.encoded
            # residual3 = residual2 + fcproj: dres is the gradient of fcproj, and
            # layernorm-2's backward adds into it to make the gradient of residual2.
            matmul.matmul_backward(a.d_fch_gelu, g.fcprojw[l], g.fcprojb[l], dres,
                                   a.fch_gelu[l], p.fcprojw[l], overwrite=(True, fresh, fresh))
            layers.gelu_backward(a.d_fch, a.fch[l], a.d_fch_gelu, overwrite=True)
            matmul.matmul_backward(a.d_ln, g.fcw[l], g.fcb[l], a.d_fch, a.ln2[l], p.fcw[l],
                                   overwrite=(True, fresh, fresh))
            layers.layernorm_backward(dres, g.ln2w[l], g.ln2b[l], a.d_ln, a.residual2[l],
                                      p.ln2w[l], a.ln2_mean[l], a.ln2_rstd[l],
                                      overwrite=(False, fresh, fresh))
            # residual2 = residual + attproj: the same again for the attention half.
            matmul.matmul_backward(a.d_atty, g.attprojw[l], g.attprojb[l], dres,
                                   a.atty[l], p.attprojw[l], overwrite=(True, fresh, fresh))
            attention.attention_backward(a.d_qkv, a.d_atty, a.qkv[l], a.atty[l], a.att_lse[l],
                                         NH, overwrite=True)
            matmul.matmul_backward(a.d_ln, g.qkvw[l], g.qkvb[l], a.d_qkv, a.ln1[l], p.qkvw[l],
                                   overwrite=(True, fresh, fresh))
            layers.layernorm_backward(dres, g.ln1w[l], g.ln1b[l], a.d_ln, residual,
                                      p.ln1w[l], a.ln1_mean[l], a.ln1_rstd[l],
                                      overwrite=(False, fresh, fresh))
        # wte already holds the LM head's gradient: the lookup adds to it.
        layers.encoder_backward(g.wte, g.wpe, dres, inputs, overwrite=(False, fresh))


# The name it had when GPT-2 was the only family.
GPT2 = Model


def time_training_step(config, B, T, repeats=3, engine="tape", seed=0, **model_kwargs):
    """Measure a full training step (zero grad, forward, backward, AdamW) on random tokens.

    Returns ``{"seconds": median step time, "peak_rss": the process's peak resident
    bytes, "tape_bytes": bytes the tape engine saved in its last forward pass (0 for
    the manual engine)}``; one warm-up step is not timed.
    """
    import time

    from gpt2.units import peak_rss_bytes

    model = Model(config, seed=seed, engine=engine, **model_kwargs)
    rng = np.random.default_rng(seed)
    x = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    model.train_step(x, y, lr=1e-4, weight_decay=0.1)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.train_step(x, y, lr=1e-4, weight_decay=0.1)
        times.append(time.perf_counter() - t0)
    tape_bytes = model._tape_engine.last_forward_bytes if model._tape_engine else 0
    model.close()
    return {"seconds": float(np.median(times)),
            "peak_rss": peak_rss_bytes(),
            "tape_bytes": int(tape_bytes)}
