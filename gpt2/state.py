"""One training state: what trains (parameters, their gradients, the AdamW moments and
step), wherever it lives, behind the one interface that the model, its tape engine,
checkpoints and the data-parallel trainer use.

``TrainingState`` is the interface; the implementations:

* ``ArenaState``: four arenas in RAM (``gpt2.params.ParamArena``; a LoRA run's adapters,
  ``gpt2.lora.LoraState``, are four ``AdapterArena``s);
* ``gpt2.offload.MomentState``: parameters and gradients in RAM, the moments on disk
  (``--offload moments``), updated during the next forward pass;
* ``gpt2.offload.FullOffloadState``: the blocks' parameters and gradients on disk too,
  streamed a block at a time (``--offload all``);
* ``gpt2.distributed.ZeroShardState``: ZeRO-1's, this rank's share of the moments, the
  parameters all-gathered after each update.

``training_state`` builds the state a ``Model``'s options ask for; ``planned_nbytes`` is
what it will hold in RAM, from sizes alone, the figure the memory planner
(``gpt2.perfmodel.plan``) weighs.  This module imports nothing compiled until a state is
built, so the planner can import it.  A caller never asks
which one it holds: it zeroes, measures and clips the gradients, runs AdamW, hands
``sections()`` to ``gpt2.checkpoint`` and closes through this interface.
"""
import numpy as np

from gpt2.units import FULL_WINDOW, UNIT_BYTES, WINDOW

OFFLOAD_POLICIES = (None, "moments", "all")
# offload="all" (gpt2.offload.FullOffload): the blocks whose parameters and gradients are
# in RAM at once.
FULL_OFFLOAD_SLOTS = 2


def _optim():
    from kernels import optim
    return optim


class TrainingState:
    """Parameters, gradients, AdamW moments and step of what trains.

    ``params``, ``grads``, ``adam_m``, ``adam_v``: the arrays held in RAM as arenas
    (``gpt2.params.FlatArena``), None where they are elsewhere.  ``step``: the AdamW
    updates taken.  ``lora``: a LoRA run's ``LoraConfig`` (the state is its adapters'),
    else None.  ``offload``: the object that moves state to and from disk (its
    ``stats()``, its ``file``), or None.  ``accumulates``: whether a backward pass may
    add into gradients a previous one left (False where each writes them anew).
    ``streams_blocks``: whether the blocks' parameters come and go during the pass
    (``backward_begin(l)`` / ``backward_done(l)`` as the sweep reaches and leaves block l).
    ``trains``: False for ``FrozenState``, a model that only runs forward passes.
    """

    params = grads = adam_m = adam_v = None
    lora = None
    offload = None
    accumulates = True
    streams_blocks = False
    trains = True

    def __init__(self):
        self.step = 0

    # -- gradients -----------------------------------------------------------------------

    def zero_grad(self):
        """Zero the gradients now."""
        _optim().zero_grad(self.grads.flat)

    def begin_step(self):
        """A training step starts (its backward passes will make the gradients)."""

    def grad_norm(self):
        """The global norm of the gradients."""
        return _optim().grad_norm(self.grads.flat)

    def clip_grad_norm(self, max_norm):
        """Scale the gradients to global norm ``max_norm`` at most; returns the norm before."""
        return _optim().clip_grad_norm(self.grads.flat, max_norm)

    # -- the update ----------------------------------------------------------------------

    def adamw(self, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, grad_scale=1.0,
              defer=False):
        """One AdamW update of every parameter (PyTorch semantics, decay on all of them),
        the gradients multiplied by ``grad_scale`` as they are read; ``step`` counts it.
        An implementation may defer it into the next forward pass (``ready``): the
        offloaded ones always do, ``ArenaState`` where ``defer`` (its model runs bf16
        products and the next forward writes the weights' bf16 copies in the update's
        pass); the others ignore ``defer``."""
        raise NotImplementedError

    def ready(self, stage):
        """The forward pass is about to run ``stage`` ("embed", a block's index, "head"):
        the parameters it reads are there and updated."""

    def read_ahead(self):
        """The forward pass is over: start moving in what the next update reads."""

    def finish(self):
        """Complete a deferred update: before anything but the next training step reads
        the parameters (a checkpoint, an evaluation, a sample)."""

    # -- whole arrays: checkpoints, sampling, exports ------------------------------------

    def sections(self):
        """(parameters, first moment, second moment) as ``gpt2.checkpoint`` saves and
        loads them: arenas, or sections streamed from and to disk (``pieces()``,
        ``load()``).  Collective under data parallelism (None on the ranks that do not
        write)."""
        self.finish()
        return self.params, self.adam_m, self.adam_v

    def param_arena(self):
        """Every parameter as a ParamArena in llm.c order (a copy where they are not one
        arena in RAM)."""
        self.finish()
        return self.params

    def set_params(self, arena):
        """Copy a ParamArena's values into the parameters."""
        self.finish()
        self.params.copy_(arena)

    def load_moment(self, which, flat):
        """Set moment ``which`` (0: m, 1: v) from a flat float32 array in this state's
        order (None: zeros)."""
        mine = (self.adam_m, self.adam_v)[which]
        if flat is None:
            mine.zero_()
        else:
            np.copyto(mine.flat, flat)

    def share_moment(self, which, flat, comm):
        """Collective over ``comm``: moment ``which`` from rank 0's whole ``flat`` in this
        state's order (the other ranks pass None), each rank keeping what it holds."""
        if comm.Get_rank() != 0:
            flat = np.empty(self.params.flat.size, np.float32)
        comm.Bcast(flat, root=0)
        self.load_moment(which, flat)

    # -- memory ------------------------------------------------------------------------

    @property
    def nbytes(self):
        """Bytes of the state held in RAM (arenas, slots and unit buffers)."""
        return sum(a.nbytes for a in (self.params, self.grads, self.adam_m, self.adam_v)
                   if a is not None)

    def close(self):
        """Release what the state holds outside the process's memory (its files)."""


class ArenaState(TrainingState):
    """Parameters, gradients and both moments as four arenas in RAM.

    With ``adamw(..., defer=True)`` (``Model.train_step`` asks for it where the step's
    products are bf16) the update waits for the next forward pass: at its first stage it
    runs with the parameters' bf16 rounding written in the same pass (``bf16_copies``,
    handed to the tape engine by ``take_bf16_copies``), so the products' copies of the
    weights cost no pass of their own over the parameters (GPT-2 124M (1, 64) on Zen 4:
    21 of 236 ms).  ``finish()`` (every reader of the parameters or moments calls it)
    runs a pending update at once."""

    pending = None          # (step, lr, beta1, beta2, eps, weight_decay, grad_scale)
    bf16_copies = None      # uint16, the parameters rounded to bf16 by the last deferred update
    _copies_fresh = False

    def __init__(self, params, grads, adam_m, adam_v):
        super().__init__()
        self.params, self.grads, self.adam_m, self.adam_v = params, grads, adam_m, adam_v

    @classmethod
    def for_model(cls, config, seed=0):
        """A model of ``config`` initialized from ``seed``, zero gradients and moments."""
        from gpt2.params import ParamArena, init_params_
        return cls(init_params_(ParamArena(config), seed), ParamArena(config),
                   ParamArena(config), ParamArena(config))

    def adamw(self, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, grad_scale=1.0,
              defer=False):
        self.finish()
        self.step += 1
        update = (self.step, lr, beta1, beta2, eps, weight_decay, grad_scale)
        if defer:
            self.pending = update
        else:
            self._update(update, None)

    def _update(self, update, out_bf16):
        step, lr, beta1, beta2, eps, weight_decay, grad_scale = update
        _optim().adamw_step(self.params.flat, self.grads.flat, self.adam_m.flat, self.adam_v.flat,
                            step, lr, beta1, beta2, eps, weight_decay, grad_scale=grad_scale,
                            out_bf16=out_bf16)

    def bf16_arena(self):
        """The parameters' bf16 copies, one uint16 arena (allocated on first use): where
        a deferred update writes them and where the products' conversions go meanwhile."""
        if self.bf16_copies is None:
            from adtape import buffers
            self.bf16_copies = buffers.empty(self.params.flat.size, np.uint16)
        return self.bf16_copies

    def ready(self, stage):
        if self.pending is not None and stage == "embed":
            update, self.pending = self.pending, None
            self._copies_fresh = False
            self._update(update, self.bf16_arena())
            self._copies_fresh = True

    def take_bf16_copies(self):
        """The parameters' bf16 rounding if the update that just ran at this forward
        pass's first stage wrote it (once), else None."""
        fresh, self._copies_fresh = self._copies_fresh, False
        return self.bf16_copies if fresh else None

    def finish(self):
        if self.pending is not None:
            update, self.pending = self.pending, None
            self._update(update, None)


class FrozenState(TrainingState):
    """Parameters alone, for a model that only runs forward passes (``Model.for_inference``:
    gpt2-eval's): 4 bytes per parameter where training holds 16.  Everything that
    trains raises."""

    trains = False

    def __init__(self, params):
        super().__init__()
        self.params = params

    def refuse(self, *args, **kwargs):
        """Raise: what trains needs gradients and moments this state does not hold."""
        raise RuntimeError("this model is for inference (Model.for_inference): it holds no "
                           "gradients and no optimizer state; build a Model to train")

    zero_grad = grad_norm = clip_grad_norm = adamw = load_moment = share_moment = refuse

    def sections(self):
        return self.params, None, None


def planned_nbytes(offload, arena_bytes, outside_params, block_params, float_bytes=4):
    """The model-state bytes in RAM of ``training_state(config, offload=offload)`` from
    sizes alone: ``arena_bytes`` of the four arenas (parameters, gradients, two moments;
    a LoRA model's frozen base and adapters' four), ``outside_params`` the parameters
    outside the blocks, ``block_params`` one block's.  In RAM: the arenas; with the
    moments on disk half of them and the offload's unit buffers; with everything
    offloaded the parameters and gradients outside the blocks, FULL_OFFLOAD_SLOTS
    blocks' and the unit buffers (a block's gradients or a unit of moments).  The
    states' ``nbytes`` count the same (tests/gpt2/test_state.py; less where a model's
    stages cannot fill a unit)."""
    if offload not in OFFLOAD_POLICIES:
        raise ValueError(f"offload must be one of {', '.join(map(repr, OFFLOAD_POLICIES))}, "
                         f"got {offload!r}")
    if offload == "moments":
        moments = arena_bytes / 2
        return moments + WINDOW * min(UNIT_BYTES, moments)
    if offload == "all":
        block = float_bytes * block_params
        return (2 * float_bytes * outside_params + FULL_OFFLOAD_SLOTS * 2 * block
                + FULL_WINDOW * max(block, min(UNIT_BYTES, arena_bytes / 2)))
    return arena_bytes


def training_state(config, seed=0, offload=None, offload_dir=None):
    """The training state of a model of ``config`` initialized from ``seed``, its
    ``offload`` policy: None (in RAM), "moments" or "all" (on disk in ``offload_dir``)."""
    if offload not in OFFLOAD_POLICIES:
        raise ValueError(f"offload must be one of {', '.join(map(repr, OFFLOAD_POLICIES))}, "
                         f"got {offload!r}")
    if offload is None:
        return ArenaState.for_model(config, seed)
    from gpt2.offload import FullOffloadState, MomentState
    if offload == "moments":
        return MomentState.for_model(config, seed, offload_dir)
    return FullOffloadState.for_model(config, seed, offload_dir)
