"""Tokenizers: byte-level (256 ids), GPT-2 BPE from a tiktoken file, llm.c's decode-only
vocabulary, and Hugging Face's two formats through their own libraries: a ``tokenizer.json``
(the ``tokenizers`` library) and a SentencePiece ``tokenizer.model`` (``sentencepiece``), both
optional (``pip install 'adtape[hf]'``).  ``load_tokenizer`` tells the file kinds apart and
``find_tokenizer`` finds a model directory's own.

GPT-2 BPE (``GPT2BPETokenizer``) reads a local tiktoken encoding file (the format of
``r50k_base.tiktoken``: one ``base64(token_bytes) rank`` per line) and encodes with byte-level
BPE: the text is split by GPT-2's pre-tokenizer pattern, each piece's UTF-8 bytes are merged by
lowest rank first, exactly as tiktoken does.

GPT-2's pattern uses the Unicode classes ``\\p{L}`` (letters) and ``\\p{N}`` (numbers), which the
standard ``re`` module lacks.  We approximate them with ``re``'s Unicode classes:
  letters  ``\\p{L}``   -> ``[^\\W\\d_]``  (word characters that are not decimal digits nor ``_``)
  numbers  ``\\p{N}``   -> ``\\d``         (decimal digits, category Nd)
  other    ``[^\\s\\p{L}\\p{N}]`` -> ``(?:[^\\s\\w]|_)``
The approximation is exact on ASCII and on the letters and decimal digits of every script.  It
differs from GPT-2 only on (a) numeric characters that are not decimal digits (categories Nl/No,
e.g. ``²``, ``½``, ``Ⅻ``), which ``re`` counts as word characters and so we group with letters, and
(b) the control characters U+001C..U+001F, which ``re`` treats as whitespace and GPT-2 does not.
Either way every byte is still encoded and ``decode(encode(s)) == s`` holds; only the token split
of such characters may differ from tiktoken's.
"""
import base64
import binascii
import importlib
import os
import re

import numpy as np

from gpt2.checkpoint import atomic_writer

GPT2_SPLIT_PATTERN = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")
GPT2_EOT = "<|endoftext|>"

LLMC_TOKENIZER_MAGIC = 20240328
LLMC_TOKENIZER_HEADER_INTS = 256
# llm.c's version 1 files predate the eot field in the header; GPT-2's eot id is implied
# when the vocabulary is GPT-2's size.
LLMC_V1_EOT = 50256


def _ids_array(ids, vocab_size, who):
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{who}.decode needs a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{who}.decode needs integer token ids, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise ValueError(f"{who}.decode: token ids must lie in [0, {vocab_size}), got range "
                         f"[{arr.min()}, {arr.max()}]")
    return arr.astype(np.int64, copy=False)


def _check_text(text, who):
    if not isinstance(text, str):
        raise TypeError(f"{who}.encode needs a str, got {type(text).__name__}")


class ByteTokenizer:
    """Each UTF-8 byte is one token: vocabulary of 256, no special tokens."""

    vocab_size = 256
    eot_token = None

    def encode(self, text):
        _check_text(text, "ByteTokenizer")
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_bytes(self, data):
        """Token ids of raw bytes (no UTF-8 round trip needed for byte-level tokens)."""
        return np.frombuffer(bytes(data), dtype=np.uint8).astype(np.int32)

    def decode_bytes(self, ids):
        return _ids_array(ids, 256, "ByteTokenizer").astype(np.uint8).tobytes()

    def decode(self, ids):
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class _VocabDecoder:
    """Decoding shared by the BPE tokenizers: id -> bytes table, then UTF-8 with replacement."""

    def __init__(self, token_bytes, eot_token):
        self._token_bytes = token_bytes
        self.eot_token = eot_token

    @property
    def vocab_size(self):
        return len(self._token_bytes)

    def token_bytes(self, token_id):
        return self._token_bytes[int(_ids_array([token_id], self.vocab_size, type(self).__name__)[0])]

    def decode_bytes(self, ids):
        table = self._token_bytes
        return b"".join(table[i] for i in _ids_array(ids, self.vocab_size, type(self).__name__).tolist())

    def decode(self, ids):
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class LlmcTokenizer(_VocabDecoder):
    """Decode-only GPT-2 vocabulary from llm.c's ``gpt2_tokenizer.bin``.

    Format: 256 little-endian uint32 header [20240328, version (1 or 2), vocab size,
    eot token (version 2)], then per token a uint8 length (>= 1) and that many bytes.
    ``eot_token`` is None for a version 1 file smaller than GPT-2's vocabulary.
    """

    def __init__(self, path):
        path = os.fspath(path)
        with open(path, "rb") as f:
            data = f.read()
        header_bytes = 4 * LLMC_TOKENIZER_HEADER_INTS
        if len(data) < header_bytes:
            raise ValueError(f"llm.c tokenizer file {path!r} is truncated: {len(data)} bytes, "
                             f"the header alone needs {header_bytes}")
        header = np.frombuffer(data, dtype="<u4", count=LLMC_TOKENIZER_HEADER_INTS)
        if header[0] != LLMC_TOKENIZER_MAGIC:
            raise ValueError(f"{path!r} is not an llm.c tokenizer file: magic {int(header[0])}, "
                             f"expected {LLMC_TOKENIZER_MAGIC}")
        version, vocab_size = int(header[1]), int(header[2])
        if version == 1:
            eot = LLMC_V1_EOT if vocab_size > LLMC_V1_EOT else None
        elif version == 2:
            eot = int(header[3])
        else:
            raise ValueError(f"llm.c tokenizer file {path!r} has version {version}; "
                             "only versions 1 and 2 are supported")
        if vocab_size <= 0:
            raise ValueError(f"llm.c tokenizer file {path!r} declares vocab size {vocab_size}")
        tokens, pos = [], header_bytes
        for i in range(vocab_size):
            if pos >= len(data):
                raise ValueError(f"llm.c tokenizer file {path!r} is truncated: it declares "
                                 f"{vocab_size} tokens but ends after {i}")
            length = data[pos]
            if length == 0:
                raise ValueError(f"llm.c tokenizer file {path!r}: token {i} has length 0")
            if pos + 1 + length > len(data):
                raise ValueError(f"llm.c tokenizer file {path!r} is truncated inside token {i}")
            tokens.append(data[pos + 1:pos + 1 + length])
            pos += 1 + length
        if pos != len(data):
            raise ValueError(f"llm.c tokenizer file {path!r} has {len(data) - pos} bytes after "
                             f"its {vocab_size} tokens")
        if eot is not None and not 0 <= eot < vocab_size:
            raise ValueError(f"llm.c tokenizer file {path!r}: eot token {eot} is outside the "
                             f"vocabulary of {vocab_size}")
        super().__init__(tokens, eot)
        self.path = path


def write_llmc_tokenizer(path, token_bytes, eot_token=None, version=2):
    """Write a vocabulary (list of 1 to 255 byte tokens) in llm.c's tokenizer format.

    Version 2 stores ``eot_token`` in the header; version 1 has no field for it.
    """
    if version not in (1, 2):
        raise ValueError(f"llm.c tokenizer version must be 1 or 2, got {version}")
    if version == 2 and (eot_token is None or not 0 <= eot_token < len(token_bytes)):
        raise ValueError(f"a version 2 llm.c tokenizer needs an eot_token in "
                         f"[0, {len(token_bytes)}), got {eot_token!r}")
    header = np.zeros(LLMC_TOKENIZER_HEADER_INTS, dtype="<u4")
    header[:3] = (LLMC_TOKENIZER_MAGIC, version, len(token_bytes))
    if version == 2:
        header[3] = eot_token
    parts = [header.tobytes()]
    for i, tok in enumerate(token_bytes):
        if not isinstance(tok, (bytes, bytearray)) or not 1 <= len(tok) <= 255:
            raise ValueError(f"token {i} must be 1 to 255 bytes, got {tok!r}")
        parts.append(bytes([len(tok)]) + bytes(tok))
    with atomic_writer(path) as f:
        f.write(b"".join(parts))


def read_tiktoken_ranks(path):
    """dict bytes -> rank from a tiktoken encoding file; validates every line."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    ranks = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        fields_ = line.split()
        if len(fields_) != 2:
            raise ValueError(f"tiktoken file {path!r} line {lineno}: expected "
                             f"'base64_token rank', got {line[:80]!r}")
        try:
            token = base64.b64decode(fields_[0], validate=True)
            rank = int(fields_[1])
        except (binascii.Error, ValueError):
            raise ValueError(f"tiktoken file {path!r} line {lineno}: bad base64 token or "
                             f"rank in {line[:80]!r}") from None
        if not token:
            raise ValueError(f"tiktoken file {path!r} line {lineno}: empty token")
        if token in ranks:
            raise ValueError(f"tiktoken file {path!r} line {lineno}: token {token!r} repeated")
        ranks[token] = rank
    if not ranks:
        raise ValueError(f"tiktoken file {path!r} holds no tokens")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"tiktoken file {path!r}: ranks must be exactly 0..{len(ranks) - 1}, "
                         "each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"tiktoken file {path!r} lacks {len(missing)} single-byte tokens "
                         f"(first: byte {missing[0]}); byte-level BPE needs all 256")
    return ranks


def write_tiktoken_ranks(path, ranks):
    """Write dict bytes -> rank in the tiktoken encoding file format (sorted by rank)."""
    lines = [base64.b64encode(tok) + b" " + str(rank).encode()
             for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    with atomic_writer(path) as f:
        f.write(b"\n".join(lines) + b"\n")


def bpe_merge(piece, ranks):
    """Token ranks of one pre-tokenized piece (bytes) by byte-level BPE, lowest-rank pair first."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best_rank, best_i = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best_i = rank, i
        if best_rank is None:
            break
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return [ranks[p] for p in parts]


class GPT2BPETokenizer(_VocabDecoder):
    """GPT-2 byte-level BPE (encode and decode) from a local tiktoken encoding file.

    The special token ``<|endoftext|>`` gets the id after the last rank (50256 for GPT-2's
    r50k_base file).  ``encode`` treats special-token text as ordinary text unless
    ``allow_special=True``.
    """

    def __init__(self, path, special_tokens=None):
        self.path = os.fspath(path)
        self._ranks = read_tiktoken_ranks(self.path)
        if special_tokens is None:
            special_tokens = {GPT2_EOT: len(self._ranks)}
        table = [b""] * (len(self._ranks) + len(special_tokens))
        for tok, rank in self._ranks.items():
            table[rank] = tok
        for text, token_id in special_tokens.items():
            if not len(self._ranks) <= token_id < len(table) or table[token_id]:
                raise ValueError(f"special token {text!r} id {token_id} must be a distinct id in "
                                 f"[{len(self._ranks)}, {len(table)})")
            table[token_id] = text.encode("utf-8")
        self.special_tokens = dict(special_tokens)
        super().__init__(table, self.special_tokens.get(GPT2_EOT))
        self._special_pattern = (re.compile("|".join(re.escape(s) for s in
                                                     sorted(special_tokens, key=len, reverse=True)))
                                 if special_tokens else None)
        self._piece_cache = {}

    def _encode_ordinary(self, text, out):
        cache, ranks = self._piece_cache, self._ranks
        for match in GPT2_SPLIT_PATTERN.finditer(text):
            piece = match.group().encode("utf-8")
            ids = cache.get(piece)
            if ids is None:
                ids = bpe_merge(piece, ranks)
                cache[piece] = ids
            out.extend(ids)

    def encode(self, text, allow_special=False):
        _check_text(text, "GPT2BPETokenizer")
        out = []
        if allow_special and self._special_pattern is not None:
            start = 0
            for match in self._special_pattern.finditer(text):
                self._encode_ordinary(text[start:match.start()], out)
                out.append(self.special_tokens[match.group()])
                start = match.end()
            self._encode_ordinary(text[start:], out)
        else:
            self._encode_ordinary(text, out)
        return np.asarray(out, dtype=np.int32)


HF_TOKENIZER_NAMES = ("tokenizer.json", "tokenizer.model")
# The spellings of the start and end of a text in the tokenizers of the families we train
# (GPT-2, Llama 2 and 3, SmolLM2, Qwen2), likeliest first.
_USUAL_SPECIAL_TOKENS = {"bos": ("<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>"),
                         "eos": ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>",
                                 "<|im_end|>")}


def special_ids(tokenizer):
    """{'bos'|'eos'|'pad': (token text, id)} that ``tokenizer`` knows; {} for bytes."""
    if hasattr(tokenizer, "special_ids"):
        return tokenizer.special_ids()
    eot = getattr(tokenizer, "eot_token", None)
    if eot is None:
        return {}
    text = GPT2_EOT if isinstance(tokenizer, GPT2BPETokenizer) else None
    return {"bos": (text, eot), "eos": (text, eot)}
_TIKTOKEN_HEAD = re.compile(rb"[A-Za-z0-9+/=\s]*")


def _optional_import(module, what):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"reading {what} needs the {module} package: "
                          f"pip install 'adtape[hf]'") from None


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library.

    ``encode`` adds no special tokens (no BOS), as for the other tokenizers here: the data
    is one stream of text.  ``eot_token`` is None: which token ends a text is not in
    tokenizer.json (transformers reads it from tokenizer_config.json).
    """

    eot_token = None

    def __init__(self, path):
        self.path = os.fspath(path)
        tokenizers = _optional_import("tokenizers", f"the tokenizer file {self.path!r}")
        with open(self.path, "rb") as f:
            data = f.read()
        try:
            self._tokenizer = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # the library raises a bare Exception for a malformed file
            raise ValueError(f"{self.path!r} is not a Hugging Face tokenizer.json: {e}") from None
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        if not vocab:
            raise ValueError(f"{self.path!r} holds no tokens")
        # Ids may be sparse: the vocabulary spans up to the largest one.
        self.vocab_size = max(vocab.values()) + 1
        self._offsets_tokenizer = None      # encode_offsets's copy, made on first use

    def encode(self, text, add_special_tokens=False):
        """Token ids of ``text``; ``add_special_tokens``: with what the tokenizer's
        post-processor adds (a Llama tokenizer's BOS), as transformers' ``tokenizer(text)``."""
        _check_text(text, "HFTokenizer")
        # The batch call without offsets is three times faster than encode on a long text.
        ids = self._tokenizer.encode_batch_fast([text],
                                                add_special_tokens=add_special_tokens)[0].ids
        return np.asarray(ids, dtype=np.int32)

    def token_id(self, token):
        """The id of the token whose text is ``token`` (an added token such as
        ``<|endoftext|>``), or None where the vocabulary lacks it."""
        return self._tokenizer.token_to_id(token)

    def encode_offsets(self, text):
        """(ids, offsets): ``encode(text)``'s ids and each token's span of characters in
        ``text``, an int64 (n, 2) array of [start, end).  The spans are the pre-tokenizer's,
        untrimmed (a ByteLevel post-processor's trim_offsets would shrink a space token to
        nothing): the tokens tile the text."""
        _check_text(text, "HFTokenizer")
        if self._offsets_tokenizer is None:
            # The post-processor adds no ids without special tokens; it only trims offsets.
            tokenizers = _optional_import("tokenizers", f"the tokenizer file {self.path!r}")
            self._offsets_tokenizer = tokenizers.Tokenizer.from_str(self._tokenizer.to_str())
            self._offsets_tokenizer.post_processor = None
        encoding = self._offsets_tokenizer.encode(text, add_special_tokens=False)
        return (np.asarray(encoding.ids, dtype=np.int32),
                np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2))

    def special_token_ids(self):
        """The ids of the tokenizer's special added tokens (``<|im_end|>``, ``<|eot_id|>``,
        ...), as a frozenset."""
        return frozenset(i for i, token in self._tokenizer.get_added_tokens_decoder().items()
                         if token.special)

    def decode(self, ids):
        ids = _ids_array(ids, self.vocab_size, "HFTokenizer")
        return self._tokenizer.decode(ids.tolist(), skip_special_tokens=False)

    def special_ids(self):
        """bos/eos ids of the well-known special tokens this tokenizer.json holds (a
        tokenizer_config.json says which they are; without one, these are the usual)."""
        found = {}
        for key, names in _USUAL_SPECIAL_TOKENS.items():
            for name in names:
                token_id = self.token_id(name)
                if token_id is not None:
                    found[key] = (name, token_id)
                    break
        return found


class SentencePieceTokenizer:
    """A SentencePiece model (``tokenizer.model``: Llama 2, TinyLlama, Mistral) through the
    ``sentencepiece`` library.  ``encode`` adds no BOS or EOS."""

    def __init__(self, path):
        self.path = os.fspath(path)
        spm = _optional_import("sentencepiece", f"the SentencePiece model {self.path!r}")
        with open(self.path, "rb") as f:
            proto = f.read()
        self._processor = spm.SentencePieceProcessor()
        try:
            self._processor.LoadFromSerializedProto(proto)
        except RuntimeError:
            raise ValueError(f"{self.path!r} is not a SentencePiece model (its protobuf does "
                             f"not parse)") from None
        self.vocab_size = self._processor.get_piece_size()
        eos = self._processor.eos_id()
        self.eot_token = eos if eos >= 0 else None

    def encode(self, text):
        _check_text(text, "SentencePieceTokenizer")
        return np.asarray(self._processor.encode(text), dtype=np.int32)

    def decode(self, ids):
        ids = _ids_array(ids, self.vocab_size, "SentencePieceTokenizer")
        return self._processor.decode(ids.tolist())

    def token_id(self, text):
        token_id = self._processor.piece_to_id(text)
        return token_id if self._processor.id_to_piece(token_id) == text else None

    def special_ids(self):
        """bos/eos/pad of the model ((piece, id); absent where it defines none)."""
        ids = {"bos": self._processor.bos_id(), "eos": self._processor.eos_id(),
               "pad": self._processor.pad_id()}
        return {k: (self._processor.id_to_piece(i), i) for k, i in ids.items() if i >= 0}


def _looks_like_sentencepiece(head):
    # A SentencePiece ModelProto opens with its first piece: field 1, length-delimited (0x0a,
    # then a varint length), whose own first field, the piece's text, is 0x0a again.
    if head[:1] != b"\n":
        return False
    end = 1
    while end < len(head) and head[end] & 0x80:
        end += 1
    return head[end + 1:end + 2] == b"\n"


def load_tokenizer(path):
    """The tokenizer in a file: a Hugging Face ``tokenizer.json``, a SentencePiece
    ``tokenizer.model`` or a tiktoken file (GPT-2 BPE), told apart by the name's extension
    (.json, .model, .tiktoken), else by the contents; or a model directory's (its
    tokenizer.json, else tokenizer.model: ``tokenizer_file``)."""
    path = tokenizer_file(path)
    kinds = {".json": HFTokenizer, ".model": SentencePieceTokenizer,
             ".tiktoken": GPT2BPETokenizer}
    ext = os.path.splitext(path)[1].lower()
    if ext in kinds:
        return kinds[ext](path)
    with open(path, "rb") as f:
        head = f.read(256)
    if head.lstrip()[:1] == b"{":
        return HFTokenizer(path)
    if _looks_like_sentencepiece(head):
        return SentencePieceTokenizer(path)
    if _TIKTOKEN_HEAD.fullmatch(head):
        return GPT2BPETokenizer(path)
    raise ValueError(f"{path!r} is not a tokenizer file: neither JSON (a Hugging Face "
                     f"tokenizer.json), a SentencePiece model (tokenizer.model) nor a "
                     f"tiktoken file (lines of 'base64_token rank')")


def tokenizer_file(path):
    """``path``, or where it is a directory, the tokenizer file in it (``find_tokenizer``);
    ValueError for a directory without one."""
    path = os.fspath(path)
    if os.path.isdir(path):
        found = find_tokenizer(path)
        if found is None:
            raise ValueError(f"{path!r} is a directory without a tokenizer "
                             f"({' or '.join(HF_TOKENIZER_NAMES)})")
        return found
    return path


def find_tokenizer(directory):
    """The path of a Hugging Face model directory's tokenizer (tokenizer.json preferred,
    else tokenizer.model), or None if it has neither."""
    for name in HF_TOKENIZER_NAMES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    return None
