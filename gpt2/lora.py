"""LoRA: low-rank adapters on a frozen base (Hu et al. 2021, as Hugging Face peft does it).

Each adapted projection ``W`` (out, in) gains ``scale * B @ A`` with A (r, in) and B (out,
r): ``y = x W^T + scale * (dropout(x) A^T) B^T``, scale ``alpha / r`` (rsLoRA: ``alpha /
sqrt(r)``).  A starts uniform in +-1/sqrt(in) (peft's kaiming_uniform with a = sqrt(5)), B
at zero, so training starts from the base model.  Only the adapters train: the base has
no gradient, no AdamW moments and no weight-gradient products, and it may be held in bf16
(``base_dtype="bf16"``: half the bytes; its products then run in bf16, as
``--precision bf16`` runs them).

Our weights pack several of Hugging Face's projections (Llama's q|k|v in ``qkvw``, gate|up
in ``gateupw``); peft adapts each projection on its own, so one packed weight carries one
A per adapted projection, stacked, and their B's stacked in row order
(``Family.lora_targets`` says which rows are which projection).  ``LoraState`` holds
every adapter, its gradients and its moments, each one flat float32 arena;
``gpt2.peft_io`` reads and writes them in peft's format.
"""
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from adtape import buffers, nn
from adtape.tensor import Tensor, _state
from gpt2.families import family_of
from gpt2.families.base import Recorded
from gpt2.params import FlatArena
from gpt2.state import ArenaState


@dataclass(frozen=True)
class LoraConfig:
    """r: the adapters' rank; alpha: their scale's numerator; dropout: on the adapters'
    input while training; targets: the module names adapted (peft's ``target_modules``,
    e.g. ("q_proj", "v_proj"); None: every projection of the family); rslora: scale
    alpha / sqrt(r) instead of alpha / r."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple = None
    rslora: bool = False

    def __post_init__(self):
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoRA rank r must be a positive int, got {self.r!r}")
        if (isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float))
                or not math.isfinite(self.alpha) or self.alpha <= 0):
            raise ValueError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        if (isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float))
                or not 0 <= self.dropout < 1):
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if self.targets is not None:
            targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
            if not targets or not all(isinstance(t, str) and t for t in targets):
                raise ValueError(f"LoRA targets must be module names, got {self.targets!r}")
            object.__setattr__(self, "targets", tuple(dict.fromkeys(targets)))

    @property
    def scale(self):
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)

    def groups(self, config):
        """The adapted weights of ``config``'s family, in parameter order:
        ``[(weight, ((module, hf_module, start, rows), ...)), ...]``."""
        table = family_of(config).lora_targets(config)
        known = list(dict.fromkeys(m for parts in table.values() for m, *_ in parts))
        wanted = known if self.targets is None else self.targets
        unknown = [t for t in wanted if t not in known]
        if unknown:
            raise ValueError(f"LoRA target(s) {', '.join(map(repr, unknown))} are not "
                             f"projections of a {family_of(config).title} model; its "
                             f"targets: {', '.join(known)}")
        order = [name for name in config.param_shapes() if name in table]
        out = []
        for weight in order:
            parts = tuple(p for p in table[weight] if p[0] in wanted)
            if parts:
                out.append((weight, parts))
        return out

    def to_dict(self):
        return {"r": self.r, "alpha": self.alpha, "dropout": self.dropout,
                "targets": list(self.targets) if self.targets is not None else None,
                "rslora": self.rslora}

    @classmethod
    def from_dict(cls, d):
        d = dict(d)
        if d.get("targets") is not None:
            d["targets"] = tuple(d["targets"])
        return cls(**d)


def adapter_shapes(config, lora):
    """Ordered dict ``"<weight>.lora_A"`` -> (L, k*r, in) and ``"<weight>.lora_B"`` ->
    (L, rows, r) for each adapted weight (k projections, ``rows`` their output rows)."""
    shapes = {}
    pshapes = config.param_shapes()
    for weight, parts in lora.groups(config):
        L, _, fan_in = pshapes[weight]
        shapes[f"{weight}.lora_A"] = (L, len(parts) * lora.r, fan_in)
        shapes[f"{weight}.lora_B"] = (L, sum(p[3] for p in parts), lora.r)
    return shapes


class AdapterArena(FlatArena):
    """Every adapter matrix (or their gradients, or a moment) in one ``FlatArena`` whose
    views are shaped as ``adapter_shapes`` says."""

    def __init__(self, config, lora, flat=None):
        self.config, self.lora = config, lora
        super().__init__(adapter_shapes(config, lora), flat)

    def in_sweep_order(self, flat):
        # Weight by weight, each A of every block then its B: the sweep's order already.
        return AdapterArena(self.config, self.lora, flat=flat)


def init_adapters_(arena, seed):
    """peft's initialization: each A uniform in +-1/sqrt(in) (kaiming_uniform with
    a = sqrt(5)), each B zero.  Deterministic in ``seed``."""
    rng = np.random.Generator(np.random.PCG64(seed))
    for name, view in arena.views.items():
        if name.endswith(".lora_A"):
            bound = 1.0 / math.sqrt(view.shape[-1])
            view[...] = rng.uniform(-bound, bound, view.shape).astype(np.float32)
        else:
            view.fill(0.0)
    return arena


class LoraState(ArenaState):
    """The trainable state of a LoRA run (a ``gpt2.state.ArenaState``): the adapters,
    their gradients and AdamW moments, each an ``AdapterArena``; the frozen base is the
    model's.  ``sections()`` are the adapters' (a checkpoint holds no base)."""

    def __init__(self, config, lora, seed=0):
        super().__init__(init_adapters_(AdapterArena(config, lora), seed),
                         AdapterArena(config, lora), AdapterArena(config, lora),
                         AdapterArena(config, lora))
        self.config, self.lora = config, lora
        self.rng = np.random.Generator(np.random.PCG64([seed, 1]))   # dropout masks

    @property
    def num_parameters(self):
        return self.params.flat.size

    def delta(self, weight, layer):
        """``scale * B @ A`` of ``weight`` in block ``layer``, as a dict of row slices:
        ``{(start, rows): (rows, in) float32}``."""
        lora = self.lora
        parts = dict(lora.groups(self.config))[weight]
        a = self.params.views[f"{weight}.lora_A"][layer]
        b = self.params.views[f"{weight}.lora_B"][layer]
        out, row = {}, 0
        for j, (_, _, start, rows) in enumerate(parts):
            out[start, rows] = np.float32(lora.scale) * (
                b[row:row + rows].astype(np.float64) @ a[j * lora.r:(j + 1) * lora.r]
            ).astype(np.float32)
            row += rows
        return out

    def merged(self, params):
        """A copy of the base ``params`` (a float32 ParamArena or a Bf16Base) with every
        adapter added into its weight: the model the adapters make, as a float32
        ParamArena (``MergedParams`` reads it a tensor at a time)."""
        return MergedParams(params, self).to_arena()


class MergedParams:
    """The model a base (a float32 ParamArena or a Bf16Base) and its adapters (a
    LoraState) make, read a tensor at a time, for the exports that write one tensor at a
    time (``gpt2.hf.save_dir``, ``gpt2.gguf_export.save_gguf``): ``views[name][layer]``
    of a block weight is that block's float32 matrix with the adapters merged (the base
    widened where it is bf16, ``scale * B @ A`` added to the adapted rows), computed when
    read; ``views[name]`` of any other tensor its float32 values.  No float32 copy of
    the whole model is made: an 8B model held in bf16 exports in its own 16 GB."""

    layer_major = False

    def __init__(self, base, adapters):
        if base.config != adapters.config:
            raise ValueError("MergedParams: the base and the adapters are of other models")
        self.config, self.base, self.adapters = base.config, base, adapters
        self._adapted = {weight for weight, _ in adapters.lora.groups(self.config)}
        self.views = _MergedViews(self)

    def in_llmc_order(self):
        return self

    def block(self, name, layer):
        """Block ``layer``'s ``name``, float32, the adapters merged: a new array."""
        view = self.base.views[name][layer]
        out = _widen(view) if view.dtype == np.uint16 else np.array(view, dtype=np.float32)
        if name in self._adapted:
            for (start, rows), d in self.adapters.delta(name, layer).items():
                out[start:start + rows] += d
        return out

    def tensor(self, name):
        """A tensor outside the blocks, float32 (a bf16 one widened)."""
        view = self.base.views[name]
        return _widen(view) if view.dtype == np.uint16 else view

    def to_arena(self):
        """Every tensor in a float32 ParamArena (the one float32 copy of the model)."""
        from gpt2.params import ParamArena
        arena = ParamArena(self.config)
        for name, view in arena.views.items():
            if name in self.config.per_layer:
                for layer in range(self.config.n_layer):
                    view[layer] = self.block(name, layer)
            else:
                view[...] = self.tensor(name)
        return arena


class _MergedViews(Mapping):
    """``MergedParams.views``: name -> the float32 tensor, or for a block weight an object
    indexed by block."""

    def __init__(self, merged):
        self._merged = merged

    def __getitem__(self, name):
        merged = self._merged
        if name in merged.config.per_layer:
            return _MergedBlocks(merged, name)
        return merged.tensor(name)

    def __iter__(self):
        return iter(self._merged.config.param_shapes())

    def __len__(self):
        return len(self._merged.config.param_shapes())


class _MergedBlocks:
    """The blocks of one weight of ``MergedParams``: ``[layer]`` merges that block."""

    def __init__(self, merged, name):
        self._merged, self._name = merged, name
        self.shape = merged.config.param_shapes()[name]

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, layer):
        if not isinstance(layer, (int, np.integer)):
            raise TypeError(f"{self._name} of a merged model is read a block at a time, "
                            f"not [{layer!r}]")
        return self._merged.block(self._name, int(layer))


# -- the base held in bf16 --------------------------------------------------------------------

def _widen(u16):
    """float32 values of a bf16 (uint16) array (exact; kernels.bf16.from_bf16 on our
    threads)."""
    from kernels import bf16
    u16 = np.ascontiguousarray(u16)
    out = buffers.empty(u16.shape)
    bf16.from_bf16(out, u16)
    return out


class Bf16Base:
    """A frozen base model's parameters with its matrices in bf16: ``views[name]`` are
    uint16 arrays for the weight matrices and embeddings, float32 for the norms and
    biases (a few floats a block).  Built from a float32 ParamArena (``from_arena``) or
    initialized as ``gpt2.params.init_params_`` would, then rounded (``random``), one
    tensor at a time so that no float32 copy of the whole model exists."""

    def __init__(self, config, views):
        self.config, self.views = config, views

    @staticmethod
    def _is_matrix(config, name):
        return len(config.param_shapes()[name]) >= (3 if name in config.per_layer else 2)

    @classmethod
    def from_arena(cls, arena):
        from kernels import bf16
        views = {}
        for name, view in arena.views.items():
            if cls._is_matrix(arena.config, name):
                out = buffers.empty(view.shape, np.uint16)
                bf16.to_bf16(out, np.ascontiguousarray(view))
                views[name] = out
            else:
                views[name] = np.array(view, dtype=np.float32)
        return cls(arena.config, views)

    @classmethod
    def empty(cls, config):
        """Zeros of ``config``'s layout (matrices uint16, the rest float32)."""
        return cls(config, {name: buffers.zeros(shape, np.uint16 if cls._is_matrix(config, name)
                                                 else np.float32)
                            for name, shape in config.param_shapes().items()})

    @classmethod
    def load_hf(cls, directory):
        """The base of a Hugging Face directory, rounded to bf16: read one tensor at a time
        where the family can (Llama, Qwen2: no float32 copy of the model), else read whole
        and rounded."""
        from gpt2 import hf
        config = hf.read_config(directory)
        family = family_of(config)
        if not family.loads_into_bf16:
            return cls.from_arena(family.load_hf(directory, config))
        base = cls.empty(config)
        family.load_hf(directory, config, into=base)
        return base

    @classmethod
    def random(cls, config, seed=0):
        """``init_params_``'s values (same seed, same stream), rounded to bf16."""
        from gpt2.params import init_rules
        from kernels import bf16
        rng = np.random.Generator(np.random.PCG64(seed))
        views = {}
        chunk = buffers.empty(1 << 22)
        shapes = config.param_shapes()
        for name, std, rows in init_rules(config):
            matrix = cls._is_matrix(config, name)
            out = buffers.zeros(shapes[name], np.uint16) if matrix else buffers.zeros(shapes[name])
            views[name] = out
            if std is None:
                out.fill(1.0)
                continue
            if not std:
                continue
            flat = out[:rows].reshape(-1)
            for start in range(0, flat.size, chunk.size):
                piece = chunk[:min(chunk.size, flat.size - start)]
                rng.standard_normal(out=piece, dtype=np.float32)
                piece *= std
                if matrix:
                    bf16.to_bf16(flat[start:start + piece.size], piece)
                else:
                    flat[start:start + piece.size] = piece
        return cls(config, views)

    @property
    def nbytes(self):
        return sum(v.nbytes for v in self.views.values())

    def to_arena(self):
        """The float32 ParamArena of these values (exact)."""
        from gpt2.params import ParamArena
        arena = ParamArena(self.config)
        for name, view in self.views.items():
            arena.views[name][...] = _widen(view) if view.dtype == np.uint16 else view
        return arena


# -- the ops -----------------------------------------------------------------------------------

class LoraWeight:
    """A frozen base weight and its adapters, as a family's ops see ``w["qkvw"]``."""

    __slots__ = ("base", "a", "b", "splits", "scale", "dropout", "rng")

    def __init__(self, base, a, b, splits, scale, dropout, rng):
        self.base, self.a, self.b, self.splits = base, a, b, splits
        self.scale, self.dropout, self.rng = scale, dropout, rng


def block_weights(params, adapters=None):
    """(the parameters outside the blocks by name, each block's by name) of ``params`` (a
    ParamArena or Bf16Base), each weight ``adapters`` (a LoraState, or None) adapts a
    ``LoraWeight`` of arrays (no dropout): what ``gpt2.generate.Decoder`` runs, the
    adapters unmerged, so that no copy of the base is made."""
    config, views = params.config, params.views
    layers = [{name: views[name][l] for name in config.per_layer}
              for l in range(config.n_layer)]
    groups = adapters.lora.groups(config) if adapters is not None else ()
    for weight, parts in groups:
        splits = tuple((start, rows) for _, _, start, rows in parts)
        a, b = (adapters.params.views[f"{weight}.lora_{x}"] for x in "AB")
        for l, layer in enumerate(layers):
            layer[weight] = LoraWeight(layer[weight], a[l], b[l], splits, adapters.lora.scale,
                                       0.0, None)
    return views, layers


class LoraRecorded(Recorded):
    """The recorded operations with LoRA: a ``LoraWeight`` runs ``nn.lora_linear``; a
    bf16 embedding table is read by a gather (frozen: nothing to record)."""

    @staticmethod
    def linear(x, weight, bias=None):
        if type(weight) is LoraWeight:
            # Dropout while training only (a recorded pass), as torch's module.train().
            dropout = weight.dropout if _state.enabled else 0.0
            return nn.lora_linear(x, weight.base, bias, weight.a, weight.b, weight.splits,
                                  weight.scale, dropout, weight.rng)
        return nn.linear(x, weight, bias)

    @staticmethod
    def swiglu_linear(gate_up, weight, bias=None):
        if type(weight) is LoraWeight:
            return LoraRecorded.linear(nn.swiglu(gate_up), weight, bias)
        return nn.swiglu_linear(gate_up, weight, bias)

    @staticmethod
    def embed(ids, wte, wpe):
        table = wte.data if type(wte) is Tensor else wte
        if table.dtype != np.uint16:
            return Recorded.embed(ids, wte, wpe)
        x = _widen(table[np.asarray(ids)])
        if wpe is not None:
            pos = (wpe.data if type(wpe) is Tensor else wpe)[:ids.shape[1]]
            x += _widen(pos) if pos.dtype == np.uint16 else pos
        return Tensor(x)

    @staticmethod
    def logits(h, weight):
        return nn.linear(h, weight, None)


LORA_RECORDED = LoraRecorded()


# -- peft's names -------------------------------------------------------------------------------

PEFT_PREFIX = "base_model.model."


def peft_tensors(state):
    """``{peft key: array}`` of every adapter, as peft's ``get_peft_model_state_dict``
    names them (``base_model.model.<module>.lora_A.weight`` (r, in) and ``.lora_B.weight``
    (out, r)): views into the adapter arena, no copies."""
    lora, out = state.lora, {}
    for weight, parts in lora.groups(state.config):
        pa = state.params.views[f"{weight}.lora_A"]
        pb = state.params.views[f"{weight}.lora_B"]
        for layer in range(state.config.n_layer):
            row = 0
            for j, (_, module, _, rows) in enumerate(parts):
                key = PEFT_PREFIX + module.format(layer=layer)
                out[key + ".lora_A.weight"] = pa[layer, j * lora.r:(j + 1) * lora.r]
                out[key + ".lora_B.weight"] = pb[layer, row:row + rows]
                row += rows
    return out


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def save_adapter(directory, state, base_model=None):
    """Write the adapters as peft writes them: ``adapter_config.json`` and
    ``adapter_model.safetensors`` (float32) in ``directory``, so that
    ``peft.PeftModel.from_pretrained(base, directory)`` loads them (no missing or
    unexpected keys).  ``base_model``: ``base_model_name_or_path`` (the base's directory)."""
    import json
    import os

    from gpt2.checkpoint import atomic_writer, write_safetensors
    lora, config = state.lora, state.config
    os.makedirs(directory, exist_ok=True)
    modules = list(dict.fromkeys(m for _, parts in lora.groups(config) for m, *_ in parts))
    fields = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
              "target_modules": modules, "use_rslora": lora.rslora, "bias": "none",
              "fan_in_fan_out": config.family == "gpt2", "inference_mode": True,
              "init_lora_weights": True, "use_dora": False, "modules_to_save": None,
              "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
              "alpha_pattern": {}, "revision": None}
    write_safetensors(os.path.join(directory, ADAPTER_WEIGHTS),
                      {k: np.ascontiguousarray(v) for k, v in peft_tensors(state).items()},
                      metadata={"format": "pt"})
    with atomic_writer(os.path.join(directory, ADAPTER_CONFIG)) as f:
        f.write(json.dumps(fields, indent=2).encode("utf-8"))


def read_adapter_config(directory, config):
    """The LoraConfig of a peft adapter directory for a model of ``config``; a ValueError
    naming what we cannot read (another PEFT method, DoRA, per-layer ranks, ...)."""
    import json
    import os
    path = os.path.join(directory, ADAPTER_CONFIG)
    try:
        with open(path, encoding="utf-8") as f:
            fields = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{directory}: no {ADAPTER_CONFIG} (not a peft adapter directory)") \
            from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(fields, dict) or fields.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type must be LORA, got "
                         f"{fields.get('peft_type') if isinstance(fields, dict) else fields!r}")
    for key, ok in (("use_dora", (False, None)), ("bias", ("none", None)),
                    ("layers_to_transform", (None,)), ("rank_pattern", ({}, None)),
                    ("alpha_pattern", ({}, None)), ("modules_to_save", (None, [])),
                    ("lora_bias", (False, None))):
        if fields.get(key) not in ok:
            raise ValueError(f"{path}: {key} {fields[key]!r} is not supported (we read "
                             f"{key} {ok[0]!r})")
    targets = fields.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{path}: target_modules must be a list of module names, got "
                         f"{targets!r}")
    try:
        lora = LoraConfig(r=fields.get("r"), alpha=fields.get("lora_alpha"),
                          dropout=fields.get("lora_dropout") or 0.0, targets=tuple(targets),
                          rslora=bool(fields.get("use_rslora")))
        lora.groups(config)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    return lora


def load_adapter(directory, state):
    """Read a peft adapter directory's tensors into ``state`` (whose LoraConfig is the
    directory's, ``read_adapter_config``); every key must be there with its shape."""
    import os

    from gpt2.checkpoint import SafetensorsFile
    path = os.path.join(directory, ADAPTER_WEIGHTS)
    if not os.path.exists(path):
        raise ValueError(f"{directory}: no {ADAPTER_WEIGHTS}")
    f = SafetensorsFile(path)
    # peft writes no adapter name; a file saved from a model's state_dict has ".default".
    names = {k.replace(".default.weight", ".weight"): k for k in f.entries}
    wanted = peft_tensors(state)
    missing = sorted(set(wanted) - set(names))
    unexpected = sorted(set(names) - set(wanted))
    if missing or unexpected:
        raise ValueError(f"{path} does not fit this model's adapters (r {state.lora.r}): "
                         + (f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}"
                            if missing else "")
                         + ("; " if missing and unexpected else "")
                         + (f"unexpected {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}"
                            if unexpected else ""))
    for key, view in wanted.items():
        shape = f.entries[names[key]].shape
        if shape != view.shape:
            raise ValueError(f"{path}: {key} has shape {list(shape)}, this model's is "
                             f"{list(view.shape)}")
        view[...] = f.read(names[key])


# -- using a LoRA run's output ------------------------------------------------------------------

def load_base(source, config, seed=0, dtype="fp32", trained_in="fp32"):
    """The base a LoRA run started from: its --init-from ``source`` (a Hugging Face
    directory, a checkpoint.bin, an llm.c file or a GPT-2 model.safetensors), or with
    ``source`` None the random initialization of ``seed``; a float32 ParamArena, or with
    ``dtype`` "bf16" a Bf16Base (a Llama-family directory read tensor by tensor: no float32
    copy).  ``trained_in``: the run's --base-dtype; a run that held its base in bf16 trained
    on the rounded values, and its float32 base is rounded so."""
    import os

    from gpt2 import checkpoint as ckpt
    from gpt2 import hf
    from gpt2.params import ParamArena, init_params_
    if source is None:
        if dtype == "bf16":
            return Bf16Base.random(config, seed)
        base = init_params_(ParamArena(config), seed)
    elif not os.path.exists(source):
        raise ValueError(f"the LoRA run's base model {source} (its --init-from) is gone; the "
                         f"adapters alone are not the model")
    elif os.path.isdir(source):
        base = Bf16Base.load_hf(source) if dtype == "bf16" else hf.load_dir(source)
    elif ckpt.is_checkpoint(source):
        base = ckpt.load_checkpoint(source, optimizer=False).params
    elif source.endswith(".bin"):
        base = ckpt.import_llmc(source)
    else:
        base = ckpt.import_hf_gpt2(source)
    if base.config != config:
        raise ValueError(f"the LoRA run's base {source} now holds another model than the "
                         f"adapters were trained on")
    if isinstance(base, Bf16Base):
        return base
    if dtype == "bf16":
        return Bf16Base.from_arena(base)
    return _round_matrices_(base) if trained_in == "bf16" else base


def _round_matrices_(arena):
    """``arena`` with the matrices a Bf16Base holds in bf16 rounded so, in place."""
    from kernels import bf16
    for name, view in arena.views.items():
        if Bf16Base._is_matrix(arena.config, name):
            for part in (view if name in arena.config.per_layer else (view,)):
                u16 = buffers.empty(part.shape, np.uint16)
                bf16.to_bf16(u16, part)
                bf16.from_bf16(part, u16)
    return arena


def checkpoint_parts(path, header=None, dtype="fp32"):
    """(the base, the adapters: a LoraState) a LoRA run's checkpoint.bin stands for: the
    base ``load_base`` reads (a ParamArena, or with ``dtype`` "bf16" a Bf16Base) and the
    checkpoint's adapters."""
    from gpt2 import checkpoint as ckpt
    header = header or ckpt.read_checkpoint_header(path)
    saved = (header.extra or {}).get("args") or {}
    state = LoraState(header.config, header.lora)
    ckpt.load_checkpoint(path, header.config, params=state.params, optimizer=False, lora=True)
    base = load_base(saved.get("init_from"), header.config, saved.get("seed", 0), dtype,
                     saved.get("base_dtype") or "fp32")
    return base, state


def merged_checkpoint(path, header=None):
    """The model a LoRA run's checkpoint.bin stands for, as a float32 ParamArena: its
    base (``load_base`` of the run's --init-from, or its seed) with the adapters merged."""
    base, state = checkpoint_parts(path, header)
    return state.merged(base)


def is_adapter_dir(path):
    import os
    return os.path.isdir(path) and os.path.exists(os.path.join(path, ADAPTER_CONFIG))


def adapter_base_dir(directory):
    """The ``base_model_name_or_path`` of a peft adapter directory, which must be a local
    Hugging Face directory."""
    import json
    import os
    with open(os.path.join(directory, ADAPTER_CONFIG), encoding="utf-8") as f:
        base_dir = json.load(f).get("base_model_name_or_path")
    if not base_dir or not os.path.isdir(base_dir):
        raise ValueError(f"{directory}: its base_model_name_or_path {base_dir!r} is not a "
                         f"local model directory; merge it with gpt2-train --init-from BASE "
                         f"--lora-from {directory} --steps 1 --lr 0 --save-hf DIR")
    return base_dir


def adapter_parts(directory, dtype="fp32"):
    """(the base: a float32 ParamArena, or with ``dtype`` "bf16" a Bf16Base; the adapters:
    a LoraState; the base's directory) of a peft adapter directory whose
    ``base_model_name_or_path`` is a local Hugging Face directory."""
    from gpt2 import hf
    base_dir = adapter_base_dir(directory)
    base = Bf16Base.load_hf(base_dir) if dtype == "bf16" else hf.load_dir(base_dir)
    state = LoraState(base.config, read_adapter_config(directory, base.config))
    load_adapter(directory, state)
    return base, state, base_dir


def merged_adapter(directory):
    """(the merged float32 ParamArena, the base's directory) of a peft adapter directory
    (``adapter_parts``)."""
    base, state, base_dir = adapter_parts(directory)
    return state.merged(base), base_dir
