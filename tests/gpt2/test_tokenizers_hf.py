"""Hugging Face tokenizers: a tokenizer.json through the tokenizers library and a SentencePiece
tokenizer.model through sentencepiece, each trained here on a little text (nothing is
downloaded); they encode and decode as the libraries do, gpt2-train takes either file with
--tokenizer or finds it in an --init-from directory, and a missing library is one error line
naming the extra to install."""
import io
import json
import shutil
import sys

import numpy as np
import pytest
import sentencepiece
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from gpt2.checkpoint import read_checkpoint_header
from gpt2.config import LlamaConfig
from gpt2.data import stdlib_corpus_bytes
from gpt2.tokenizer import (GPT2BPETokenizer, HFTokenizer, SentencePieceTokenizer,
                            find_tokenizer, load_tokenizer, write_tiktoken_ranks)
from gpt2.train import main, run
from hf_models import saved_hf_model

CORPUS_BYTES = 50_000
# The run's corpus: what gpt2-train --corpus-bytes 50k reads, so every character is known.
CORPUS = stdlib_corpus_bytes(CORPUS_BYTES).decode("utf-8")
SAMPLES = ["def f(x):\n    return x + 1\n", "hello world", "", "  two  spaces\n\n  and more",
           CORPUS[:2000]]
BEYOND = "héllo\twörld ✓ 😀"     # characters the corpus may lack
RUN = ["-B", "2", "-T", "32", "--steps", "2", "--corpus-bytes", "50k", "--eval-interval", "0",
       "--sample-tokens", "8", "--no-progress", "--no-checkpoint", "--prompt", "def "]


def train_tokenizer_json(path, vocab_size, full_alphabet):
    """A byte-level BPE tokenizer.json; without the full alphabet it knows only the
    characters of CORPUS (and stays within llama-tiny's 256 ids)."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if full_alphabet else []
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False))
    tok.save(str(path))
    return tokenizers.Tokenizer.from_file(str(path))


def train_sentencepiece(path, vocab_size):
    """A SentencePiece BPE model with byte fallback and no normalization (as Llama 2's)."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, character_coverage=1.0, minloglevel=2)
    path.write_bytes(model.getvalue())
    return sentencepiece.SentencePieceProcessor(model_file=str(path))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokenizers")
    out = {}
    out["json"], out["json_lib"] = d / "tok.json", train_tokenizer_json(d / "tok.json", 256, False)
    out["wide_json"] = d / "wide.json"
    train_tokenizer_json(out["wide_json"], 320, True)
    out["model"], out["model_lib"] = d / "tok.model", train_sentencepiece(d / "tok.model", 400)
    return out


def test_tokenizer_json_encodes_and_decodes_as_the_library(files):
    tok, lib = HFTokenizer(files["json"]), files["json_lib"]
    assert tok.vocab_size == lib.get_vocab_size() == 256 and tok.eot_token is None
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids.dtype == np.int32
        assert ids.tolist() == lib.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == lib.decode(ids.tolist()) == text
    wide = HFTokenizer(files["wide_json"])     # every byte in its alphabet
    assert wide.decode(wide.encode(BEYOND)) == BEYOND
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        tok.decode([1, 256])
    with pytest.raises(TypeError, match="needs a str"):
        tok.encode(b"bytes")


def test_sentencepiece_model_encodes_and_decodes_as_the_library(files):
    tok, lib = SentencePieceTokenizer(files["model"]), files["model_lib"]
    assert tok.vocab_size == lib.get_piece_size() == 400 and tok.eot_token == lib.eos_id()
    for text in SAMPLES + [BEYOND]:
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and ids.tolist() == lib.encode(text)
        assert tok.decode(ids) == lib.decode(ids.tolist()) == text
    with pytest.raises(ValueError, match=r"\[0, 400\)"):
        tok.decode([400])


def test_the_file_kind_comes_from_the_name_or_the_contents(files, tmp_path):
    tiktoken = tmp_path / "bytes.tiktoken"
    write_tiktoken_ranks(tiktoken, {bytes([b]): b for b in range(256)})
    for source, kind in ((files["json"], HFTokenizer), (files["model"], SentencePieceTokenizer),
                         (tiktoken, GPT2BPETokenizer)):
        assert type(load_tokenizer(source)) is kind
        unnamed = tmp_path / f"unnamed-{kind.__name__}"
        shutil.copy(source, unnamed)
        assert type(load_tokenizer(unnamed)) is kind
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*not a Hugging Face tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")
    (tmp_path / "bad.model").write_bytes(b"\x0a\xff\xff garbage")
    with pytest.raises(ValueError, match="bad.model.*not a SentencePiece model"):
        load_tokenizer(tmp_path / "bad.model")
    (tmp_path / "garbage").write_bytes(bytes(range(100)))
    with pytest.raises(ValueError, match="garbage.*not a tokenizer file.*tiktoken"):
        load_tokenizer(tmp_path / "garbage")
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "absent.json")


def test_a_model_directory_prefers_tokenizer_json(files, tmp_path):
    assert find_tokenizer(tmp_path) is None
    shutil.copy(files["model"], tmp_path / "tokenizer.model")
    assert find_tokenizer(tmp_path) == str(tmp_path / "tokenizer.model")
    shutil.copy(files["json"], tmp_path / "tokenizer.json")
    assert find_tokenizer(tmp_path) == str(tmp_path / "tokenizer.json")


def sample_text(printed):
    block = printed.split("----- sample -----\n")[1].split("------------------")[0]
    lines = block.splitlines()
    assert lines[-1].startswith("(8 tokens in ") and lines[-1].endswith(" tokens/s)")
    return "\n".join(lines[:-1])


@pytest.mark.parametrize("kind", ["json", "model"])
def test_train_with_a_tokenizer_file(files, tmp_path, capsys, kind):
    # SentencePiece's byte fallback needs 259 ids at least: a model as wide as its 400.
    source = files[kind]
    args = ["--tokenizer", str(source), "--out-dir", str(tmp_path / "run")] + RUN
    if kind == "json":
        summary = run(args + ["--model", "llama-tiny"])
    else:
        summary = run(args + ["--init-from", str(llama_directory(tmp_path / "start", 400))])
    text = sample_text(capsys.readouterr().out)
    assert text.startswith("def ") and len(text) > len("def ")    # text, not token ids
    assert summary["sample_tokens_per_s"] > 0
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["sample_tokens_per_s"] == summary["sample_tokens_per_s"]


def llama_directory(path, vocab_size):
    """A Hugging Face directory of a llama-tiny-sized model with ``vocab_size`` tokens, as
    transformers saves it."""
    config = LlamaConfig(**{**LlamaConfig.preset("llama-tiny").to_dict(),
                            "vocab_size": vocab_size})
    saved_hf_model(config, path, spread=False)
    return path


def test_init_from_a_directory_uses_its_tokenizer_and_resume_keeps_it(files, tmp_path, capsys):
    start = llama_directory(tmp_path / "start", 320)
    shutil.copy(files["wide_json"], start / "tokenizer.json")
    out = tmp_path / "run"
    args = ["--init-from", str(start), "--out-dir", str(out)] + RUN
    args.remove("--no-checkpoint")
    run(args)
    text = sample_text(capsys.readouterr().out)
    assert text.startswith("def ")
    # The directory's tokenizer is the run's: saved with it, so --resume reads it too.
    saved = read_checkpoint_header(out / "checkpoint.bin").extra["args"]
    assert saved["tokenizer"] == str(start / "tokenizer.json")
    resumed = run(["--resume", str(out / "checkpoint.bin"), "--steps", "3"])
    assert resumed["start_step"] == 2
    assert sample_text(capsys.readouterr().out).startswith("def ")


@pytest.mark.parametrize("module, kind", [("tokenizers", "json"), ("sentencepiece", "model")])
def test_a_missing_library_is_one_line_naming_the_extra(files, tmp_path, capsys, monkeypatch,
                                                       module, kind):
    monkeypatch.setitem(sys.modules, module, None)     # import raises ImportError
    with pytest.raises(ImportError, match=rf"needs the {module} package: pip install "
                                          rf"'adtape\[hf\]'"):
        load_tokenizer(files[kind])
    status = main(["--tokenizer", str(files[kind]), "--model", "llama-tiny", "--out-dir",
                   str(tmp_path / "run")] + RUN)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1
    assert "error: --tokenizer" in err[0] and "pip install 'adtape[hf]'" in err[0]
    start = llama_directory(tmp_path / "start", 400)
    shutil.copy(files[kind], start / f"tokenizer.{kind}")
    capsys.readouterr()
    assert main(["--init-from", str(start), "--out-dir", str(tmp_path / "run")] + RUN) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"error: --init-from {start}" in err[0] and "adtape[hf]" in err[0]
