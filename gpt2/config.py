"""The families' configurations, where they have always been imported from: each family's
config class and presets live in its module (``gpt2.families.gpt2``,
``gpt2.families.llama``), the lookups across families in ``gpt2.families``.

A config is plain data (frozen dataclass).  What the rest of the code needs to know of
a family's parameters it asks the config: ``param_shapes()`` (name -> shape, in file
order), ``per_layer`` (the names with one slice per block), ``norm_weights``,
``biases`` and ``residual_projections`` (how initialization treats them).
"""
from gpt2.families import all_presets, config_from_dict, preset
from gpt2.families.base import VOCAB_PAD_MULTIPLE
from gpt2.families.gpt2 import PRESETS, GPT2Config
from gpt2.families.llama import PRESETS as LLAMA_PRESETS, LlamaConfig

# Preset name -> config class of the families built in (gpt2.families.all_presets() also
# knows those registered since).
ALL_PRESETS = {name: family.config for name, family in all_presets().items()}

__all__ = ["ALL_PRESETS", "GPT2Config", "LLAMA_PRESETS", "LlamaConfig", "PRESETS",
           "VOCAB_PAD_MULTIPLE", "config_from_dict", "preset"]
