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


# --save-dtype's names: safetensors' and config.json's (torch_dtype) for each.
SAVE_DTYPES = {"fp32": ("F32", "float32"), "bf16": ("BF16", "bfloat16"),
               "fp16": ("F16", "float16")}
_SAVE_DTYPE_OF = {"F32": "fp32", "F64": "fp32", "BF16": "bf16", "F16": "fp16"}
# What a directory's tokenizer is made of (transformers' names), and the generation defaults.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "added_tokens.json", "vocab.json", "merges.txt",
                   "chat_template.jinja", "chat_template.json")
GENERATION_CONFIG = "generation_config.json"
SPECIAL_TOKENS = ("bos", "eos", "pad")


def weights_dtype(path):
    """fp32, bf16 or fp16: the format holding most of the weights of a Hugging Face
    directory or safetensors file (F64 counts as fp32)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        entries = [st.entries[name] for name, st in tensor_files(path).items()]
    else:
        entries = list(SafetensorsFile(path).entries.values())
    counts = {}
    for entry in entries:
        kind = _SAVE_DTYPE_OF.get(entry.dtype)
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + math.prod(entry.shape)
    return max(counts, key=counts.get) if counts else "fp32"


def _read_json(path):
    """The JSON object in ``path``, or {} where it is missing or not an object."""
    try:
        with open(path, "rb") as f:
            value = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def _same_path(a, b):
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _token_text(value):
    """A tokenizer_config.json special token: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tokenizer_plan(source, tokenizer):
    """(files to copy: name -> path, the tokenizer file the run used or None, whether the
    source directory's tokenizer is the run's) for ``save_dir``."""
    from gpt2.tokenizer import find_tokenizer
    used = None if tokenizer in (None, "bytes") else os.path.abspath(os.fspath(tokenizer))
    own_tokenizer = find_tokenizer(source) if source else None
    if source and (used is None or (own_tokenizer and _same_path(used, own_tokenizer))):
        names = TOKENIZER_FILES + (GENERATION_CONFIG,)
        return ({n: os.path.join(source, n) for n in names
                 if os.path.isfile(os.path.join(source, n))}, own_tokenizer, True)
    if used is None:
        return {}, None, False
    home = os.path.dirname(used)
    if _same_path(find_tokenizer(home) or "", used):   # a model directory's own tokenizer
        return ({n: os.path.join(home, n) for n in TOKENIZER_FILES
                 if os.path.isfile(os.path.join(home, n))}, used, False)
    from gpt2.tokenizer import HFTokenizer, SentencePieceTokenizer, load_tokenizer
    kind = type(load_tokenizer(used))
    name = {HFTokenizer: "tokenizer.json", SentencePieceTokenizer: "tokenizer.model"}.get(kind)
    return ({name: used} if name else {}), used, False


def save_dir(directory, params, overwrite=False, dtype="fp32", source=None, tokenizer=None):
    """A Hugging Face model directory of ``params`` (any family), weights in ``dtype`` (fp32,
    bf16 or fp16; config.json's torch_dtype says which).

    ``source``: the Hugging Face directory the weights came from; ``tokenizer``: the
    tokenizer file the model was trained with (None or "bytes": none, or the source's).
    Where the run's tokenizer is the source's own, its tokenizer files, generation_config.json
    and the special-token ids of its config.json are carried over; else the tokenizer file
    is written (its directory's tokenizer files too, where it is a model directory's own),
    with the bos/eos ids it knows, a tokenizer_config.json and a generation_config.json.

    A directory that holds another model's weights is refused unless ``overwrite``; then
    the others (shards, their index, pytorch_model.bin, ...) are removed once the new
    ``model.safetensors`` is written, so that transformers and ``load_dir`` both read the
    new weights and nothing else.  Where a tokenizer is written, the directory's other
    tokenizer files go too; without one (bytes), they stay.
    """
    from gpt2.tokenizer import load_tokenizer, special_ids
    directory = os.fspath(directory)
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(SAVE_DTYPES)}, got {dtype!r}")
    others = weight_files(directory)
    if others and not overwrite:
        raise ValueError(f"{directory!r} holds another model's weights "
                         f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})")
    source = os.fspath(source) if source else None
    copies, used, own = _tokenizer_plan(source, tokenizer)
    ids = {}
    if own:
        hf_config = _read_json(os.path.join(source, "config.json"))
        ids = {f"{k}_token_id": hf_config[f"{k}_token_id"] for k in SPECIAL_TOKENS
               if f"{k}_token_id" in hf_config}
    texts = {}
    if used is not None:
        tok = load_tokenizer(used)
        settings = (_read_json(copies["tokenizer_config.json"])
                    if "tokenizer_config.json" in copies else {})
        for key in SPECIAL_TOKENS:
            text = _token_text(settings.get(f"{key}_token"))
            token_id = tok.token_id(text) if text and hasattr(tok, "token_id") else None
            if token_id is not None:
                texts[key] = (text, token_id)
        if not settings:
            texts = {**special_ids(tok), **texts}
        for key, (_, token_id) in texts.items():
            ids.setdefault(f"{key}_token_id", token_id)
    extra = {"torch_dtype": SAVE_DTYPES[dtype][1], **ids}
    families.family_of(params.config).save_hf(directory, params.in_llmc_order(),
                                              dtype=SAVE_DTYPES[dtype][0], extra_config=extra)
    from gpt2.checkpoint import atomic_writer

    def write(name, data):
        with atomic_writer(os.path.join(directory, name)) as f:
            f.write(data)

    for name, path in copies.items():
        if not _same_path(path, os.path.join(directory, name)):
            with open(path, "rb") as f:
                write(name, f.read())
    written = set(copies)
    if written & {"tokenizer.json", "tokenizer.model"} and "tokenizer_config.json" not in written:
        settings = {f"{k}_token": text for k, (text, _) in texts.items() if text}
        if "tokenizer.json" in written:
            settings["tokenizer_class"] = "PreTrainedTokenizerFast"
        settings["model_max_length"] = params.config.block_size
        write("tokenizer_config.json", json.dumps(settings, indent=2).encode("utf-8"))
        written.add("tokenizer_config.json")
    if GENERATION_CONFIG not in written and ids.keys() & {"bos_token_id", "eos_token_id"}:
        write(GENERATION_CONFIG, json.dumps(ids, indent=2).encode("utf-8"))
        written.add(GENERATION_CONFIG)
    stale = [n for n in others if n != WEIGHTS_NAME]
    if written & set(TOKENIZER_FILES):     # no other tokenizer's files may mix with these
        stale += [n for n in TOKENIZER_FILES if n not in written]
    for name in stale:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


def num_parameters(config):
    """Parameters as Hugging Face counts them (vocabulary unpadded, a tied head once)."""
    return sum(math.prod((config.vocab_size, *shape[1:]) if name in ("wte", "lm_head")
                         else shape)
               for name, shape in config.param_shapes().items())
