"""Issue 43, item 6: gpt2-train's header names the tokenizer and warns when the model's
vocabulary dwarfs it; --tokenizer takes a model directory; the sample at the end starts
from the tokenizer's BOS (or --prompt, or a newline for bytes) and stops at end-of-sequence;
the summary line names every output; python -m gpt2.perfmodel reads a model directory's
config.json and takes --n-kv-head and --intermediate."""
import argparse
import json
import os

import pytest

from gpt2 import hf
from gpt2 import tokenizer as tok
from gpt2.checkpoint import export_llmc, read_checkpoint_header
from gpt2.config import GPT2Config, LlamaConfig, preset
from gpt2.data import stdlib_corpus_bytes
from gpt2.params import ParamArena, init_params_
from gpt2.perfmodel import cli as perf_cli
from gpt2.perfmodel.spec import ModelSpec
from gpt2.train import _describe_tokenizer, _sample_start, run
from gpt2.train_options import UsageError

tokenizers = pytest.importorskip("tokenizers")

RUN = ["-B", "2", "-T", "16", "--steps", "2", "--corpus-bytes", "20k", "--eval-interval", "0",
       "--no-progress", "--sample-tokens", "6"]


def tokenizer_dir(path, config=True):
    """A directory with a 256-id BPE tokenizer.json holding <s> and </s> (named BOS and EOS
    by its tokenizer_config.json unless ``config`` is False)."""
    from tokenizers import decoders, models, pre_tokenizers, trainers
    path.mkdir()
    t = tokenizers.Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator([stdlib_corpus_bytes(20_000).decode("utf-8")], trainers.BpeTrainer(
        vocab_size=256, special_tokens=["<s>", "</s>"], show_progress=False))
    t.save(str(path / "tokenizer.json"))
    if config:
        (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                                "eos_token": "</s>"}))
    return path


def args_of(**fields):
    return argparse.Namespace(**{"tokenizer": None, "init_from": None, "prompt": None, **fields})


# -- the header names the tokenizer; the warning -----------------------------------------

def test_the_warning_names_both_vocabularies_of_smollm2_from_scratch_on_bytes():
    lines = _describe_tokenizer(args_of(), tok.ByteTokenizer(), preset("smollm2-360m"))
    assert lines[0] == "tokenizer: bytes, 256 tokens; the model's vocabulary: 49,152"
    assert len(lines) == 2 and lines[1].startswith("warning: ")
    assert "49,152" in lines[1] and " 256" in lines[1] and "--tokenizer" in lines[1]
    # A matching vocabulary, or one a little wider (padding), says nothing more.
    assert len(_describe_tokenizer(args_of(), tok.ByteTokenizer(), preset("tiny"))) == 1
    wider = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=512, block_size=32)
    assert len(_describe_tokenizer(args_of(), tok.ByteTokenizer(), wider)) == 1


def test_the_header_names_the_tokenizer_and_warns(tmp_path, capsys):
    path = tmp_path / "wide.bin"
    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=4000, block_size=32)
    export_llmc(path, init_params_(ParamArena(config), 0))
    run(["--init-from", str(path), "--out-dir", str(tmp_path / "run"), "--sample-tokens", "0"]
        + RUN[:-2])
    out = capsys.readouterr().out
    assert "tokenizer: bytes, 256 tokens; the model's vocabulary: 4,000\n" in out
    warning = next(line for line in out.splitlines() if line.startswith("warning:"))
    assert "4,000" in warning and "256" in warning
    assert out.index("tokenizer: bytes") < out.index(warning) < out.index("step 1/")


# -- --tokenizer DIR ---------------------------------------------------------------------

def test_tokenizer_takes_a_directory_and_the_checkpoint_names_its_file(tmp_path, capsys):
    directory = tokenizer_dir(tmp_path / "tok")
    out = tmp_path / "run"
    run(["--model", "llama-tiny", "--tokenizer", str(directory), "--out-dir", str(out)] + RUN)
    printed = capsys.readouterr().out
    assert f"tokenizer: {directory / 'tokenizer.json'} (HFTokenizer), 256 tokens" in printed
    assert "warning:" not in printed
    saved = read_checkpoint_header(out / "checkpoint.bin").extra["args"]
    assert saved["tokenizer"] == str(directory / "tokenizer.json")
    # The library's loader too (gpt2-generate's and gpt2-eval's --tokenizer).
    assert isinstance(tok.load_tokenizer(directory), tok.HFTokenizer)


def test_tokenizer_a_directory_without_one_is_one_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match=r"--tokenizer: .*empty.* is a directory without a "
                                         r"tokenizer \(tokenizer.json or tokenizer.model\)"):
        run(["--model", "tiny", "--tokenizer", str(tmp_path / "empty"),
             "--out-dir", str(tmp_path / "run")] + RUN)


# -- the sample ------------------------------------------------------------------------

def test_the_sample_starts_from_bos_or_the_prompt_or_a_newline_for_bytes(tmp_path):
    directory = tokenizer_dir(tmp_path / "tok")
    hf_tok = tok.load_tokenizer(directory)
    bos, eos = hf_tok.token_id("<s>"), hf_tok.token_id("</s>")
    file = str(directory / "tokenizer.json")
    assert _sample_start(args_of(tokenizer=file), hf_tok) == ([bos], [eos], True)
    ids, stops, from_bos = _sample_start(args_of(tokenizer=file, prompt="def "), hf_tok)
    assert ids == hf_tok.encode("def ").tolist() and stops == [eos] and not from_bos
    # Bytes have neither BOS nor EOS: a newline, and no early stop.
    assert _sample_start(args_of(), tok.ByteTokenizer()) == ([10], [], False)
    # Without tokenizer_config.json, the usual BOS spelling still starts it.
    bare = tokenizer_dir(tmp_path / "bare", config=False)
    assert _sample_start(args_of(tokenizer=str(bare / "tokenizer.json")),
                         tok.load_tokenizer(bare))[0] == [bos]


def test_the_sample_stops_at_end_of_sequence(tmp_path, capsys, monkeypatch):
    import gpt2.generate
    directory = tokenizer_dir(tmp_path / "tok")
    hf_tok = tok.load_tokenizer(directory)
    eos = hf_tok.token_id("</s>")
    picks = iter([hf_tok.encode("def").tolist()[0], hf_tok.encode(" f").tolist()[0], eos, 5, 5])
    monkeypatch.setattr(gpt2.generate, "pick_token", lambda *a, **k: next(picks))
    summary = run(["--model", "llama-tiny", "--tokenizer", str(directory),
                   "--out-dir", str(tmp_path / "run")] + RUN)
    block = capsys.readouterr().out.split("----- sample -----\n")[1].split("-----------")[0]
    text, speed = block.splitlines()
    assert text == "def f"          # neither the BOS it started from nor the EOS it ended at
    assert speed.startswith("(3 tokens in ") and speed.endswith("; stopped at end-of-sequence)")
    assert summary["sample_tokens_per_s"] > 0


def test_prompt_help_names_the_default():
    from gpt2.train_options import build_parser
    action = next(a for a in build_parser()._actions if "--prompt" in a.option_strings)
    assert action.default is None
    assert "beginning-of-sequence" in action.help and "newline" in action.help


# -- the summary line names every output -------------------------------------------------

def test_the_summary_line_names_every_output(tmp_path, capsys):
    out, exported = tmp_path / "run", tmp_path / "hf"
    run(["--model", "tiny", "--out-dir", str(out), "--save-hf", str(exported)] + RUN)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("loss "))
    assert line.endswith(f"; wrote log.csv, loss.png, checkpoint.bin and summary.json in "
                         f"{out}/, and the Hugging Face model in {exported}/")
    for name in ("log.csv", "loss.png", "checkpoint.bin", "summary.json"):
        assert (out / name).is_file()
    assert (exported / "config.json").is_file()


def test_the_summary_line_without_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    run(["--model", "tiny", "--out-dir", str(out), "--no-checkpoint"] + RUN)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("loss "))
    assert line.endswith(f"; wrote log.csv, loss.png and summary.json in {out}/")
    assert not (out / "checkpoint.bin").exists()


# -- python -m gpt2.perfmodel --model DIR, --n-kv-head, --intermediate -------------------

def spec_of(*argv):
    return perf_cli.model_from_args(perf_cli.build_parser().parse_args(list(argv)))


def model_directory(path, config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf.hf_config_dict(config)))
    return path


@pytest.mark.parametrize("name", ["smollm2-135m", "gpt2"])
def test_perfmodel_reads_a_model_directory_config(tmp_path, capsys, name):
    directory = model_directory(tmp_path / name, preset(name))
    assert spec_of("--model", str(directory)) == spec_of("--model", name)
    common = ["--batch", "1", "--seq", "64", "--json", "--hardware", "zen4-2core-vm"]
    assert perf_cli.main(["--model", str(directory)] + common) == 0
    from_dir = json.loads(capsys.readouterr().out)
    assert perf_cli.main(["--model", name] + common) == 0
    assert from_dir == json.loads(capsys.readouterr().out)


def test_perfmodel_model_errors(tmp_path):
    with pytest.raises(SystemExit, match="no-such/dir.*no such directory"):
        spec_of("--model", "no-such/dir")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="has no config.json"):
        spec_of("--model", str(tmp_path / "empty"))
    # A preset's name wins over a directory of that name (the gpt2 package here).
    cwd = os.getcwd()
    try:
        os.chdir(os.path.dirname(os.path.dirname(perf_cli.__file__)) + "/..")
        assert spec_of("--model", "gpt2").n_layer == 12
    finally:
        os.chdir(cwd)


def test_perfmodel_kv_heads_and_mlp_width():
    custom = spec_of("--n-layer", "2", "--n-head", "8", "--n-embd", "256", "--vocab", "1000",
                     "--n-kv-head", "2", "--intermediate", "640")
    plain = spec_of("--n-layer", "2", "--n-head", "8", "--n-embd", "256", "--vocab", "1000")
    assert (custom.n_kv_head, custom.intermediate_size) == (2, 640)
    assert (plain.n_kv_head, plain.intermediate_size) == (8, 1024)
    assert custom.num_parameters() < plain.num_parameters()
    # In place of a preset's, as a LlamaConfig with them would be.
    spec = spec_of("--model", "smollm2-135m", "--n-kv-head", "9", "--intermediate", "2048")
    changed = LlamaConfig(**{**preset("smollm2-135m").to_dict(), "n_kv_head": 9,
                             "intermediate_size": 2048})
    assert spec == ModelSpec.from_config(changed)
    with pytest.raises(SystemExit, match="GPT-2 model, which has no --n-kv-head"):
        spec_of("--model", "gpt2", "--n-kv-head", "4")
    with pytest.raises(SystemExit, match="n_kv_head .*3.* must divide n_head"):
        spec_of("--n-layer", "2", "--n-head", "8", "--n-embd", "256", "--vocab", "1000",
                "--n-kv-head", "3")


def test_perfmodel_plan_of_a_custom_shape_with_kv_heads_is_refused(capsys):
    assert perf_cli.main(["--plan", "--max-memory", "1G", "--n-layer", "2", "--n-head", "8",
                          "--n-embd", "256", "--vocab", "1000", "--n-kv-head", "2"]) == 2
    assert "give --model" in capsys.readouterr().err
