"""Hugging Face directories written by gpt2-train are complete (issue 43, items 3 and 4):
the source directory's tokenizer files, generation_config.json and special-token ids come
along, the weights keep the source's format unless --save-dtype says otherwise, and
transformers' AutoTokenizer and generate work on the result; a finished checkpoint exports
without training, --init-from takes a checkpoint, the Ctrl-C resume line keeps --save-hf and
the memory policy, and a directory without a tokenizer whose vocabulary is wider than bytes
needs --tokenizer.  The models and tokenizers are tiny and made here."""
import json
import shlex
import shutil
import signal
import struct

import numpy as np
import pytest
import tokenizers
import torch
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

import gpt2.train
from gpt2 import hf
from gpt2.checkpoint import load_checkpoint, read_checkpoint_header, to_bfloat16
from gpt2.config import LlamaConfig
from gpt2.data import stdlib_corpus_bytes
from gpt2.train import main, run

CORPUS = stdlib_corpus_bytes(20_000).decode("utf-8")
QUICK = ["-B", "2", "-T", "16", "--corpus-bytes", "20k", "--eval-interval", "0",
         "--sample-tokens", "0", "--no-progress"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 320
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def bpe_tokenizer(path, vocab_size, full_alphabet=True):
    """A byte-level BPE tokenizer.json with SmolLM2's special tokens."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if full_alphabet else []
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=alphabet, special_tokens=SPECIALS,
        show_progress=False))
    tok.save(str(path))
    return tok


def dtypes(directory):
    """The safetensors dtypes of a directory's model.safetensors."""
    raw = (directory / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A SmolLM2-like directory as transformers saves it: bf16 weights, a ChatML
    tokenizer (bos <|endoftext|>, eos <|im_end|>), the ids in config.json and
    generation_config.json."""
    directory = tmp_path_factory.mktemp("source")
    tok = bpe_tokenizer(directory / "tokenizer.json", VOCAB)
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    config = LlamaConfig(**{**LlamaConfig.preset("llama-tiny").to_dict(), "vocab_size": VOCAB})
    hf_config = {k: v for k, v in hf.hf_config_dict(config).items() if k != "architectures"}
    hf_config.update(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                     pad_token_id=ids["<|endoftext|>"])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(**hf_config))
    model.to(torch.bfloat16).save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 64,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                         "{{ m['content'] }}<|im_end|>\n{% endfor %}"}))
    (directory / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    assert (directory / "generation_config.json").exists()
    return directory


@pytest.fixture(scope="module")
def trained(source, tmp_path_factory):
    """Two steps from ``source`` with --save-hf in bf16: (run directory, exported one)."""
    base = tmp_path_factory.mktemp("trained")
    out, export = base / "run", base / "hf"
    run(["--init-from", str(source), "--steps", "2", "--save-hf", str(export),
         "--save-dtype", "bf16", "--out-dir", str(out), *QUICK])
    return out, export


def test_the_directory_carries_the_tokenizer_ids_and_dtype(source, trained):
    _, export = trained
    for name in TOKENIZER_FILES + ("generation_config.json",):
        assert (export / name).read_bytes() == (source / name).read_bytes(), name
    written = json.loads((export / "config.json").read_text())
    original = json.loads((source / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert written[key] == original[key], key
    assert written["torch_dtype"] == "bfloat16" and dtypes(export) == {"BF16"}


def test_transformers_tokenizes_and_generates_from_it(source, trained):
    _, export = trained
    theirs = transformers.AutoTokenizer.from_pretrained(source)
    ours = transformers.AutoTokenizer.from_pretrained(export)
    text = "def f(x):\n    return x<|im_end|>"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == theirs.eos_token_id
    model = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert model.dtype == torch.bfloat16
    assert model.generation_config.eos_token_id == theirs.eos_token_id
    prompt = ours("def ", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 5 or \
        out[0, -1].item() == theirs.eos_token_id
    assert isinstance(ours.decode(out[0]), str)


def test_the_weights_are_the_checkpoints_rounded_to_the_format(trained):
    out, export = trained
    state = load_checkpoint(out / "checkpoint.bin", optimizer=False)
    assert state.adam_m is None
    written = hf.load_dir(export)
    expected = (to_bfloat16(state.params.flat).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(written.flat, expected)


def test_the_default_format_is_the_sources(source, tmp_path):
    run(["--init-from", str(source), "--steps", "1", "--save-hf", str(tmp_path / "hf"),
         "--out-dir", str(tmp_path / "run"), "--no-checkpoint", *QUICK])
    assert dtypes(tmp_path / "hf") == {"BF16"}


def test_a_finished_checkpoint_exports_without_training(source, trained, tmp_path, capsys):
    out, export = trained
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    ckpt = str(out / "checkpoint.bin")
    # Its own --save-hf is written already: nothing to do.
    assert main(["--resume", ckpt]) == 0
    assert "nothing left to do" in capsys.readouterr().out
    assert main(["--resume", ckpt, "--save-hf", str(tmp_path / "fp32"), "--save-dtype",
                 "fp32"]) == 0
    assert f"wrote its model to {tmp_path / 'fp32'} (fp32)" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before    # the run unchanged
    assert dtypes(tmp_path / "fp32") == {"F32"}
    state = load_checkpoint(ckpt, optimizer=False)
    np.testing.assert_array_equal(hf.load_dir(tmp_path / "fp32").flat, state.params.flat)
    for name in TOKENIZER_FILES + ("generation_config.json",):
        assert (tmp_path / "fp32" / name).read_bytes() == (source / name).read_bytes(), name
    # The source's format, recorded in the checkpoint, is the default.
    assert main(["--resume", ckpt, "--save-hf", str(tmp_path / "default")]) == 0
    assert dtypes(tmp_path / "default") == {"BF16"}
    # Another model's directory is still refused, in one line.
    capsys.readouterr()
    assert main(["--resume", ckpt, "--save-hf", str(tmp_path / "fp32")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: --save-hf" in err[0] and "--overwrite" in err[0]


def test_init_from_a_checkpoint_starts_a_new_run_from_its_weights(source, trained, tmp_path):
    out, _ = trained
    # lr 0: the weights stay the checkpoint's, so the export shows what was loaded.
    summary = run(["--init-from", str(out / "checkpoint.bin"), "--steps", "1", "--lr", "0",
                   "--warmup", "0", "--out-dir", str(tmp_path / "run"), "--save-hf",
                   str(tmp_path / "hf"), "--save-dtype", "fp32", *QUICK])
    assert summary["start_step"] == 0 and summary["steps"] == 1
    state = load_checkpoint(out / "checkpoint.bin", optimizer=False)
    np.testing.assert_array_equal(hf.load_dir(tmp_path / "hf").flat, state.params.flat)
    # Its tokenizer and source come along.
    saved = read_checkpoint_header(tmp_path / "run" / "checkpoint.bin").extra
    assert saved["args"]["tokenizer"] == str(source / "tokenizer.json")
    assert saved["hf_export"]["source"] == {"directory": str(source), "dtype": "bf16"}
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == \
        (source / "tokenizer.json").read_bytes()


class StopAfterTheFirstStep:
    """StopSignals as if Ctrl-C came during the first step."""

    signum = signal.SIGINT

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_resume_line_keeps_save_hf_and_the_memory_policy(source, tmp_path, capsys,
                                                             monkeypatch):
    export = tmp_path / "my hf"
    args = ["--init-from", str(source), "--steps", "3", "--save-hf", str(export),
            "--save-dtype", "fp16", "--checkpointing", "layer",
            "--out-dir", str(tmp_path / "run"), *QUICK]
    with monkeypatch.context() as m:
        m.setattr(gpt2.train, "StopSignals", StopAfterTheFirstStep)
        assert main(args) == 128 + signal.SIGINT
    err = capsys.readouterr().err
    line = err.split("continue with: ", 1)[1].strip()
    words = shlex.split(line)
    assert words[words.index("--save-hf") + 1] == str(export)
    assert words[words.index("--save-dtype") + 1] == "fp16"
    assert words[words.index("--checkpointing") + 1] == "layer"
    assert not export.exists()
    # The line as printed resumes the run, which writes the directory at its end.
    summary = run(words[words.index("--resume"):])
    assert summary["start_step"] == 1 and summary["memory_policy"]["checkpointing"] == "layer"
    assert dtypes(export) == {"F16"} and (export / "tokenizer.json").exists()
    # --resume alone restores them from the checkpoint, and replaces the run's own export.
    summary = run(["--resume", str(tmp_path / "run" / "checkpoint.bin"), "--steps", "4"])
    assert summary["start_step"] == 3 and summary["memory_policy"]["checkpointing"] == "layer"
    assert dtypes(export) == {"F16"}
    state = load_checkpoint(tmp_path / "run" / "checkpoint.bin", optimizer=False)
    np.testing.assert_array_equal(hf.load_dir(export).flat,
                                  state.params.flat.astype(np.float16).astype(np.float32))


def test_a_wide_vocabulary_without_a_tokenizer_needs_tokenizer(source, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(source, bare)
    for name in TOKENIZER_FILES:
        (bare / name).unlink()
    args = ["--init-from", str(bare), "--steps", "1", "--no-checkpoint", *QUICK]
    assert main(args + ["--out-dir", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"error: --init-from {bare} has no tokenizer" in err[0]
    assert "vocabulary of 320" in err[0] and "--tokenizer" in err[0]
    assert not (tmp_path / "a").exists()
    assert main(args + ["--tokenizer", str(source / "tokenizer.json"), "--out-dir",
                        str(tmp_path / "b")]) == 0
    assert main(args + ["--tokenizer", "bytes", "--out-dir", str(tmp_path / "c")]) == 0


def test_from_scratch_with_a_tokenizer_file_writes_what_it_knows(tmp_path):
    tok_path = tmp_path / "tok.json"
    tok = bpe_tokenizer(tok_path, 256, full_alphabet=False)   # within llama-tiny's 256 ids
    export = tmp_path / "hf"
    run(["--model", "llama-tiny", "--tokenizer", str(tok_path), "--steps", "1",
         "--save-hf", str(export), "--out-dir", str(tmp_path / "run"), "--no-checkpoint",
         *QUICK])
    assert (export / "tokenizer.json").read_bytes() == tok_path.read_bytes()
    eot = tok.token_to_id("<|endoftext|>")
    config = json.loads((export / "config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == eot
    assert config["torch_dtype"] == "float32" and dtypes(export) == {"F32"}
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == eot
    theirs = transformers.AutoTokenizer.from_pretrained(export)
    assert theirs.eos_token == "<|endoftext|>"
    text = CORPUS[:200]
    assert theirs(text)["input_ids"] == tok.encode(text).ids
    model = transformers.AutoModelForCausalLM.from_pretrained(export)
    model.generate(**theirs("def ", return_tensors="pt"), max_new_tokens=3, do_sample=False)


def test_bfloat16_rounds_as_torch_does():
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(1 << 16) * 10.0 ** rng.integers(-40, 38, 1 << 16)).astype(
        np.float32)
    values[:4] = [np.inf, -np.inf, 0.0, -0.0]
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(to_bfloat16(values), expected.view(np.uint16))
    nan = to_bfloat16(np.array([np.nan], np.float32))
    assert np.isnan((nan.astype(np.uint32) << 16).view(np.float32)).all()
