"""The model families and their registry.

A family is one module (``gpt2.families.gpt2``, ``gpt2.families.llama``): its config class
and presets, its ``embed``/``block``/``head`` ops (which serve both the tape engine and
the key/value-cache decoder), its Hugging Face key map and its performance-model spec,
behind a ``Family`` object (``gpt2.families.base``).  The rest of the package asks this
registry, never a family's name: the family of a config, of a preset name, of a Hugging
Face architecture.  Adding a family is its module and one ``register`` line below.
"""
from gpt2.families import gpt2 as _gpt2, llama as _llama
from gpt2.families.base import Family

_FAMILIES = {}      # name -> Family, in registration order


def register(family):
    """Add ``family`` (a ``Family`` instance); its name, presets and Hugging Face
    architectures must be new."""
    if not isinstance(family, Family):
        raise TypeError(f"register needs a Family, got {type(family).__name__}")
    if family.name in _FAMILIES:
        raise ValueError(f"a model family named {family.name!r} is already registered")
    taken = {name: other for other in _FAMILIES.values() for name in other.presets}
    taken.update({name: other for other in _FAMILIES.values()
                  for name in (*other.hf_architectures, *other.hf_model_types)})
    clashes = [name for name in (*family.presets, *family.hf_architectures,
                                 *family.hf_model_types) if name in taken]
    if clashes:
        raise ValueError(f"family {family.name!r}: {', '.join(map(repr, clashes))} already "
                         f"name(s) family {taken[clashes[0]].name!r}'s preset or architecture")
    _FAMILIES[family.name] = family
    return family


def unregister(name):
    """Remove the family ``name`` (a family a test registered)."""
    del _FAMILIES[name]


def families():
    """Every registered family, in registration order."""
    return list(_FAMILIES.values())


def get(name):
    """The family named ``name`` ("gpt2", "llama", ...)."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known families: "
                         f"{', '.join(_FAMILIES)}") from None


def config_types():
    return tuple(family.config for family in _FAMILIES.values())


def family_of(config):
    """The family of ``config``; a TypeError for anything but a registered family's config."""
    family = _FAMILIES.get(getattr(config, "family", None))
    if family is None or not isinstance(config, family.config):
        raise TypeError(f"config must be a "
                        f"{' or '.join(t.__name__ for t in config_types())}, "
                        f"got {type(config).__name__}")
    return family


def all_presets():
    """Preset name -> its family, every family's."""
    return {name: family for family in _FAMILIES.values() for name in family.presets}


def preset(name):
    """The configuration of any family's preset (``gpt2``, ``smollm2-135m``, ...)."""
    presets = all_presets()
    if name not in presets:
        raise ValueError(f"unknown model preset {name!r}; known presets: "
                         f"{', '.join(presets)}")
    return presets[name].config.preset(name)


def config_from_dict(d, family=None):
    """A config from its ``to_dict()`` form and its family's name; without a name (files
    written before families were named), a Llama config is told by its ``n_kv_head``."""
    if family is None:
        family = "llama" if isinstance(d, dict) and "n_kv_head" in d else "gpt2"
    return get(family).config.from_dict(d)


def from_hf(architectures, model_type):
    """(family, variant) reading a Hugging Face config.json of these ``architectures`` (any
    entry known) or, failing that, this ``model_type``; None where no family reads it."""
    for architecture in architectures:
        for family in _FAMILIES.values():
            if isinstance(architecture, str) and architecture in family.hf_architectures:
                return family, family.hf_architectures[architecture]
    for family in _FAMILIES.values():
        if isinstance(model_type, str) and model_type in family.hf_model_types:
            return family, family.hf_model_types[model_type]
    return None


def hf_architectures():
    """Every Hugging Face architecture some family reads."""
    return [name for family in _FAMILIES.values() for name in family.hf_architectures]


register(_gpt2.FAMILY)
register(_llama.FAMILY)
