"""Checkpoints: our own training checkpoint, llm.c model files and Hugging Face GPT-2 safetensors.

Every writer goes through ``atomic_writer``: the bytes go to a temporary file in the target's
directory, are flushed and fsynced, and only then renamed over the target, so a crash or an
error while saving leaves the previous file intact. An error removes the temporary at once; a
writer killed outright (SIGKILL, power loss) cannot, so temporaries are named after their
writer's pid and the next write of the same file removes those whose process is gone.
Every reader validates magic, version, sizes and config before trusting the data, and names the
file and the broken constraint when it refuses one.
"""
import contextlib
import json
import math
import os
import re
import secrets
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from gpt2.families import config_from_dict
from gpt2.families.gpt2 import LLMC_HEADER, GPT2Config
# Hugging Face GPT-2 files, the GPT-2 family's (gpt2.families.gpt2), by the names they have
# always had here.
from gpt2.families.gpt2 import export_hf_gpt2, hf_config_dict, import_hf_gpt2  # noqa: F401
from gpt2.params import FlatArena, ParamArena, num_parameters


_TEMP_NAME = re.compile(r"\.(?P<target>.+)\.(?P<pid>[0-9]+)-[0-9a-f]{8}\.tmp")


def _temporary_name(target_name):
    """Hidden name of a temporary for ``target_name``, carrying the writer's pid."""
    return f".{target_name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temporaries(path):
    """Remove temporaries of ``path`` left by writers that died mid-save (kill -9, power loss).

    A temporary is stale when the process named in it no longer runs; a live writer's
    temporary is never touched. Returns the names removed.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    target = os.path.basename(path)
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        match = _TEMP_NAME.fullmatch(name)
        if match is None or match["target"] != target or _pid_alive(int(match["pid"])):
            continue
        with contextlib.suppress(FileNotFoundError):  # another process removed it first
            os.unlink(os.path.join(directory, name))
            removed.append(name)
    return removed


@contextlib.contextmanager
def atomic_writer(path):
    """Binary file object whose contents replace ``path`` only if the block completes.

    Temporaries that dead writers left beside ``path`` are removed first.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    remove_stale_temporaries(path)
    tmp_path = os.path.join(directory, _temporary_name(os.path.basename(path)))
    # O_EXCL: never write through a file (or link) that is already there; the mode is a plain
    # open()'s (0666 less the umask).
    fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_path)
        raise
    # The rename is durable only once the directory entry is on disk too.
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _read_exact(f, n, path, what):
    data = f.read(n)
    if len(data) != n:
        raise ValueError(f"{path!r} is truncated: {what} needs {n} bytes, only {len(data)} left")
    return data


def _readinto_exact(f, array, path, what):
    view = memoryview(array).cast("B")
    got = f.readinto(view)
    if got != len(view):
        raise ValueError(f"{path!r} is truncated: {what} needs {len(view)} bytes, "
                         f"only {got or 0} left")


def _config_mismatch(expected, found):
    return ", ".join(f"{k}: expected {v}, file has {found.to_dict()[k]}"
                     for k, v in expected.to_dict().items() if found.to_dict()[k] != v)


def _as_section(arr, config, name):
    """A section to write (``pieces()`` in saved order, or one flat array): a ParamArena,
    a section streamed from disk (``gpt2.offload.StreamedState``) or a 1-D float32 array
    of the layout's size, checked against ``config``."""
    if isinstance(arr, ParamArena):
        if arr.config != config:
            raise ValueError(f"{name} has config {arr.config}, the parameters have {config}")
        return arr
    if hasattr(arr, "pieces"):
        if arr.nbytes != 4 * num_parameters(config):
            raise ValueError(f"{name} holds {arr.nbytes} bytes, the layout needs "
                             f"{4 * num_parameters(config)}")
        return arr
    n = num_parameters(config)
    if (not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.shape != (n,)
            or not arr.flags.c_contiguous):
        raise ValueError(f"{name} must be a ParamArena or a C-contiguous float32 array of shape "
                         f"({n},), got {type(arr).__name__} "
                         f"{getattr(arr, 'dtype', '')} {getattr(arr, 'shape', '')}")
    return arr


# --------------------------------------------------------------------------------------------
# Our own checkpoint format
# --------------------------------------------------------------------------------------------

CHECKPOINT_MAGIC = b"ADTGPT2\x00"
# Version 2 stores the CRC32 of the JSON header in the preamble; version 1 left that field
# zero and is still read (its header unchecked), so older runs can be resumed.
CHECKPOINT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
_PREAMBLE = struct.Struct("<8sIIQ")  # magic, format version, header CRC32, JSON header length
_SECTION_ALIGN = 64
_MAX_HEADER_BYTES = 1 << 26


@dataclass
class Checkpoint:
    """What ``load_checkpoint`` returns; adam_m / adam_v are None when no optimizer was saved."""

    config: object          # the model's config, of any family
    params: ParamArena
    step: int
    adam_m: ParamArena = None
    adam_v: ParamArena = None
    adam_step: int = 0
    data_state: dict = None
    extra: dict = None
    lora: object = None     # a LoRA run's: its LoraConfig; params and moments are adapters'


def _align(n):
    return (n + _SECTION_ALIGN - 1) // _SECTION_ALIGN * _SECTION_ALIGN


def save_checkpoint(path, params, *, step, adam_m=None, adam_v=None, adam_step=0,
                    data_state=None, extra=None, lora=None):
    """Write parameters, AdamW moments and step, training step and data position to ``path``.

    params: ParamArena. adam_m / adam_v: both or neither, each a ParamArena or a flat float32
    array of the same layout. data_state / extra: JSON-serializable dicts (e.g.
    ``DataLoader.state()``, hyperparameters). The write is atomic (see ``atomic_writer``).
    lora: a LoRA run's LoraConfig, with ``params``, ``adam_m`` and ``adam_v`` its
    ``gpt2.lora.AdapterArena``s (the frozen base is not in the file: the run's
    --init-from, or its seed, gives it).
    """
    if lora is not None:
        return _save_sections(path, params.config, [("params", params)]
                              + ([("adam_m", adam_m), ("adam_v", adam_v)]
                                 if adam_m is not None else []),
                              step, adam_step, data_state, extra, lora.to_dict())
    if not isinstance(params, ParamArena) and not hasattr(params, "pieces"):
        raise TypeError(f"params must be a ParamArena, got {type(params).__name__}")
    config = params.config
    if (adam_m is None) != (adam_v is None):
        raise ValueError("adam_m and adam_v must be given together (or neither)")
    for name, value in (("step", step), ("adam_step", adam_step)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    sections = [("params", params)]
    if adam_m is not None:
        sections += [("adam_m", _as_section(adam_m, config, "adam_m")),
                     ("adam_v", _as_section(adam_v, config, "adam_v"))]
    return _save_sections(path, config, sections, step, adam_step, data_state, extra, None)


def _save_sections(path, config, sections, step, adam_step, data_state, extra, lora):
    table, offset = [], 0
    for name, flat in sections:
        # The CRC32s are computed as the sections are written (a streamed section is read
        # once); the header goes in last, in the room its widest CRC values would take.
        table.append({"name": name, "offset": offset, "nbytes": flat.nbytes,
                      "crc32": 0xFFFFFFFF})
        offset = _align(offset + flat.nbytes)
    header = {"config": config.to_dict(), "family": config.family,
              "step": int(step), "adam_step": int(adam_step),
              "data_state": data_state, "extra": extra, "sections": table}
    if lora is not None:
        header["lora"] = lora
    try:
        widest = json.dumps(header).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise ValueError(f"data_state and extra must be JSON-serializable: {e}") from None
    data_start = _align(_PREAMBLE.size + len(widest))
    with atomic_writer(path) as f:
        for entry, (_, flat) in zip(table, sections):
            f.seek(data_start + entry["offset"])
            crc = 0
            for piece in (flat.pieces() if hasattr(flat, "pieces") else [(0, flat)]):
                data = memoryview(piece[1]).cast("B")
                crc = zlib.crc32(data, crc)
                f.write(data)
            entry["crc32"] = crc
        header_bytes = json.dumps(header).encode("utf-8").ljust(data_start - _PREAMBLE.size,
                                                                b" ")
        f.seek(0)
        f.write(_PREAMBLE.pack(CHECKPOINT_MAGIC, CHECKPOINT_VERSION, zlib.crc32(header_bytes),
                               len(header_bytes)))
        f.write(header_bytes)


def _parse_checkpoint_header(f, path, file_size):
    preamble = f.read(_PREAMBLE.size)
    if len(preamble) < _PREAMBLE.size or preamble[:8] != CHECKPOINT_MAGIC:
        raise ValueError(f"{path!r} is not an adtape GPT-2 checkpoint (bad magic)")
    _, version, header_crc, header_len = _PREAMBLE.unpack(preamble)
    if version not in _READABLE_VERSIONS:
        raise ValueError(f"checkpoint {path!r} has format version {version}; this adtape reads "
                         f"versions {', '.join(map(str, _READABLE_VERSIONS))}")
    if header_len > min(_MAX_HEADER_BYTES, file_size - _PREAMBLE.size):
        raise ValueError(f"checkpoint {path!r} is truncated or corrupt: header length "
                         f"{header_len} exceeds the {file_size} byte file")
    header_bytes = _read_exact(f, header_len, path, "the JSON header")
    if version >= 2 and zlib.crc32(header_bytes) != header_crc:
        raise ValueError(f"checkpoint {path!r} has a corrupt header: it fails its CRC32 check "
                         "(the file was damaged or edited)")
    try:
        header = json.loads(header_bytes)
        config = config_from_dict(header["config"], header.get("family"))
        sections = {}
        for s in header["sections"]:
            entry = {k: int(s[k]) for k in ("offset", "nbytes", "crc32")}
            if entry["offset"] < 0:
                raise ValueError(f"negative offset in section {s['name']!r}")
            sections[str(s["name"])] = entry
        header["step"], header["adam_step"] = int(header["step"]), int(header["adam_step"])
        missing = {"data_state", "extra"} - header.keys()
        if missing:
            raise KeyError(f"missing keys {sorted(missing)}")
        if header.get("lora") is not None:
            from gpt2.lora import LoraConfig
            header["lora"] = LoraConfig.from_dict(header["lora"])
            header["lora"].groups(config)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint {path!r} has a corrupt header: {e!r}") from None
    return header, config, sections, _PREAMBLE.size + header_len


def read_checkpoint_header(path):
    """What a checkpoint holds, without its tensors: a ``Checkpoint`` whose params are None.

    For deciding how to build a model before loading into it; the header is validated (and
    CRC-checked) as ``load_checkpoint`` does.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        header, config, _, _ = _parse_checkpoint_header(f, path, os.fstat(f.fileno()).st_size)
    return Checkpoint(config=config, params=None, step=header["step"],
                      adam_step=header["adam_step"], data_state=header["data_state"],
                      extra=header["extra"], lora=header.get("lora"))


def is_checkpoint(path):
    """Whether ``path`` opens with our checkpoint's magic (not an llm.c model file)."""
    with open(path, "rb") as f:
        return f.read(len(CHECKPOINT_MAGIC)) == CHECKPOINT_MAGIC


def _destination(dest, name, config, lora, n_bytes):
    """What a section is read into (``load(read_into)`` in saved order): ``dest`` checked
    against the file's ``config`` and ``lora`` (an arena; a section streamed to disk is
    the caller's to match), or with ``dest`` None a new arena."""
    if dest is None and lora is not None:
        from gpt2.lora import AdapterArena
        return AdapterArena(config, lora)
    if dest is None:
        return ParamArena(config)
    if not isinstance(dest, FlatArena) and hasattr(dest, "load"):
        return dest
    if lora is None and (not isinstance(dest, ParamArena) or dest.config != config):
        raise ValueError(f"{name} destination must be a ParamArena with the file's config "
                         f"{config}")
    if dest.nbytes != n_bytes:
        raise ValueError(f"{name} destination holds {dest.nbytes} bytes, the file's adapters "
                         f"{n_bytes}")
    return dest


def load_checkpoint(path, config=None, *, params=None, adam_m=None, adam_v=None,
                    optimizer=True, lora=False):
    """Read a checkpoint written by ``save_checkpoint``.

    config: if given, the file's config must equal it. params / adam_m / adam_v: optional
    ParamArenas to read into in place (no second copy of a large model); otherwise new arenas.
    Their contents are undefined if loading fails, so pass fresh ones when the old values matter.
    Raises FileNotFoundError for a missing file and ValueError for a foreign, truncated,
    corrupt (CRC) or mismatching one.  Without ``optimizer`` only the parameters are read
    (the moments come back as None): to generate, export or start a new run.
    ``lora``: read a LoRA run's checkpoint (its adapters, into ``gpt2.lora.AdapterArena``
    destinations); without it such a file is refused with a ValueError that says where the
    run's adapter and merged model are.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        header, file_config, sections, data_start = _parse_checkpoint_header(f, path, file_size)
        if config is not None and file_config != config:
            raise ValueError(f"checkpoint {path!r} was saved for a different model: "
                             f"{_config_mismatch(config, file_config)}")
        file_lora = header.get("lora")
        if (file_lora is not None) != bool(lora):
            raise ValueError(
                f"checkpoint {path!r} is a LoRA run's (its adapters only, r "
                f"{file_lora.r}): continue it with gpt2-train --resume; its adapter is in "
                f"{os.path.join(os.path.dirname(path) or '.', 'adapter')}/ (peft's format) and "
                f"gpt2-train --resume {path} --save-hf DIR writes the merged model"
                if file_lora is not None else f"checkpoint {path!r} is not a LoRA run's")
        if file_lora is not None:
            from gpt2.lora import AdapterArena
            n_bytes = AdapterArena(file_config, file_lora).nbytes
        else:
            n_bytes = num_parameters(file_config) * 4
        expected_names = ["params"] + (["adam_m", "adam_v"] if "adam_m" in sections else [])
        if sorted(sections) != sorted(expected_names):
            raise ValueError(f"checkpoint {path!r} has sections {sorted(sections)}, expected "
                             f"{expected_names}")
        end = 0
        for name in expected_names:
            entry = sections[name]
            if entry["nbytes"] != n_bytes:
                raise ValueError(f"checkpoint {path!r}: section {name} holds {entry['nbytes']} "
                                 f"bytes, the config needs {n_bytes}")
            end = max(end, data_start + entry["offset"] + entry["nbytes"])
        if file_size < end:
            raise ValueError(f"checkpoint {path!r} is truncated: {file_size} bytes, its header "
                             f"describes {end}")
        destinations = {"params": params, "adam_m": adam_m, "adam_v": adam_v}
        arenas = {}
        for name in expected_names if optimizer else ["params"]:
            dest = _destination(destinations[name], name, file_config, file_lora, n_bytes)
            entry = sections[name]
            f.seek(data_start + entry["offset"])
            crc = [0]

            def read_into(piece, name=name):
                _readinto_exact(f, piece, path, f"section {name}")
                crc[0] = zlib.crc32(memoryview(piece).cast("B"), crc[0])
            dest.load(read_into)
            if crc[0] != entry["crc32"]:
                raise ValueError(f"checkpoint {path!r} is corrupt: section {name} fails its "
                                 "CRC32 check")
            arenas[name] = dest
    return Checkpoint(config=file_config, params=arenas["params"], step=header["step"],
                      adam_m=arenas.get("adam_m"), adam_v=arenas.get("adam_v"),
                      adam_step=header["adam_step"], data_state=header["data_state"],
                      extra=header["extra"], lora=file_lora)


def save_state(path, state, *, step, data_state=None, extra=None, sections=None):
    """``save_checkpoint`` of a training state (``gpt2.state``): its parameters, moments
    and AdamW step, wherever they live; a LoRA state's adapters.  ``sections``: the
    state's ``sections()`` where the caller has them already (data parallelism: every
    rank runs that collective, rank 0 writes)."""
    params, adam_m, adam_v = state.sections() if sections is None else sections
    return save_checkpoint(path, params, step=step, adam_m=adam_m, adam_v=adam_v,
                           adam_step=state.step, data_state=data_state, extra=extra,
                           lora=state.lora)


def load_state(path, state, config, sections=None):
    """``load_checkpoint`` into a training state in place (``gpt2.state``): its
    parameters, moments (where the file has them) and AdamW step; a LoRA state reads a
    LoRA run's checkpoint of the same adapters.  ``sections``: other destinations than
    the state's ``sections()`` (the data-parallel trainer's whole moments before it
    shares them out).  Returns the ``Checkpoint``."""
    params, adam_m, adam_v = state.sections() if sections is None else sections
    loaded = load_checkpoint(path, config, params=params, adam_m=adam_m, adam_v=adam_v,
                             lora=state.lora is not None)
    if loaded.lora != state.lora:
        raise ValueError(f"checkpoint {os.fspath(path)!r} holds adapters of {loaded.lora}, "
                         f"this model's are {state.lora}")
    state.step = loaded.adam_step
    return loaded


# --------------------------------------------------------------------------------------------
# llm.c model files (gpt2_124M.bin)
# --------------------------------------------------------------------------------------------

LLMC_MODEL_MAGIC = 20240326
LLMC_MODEL_VERSION = 3  # float32 parameters with wte padded to Vp rows
LLMC_HEADER_INTS = 256


def export_llmc(path, params):
    """Write ``params`` as an llm.c float32 model file (version 3)."""
    if not isinstance(params, ParamArena):
        raise TypeError(f"params must be a ParamArena, got {type(params).__name__}")
    c = params.config
    header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    header[:8] = (LLMC_MODEL_MAGIC, LLMC_MODEL_VERSION, *(getattr(c, k) for k in LLMC_HEADER))
    with atomic_writer(path) as f:
        f.write(header.tobytes())
        f.write(memoryview(params.in_llmc_order().flat).cast("B"))


def import_llmc(path):
    """Read an llm.c float32 model file (version 3) into a new ParamArena."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        header = np.frombuffer(_read_exact(f, 4 * LLMC_HEADER_INTS, path, "the llm.c header"),
                               dtype="<i4")
        if header[0] != LLMC_MODEL_MAGIC:
            raise ValueError(f"{path!r} is not an llm.c model file: magic {int(header[0])}, "
                             f"expected {LLMC_MODEL_MAGIC}")
        if header[1] != LLMC_MODEL_VERSION:
            raise ValueError(f"llm.c model file {path!r} has version {int(header[1])}; only "
                             f"version {LLMC_MODEL_VERSION} (float32, padded vocab) is supported")
        sizes = {k: int(x) for k, x in zip(LLMC_HEADER, header[2:8])}
        padded_vocab = sizes.pop("padded_vocab_size")
        try:
            config = GPT2Config(**sizes)
        except ValueError as e:
            raise ValueError(f"llm.c model file {path!r} has an invalid config: {e}") from None
        if padded_vocab != config.padded_vocab_size:
            raise ValueError(f"llm.c model file {path!r} pads the vocabulary to {padded_vocab} "
                             f"rows; our layout needs {config.padded_vocab_size}")
        expected = 4 * LLMC_HEADER_INTS + 4 * num_parameters(config)
        if file_size != expected:
            raise ValueError(f"llm.c model file {path!r} is {file_size} bytes, its header "
                             f"({config}) needs {expected}"
                             + (" (truncated)" if file_size < expected else ""))
        arena = ParamArena(config)
        _readinto_exact(f, arena.flat, path, "the parameters")
    return arena


# --------------------------------------------------------------------------------------------
# safetensors (format spec: u64 LE header length, JSON header, raw little-endian data)
# --------------------------------------------------------------------------------------------

SAFETENSORS_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
    "U16": np.dtype("<u2"), "U32": np.dtype("<u4"), "U64": np.dtype("<u8"),
}
_MAX_SAFETENSORS_HEADER = 100 << 20  # the reference implementation's limit


@dataclass
class SafetensorsEntry:
    dtype: str
    shape: tuple
    begin: int
    end: int


class SafetensorsFile:
    """Validated header of a safetensors file; ``read(name)`` loads one tensor (floats as float32)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            if file_size < 8:
                raise ValueError(f"{self.path!r} is not a safetensors file: only {file_size} bytes")
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(_MAX_SAFETENSORS_HEADER, file_size - 8):
                raise ValueError(f"{self.path!r} is not a safetensors file or is truncated: "
                                 f"header length {header_len}, file size {file_size}")
            raw = f.read(header_len)
        try:
            header = json.loads(raw.decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{self.path!r} is not a safetensors file: bad JSON header "
                             f"({e})") from None
        self.data_start = 8 + header_len
        data_size = file_size - self.data_start
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries = {}
        for name, info in header.items():
            try:
                dtype = info["dtype"]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"safetensors file {self.path!r}: malformed entry for tensor "
                                 f"{name!r}: {info!r}") from None
            if dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"safetensors file {self.path!r}: tensor {name!r} has "
                                 f"unsupported dtype {dtype!r}")
            nbytes = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
            if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != nbytes:
                raise ValueError(f"safetensors file {self.path!r}: tensor {name!r} {dtype} "
                                 f"{list(shape)} has data_offsets [{begin}, {end}], inconsistent "
                                 f"with its {nbytes} bytes")
            if end > data_size:
                raise ValueError(f"safetensors file {self.path!r} is truncated: tensor {name!r} "
                                 f"ends at byte {end} of a {data_size} byte data section")
            self.entries[name] = SafetensorsEntry(dtype, shape, begin, end)

    def read(self, name, as_float32=True):
        entry = self.entries[name]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + entry.begin)
            raw = _read_exact(f, entry.end - entry.begin, self.path, f"tensor {name!r}")
        arr = np.frombuffer(raw, dtype=SAFETENSORS_DTYPES[entry.dtype]).reshape(entry.shape)
        if not as_float32:
            return arr
        if entry.dtype == "BF16":
            # bfloat16 is the top half of a float32.
            return (arr.astype(np.uint32) << 16).view(np.float32)
        if entry.dtype not in ("F64", "F32", "F16"):
            raise ValueError(f"safetensors file {self.path!r}: tensor {name!r} has dtype "
                             f"{entry.dtype}, expected a float type (F32, F16, BF16, F64)")
        return arr.astype(np.float32)


def to_bfloat16(arr):
    """float32 ``arr`` rounded to bfloat16 (to nearest, ties to even; NaN stays NaN), as the
    uint16 bit patterns safetensors stores."""
    bits = np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(arr)
    if nan.any():   # rounding could carry a NaN's payload into the exponent: keep it quiet NaN
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded


# Values write_safetensors converts and writes at once.
WRITE_CHUNK_VALUES = 1 << 22
# The floating-point formats write_safetensors converts to, by their safetensors names.
_FLOAT_WRITERS = {"F32": lambda a: a.astype("<f4", copy=False),
                  "F16": lambda a: a.astype("<f2"),
                  "BF16": to_bfloat16}


class Deferred:
    """A tensor ``write_safetensors`` reads only when it writes it: its ``shape`` and
    ``dtype`` known up front, its values ``read()`` (so that a model merged or widened a
    tensor at a time is never whole in memory)."""

    __slots__ = ("shape", "dtype", "read")

    def __init__(self, shape, dtype, read):
        self.shape, self.dtype, self.read = tuple(shape), np.dtype(dtype), read


def write_safetensors(path, tensors, metadata=None, dtype=None):
    """Write dict name -> numpy array (float32/float16/float64/ints) or ``Deferred`` as a
    safetensors file.

    dtype: None keeps each array's own; "F32", "F16" or "BF16" stores every floating-point
    array in that format (bfloat16 rounded to nearest even), one tensor at a time.
    """
    if dtype is not None and dtype not in _FLOAT_WRITERS:
        raise ValueError(f"dtype must be one of {', '.join(_FLOAT_WRITERS)} or None, got "
                         f"{dtype!r}")
    by_dtype = {v: k for k, v in SAFETENSORS_DTYPES.items() if k != "BF16"}
    header, arrays, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, arr in tensors.items():
        if not isinstance(arr, Deferred):
            arr = np.asarray(arr)
        if dtype is not None and arr.dtype.kind == "f":
            code, convert = dtype, _FLOAT_WRITERS[dtype]
        else:
            code = by_dtype.get(arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">"
                                else arr.dtype)
            if code is None:
                raise ValueError(f"tensor {name!r} has dtype {arr.dtype}, which "
                                 "write_safetensors does not store")
            convert = None
        nbytes = math.prod(arr.shape) * SAFETENSORS_DTYPES[code].itemsize
        header[name] = {"dtype": code, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + nbytes]}
        arrays.append((arr, code, convert))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw = raw.ljust((len(raw) + 7) // 8 * 8, b" ")  # the spec pads the header to 8 bytes
    with atomic_writer(path) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for arr, code, convert in arrays:
            if isinstance(arr, Deferred):
                shape, arr = arr.shape, np.asarray(arr.read(), dtype=arr.dtype)
                if arr.shape != shape:      # the header already said otherwise
                    raise ValueError(f"a deferred tensor read as {arr.shape}, not {shape}")
            # Converted a chunk at a time: the temporaries of a conversion stay small.
            flat = np.ascontiguousarray(arr).reshape(-1)
            for start in range(0, flat.size, WRITE_CHUNK_VALUES):
                piece = flat[start:start + WRITE_CHUNK_VALUES]
                out = (convert(piece) if convert is not None
                       else piece.astype(SAFETENSORS_DTYPES[code], copy=False))
                f.write(memoryview(np.ascontiguousarray(out)).cast("B"))


def check_fits_in_memory(config, source, bytes_per_parameter=4):
    """A ValueError naming ``source`` where the parameters of ``config`` (float32, or
    ``bytes_per_parameter`` 2: bf16) need more than the memory available (RAM and free
    swap): checked before they are allocated, so that an impossible model is refused at
    once rather than by a MemoryError after the allocation has filled the memory."""
    import psutil
    n = num_parameters(config)
    available = psutil.virtual_memory().available + psutil.swap_memory().free
    if bytes_per_parameter * n > available:
        kind = "float32" if bytes_per_parameter == 4 else "bf16"
        raise ValueError(f"{os.fspath(source)!r}: the model's {n:,} parameters take "
                         f"{bytes_per_parameter * n / 2**30:,.1f} GiB as {kind}, more than "
                         f"the {available / 2**30:,.1f} GiB of memory available")


def hf_config_path(path):
    """Where the config.json of a Hugging Face weights file is read from: beside it."""
    return os.path.join(os.path.dirname(os.path.abspath(os.fspath(path))), "config.json")

