"""Training data: corpora as token arrays, llm.c token files, and a resumable batch loader.

Corpora: the built-in default (the Python standard library's own ``.py`` sources, no download),
any text file, a JSONL file of {"text": ...} records, and llm.c's ``.bin`` token shards
(``file_tokens`` tells them apart by the name's extension).  ``DataLoader`` cuts a token array into
(inputs, targets) batches of shape (B, T), targets shifted by one, over a train or val split.
"""
import functools
import json
import os
import sysconfig

import numpy as np

from gpt2.checkpoint import atomic_writer
from gpt2.tokenizer import ByteTokenizer

DEFAULT_CORPUS_BYTES = 3_000_000
# The stdlib path also holds installed third-party packages and test suites with deliberately
# malformed sources; the corpus is the library proper.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests",
                           "idle_test"})


def stdlib_source_files():
    """Sorted paths (relative to the stdlib) of the standard library's .py files."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        rel = os.path.relpath(dirpath, root)
        found.extend(os.path.normpath(os.path.join(rel, n)) for n in filenames if n.endswith(".py"))
    return root, sorted(found)


@functools.lru_cache(maxsize=4)
def stdlib_corpus_bytes(max_bytes=DEFAULT_CORPUS_BYTES):
    """The default corpus: stdlib .py sources in sorted path order, UTF-8, cut at a line end.

    Files are joined whole until ``max_bytes``; the last one is cut at the last newline that
    fits, so the result is valid UTF-8 text. Files that are not UTF-8 are skipped.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    root, files = stdlib_source_files()
    parts, size = [], 0
    for rel in files:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not data.endswith(b"\n"):
            data += b"\n"
        if size + len(data) > max_bytes:
            cut = data.rfind(b"\n", 0, max_bytes - size)
            if cut >= 0:
                parts.append(data[:cut + 1])
                size += cut + 1
            break
        parts.append(data)
        size += len(data)
    if not size:
        raise ValueError(f"the standard library at {root!r} yielded no text for the default "
                         f"corpus (max_bytes={max_bytes})")
    return b"".join(parts)


@functools.lru_cache(maxsize=4)
def _stdlib_byte_tokens(max_bytes):
    tokens = ByteTokenizer().encode_bytes(stdlib_corpus_bytes(max_bytes))
    tokens.flags.writeable = False  # shared by every caller through the cache
    return tokens


def default_corpus_tokens(tokenizer=None, max_bytes=DEFAULT_CORPUS_BYTES):
    """Token ids (int32) of the default corpus; byte-level unless a tokenizer is given.

    The byte-level array is cached in memory and read-only.
    """
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
        return _stdlib_byte_tokens(max_bytes)
    return tokenizer.encode(stdlib_corpus_bytes(max_bytes).decode("utf-8"))


def text_file_tokens(path, tokenizer=None):
    """Token ids (int32) of a text file; byte-level unless a tokenizer (with encode) is given."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise ValueError(f"text file {path!r} is empty")
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
        return ByteTokenizer().encode_bytes(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"text file {path!r} is not UTF-8 ({e}); a BPE tokenizer needs text") \
            from None
    return tokenizer.encode(text)


def jsonl_file_tokens(path, tokenizer=None):
    """Token ids (int32) of a JSONL file of {"text": ...} records (other keys are ignored,
    blank lines skipped), byte-level unless a tokenizer is given.

    Each record's text is tokenized on its own and the records follow one another in file
    order, each after the tokenizer's end-of-text token where it has one (as llm.c's data
    scripts write their shards; GPT-2 BPE has one, bytes and tokenizer.json do not): one
    stream of tokens, whose windows may cross from one record into the next.
    """
    path = os.fspath(path)
    tokenizer = tokenizer or ByteTokenizer()
    eot = getattr(tokenizer, "eot_token", None)
    pieces = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(f"JSONL file {path!r} line {number}: not JSON ({e})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"JSONL file {path!r} line {number}: not a record with a "
                                 f"\"text\" string (chat-format records are not read yet)")
            if eot is not None:
                pieces.append(np.array([eot], dtype=np.int32))
            pieces.append(np.asarray(tokenizer.encode(record["text"]), dtype=np.int32))
    if not pieces:
        raise ValueError(f"JSONL file {path!r} holds no records")
    return np.concatenate(pieces)


def file_tokens(path, tokenizer=None):
    """Token ids (int32) of a data file, by its extension: ``.bin`` an llm.c token file
    (the tokenizer is not used), ``.jsonl`` records of text, anything else a text file."""
    path = os.fspath(path)
    if path.endswith(".bin"):
        return read_llmc_tokens(path)
    if path.endswith(".jsonl"):
        return jsonl_file_tokens(path, tokenizer)
    return text_file_tokens(path, tokenizer)


# llm.c token shards (dev/data/data_common.py, GPT-2 flavour)
LLMC_TOKENS_MAGIC = 20240520
LLMC_TOKENS_VERSION = 1  # uint16 tokens
LLMC_TOKENS_HEADER_INTS = 256


def read_llmc_tokens(path):
    """Token ids (int32) of an llm.c ``.bin`` token file (version 1, uint16 tokens)."""
    path = os.fspath(path)
    header_bytes = 4 * LLMC_TOKENS_HEADER_INTS
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        raw_header = f.read(header_bytes)
        if len(raw_header) < header_bytes:
            raise ValueError(f"llm.c token file {path!r} is truncated: {file_size} bytes, the "
                             f"header alone needs {header_bytes}")
        header = np.frombuffer(raw_header, dtype="<i4")
        if header[0] != LLMC_TOKENS_MAGIC:
            raise ValueError(f"{path!r} is not an llm.c token file: magic {int(header[0])}, "
                             f"expected {LLMC_TOKENS_MAGIC}")
        if header[1] != LLMC_TOKENS_VERSION:
            raise ValueError(f"llm.c token file {path!r} has version {int(header[1])}; only "
                             f"version {LLMC_TOKENS_VERSION} (uint16 tokens) is supported")
        count = int(header[2])
        expected = header_bytes + 2 * count
        if count < 0 or file_size != expected:
            raise ValueError(f"llm.c token file {path!r} is {file_size} bytes but its header "
                             f"declares {count} tokens ({expected} bytes)"
                             + (" (truncated)" if file_size < expected else ""))
        tokens = np.fromfile(f, dtype="<u2", count=count)
    if tokens.size != count:
        raise ValueError(f"llm.c token file {path!r} is truncated: read {tokens.size} of "
                         f"{count} tokens")
    return tokens.astype(np.int32)


def write_llmc_tokens(path, tokens):
    """Write token ids (each in [0, 65535]) as an llm.c version 1 token file, atomically."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
        raise ValueError(f"tokens must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() > 0xFFFF):
        raise ValueError(f"llm.c token files store uint16: token ids must lie in [0, 65535], "
                         f"got [{tokens.min()}, {tokens.max()}]")
    if tokens.size > np.iinfo(np.int32).max:
        raise ValueError(f"llm.c token files hold at most 2**31-1 tokens, got {tokens.size}")
    header = np.zeros(LLMC_TOKENS_HEADER_INTS, dtype="<i4")
    header[:3] = (LLMC_TOKENS_MAGIC, LLMC_TOKENS_VERSION, tokens.size)
    with atomic_writer(path) as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def split_sizes(n_tokens, val_fraction):
    """(train, val) token counts of a corpus of ``n_tokens``: val is the last ``val_fraction``."""
    n_val = int(round(n_tokens * val_fraction))
    return n_tokens - n_val, n_val


class DataLoader:
    """Batches (inputs, targets), int32 (B, T), from one split of a token array.

    The split is cut into non-overlapping windows of T+1 tokens that overlap by one (window k
    covers tokens[k*T : k*T + T + 1]); an epoch is ``num_batches`` batches of B windows, in a
    seeded random order per epoch (shuffle=True) or in order.  ``state()`` / ``load_state()``
    save and restore the position, so a resumed run sees exactly the batches it would have.

    tokens: 1-D integer array; vocab_size: every id must lie in [0, vocab_size);
    split: "train" (the first 1 - val_fraction of the tokens), "val" (the rest) or "all"
    (every token: a validation file of its own).
    """

    def __init__(self, tokens, batch_size, seq_len, vocab_size, *, split="train",
                 val_fraction=0.1, shuffle=True, seed=0):
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len),
                            ("vocab_size", vocab_size)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"DataLoader {name} must be a positive int, got {value!r}")
        if split not in ("train", "val", "all"):
            raise ValueError(f"DataLoader split must be 'train', 'val' or 'all', got {split!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"DataLoader val_fraction must lie in [0, 1), got {val_fraction}")
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
            raise ValueError(f"DataLoader tokens must be a 1-D integer array, got "
                             f"{tokens.dtype} with shape {tokens.shape}")
        if tokens.size == 0:
            raise ValueError("DataLoader: the corpus is empty (0 tokens)")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"DataLoader: token ids must lie in [0, {vocab_size}) (vocab_size), "
                             f"the corpus has ids in [{lo}, {hi}]")
        n_train, _ = split_sizes(tokens.size, val_fraction)
        part = {"train": tokens[:n_train], "val": tokens[n_train:], "all": tokens}[split]
        needed = batch_size * seq_len + 1
        if part.size < needed:
            raise ValueError(f"DataLoader: the {split} split has {part.size} tokens, too few for "
                             f"one batch of B={batch_size} x T={seq_len} (needs {needed}); use a "
                             f"smaller B or T, more data or a different val_fraction")
        self.tokens = np.ascontiguousarray(part, dtype=np.int32)
        self.batch_size, self.seq_len, self.vocab_size = int(batch_size), int(seq_len), int(vocab_size)
        self.split, self.shuffle, self.seed = split, bool(shuffle), int(seed)
        self.num_windows = (self.tokens.size - 1) // self.seq_len
        self.num_batches = self.num_windows // self.batch_size
        self._offsets = np.arange(self.seq_len + 1)
        self.epoch, self.batch_index = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch):
        if not self.shuffle:
            return np.arange(self.num_windows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def next_batch(self):
        """(inputs, targets), each a fresh C-contiguous int32 array of shape (B, T)."""
        if self.batch_index == self.num_batches:
            self.epoch += 1
            self.batch_index = 0
            self._order = self._epoch_order(self.epoch)
        B, T = self.batch_size, self.seq_len
        windows = self._order[self.batch_index * B:(self.batch_index + 1) * B]
        chunk = self.tokens[windows[:, None] * T + self._offsets]  # (B, T+1)
        self.batch_index += 1
        return np.ascontiguousarray(chunk[:, :-1]), np.ascontiguousarray(chunk[:, 1:])

    def __iter__(self):
        return self

    def __next__(self):
        return self.next_batch()

    def reset(self):
        """Back to the first batch of epoch 0."""
        self.load_state({**self.state(), "epoch": 0, "batch_index": 0})

    def state(self):
        """JSON-serializable position (and the settings it is only valid for)."""
        return {"split": self.split, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "shuffle": self.shuffle, "seed": self.seed, "num_tokens": int(self.tokens.size),
                "epoch": self.epoch, "batch_index": self.batch_index}

    def load_state(self, state):
        """Continue from a position saved by ``state()`` of a loader over the same data."""
        if not isinstance(state, dict):
            raise ValueError(f"DataLoader.load_state needs a dict, got {type(state).__name__}")
        mine = self.state()
        missing = sorted(set(mine) - set(state))
        if missing:
            raise ValueError(f"DataLoader state lacks keys {missing}")
        different = {k: (state[k], mine[k]) for k in ("split", "batch_size", "seq_len",
                                                      "shuffle", "seed", "num_tokens")
                     if state[k] != mine[k]}
        if different:
            raise ValueError("DataLoader state was saved for different data or settings: "
                             + ", ".join(f"{k}: saved {a!r}, this loader {b!r}"
                                         for k, (a, b) in different.items()))
        epoch, index = state["epoch"], state["batch_index"]
        if (not isinstance(epoch, int) or not isinstance(index, int) or epoch < 0
                or not 0 <= index <= self.num_batches):
            raise ValueError(f"DataLoader state has an invalid position: epoch {epoch!r}, "
                             f"batch_index {index!r} of {self.num_batches}")
        self.epoch, self.batch_index = epoch, index
        self._order = self._epoch_order(epoch)


def train_val_loaders(tokens, batch_size, seq_len, vocab_size, *, val_fraction=0.1, seed=0):
    """A shuffled train loader and a sequential val loader over the two splits of ``tokens``."""
    train = DataLoader(tokens, batch_size, seq_len, vocab_size, split="train",
                       val_fraction=val_fraction, shuffle=True, seed=seed)
    val = DataLoader(tokens, batch_size, seq_len, vocab_size, split="val",
                     val_fraction=val_fraction, shuffle=False, seed=seed)
    return train, val
