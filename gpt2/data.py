"""Training data: corpora as token arrays, llm.c token files, chat and instruction examples,
and resumable batch loaders.

Corpora: the built-in default (the Python standard library's own ``.py`` sources, no download),
any text file, a JSONL file of {"text": ...} records, and llm.c's ``.bin`` token shards
(``file_tokens`` tells them apart by the name's extension).  ``DataLoader`` cuts a token array into
(inputs, targets) batches of shape (B, T), targets shifted by one, over a train or val split.

Examples: a JSONL file with {"messages": [...]} (a conversation, rendered by the tokenizer
directory's chat template: ``gpt2.chat``) or {"prompt": ..., "completion": ...} records
(``read_data`` reads it as ``Examples``; its {"text": ...} records are examples too).  Only
some tokens of an example are trained: the assistant's, the completion's.
``ExampleLoader`` serves them one example a row, padded, the other targets
``IGNORE_INDEX`` (no loss).
"""
import dataclasses
import functools
import json
import os
import sysconfig

import numpy as np

from gpt2.checkpoint import atomic_writer
from gpt2.tokenizer import ByteTokenizer, HFTokenizer, special_ids
from kernels.loss import IGNORE_INDEX

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
    stream of tokens, whose windows may cross from one record into the next.  A file with
    chat or prompt/completion records is examples, not a stream: ``read_data``.
    """
    found = read_jsonl(path, tokenizer)
    if isinstance(found, Examples):
        raise ValueError(f"JSONL file {os.fspath(path)!r} holds chat or prompt/completion "
                         f"examples ({found.describe_kinds()}), not one stream of text")
    return found


def file_tokens(path, tokenizer=None):
    """Token ids (int32) of a data file, by its extension: ``.bin`` an llm.c token file
    (the tokenizer is not used), ``.jsonl`` records of text, anything else a text file."""
    path = os.fspath(path)
    if path.endswith(".bin"):
        return read_llmc_tokens(path)
    if path.endswith(".jsonl"):
        return jsonl_file_tokens(path, tokenizer)
    return text_file_tokens(path, tokenizer)


def read_data(path, tokenizer=None, tokenizer_dir=None):
    """The data in a file: ``Examples`` for a JSONL file with a "messages" or
    "prompt"/"completion" record (``read_jsonl``), else its tokens (``file_tokens``).
    ``tokenizer_dir``: the Hugging Face directory of ``tokenizer`` (its chat template and
    special tokens), or None."""
    path = os.fspath(path)
    if path.endswith(".jsonl"):
        return read_jsonl(path, tokenizer, tokenizer_dir)
    return file_tokens(path, tokenizer)


# -- chat and instruction examples ---------------------------------------------------

# The record forms of a JSONL file, as its errors name them.
RECORD_FORMS = ('{"messages": [{"role": ..., "content": ...}, ...]}',
                '{"prompt": ..., "completion": ...}', '{"text": ...}')
# The roles a conversation's messages may have.
ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass
class Examples:
    """Training examples of a JSONL file, each a run of tokens of which some are trained.

    ids: int32, every example's tokens one after another; trained: bool per token, True
    where predicting it takes the loss (the assistant's tokens, a completion's, the end of
    sequence after it; never an example's first token, which nothing predicts); starts:
    int64 (n + 1,), example k is ids[starts[k]:starts[k + 1]]; lines: each example's line
    in the file; kinds: how many records of each form ("messages", "prompt/completion",
    "text")."""

    ids: np.ndarray
    trained: np.ndarray
    starts: np.ndarray
    lines: np.ndarray
    path: str
    kinds: dict

    def __len__(self):
        return self.starts.size - 1

    def lengths(self):
        """Each example's number of tokens."""
        return np.diff(self.starts)

    def describe_kinds(self):
        """'3 conversations, 1 prompt/completion' (the forms present)."""
        names = {"messages": ("conversation", "conversations"),
                 "prompt/completion": ("prompt/completion", "prompts/completions"),
                 "text": ("text", "texts")}
        return ", ".join(f"{n:,} {names[k][n != 1]}" for k, n in self.kinds.items() if n)


class _RecordReader:
    """Turns the records of one JSONL file into tokens: a record's form, its ids and which
    of them are trained (``read``); the chat template and the start and end tokens are
    found on first use (a file of texts reads neither)."""

    def __init__(self, tokenizer, tokenizer_dir):
        self.tokenizer = tokenizer
        self.tokenizer_dir = tokenizer_dir

    def read(self, record):
        """(form, ids, trained): trained None for a text (whose tokens all count)."""
        if not isinstance(record, dict):
            raise ValueError(f"not a JSON object: a record is one of {', '.join(RECORD_FORMS)}")
        forms = [k for k in ("messages", "prompt", "completion", "text") if k in record]
        if not forms:
            raise ValueError(f"no \"messages\", \"prompt\"/\"completion\" or \"text\" key "
                             f"(it has {', '.join(map(json.dumps, record)) or 'none'}): a "
                             f"record is one of {', '.join(RECORD_FORMS)}")
        if "messages" in record:
            if len(forms) > 1:
                raise ValueError(f"both \"messages\" and \"{forms[1]}\": a record is one of "
                                 f"{', '.join(RECORD_FORMS)}")
            return ("messages",) + self._conversation(record["messages"])
        if "prompt" in record or "completion" in record:
            if "text" in record:
                raise ValueError("both \"text\" and \"prompt\"/\"completion\": a record is "
                                 f"one of {', '.join(RECORD_FORMS)}")
            return ("prompt/completion",) + self._prompt_completion(record)
        return "text", self._encode(_string(record, "text")), None

    def _encode(self, text):
        return np.asarray(self.tokenizer.encode(text), dtype=np.int32)

    @functools.cached_property
    def opening(self):
        """The ids an example opens with (an int32 array): the tokenizer's beginning of
        sequence where it puts one before a text - what a Hugging Face tokenizer's
        post-processor adds (transformers' ``tokenizer(text)``: a Llama tokenizer's BOS),
        the others' own BOS (SentencePiece's <s>, GPT-2's <|endoftext|>); none for bytes."""
        if isinstance(self.tokenizer, HFTokenizer):
            plain = self.tokenizer.encode("a").tolist()
            full = self.tokenizer.encode("a", add_special_tokens=True).tolist()
            cut = next((k for k in range(len(full) - len(plain) + 1)
                        if full[k:k + len(plain)] == plain), 0)
            return np.asarray(full[:cut], dtype=np.int32)
        bos = special_ids(self.tokenizer).get("bos")
        return np.asarray([] if bos is None else [bos[1]], dtype=np.int32)

    @functools.cached_property
    def closing(self):
        """The ids that close a completion or a text (an int32 array): the directory's
        eos_token (tokenizer_config.json), else the tokenizer's own; none for bytes."""
        from gpt2 import chat
        name = (chat.special_tokens(self.tokenizer_dir).get("eos_token")
                if self.tokenizer_dir else None)
        end = (self.tokenizer.token_id(name)
               if name is not None and hasattr(self.tokenizer, "token_id") else None)
        if end is None:
            end = special_ids(self.tokenizer).get("eos", (None, None))[1]
        return np.asarray([] if end is None else [end], dtype=np.int32)

    @functools.cached_property
    def template(self):
        """The chat template of the tokenizer's directory (a ``gpt2.chat.ChatTemplate``)."""
        from gpt2 import chat
        if not isinstance(self.tokenizer, HFTokenizer) or self.tokenizer_dir is None:
            raise ValueError("a \"messages\" record is rendered by a chat template: pass "
                             "--tokenizer (or --init-from) with a Hugging Face directory "
                             "holding tokenizer.json and a chat template")
        template = chat.ChatTemplate.from_directory(self.tokenizer_dir)
        if template is None:
            raise ValueError(f"a \"messages\" record is rendered by a chat template, and "
                             f"{self.tokenizer_dir} has none ({chat.TEMPLATE_FILE}, or "
                             f"chat_template in {chat.TOKENIZER_CONFIG})")
        return template

    def _conversation(self, messages):
        from gpt2 import chat
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"\"messages\" must be a non-empty list of {{\"role\": ..., "
                             f"\"content\": ...}} objects, got {_shown(messages)}")
        for number, message in enumerate(messages, 1):
            if not isinstance(message, dict):
                raise ValueError(f"message {number} is not an object with \"role\" and "
                                 f"\"content\": {_shown(message)}")
            for key in ("role", "content"):
                if not isinstance(message.get(key), str):
                    raise ValueError(f"message {number}'s \"{key}\" must be a string, got "
                                     f"{_shown(message.get(key))}")
            if message["role"] not in ROLES:
                raise ValueError(f"message {number} has the unknown role "
                                 f"{message['role']!r}; the roles are {', '.join(ROLES)}")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError("no assistant message: the conversation has no token to train on "
                             "(the loss counts the assistant's tokens)")
        return chat.conversation_tokens(self.template, self.tokenizer, messages)

    def _prompt_completion(self, record):
        for key, other in (("prompt", "completion"), ("completion", "prompt")):
            if key not in record:
                raise ValueError(f"a \"{other}\" without a \"{key}\": a record is one of "
                                 f"{', '.join(RECORD_FORMS)}")
        prompt = self._encode(_string(record, "prompt"))
        completion = self._encode(_string(record, "completion"))
        ids = np.concatenate([self.opening, prompt, completion, self.closing])
        trained = np.zeros(ids.size, dtype=bool)
        trained[self.opening.size + prompt.size:] = True
        return ids, trained


def _string(record, key):
    """``record[key]``, which must be a string."""
    if not isinstance(record[key], str):
        raise ValueError(f"\"{key}\" must be a string, got {_shown(record[key])}")
    return record[key]


def _shown(value, limit=60):
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def read_jsonl(path, tokenizer=None, tokenizer_dir=None):
    """The data of a JSONL file, one record a line (blank lines skipped, keys other than a
    form's ignored), byte-level unless a tokenizer is given: a stream of tokens
    (``jsonl_file_tokens``) where every record is {"text": ...}, else ``Examples``.

    Each example's tokens, and those trained:
    * {"messages": [{"role", "content"}, ...]}: the conversation as the chat template of
      ``tokenizer_dir`` renders it, tokenized as transformers' apply_chat_template; the
      assistant's tokens trained (``gpt2.chat.conversation_tokens``: each assistant
      message's content and the end-of-turn marker after it).  Roles: ``ROLES``; other
      keys of a message go to the template as they are.
    * {"prompt", "completion"}: the tokenizer's opening (a BOS) and the prompt, then the
      completion and the end-of-sequence token (tokenizer_config.json's eos_token, else
      the tokenizer's own, where it has one), which are trained; prompt and completion are
      tokenized apart, so the boundary between them is exact.
    * {"text"}: the opening, the text and the end of sequence, all trained.

    A bad record is a ValueError naming the file and line: not JSON, no known key, messages
    not a list of {role, content} strings, an unknown role, no token to train on.
    """
    path = os.fspath(path)
    reader = _RecordReader(tokenizer or ByteTokenizer(), tokenizer_dir)
    records = []    # (line, form, ids, trained)
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"JSONL file {path!r} line {number}"
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{where}: not JSON ({e})") from None
            try:
                records.append((number,) + reader.read(record))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
    if not records:
        raise ValueError(f"JSONL file {path!r} holds no records")
    if all(form == "text" for _, form, _, _ in records):
        eot = getattr(reader.tokenizer, "eot_token", None)
        pieces = []
        for _, _, ids, _ in records:
            if eot is not None:
                pieces.append(np.array([eot], dtype=np.int32))
            pieces.append(ids)
        return np.concatenate(pieces)
    return _examples(path, reader, records)


def _examples(path, reader, records):
    ids, trained, lines = [], [], []
    kinds = {"messages": 0, "prompt/completion": 0, "text": 0}
    for number, form, record_ids, record_trained in records:
        if form == "text":
            record_ids = np.concatenate([reader.opening, record_ids, reader.closing])
            record_trained = np.ones(record_ids.size, dtype=bool)
        record_trained = record_trained.copy()
        record_trained[:1] = False          # nothing predicts the first token
        if not record_trained.any():
            what = {"messages": "the template renders no assistant token after the first",
                    "prompt/completion": "the completion is empty and the tokenizer has no "
                                         "end-of-sequence token",
                    "text": "the text is too short to predict a token of"}[form]
            raise ValueError(f"JSONL file {path!r} line {number}: no token to train on: {what}")
        ids.append(record_ids)
        trained.append(record_trained)
        lines.append(number)
        kinds[form] += 1
    starts = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum([a.size for a in ids], out=starts[1:])
    return Examples(ids=np.concatenate(ids).astype(np.int32, copy=False),
                    trained=np.concatenate(trained), starts=starts,
                    lines=np.asarray(lines, dtype=np.int64), path=path, kinds=kinds)


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
        if ("num_examples" in state) != ("num_examples" in mine):
            raise ValueError(f"DataLoader state was saved for "
                             f"{'examples' if 'num_examples' in state else 'a stream of tokens'}"
                             f", this data is "
                             f"{'examples' if 'num_examples' in mine else 'a stream of tokens'}")
        missing = sorted(set(mine) - set(state))
        if missing:
            raise ValueError(f"DataLoader state lacks keys {missing}")
        different = {k: (state[k], mine[k]) for k in mine
                     if k not in ("epoch", "batch_index") and state[k] != mine[k]}
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


class ExampleLoader(DataLoader):
    """Batches (inputs, targets), int32 (B, T), of ``Examples``, one example a row.

    Row r holds an example's tokens t[0..L-1] from its start: inputs t[0..L-2], targets
    t[1..L-1] where that token is trained and ``IGNORE_INDEX`` where not (a prompt, the
    other roles, headers), then padding: inputs 0 and targets IGNORE_INDEX (under causal
    attention padding after an example changes nothing before it).  An example longer than
    T + 1 tokens is cut to its first T + 1 (``truncated`` counts them); one left with no
    trained target is left out (``dropped``).  The split is by examples (the last
    ``val_fraction`` of them are "val"); an epoch is ``num_batches`` batches of B examples
    in a seeded random order (or in order); ``state()`` / ``load_state()`` as DataLoader's.
    ``padding_fraction``: the share of the split's (B, T) positions that are padding;
    ``trained_fraction``: the share whose target is trained.  A batch is only as wide as
    its longest example (``width``), and training batches (``shuffle``) group examples of
    like lengths, so that little of that padding is computed (``batch_padding_fraction``).
    """

    def __init__(self, examples, batch_size, seq_len, vocab_size, *, split="train",
                 val_fraction=0.1, shuffle=True, seed=0):
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len),
                            ("vocab_size", vocab_size)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"ExampleLoader {name} must be a positive int, got {value!r}")
        if split not in ("train", "val", "all"):
            raise ValueError(f"ExampleLoader split must be 'train', 'val' or 'all', got {split!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"ExampleLoader val_fraction must lie in [0, 1), got {val_fraction}")
        if not isinstance(examples, Examples):
            raise ValueError(f"ExampleLoader needs Examples, got {type(examples).__name__}")
        hi = int(examples.ids.max())
        if examples.ids.min() < 0 or hi >= vocab_size:
            raise ValueError(f"ExampleLoader: token ids must lie in [0, {vocab_size}) "
                             f"(vocab_size), the examples have ids up to {hi}")
        n = len(examples)
        n_train, _ = split_sizes(n, val_fraction)
        first, stop = {"train": (0, n_train), "val": (n_train, n), "all": (0, n)}[split]
        T = int(seq_len)
        starts = examples.starts[first:stop]
        lengths = np.minimum(examples.lengths()[first:stop], T + 1)
        trained_before = np.concatenate([[0], np.cumsum(examples.trained, dtype=np.int64)])
        # trained targets of each (cut) example: its tokens 1..L-1
        counted = trained_before[starts + lengths] - trained_before[starts + 1]
        kept = counted > 0
        self.examples = examples
        self.truncated = int(np.count_nonzero(examples.lengths()[first:stop] > T + 1))
        self.dropped = int(np.count_nonzero(~kept))
        self._starts, self._lengths = starts[kept], lengths[kept]
        if self._starts.size < batch_size:
            raise ValueError(f"ExampleLoader: the {split} split has {self._starts.size} "
                             f"example{'s' if self._starts.size != 1 else ''} with a trained "
                             f"token within T+1={T + 1} tokens, too few for one batch of "
                             f"B={batch_size}; use a smaller B, more data or a different "
                             f"val_fraction")
        self.tokens = examples.ids[examples.starts[first]:examples.starts[stop]]
        self.batch_size, self.seq_len, self.vocab_size = int(batch_size), T, int(vocab_size)
        self.split, self.shuffle, self.seed = split, bool(shuffle), int(seed)
        self.num_windows = int(self._starts.size)      # the examples, DataLoader's windows
        self.num_batches = self.num_windows // self.batch_size
        positions = self.num_windows * T
        self.padding_fraction = 1.0 - float((self._lengths - 1).sum()) / positions
        self.trained_fraction = float(counted[kept].sum()) / positions
        self.epoch, self.batch_index = 0, 0
        self._order = self._epoch_order(0)

    def next_batch(self):
        """(inputs, targets), each a fresh C-contiguous int32 array of shape (B, width): as
        wide as the batch's longest example (``width``), at most T."""
        if self.batch_index == self.num_batches:
            self.epoch += 1
            self.batch_index = 0
            self._order = self._epoch_order(self.epoch)
        B = self.batch_size
        chosen = self._order[self.batch_index * B:(self.batch_index + 1) * B]
        self.batch_index += 1
        return self.rows(chosen)

    # A batch is as wide as its longest example, rounded up to this many positions (at
    # most T): the padding past it would be computed for nothing.
    WIDTH_MULTIPLE = 16
    # Training batches group examples of like lengths (as transformers' group_by_length):
    # the shuffled examples are cut into runs of this many batches, each run sorted by
    # length and cut into batches, and the batches shuffled.
    GROUP_BATCHES = 50

    def _epoch_order(self, epoch):
        order = super()._epoch_order(epoch)
        if not self.shuffle:
            return order
        rng = np.random.default_rng([self.seed, epoch, 1])
        B, run = self.batch_size, self.GROUP_BATCHES * self.batch_size
        grouped = np.concatenate([chunk[np.argsort(-self._lengths[chunk], kind="stable")]
                                  for chunk in np.split(order, range(run, order.size, run))])
        n = self.num_batches * B
        batches = grouped[:n].reshape(self.num_batches, B)[rng.permutation(self.num_batches)]
        return np.concatenate([batches.reshape(-1), grouped[n:]])

    def width(self, chosen):
        """The width of the batch of examples ``chosen``: its longest example's inputs,
        rounded up to WIDTH_MULTIPLE, at most T."""
        longest = int(self._lengths[chosen].max()) - 1 if len(chosen) else 1
        m = self.WIDTH_MULTIPLE
        return min(self.seq_len, max(1, (longest + m - 1) // m * m))

    def rows(self, chosen):
        """(inputs, targets) of the split's kept examples ``chosen`` (indices), one a row,
        (B, ``width(chosen)``)."""
        ids, trained = self.examples.ids, self.examples.trained
        width = self.width(chosen)
        inputs = np.zeros((len(chosen), width), dtype=np.int32)
        targets = np.full((len(chosen), width), IGNORE_INDEX, dtype=np.int32)
        for row, k in enumerate(chosen):
            start, n = int(self._starts[k]), int(self._lengths[k]) - 1
            inputs[row, :n] = ids[start:start + n]
            targets[row, :n] = np.where(trained[start + 1:start + n + 1],
                                        ids[start + 1:start + n + 1], IGNORE_INDEX)
        return inputs, targets

    def batch_padding_fraction(self, epoch=0):
        """The share of the positions of ``epoch``'s batches, each as wide as ``width``
        says, that are padding."""
        B, order = self.batch_size, self._epoch_order(epoch)
        batches = order[:self.num_batches * B].reshape(self.num_batches, B)
        positions = sum(self.width(b) * B for b in batches)
        return 1.0 - float((self._lengths[batches] - 1).sum()) / max(positions, 1)

    def state(self):
        """JSON-serializable position (and the settings it is only valid for)."""
        return {**super().state(), "num_examples": self.num_windows}

    def describe(self):
        """'1,200 examples of up to T+1 tokens: 3 truncated, 1 dropped (no trained token
        within them); 41.2% of the positions padding, 22.0% trained'."""
        return (f"{self.num_windows:,} examples of up to T+1={self.seq_len + 1} tokens: "
                f"{self.truncated:,} truncated, {self.dropped:,} dropped (no trained token "
                f"within them); {100 * self.padding_fraction:.1f}% of the positions padding, "
                f"{100 * self.trained_fraction:.1f}% trained; batches as wide as their "
                f"longest example: {100 * self.batch_padding_fraction():.1f}% padding")


def make_loader(data, batch_size, seq_len, vocab_size, **kwargs):
    """A DataLoader of a token array, an ExampleLoader of ``Examples`` (``read_data``'s)."""
    cls = ExampleLoader if isinstance(data, Examples) else DataLoader
    return cls(data, batch_size, seq_len, vocab_size, **kwargs)


def train_val_loaders(tokens, batch_size, seq_len, vocab_size, *, val_fraction=0.1, seed=0):
    """A shuffled train loader and a sequential val loader over the two splits of ``tokens``
    (a token array, or ``Examples``)."""
    train = make_loader(tokens, batch_size, seq_len, vocab_size, split="train",
                        val_fraction=val_fraction, shuffle=True, seed=seed)
    val = make_loader(tokens, batch_size, seq_len, vocab_size, split="val",
                      val_fraction=val_fraction, shuffle=False, seed=seed)
    return train, val
