"""Tokenizers (byte, GPT-2 BPE from tiktoken files, llm.c vocab), corpora, token files, DataLoader."""
import json

import numpy as np
import pytest
import regex

from gpt2.data import (DataLoader, default_corpus_tokens, read_llmc_tokens, stdlib_corpus_bytes,
                       text_file_tokens, train_val_loaders, write_llmc_tokens)
from gpt2.tokenizer import (GPT2_SPLIT_PATTERN, ByteTokenizer, GPT2BPETokenizer, LlmcTokenizer,
                            bpe_merge, write_llmc_tokenizer, write_tiktoken_ranks)

MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b" world", b"bc", b"ab",
          b"\xc3\xa9", b"  "]


@pytest.fixture
def ranks():
    table = {bytes([b]): b for b in range(256)}
    for tok in MERGES:
        table[tok] = len(table)
    return table


@pytest.fixture
def tiktoken_path(tmp_path, ranks):
    path = tmp_path / "tiny.tiktoken"
    write_tiktoken_ranks(path, ranks)
    return path


# ---------------------------------------------------------------------------- ByteTokenizer

def test_byte_tokenizer_round_trip_and_replacement():
    tok = ByteTokenizer()
    text = "héllo wörld ✓ 😀"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and list(ids) == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([0x68, 0xff, 0x69]) == "h\ufffdi"
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        tok.decode([1, 256])
    with pytest.raises(TypeError, match="needs a str"):
        tok.encode(b"bytes")


# ---------------------------------------------------------------------------- GPT-2 BPE

def test_split_pattern_on_ascii():
    text = "Hello world's 123 foo!!  bar\n\n x_y"
    assert GPT2_SPLIT_PATTERN.findall(text) == \
        ["Hello", " world", "'s", " 123", " foo", "!!", " ", " bar", "\n\n", " x", "_", "y"]


def test_split_pattern_matches_gpt2_regex_on_letters_and_digits():
    gpt2 = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    samples = ["Ünïcödé façade — naïve café's 42€!", "Привет, мир 2024", "日本語のテキスト。東京",
               "مرحبا ١٢٣ بالعالم", "x = [a_b + 3.14]\n\tif y:  return   z\r\n",
               "e\u0301 combining", "tabs\t\t\n  \n spaces   end   "]
    for s in samples:
        assert GPT2_SPLIT_PATTERN.findall(s) == gpt2.findall(s), s


def test_bpe_merges_lowest_rank_first(ranks):
    assert bpe_merge(b"hello", ranks) == [ranks[b"hello"]]
    assert bpe_merge(b"hellx", ranks) == [ranks[b"hell"], ord("x")]
    # "ab" and "bc" overlap: "bc" has the lower rank, so it wins although "ab" is leftmost
    assert ranks[b"bc"] < ranks[b"ab"]
    assert bpe_merge(b"abc", ranks) == [ord("a"), ranks[b"bc"]]
    assert bpe_merge(b"abab", ranks) == [ranks[b"ab"], ranks[b"ab"]]


def test_bpe_tokenizer_encode_decode(tiktoken_path, ranks):
    tok = GPT2BPETokenizer(tiktoken_path)
    assert tok.vocab_size == len(ranks) + 1 and tok.eot_token == len(ranks)
    ids = tok.encode("hello world")
    assert ids.dtype == np.int32
    assert list(ids) == [ranks[b"hello"], ranks[b" world"]]
    assert list(tok.encode("café")) == [ord("c"), ord("a"), ord("f"), ranks[b"\xc3\xa9"]]
    text = "hello<|endoftext|>ab"
    assert list(tok.encode(text, allow_special=True)) == \
        [ranks[b"hello"], tok.eot_token, ranks[b"ab"]]
    assert tok.eot_token not in tok.encode(text)
    assert tok.decode(tok.encode(text, allow_special=True)) == text
    assert tok.decode([ranks[b"he"], 0xc3]) == "he\ufffd"
    rng = np.random.default_rng(0)
    alphabet = list("helo wrdabc é😀\n\t'sxyz0123!?") + ["  ", "hello", " world"]
    for _ in range(50):
        s = "".join(rng.choice(alphabet, size=rng.integers(0, 40)))
        assert tok.decode(tok.encode(s)) == s


@pytest.mark.parametrize("content, message", [
    (b"aGk= 0\nnot-base64! 1\n", "line 2"),
    (b"aGk= 0 extra\n", "line 1: expected"),
    (b"aGk= zero\n", "line 1"),
    (b"", "no tokens"),
])
def test_bpe_malformed_files(tmp_path, content, message):
    path = tmp_path / "bad.tiktoken"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as info:
        GPT2BPETokenizer(path)
    assert "bad.tiktoken" in str(info.value)


def test_bpe_rank_and_byte_coverage_errors(tmp_path, ranks):
    path = tmp_path / "gap.tiktoken"
    write_tiktoken_ranks(path, {**ranks, b"zz": len(ranks) + 5})
    with pytest.raises(ValueError, match="ranks must be exactly"):
        GPT2BPETokenizer(path)
    missing = {k: v for k, v in ranks.items() if k != b"\x07"}
    missing = {k: i for i, k in enumerate(sorted(missing, key=missing.get))}
    write_tiktoken_ranks(path, missing)
    with pytest.raises(ValueError, match="byte 7"):
        GPT2BPETokenizer(path)
    with pytest.raises(FileNotFoundError):
        GPT2BPETokenizer(tmp_path / "absent.tiktoken")


def test_llmc_tokenizer_decodes_like_bpe(tmp_path, tiktoken_path):
    bpe = GPT2BPETokenizer(tiktoken_path)
    table = [bpe.token_bytes(i) for i in range(bpe.vocab_size)]
    path = tmp_path / "tok.bin"
    write_llmc_tokenizer(path, table, eot_token=bpe.eot_token)
    llmc = LlmcTokenizer(path)
    assert llmc.vocab_size == bpe.vocab_size and llmc.eot_token == bpe.eot_token
    ids = bpe.encode("hello world, café!")
    assert llmc.decode(ids) == "hello world, café!"
    write_llmc_tokenizer(path, table, version=1)
    assert LlmcTokenizer(path).eot_token is None  # too small to be GPT-2's vocabulary
    with pytest.raises(ValueError, match=r"\[0, 269\)"):
        llmc.decode([269])


def test_llmc_tokenizer_bad_files(tmp_path):
    path = tmp_path / "tok.bin"
    write_llmc_tokenizer(path, [b"a", b"bc", b"d"], eot_token=2)
    good = path.read_bytes()
    path.write_bytes(good[:-1])
    with pytest.raises(ValueError, match="truncated"):
        LlmcTokenizer(path)
    path.write_bytes(good + b"x")
    with pytest.raises(ValueError, match="1 bytes after"):
        LlmcTokenizer(path)
    header = np.frombuffer(good[:1024], dtype="<u4").copy()
    header[1] = 3
    path.write_bytes(header.tobytes() + good[1024:])
    with pytest.raises(ValueError, match="version 3"):
        LlmcTokenizer(path)
    header[:2] = (1234, 2)
    path.write_bytes(header.tobytes() + good[1024:])
    with pytest.raises(ValueError, match="not an llm.c tokenizer"):
        LlmcTokenizer(path)
    path.write_bytes(good[:1024] + b"\x00a")
    with pytest.raises(ValueError, match="token 0 has length 0"):
        LlmcTokenizer(path)
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="truncated"):
        LlmcTokenizer(path)


# ---------------------------------------------------------------------------- corpora

def test_stdlib_corpus_is_capped_deterministic_text():
    small = stdlib_corpus_bytes(100_000)
    large = stdlib_corpus_bytes(400_000)
    assert 90_000 < len(small) <= 100_000 and 390_000 < len(large) <= 400_000
    assert large.startswith(small) and small.endswith(b"\n")
    large.decode("utf-8")
    assert b"def " in small and b"import " in small
    tokens = default_corpus_tokens(max_bytes=100_000)
    assert tokens is default_corpus_tokens(max_bytes=100_000), "cached"
    assert tokens.dtype == np.int32 and not tokens.flags.writeable
    assert bytes(tokens.astype(np.uint8)) == small
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_corpus_bytes(0)


def test_default_corpus_with_bpe(tiktoken_path):
    bpe = GPT2BPETokenizer(tiktoken_path)
    tokens = default_corpus_tokens(bpe, max_bytes=20_000)
    assert tokens.size < 20_000  # merges happened
    assert bpe.decode(tokens).encode("utf-8") == stdlib_corpus_bytes(20_000)


def test_text_file_tokens(tmp_path, tiktoken_path):
    path = tmp_path / "t.txt"
    path.write_text("hello world\n", encoding="utf-8")
    assert list(text_file_tokens(path)) == list(b"hello world\n")
    bpe = GPT2BPETokenizer(tiktoken_path)
    assert bpe.decode(text_file_tokens(path, bpe)) == "hello world\n"
    path.write_bytes(b"\xff\xfe bad")
    assert text_file_tokens(path).size == 6  # bytes need no decoding
    with pytest.raises(ValueError, match="not UTF-8"):
        text_file_tokens(path, bpe)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        text_file_tokens(path)
    with pytest.raises(FileNotFoundError):
        text_file_tokens(tmp_path / "absent.txt")


def test_llmc_token_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "shard.bin"
    tokens = np.array([0, 1, 50256, 65535, 7], dtype=np.int64)
    write_llmc_tokens(path, tokens)
    assert path.stat().st_size == 1024 + 2 * 5
    back = read_llmc_tokens(path)
    assert back.dtype == np.int32 and list(back) == list(tokens)
    raw = path.read_bytes()
    path.write_bytes(raw[:-1])
    with pytest.raises(ValueError, match="truncated"):
        read_llmc_tokens(path)
    path.write_bytes(raw[:500])
    with pytest.raises(ValueError, match="truncated"):
        read_llmc_tokens(path)
    header = np.frombuffer(raw[:1024], dtype="<i4").copy()
    header[1] = 2
    path.write_bytes(header.tobytes() + raw[1024:])
    with pytest.raises(ValueError, match="version 2"):
        read_llmc_tokens(path)
    header[0] = 20240326
    path.write_bytes(header.tobytes() + raw[1024:])
    with pytest.raises(ValueError, match="not an llm.c token file"):
        read_llmc_tokens(path)
    with pytest.raises(ValueError, match=r"\[0, 65535\]"):
        write_llmc_tokens(path, [1, 65536])
    with pytest.raises(ValueError, match="1-D integer"):
        write_llmc_tokens(path, [0.5])


# ---------------------------------------------------------------------------- DataLoader

def corpus(n, vocab=256, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=n).astype(np.int32)


def test_loader_batches_shift_and_sequential_order():
    tokens = np.arange(1000, dtype=np.int32) % 256
    loader = DataLoader(tokens, 4, 8, 256, shuffle=False, val_fraction=0.0)
    assert loader.num_windows == 124 and loader.num_batches == 31
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, 8) and x.dtype == y.dtype == np.int32
    assert x.flags.c_contiguous and y.flags.c_contiguous
    np.testing.assert_array_equal(x, np.arange(32).reshape(4, 8))
    np.testing.assert_array_equal(y, x + 1)
    x2, _ = loader.next_batch()
    assert x2[0, 0] == 32


def test_loader_epoch_visits_every_window_once_and_reshuffles():
    tokens = np.arange(2001, dtype=np.int32)  # token value = position, so a row names its window
    loader = DataLoader(tokens, 3, 10, 2001, seed=5, val_fraction=0.0)
    assert loader.num_windows == 200 and loader.num_batches == 66

    def epoch_windows():
        windows = []
        for _ in range(loader.num_batches):
            x, y = loader.next_batch()
            np.testing.assert_array_equal(x, x[:, :1] + np.arange(10))
            np.testing.assert_array_equal(y, x + 1)
            windows.extend(int(w) for w in x[:, 0] // 10)
        return windows

    first, second = epoch_windows(), epoch_windows()
    for windows in (first, second):
        assert len(set(windows)) == len(windows) == 198
        assert windows != sorted(windows)
    assert first != second, "each epoch gets its own order"
    assert loader.epoch == 1 and loader.batch_index == loader.num_batches


def test_loader_same_seed_same_batches_other_seed_differs():
    tokens = corpus(5000)
    a, b, c = (DataLoader(tokens, 4, 16, 256, seed=s) for s in (1, 1, 2))
    batches_a = [a.next_batch()[0] for _ in range(5)]
    batches_b = [b.next_batch()[0] for _ in range(5)]
    batches_c = [c.next_batch()[0] for _ in range(5)]
    for p, q in zip(batches_a, batches_b):
        np.testing.assert_array_equal(p, q)
    assert any(not np.array_equal(p, q) for p, q in zip(batches_a, batches_c))


def test_loader_state_resume_is_exact_across_epochs():
    tokens = corpus(3000)
    loader = DataLoader(tokens, 2, 16, 256, seed=3)
    for _ in range(loader.num_batches + 4):  # into the second epoch
        loader.next_batch()
    state = json.loads(json.dumps(loader.state()))
    expected = [loader.next_batch() for _ in range(loader.num_batches)]
    resumed = DataLoader(tokens, 2, 16, 256, seed=3)
    resumed.load_state(state)
    assert resumed.epoch == 1
    for (ex, ey), (rx, ry) in zip(expected, (resumed.next_batch() for _ in expected)):
        np.testing.assert_array_equal(ex, rx)
        np.testing.assert_array_equal(ey, ry)
    resumed.reset()
    np.testing.assert_array_equal(resumed.next_batch()[0],
                                  DataLoader(tokens, 2, 16, 256, seed=3).next_batch()[0])


def test_loader_state_mismatch_errors():
    tokens = corpus(3000)
    state = DataLoader(tokens, 2, 16, 256, seed=3).state()
    with pytest.raises(ValueError, match="seed: saved 3, this loader 4"):
        DataLoader(tokens, 2, 16, 256, seed=4).load_state(state)
    with pytest.raises(ValueError, match="num_tokens"):
        DataLoader(tokens[:2000], 2, 16, 256, seed=3).load_state(state)
    with pytest.raises(ValueError, match="invalid position"):
        DataLoader(tokens, 2, 16, 256, seed=3).load_state({**state, "batch_index": 10**6})
    with pytest.raises(ValueError, match="lacks keys"):
        DataLoader(tokens, 2, 16, 256, seed=3).load_state({"epoch": 0})


def test_train_val_split_is_disjoint_tail():
    tokens = np.arange(2000, dtype=np.int32) % 1000
    train, val = train_val_loaders(tokens, 2, 8, 1000, val_fraction=0.25, seed=0)
    assert train.tokens.size == 1500 and val.tokens.size == 500
    np.testing.assert_array_equal(val.tokens, tokens[1500:])
    assert not val.shuffle and train.shuffle
    np.testing.assert_array_equal(val.next_batch()[0][0], tokens[1500:1508])


@pytest.mark.parametrize("tokens, B, T, vocab, message", [
    (np.zeros(0, np.int32), 1, 4, 256, "corpus is empty"),
    (np.zeros(100, np.int32), 4, 64, 256, "too few for one batch of B=4 x T=64"),
    (np.array([1, 2, 300] * 50), 1, 4, 256, r"must lie in \[0, 256\).*\[1, 300\]"),
    (np.array([1, -2] * 50), 1, 4, 256, "must lie in"),
    (np.zeros((10, 10), np.int32), 1, 4, 256, "1-D integer"),
    (np.zeros(100, np.float32), 1, 4, 256, "1-D integer"),
    (np.zeros(100, np.int32), 0, 4, 256, "batch_size must be a positive int"),
])
def test_loader_bad_input(tokens, B, T, vocab, message):
    with pytest.raises(ValueError, match=message):
        DataLoader(tokens, B, T, vocab)
