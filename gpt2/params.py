"""Parameter layout of any family (the config's ``param_shapes``), the one-allocation
arena and GPT-2-style initialization."""
import math

import numpy as np

from adtape import buffers
from gpt2.families import family_of
from gpt2.families.gpt2 import GPT2Config

# GPT-2's parameter names in llm.c order, and those with one slice per block.
PARAM_NAMES = ("wte", "wpe", *GPT2Config.per_layer, "lnfw", "lnfb")
PER_LAYER = GPT2Config.per_layer
INIT_STD = 0.02


def _check_config(config):
    family_of(config)       # a TypeError for anything but a registered family's config


def param_shapes(config):
    """Ordered dict name -> shape of every parameter tensor, in file order (llm.c's for
    GPT-2)."""
    _check_config(config)
    return config.param_shapes()


def num_parameters(config):
    """Total float count of the layout (wte counted with its padded rows)."""
    return sum(math.prod(s) for s in param_shapes(config).values())


def param_offsets(config):
    """Ordered dict name -> (start, stop) element offsets into the flat arena."""
    offsets, start = {}, 0
    for name, shape in param_shapes(config).items():
        stop = start + math.prod(shape)
        offsets[name] = (start, stop)
        start = stop
    return offsets


def layer_major_offsets(config):
    """Ordered dict (name, layer) -> (start, stop) element offsets of the layer-major order:
    the parameters before the blocks' (GPT-2: wte, wpe), then block 0's parameters
    (ln1w ... fcprojb), block 1's, ..., then the rest (lnfw, lnfb) (layer None for the
    parameters that are not per block).  Each block is one contiguous run, so the reverse
    sweep finishes the arena from its end towards its start."""
    shapes = param_shapes(config)
    names = list(shapes)
    per_layer = config.per_layer
    first = names.index(per_layer[0])
    offsets, start = {}, 0
    order = ([(name, None) for name in names[:first]]
             + [(name, l) for l in range(config.n_layer) for name in per_layer]
             + [(name, None) for name in names[first + len(per_layer):]])
    for name, layer in order:
        shape = shapes[name] if layer is None else shapes[name][1:]
        offsets[name, layer] = (start, start + math.prod(shape))
        start += math.prod(shape)
    return offsets


class FlatArena:
    """Named float32 arrays in ONE buffer: ``flat`` is the 1-D buffer, ``views[name]``
    (also ``arena.name``) shaped views into it, in the order of ``shapes``, so zeroing,
    copying or an optimizer update over all of them is one operation on ``flat``.  Pass
    ``flat`` to wrap an existing buffer (a checkpoint read in place, a padded
    data-parallel arena) instead of allocating."""

    def __init__(self, shapes, flat=None):
        self.flat = self._checked_flat(flat, sum(math.prod(s) for s in shapes.values()))
        self.views, start = {}, 0
        for name, shape in shapes.items():
            stop = start + math.prod(shape)
            self.views[name] = self.flat[start:stop].reshape(shape)
            start = stop

    def _checked_flat(self, flat, n):
        kind = type(self).__name__
        if flat is None:
            return buffers.zeros(n)
        if not isinstance(flat, np.ndarray):
            raise TypeError(f"{kind} flat must be a numpy array, got {type(flat).__name__}")
        if flat.dtype != np.float32 or flat.ndim != 1 or flat.size != n:
            raise ValueError(f"{kind} flat must be 1-D float32 of {n} elements for this "
                             f"layout, got {flat.dtype} with shape {flat.shape}")
        if not flat.flags.c_contiguous:
            raise ValueError(f"{kind} flat must be C-contiguous")
        return flat

    def __getattr__(self, name):
        # Only reached when normal lookup fails: the names resolve to their views.
        views = self.__dict__.get("views")
        if views is not None and name in views:
            return views[name]
        raise AttributeError(f"{type(self).__name__} has no attribute or parameter {name!r}")

    def __len__(self):
        return self.flat.size

    @property
    def nbytes(self):
        return self.flat.nbytes

    def zero_(self):
        self.flat.fill(0.0)
        return self

    def copy_(self, other):
        """Copy another arena of the same layout into this one."""
        if type(other) is not type(self) or other.views.keys() != self.views.keys():
            raise ValueError(f"copy_ needs a {type(self).__name__} of the same layout")
        np.copyto(self.flat, other.flat)
        return self

    def pieces(self):
        """(start, float32 array) of the arena in its saved order: what ``gpt2.checkpoint``
        writes of it (as of a section streamed from disk, ``gpt2.offload.StreamedState``)."""
        yield 0, self.flat

    def load(self, read_into):
        """Fill the arena in its saved order from ``read_into(array)`` (a checkpoint's
        section read sequentially)."""
        read_into(self.flat)

    def in_sweep_order(self, flat):
        """An arena of this layout over ``flat``, in the order the reverse sweep makes
        its gradients final (the data-parallel trainer's: each gradient bucket is
        reduced as soon as the sweep leaves it)."""
        return FlatArena({name: view.shape for name, view in self.views.items()}, flat)


class ParamArena(FlatArena):
    """All parameters of a model (or gradients, or optimizer moments) in one
    ``FlatArena`` of the config's layout.

    ``layer_major``: ``flat`` holds the parameters in ``layer_major_offsets`` order instead of
    llm.c's (the data-parallel trainer's arenas, whose gradient buckets then become final
    one after another during the reverse sweep).  The views have the same names and shapes;
    a per-block view such as ``qkvw`` (L, 3C, C) is then strided over the blocks, each
    ``qkvw[l]`` still contiguous.  Checkpoints and model files are always written and read
    in llm.c order (``gpt2.checkpoint`` reorders such an arena).
    """

    def __init__(self, config, flat=None, layer_major=False):
        _check_config(config)
        self.config = config
        self.layer_major = bool(layer_major)
        shapes = param_shapes(config)
        if not self.layer_major:
            super().__init__(shapes, flat)
            return
        flat = self.flat = self._checked_flat(flat, num_parameters(config))
        offsets = layer_major_offsets(config)
        L, per_layer = config.n_layer, config.per_layer
        blocks_start = offsets[per_layer[0], 0][0]
        block = sum(math.prod(shapes[name][1:]) for name in per_layer)
        blocks = flat[blocks_start:blocks_start + L * block].reshape(L, block)
        self.views = {}
        for name, shape in shapes.items():
            if name in per_layer:
                start, stop = offsets[name, 0]
                view = blocks[:, start - blocks_start:stop - blocks_start].view()
                view.shape = shape      # raises rather than copy: the view must alias flat
            else:
                start, stop = offsets[name, None]
                view = flat[start:stop].reshape(shape)
            self.views[name] = view

    def copy_(self, other):
        """Copy another arena of the same config into this one (in either order)."""
        if not isinstance(other, ParamArena) or other.config != self.config:
            raise ValueError("copy_ needs a ParamArena with the same config")
        if other.layer_major == self.layer_major:
            np.copyto(self.flat, other.flat)
        else:
            for name, view in self.views.items():
                np.copyto(view, other.views[name])
        return self

    def in_sweep_order(self, flat):
        return ParamArena(self.config, flat=flat, layer_major=True)

    def pieces(self):
        yield 0, self.in_llmc_order().flat      # saved in llm.c order

    def load(self, read_into):
        # Saved in llm.c order: a layer-major arena is filled from a copy.
        saved = self if not self.layer_major else ParamArena(self.config)
        read_into(saved.flat)
        if saved is not self:
            self.copy_(saved)

    def in_llmc_order(self):
        """This arena if it is in llm.c order, else a copy in llm.c order."""
        return self if not self.layer_major else ParamArena(self.config).copy_(self)

    def __repr__(self):
        order = ", layer-major" if self.layer_major else ""
        return f"ParamArena({self.config}, {self.flat.size} floats{order})"


def init_params_(arena, seed):
    """GPT-2's initialization in place, deterministic in ``seed``; returns the arena.

    Weights ~ normal(0, 0.02), the config's residual projections (GPT-2: attprojw,
    fcprojw; Llama: none, as transformers initializes it) scaled by 1/sqrt(2 * n_layer),
    biases 0, norm weights 1, padded vocabulary rows 0.
    """
    if not isinstance(arena, ParamArena):
        raise TypeError(f"init_params_ needs a ParamArena, got {type(arena).__name__}")
    config = arena.config
    rng = np.random.Generator(np.random.PCG64(seed))
    arena.zero_()
    for name, std, rows in init_rules(config):
        view = arena.views[name]
        if std is None:
            view.fill(1.0)
        elif std:
            target = view[:rows]
            rng.standard_normal(out=target, dtype=np.float32)
            target *= std
    return arena


def init_rules(config):
    """``init_params_``'s rule per parameter, in the layout's order, as (name, std, rows):
    std None for a norm weight (ones), 0 for a bias (zeros), else the float32 standard
    deviation of the normal draws filling the first ``rows`` rows (the real vocabulary of
    wte and lm_head; padded rows stay 0), each drawn in turn from one PCG64 stream."""
    residual_std = INIT_STD / math.sqrt(2 * config.n_layer)
    for name, shape in config.param_shapes().items():
        if name in config.norm_weights:
            yield name, None, shape[0]
        elif name in config.biases:
            yield name, np.float32(0.0), shape[0]
        else:
            std = residual_std if name in config.residual_projections else INIT_STD
            yield name, np.float32(std), config.vocab_size if name in ("wte", "lm_head") else shape[0]
