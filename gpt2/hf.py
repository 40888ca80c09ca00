"""Hugging Face model directories in and out, of every family that reads them:
``GPT2LMHeadModel``, ``LlamaForCausalLM`` (Llama, SmolLM2, TinyLlama) and
``Qwen2ForCausalLM`` (Qwen2.5).

A directory holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``; F32, F16 and BF16 tensors load as float32.  The
architecture in config.json names the family (``gpt2.families``), whose module holds the
key map and the translation of config.json; this module holds what all directories share.

config.json is checked field by field before anything is allocated: every size a positive
integer, the heads dividing what they split, the rotary settings in a form we read, and the
sizes against the shapes in the weights' headers, so that a wrong field is named instead of
surfacing as a MemoryError.  Where a directory holds both ``model.safetensors`` and a
sharded index, transformers reads ``model.safetensors``; so do we, once the shards are found
to hold the same tensors (a directory where they differ is refused).
"""
import contextlib
import json
import math
import os
import re

from gpt2 import families
from gpt2.checkpoint import SafetensorsFile
# The Llama family's directories, by the names they have always had here.
from gpt2.families.llama import export_hf_llama, import_hf_llama  # noqa: F401

INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "model.safetensors"
# The weight files transformers reads, with a variant (model.fp16.safetensors), as shards
# (model-00001-of-00002.safetensors) or as the index of shards.
WEIGHT_FILE = re.compile(r"(model|pytorch_model|tf_model|flax_model)(\.[\w-]+)?(-\d+-of-\d+)?"
                         r"\.(safetensors|bin|h5|msgpack)(\.index\.json)?")


def read_config(directory):
    """Our config from a Hugging Face ``config.json`` (GPT-2, Llama, Qwen2: any family's
    architecture); a field of the wrong type or value is refused by its name."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path, "rb") as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{directory!r} is not a Hugging Face model directory: it has no "
                         f"config.json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path!r} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path!r} is not a model configuration (not a JSON object)")
    architectures = hf.get("architectures") or []
    if not isinstance(architectures, list):
        architectures = [architectures]
    model_type = hf.get("model_type")
    found = families.from_hf(architectures, model_type)
    if found is None:
        raise ValueError(f"{path!r}: architecture {architectures or model_type!r} is "
                         f"not supported (supported: {', '.join(families.hf_architectures())})")
    family, variant = found
    try:
        return family.config_from_hf(hf, variant)
    except ValueError as e:
        raise ValueError(f"{path!r}: {e}") from None


def shown(value):
    """``value`` as config.json spells it, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def size_field(mapping, key, default=None, where=""):
    """mapping[key] as a size: a positive integer (a bool is not one); ``default`` where the
    field is absent or null, if the field has one."""
    value = mapping.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"{where}{key} is missing" if key not in mapping
                             else f"{where}{key} must be a positive integer, got null")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}{key} must be a positive integer, got {shown(value)}")
    return value


def number_field(mapping, key, default, where=""):
    """mapping[key] as a positive finite number, ``default`` where absent or null."""
    value = mapping.get(key)
    if value is None:
        return default
    try:
        finite = (not isinstance(value, bool) and isinstance(value, (int, float))
                  and math.isfinite(value) and value > 0)
    except OverflowError:   # an integer beyond any float
        finite = False
    if not finite:
        raise ValueError(f"{where}{key} must be a positive number, got {shown(value)}")
    return float(value)


def _index_files(index):
    """name -> SafetensorsFile holding it, from the shards ``index`` lists."""
    directory = os.path.dirname(index)
    try:
        with open(index, "rb") as f:
            weight_map = json.load(f)["weight_map"]
        files = {name: str(file) for name, file in weight_map.items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise ValueError(f"{index!r} is not a safetensors index: {e}") from None
    opened = {f: SafetensorsFile(os.path.join(directory, f)) for f in set(files.values())}
    out = {}
    for name, file in files.items():
        if name not in opened[file].entries:
            raise ValueError(f"{index!r} places {name!r} in {file}, which lacks it")
        out[name] = opened[file]
    return out


def _first_difference(single, sharded):
    """How two name -> SafetensorsFile maps differ (names, dtypes, shapes, then bytes),
    or None where they hold the same tensors."""
    if set(single) != set(sharded):
        only = sorted(set(single) - set(sharded))
        other = sorted(set(sharded) - set(single))
        return f"tensors only in {WEIGHTS_NAME}: {only[:3]}, only in the shards: {other[:3]}"
    for name in sorted(single):
        a, b = single[name], sharded[name]
        if os.path.samefile(a.path, b.path):
            continue
        ea, eb = a.entries[name], b.entries[name]
        if (ea.dtype, ea.shape) != (eb.dtype, eb.shape):
            return (f"{name!r} is {ea.dtype} {list(ea.shape)} in {WEIGHTS_NAME}, {eb.dtype} "
                    f"{list(eb.shape)} in {os.path.basename(b.path)}")
        if a.read(name, as_float32=False).tobytes() != b.read(name, as_float32=False).tobytes():
            return f"{name!r} differs between {WEIGHTS_NAME} and {os.path.basename(b.path)}"
    return None


def tensor_files(directory):
    """name -> SafetensorsFile holding it: ``model.safetensors`` where there is one (as
    transformers prefers it), else the shards of ``model.safetensors.index.json``.  A
    directory with both is refused unless they hold the same tensors."""
    index = os.path.join(directory, INDEX_NAME)
    single = os.path.join(directory, WEIGHTS_NAME)
    if not os.path.exists(single):
        if not os.path.exists(index):
            raise ValueError(f"{directory!r} holds neither {WEIGHTS_NAME} nor {INDEX_NAME}")
        return _index_files(index)
    st = SafetensorsFile(single)
    files = dict.fromkeys(st.entries, st)
    if os.path.exists(index):
        difference = _first_difference(files, _index_files(index))
        if difference:
            raise ValueError(f"{directory!r} holds two models: {WEIGHTS_NAME} and the shards "
                             f"of {INDEX_NAME} differ ({difference}); transformers reads "
                             f"{WEIGHTS_NAME}: remove the stale one")
    return files


def hf_config_dict(config):
    """config.json for ``config``, as its family writes it."""
    return families.family_of(config).hf_config_dict(config)


def load_dir(directory):
    """A ParamArena of any family from a Hugging Face model directory."""
    directory = os.fspath(directory)
    config = read_config(directory)
    return families.family_of(config).load_hf(directory, config)


def weight_files(directory):
    """Names of the model weight files in ``directory`` (any format transformers reads,
    shards and their indexes included), sorted; [] where there is no such directory."""
    try:
        names = set(os.listdir(directory))
    except FileNotFoundError:
        return []
    found = {n for n in names if WEIGHT_FILE.fullmatch(n)}
    for index in [n for n in found if n.endswith(".index.json")]:
        # Shards may be named anything: the index says which they are.
        try:
            with open(os.path.join(directory, index), "rb") as f:
                found.update(n for n in json.load(f)["weight_map"].values()
                             if isinstance(n, str) and n in names)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass    # not an index we can read: its own name is all it tells
    return sorted(found)


def save_dir(directory, params, overwrite=False):
    """A Hugging Face model directory of ``params`` (any family).

    A directory that holds another model's weights is refused unless ``overwrite``; then
    the others (shards, their index, pytorch_model.bin, ...) are removed once the new
    ``model.safetensors`` is written, so that transformers and ``load_dir`` both read the
    new weights and nothing else.
    """
    directory = os.fspath(directory)
    others = weight_files(directory)
    if others and not overwrite:
        raise ValueError(f"{directory!r} holds another model's weights "
                         f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})")
    families.family_of(params.config).save_hf(directory, params.in_llmc_order())
    for name in others:
        if name != WEIGHTS_NAME:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))


def num_parameters(config):
    """Parameters as Hugging Face counts them (vocabulary unpadded, a tied head once)."""
    return sum(math.prod((config.vocab_size, *shape[1:]) if name in ("wte", "lm_head")
                         else shape)
               for name, shape in config.param_shapes().items())
