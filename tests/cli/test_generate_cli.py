"""gpt2-generate (python -m gpt2.generate): greedy output equals transformers'
generate(do_sample=False) token for token on tiny random GPT-2 and Llama directories saved
by transformers (the oracle); a checkpoint.bin and an llm.c file of the same weights give
the same tokens; the prompt from --prompt, a file or standard input; seeded sampling
repeats, top-p 1 with top-k 0 is plain sampling and the nucleus keeps only its tokens;
generation stops at the end-of-sequence ids; --chat renders as apply_chat_template and
answers each line of standard input; bad inputs are one error line with status 2, Ctrl-C
exits 130."""
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tokenizers
import torch
import transformers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

import adtape
import gpt2
from gpt2 import chat
from gpt2.checkpoint import export_llmc, save_checkpoint
from gpt2.config import GPT2Config
from gpt2.generate import Weights, generate, pick_token
from gpt2.generate_cli import main
from gpt2.hf import load_dir
from gpt2.params import ParamArena, init_params_

PACKAGE_ROOTS = os.pathsep.join({os.path.dirname(os.path.dirname(m.__file__))
                                 for m in (adtape, gpt2)})
TEXT = ("def f(x):\n    return x + 1\n\nclass Point:\n    def __init__(self, x, y):\n"
        "        self.x = x\n        self.y = y\n") * 4 + "héllo wörld, the quick brown fox\n"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
# ChatML with a BOS, a role check (raise_exception) and trim_blocks/lstrip_blocks at work.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}\n"
    "    {% if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "        {{ raise_exception('unknown role ' + message['role']) }}\n"
    "    {% endif %}\n"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}")
N_TOKENS = 24


def tokenizer_dir(path, family):
    """A byte-level BPE tokenizer.json with ChatML specials, saved by transformers with
    eos <|im_end|> and the chat template; the Llama one's post-processor adds a BOS."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = "<s>" if family == "llama" else "<|endoftext|>"
    if family == "llama":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos,
                                                eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def model_dir(path, family, seed=0):
    """A tiny random model of ``family`` with its tokenizer, saved by transformers."""
    tok = tokenizer_dir(path, family)
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
               initializer_range=0.5)     # decisive logits: a greedy text of many tokens
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, **ids)
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=256,
                                          **ids)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():   # norms initialize to 1 and biases to 0: make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.3)
            elif "norm" in name or "ln_" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model, tok


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {family: (root / family, *model_dir(root / family, family))
            for family in ("gpt2", "llama")}


def run_main(capsys, *args):
    """gpt2-generate in this process: (status, stdout, stderr)."""
    status = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return status, out, err


def ids_of(out):
    return [int(i) for i in out.split()]


def assert_one_line_error(status, err, *expected):
    assert status == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0], err
    for text in expected:
        assert text in lines[0], lines[0]


# -- the oracle ---------------------------------------------------------------------

@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("prompt", ["def f(x):", "héllo"])
def test_greedy_equals_transformers_generate(dirs, capsys, family, prompt):
    path, model, tok = dirs[family]
    prompt_ids = tok(prompt)["input_ids"]
    assert (prompt_ids[0] == tok.convert_tokens_to_ids("<s>")) == (family == "llama")
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt_ids]), do_sample=False,
                                max_new_tokens=N_TOKENS, attention_mask=torch.ones(
                                    1, len(prompt_ids), dtype=torch.long))[0, len(prompt_ids):]
    status, out, err = run_main(capsys, path, "--prompt", prompt, "--temperature", "0",
                                "-n", N_TOKENS, "--print-ids")
    assert status == 0, err
    assert ids_of(out) == theirs.tolist()
    assert len(set(theirs.tolist())) >= 6    # a text, not one token repeated
    assert "tokens/s" in err


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_bf16_weights_greedy_equals_transformers_generate(dirs, capsys, tmp_path, family):
    # --dtype bf16: the matrices held in bf16. From weights that are bf16 values (the
    # directory's model rounded, computing in float32), the same tokens as transformers;
    # a checkpoint of them read with --dtype bf16 too.
    src, _, tok = dirs[family]
    model = transformers.AutoModelForCausalLM.from_pretrained(src).to(torch.bfloat16).float()
    path = tmp_path / family
    model.save_pretrained(path)
    tok.save_pretrained(path)
    prompt_ids = tok("def f(x):")["input_ids"]
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt_ids]), do_sample=False,
                                max_new_tokens=N_TOKENS, attention_mask=torch.ones(
                                    1, len(prompt_ids), dtype=torch.long))[0, len(prompt_ids):]
    status, out, err = run_main(capsys, path, "--prompt", "def f(x):", "--temperature", "0",
                                "-n", N_TOKENS, "--print-ids", "--dtype", "bf16")
    assert status == 0, err
    assert ids_of(out) == theirs.tolist()
    ckpt = tmp_path / "checkpoint.bin"
    save_checkpoint(str(ckpt), load_dir(str(path)), step=1)
    status, out, err = run_main(capsys, ckpt, "--tokenizer", path / "tokenizer.json",
                                "--prompt", "def f(x):",
                                "--temperature", "0", "-n", N_TOKENS, "--print-ids",
                                "--dtype", "bf16")
    assert status == 0, err
    assert ids_of(out) == theirs.tolist()


def test_greedy_stops_where_transformers_does(dirs, capsys, tmp_path):
    """generation_config.json's end-of-sequence ids (here: a list of two, one of them a token
    the greedy text reaches) end both; --no-stop goes on; the text leaves the id out."""
    source, _, tok = dirs["gpt2"]
    greedy = ["-p", "class", "--temperature", "0", "-n", 30]
    status, out, _ = run_main(capsys, source, *greedy, "--print-ids", "--no-stop")
    ids = ids_of(out)
    cut = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    path = tmp_path / "stops"
    shutil.copytree(source, path)
    config = json.loads((path / "generation_config.json").read_text())
    config["eos_token_id"] = [ids[cut], tok.eos_token_id]
    (path / "generation_config.json").write_text(json.dumps(config))
    model = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    prompt_ids = tok("class")["input_ids"]
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=30,
                                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    assert theirs[0, len(prompt_ids):].tolist() == ids[:cut + 1]
    status, out, _ = run_main(capsys, path, *greedy, "--print-ids")
    assert status == 0 and ids_of(out) == ids[:cut + 1]
    assert ids_of(run_main(capsys, path, *greedy, "--print-ids", "--no-stop")[1]) == ids
    status, out, _ = run_main(capsys, path, *greedy)
    assert out == tok.decode(ids[:cut]) + "\n"


def test_a_checkpoint_and_an_llmc_file_give_the_directorys_tokens(dirs, capsys, tmp_path):
    path, _, _ = dirs["gpt2"]
    params = load_dir(path)
    save_checkpoint(tmp_path / "checkpoint.bin", params, step=3,
                    extra={"args": {"tokenizer": str(path / "tokenizer.json")}})
    export_llmc(tmp_path / "model.bin", params)
    outputs = []
    for source in (path, tmp_path / "checkpoint.bin", tmp_path / "model.bin"):
        extra = ["--tokenizer", path / "tokenizer.json"] if source.name == "model.bin" else []
        status, out, err = run_main(capsys, source, "-p", "class", "--temperature", "0",
                                    "-n", 12, *extra)
        assert status == 0, err
        outputs.append(out)
    assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0]) > 1


# -- prompts and sampling --------------------------------------------------------------

def test_the_prompt_from_a_file_and_from_standard_input(dirs, capsys, tmp_path, monkeypatch):
    path = dirs["llama"][0]
    greedy = ["--temperature", "0", "-n", 10, "--print-ids"]
    prompt = "def f(x):\n    return"
    _, want, _ = run_main(capsys, path, "--prompt", prompt, *greedy)
    (tmp_path / "prompt.txt").write_text(prompt)
    assert run_main(capsys, path, "--prompt-file", tmp_path / "prompt.txt", *greedy)[1] == want
    monkeypatch.setattr(sys, "stdin", io.StringIO(prompt))
    assert run_main(capsys, path, "--prompt-file", "-", *greedy)[1] == want
    monkeypatch.setattr(sys, "stdin", io.StringIO(prompt))
    assert run_main(capsys, path, *greedy)[1] == want
    # The command as a program, the prompt piped in.
    proc = subprocess.run([sys.executable, "-m", "gpt2.generate", str(path), *map(str, greedy)],
                          input=prompt, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=PACKAGE_ROOTS))
    assert proc.returncode == 0 and proc.stdout == want, proc.stderr


def test_the_seed_repeats_the_sample(dirs, capsys):
    path = dirs["llama"][0]
    sample = ["-p", "class", "-n", 20, "--temperature", "1.2", "--print-ids", "--no-stop"]
    first = run_main(capsys, path, *sample, "--seed", 7)[1]
    assert run_main(capsys, path, *sample, "--seed", 7)[1] == first
    assert run_main(capsys, path, *sample, "--seed", 8)[1] != first
    assert len(ids_of(first)) == 20


def test_top_p_one_and_top_k_zero_is_plain_sampling(dirs, capsys):
    path, _, tok = dirs["gpt2"]
    weights = Weights(load_dir(path))
    prompt = tok("class")["input_ids"]
    plain = generate(weights, prompt, 16, 1.0, 0, np.random.default_rng(3))
    assert generate(weights, prompt, 16, 1.0, 0, np.random.default_rng(3), top_p=1.0) == plain
    status, out, _ = run_main(capsys, path, "-p", "class", "-n", 16, "--temperature", "1",
                              "--top-k", 0, "--top-p", 1, "--seed", 3, "--print-ids",
                              "--no-stop")
    assert ids_of(out) == plain[len(prompt):]


def test_the_nucleus_keeps_the_likeliest_tokens_up_to_top_p():
    logits = np.log(np.array([0.05, 0.5, 0.3, 0.15]))
    rng = np.random.default_rng(0)
    assert {pick_token(logits, 1.0, 0, rng, top_p=0.75) for _ in range(300)} == {1, 2}
    assert {pick_token(logits, 1.0, 0, rng, top_p=0.79) for _ in range(300)} == {1, 2}
    assert {pick_token(logits, 1.0, 0, rng, top_p=0.81) for _ in range(300)} == {1, 2, 3}
    assert {pick_token(logits, 1.0, 0, rng, top_p=0.1) for _ in range(50)} == {1}
    # top-k first, then the nucleus of what is left (transformers' order).
    assert {pick_token(logits, 1.0, 2, rng, top_p=0.99) for _ in range(300)} == {1, 2}


def test_a_text_streams_whole_characters(dirs, capsys):
    """Text mode decodes what the ids decode to, a multi-byte character once it is whole."""
    path, _, tok = dirs["gpt2"]
    status, out, _ = run_main(capsys, path, "-p", "hé", "-n", 30, "--seed", 1, "--print-ids",
                              "--no-stop", "--temperature", "1.5", "--top-k", 0)
    ids = ids_of(out)
    status, text, _ = run_main(capsys, path, "-p", "hé", "-n", 30, "--seed", 1, "--no-stop",
                               "--temperature", "1.5", "--top-k", 0)
    assert status == 0 and text == tok.decode(ids) + "\n"


# -- chat ------------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo wörld"},
     {"role": "assistant", "content": "hi"}, {"role": "user", "content": "def f(x):"}],
]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one", "four"])
def test_the_template_renders_as_apply_chat_template(dirs, family, messages):
    path, _, tok = dirs[family]
    template = chat.ChatTemplate.from_directory(path)
    for generation_prompt in (True, False):
        assert template.render(messages, add_generation_prompt=generation_prompt) == \
            tok.apply_chat_template(messages, tokenize=False,
                                    add_generation_prompt=generation_prompt)


def test_templates_use_tojson_loop_controls_and_raise_exception(dirs):
    tok = dirs["llama"][2]
    source = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
              "{{ m | tojson }}{{ eos_token }}\n{% endfor %}"
              "{% if messages[0]['role'] == 'tool' %}{{ raise_exception('no tools') }}"
              "{% endif %}")
    messages = CONVERSATIONS[1]
    template = chat.ChatTemplate(source, chat.special_tokens(dirs["llama"][0]))
    assert template.render(messages) == tok.apply_chat_template(
        messages, chat_template=source, tokenize=False, add_generation_prompt=True)
    assert "héllo" in template.render(messages)
    with pytest.raises(ValueError, match="refused the conversation: no tools"):
        template.render([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="does not parse"):
        chat.ChatTemplate("{% for %}")


def test_older_directories_keep_the_template_in_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tool_use", "template": "T"},
                          {"name": "default", "template": "{{ bos_token }}D"}],
        "bos_token": {"content": "<s>", "special": True}}))
    assert chat.read_template(tmp_path) == "{{ bos_token }}D"
    assert chat.ChatTemplate.from_directory(tmp_path).render([]) == "<s>D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert chat.read_template(tmp_path) == "J"
    assert chat.read_template(tmp_path / "nowhere") is None


def test_chat_answers_each_line_of_standard_input(dirs, capsys, monkeypatch):
    """Each turn is the rendered conversation so far, generated greedily as transformers
    would from apply_chat_template's ids; the answer joins the conversation."""
    path, model, tok = dirs["llama"]
    messages = [{"role": "system", "content": "be brief"}]
    replies = []
    for user in ["hello", "def f(x):"]:
        messages.append({"role": "user", "content": user})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        with torch.no_grad():
            theirs = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        reply = theirs[0, len(ids):].tolist()
        replies.append(tok.decode([t for t in reply if t != tok.eos_token_id]))
        messages.append({"role": "assistant", "content": replies[-1]})
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n\ndef f(x):\n"))
    status, out, err = run_main(capsys, path, "--chat", "--system", "be brief",
                                "--temperature", "0", "-n", 12)
    assert status == 0, err
    assert out == "".join(reply + "\n" for reply in replies) and err.count("tokens/s") == 2
    # One message from --prompt: one answer.
    status, out, err = run_main(capsys, path, "--chat", "-p", "hello", "--system", "be brief",
                                "--temperature", "0", "-n", 12)
    assert status == 0 and out == replies[0] + "\n"


# -- the command as a user meets it ----------------------------------------------------

def test_help_as_a_module_and_a_script():
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOTS)
    proc = subprocess.run([sys.executable, "-m", "gpt2.generate", "--help"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "usage: python -m gpt2.generate" in proc.stdout
    for option in ("--prompt-file", "--chat", "--top-p", "--seed", "--max-tokens",
                   "--no-stop", "--tokenizer"):
        assert option in proc.stdout
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml")) as f:
        assert '\ngpt2-generate = "gpt2.generate_cli:main"\n' in f.read()


def test_bad_inputs_are_one_line(dirs, capsys, tmp_path):
    path = dirs["gpt2"][0]
    (tmp_path / "garbage.bin").write_bytes(bytes(range(64)))
    tiny = GPT2Config.preset("tiny")
    big = GPT2Config(**{**tiny.__dict__, "vocab_size": 300})
    export_llmc(tmp_path / "big.bin", init_params_(ParamArena(big), 0))
    save_checkpoint(tmp_path / "gone.bin", init_params_(ParamArena(tiny), 0), step=1,
                    extra={"args": {"tokenizer": str(tmp_path / "gone.json")}})
    (tmp_path / "notemplate").mkdir()
    (tmp_path / "notemplate" / "tokenizer.json").write_bytes(
        (path / "tokenizer.json").read_bytes())
    cases = [
        ((tmp_path / "missing",), "No such file"),
        ((tmp_path / "garbage.bin",), "not a model"),
        ((tmp_path,), "no config.json"),
        ((tmp_path / "big.bin",), "pass --tokenizer"),
        ((tmp_path / "gone.bin",), "not there any more"),
        ((path, "--tokenizer", tmp_path / "garbage.bin"), "--tokenizer"),
        ((path, "--prompt-file", tmp_path / "missing.txt"), "--prompt-file"),
        ((path, "--chat", "-p", "x", "--tokenizer", tmp_path / "notemplate" / "tokenizer.json"),
         "no chat template"),
        ((tmp_path / "gone.bin", "--chat", "-p", "x", "--tokenizer", "bytes"),
         "needs a Hugging Face tokenizer.json"),
        ((path, "-p", "x", "--system", "s"), "--system"),
        ((path, "--top-p", "0"), "(0, 1]"),
        ((path, "--top-p", "1.5"), "(0, 1]"),
        ((path, "-n", "0"), "positive"),
        ((path, "--temperature", "-1"), ">= 0"),
        ((path, "-p", "x", "--prompt-file", "f"), "not allowed with"),
        ((), "MODEL"),
    ]
    for args, expected in cases:
        try:
            status = main([str(a) for a in args])
        except SystemExit as e:     # argparse's own errors exit
            status = e.code
        assert_one_line_error(status, capsys.readouterr().err, expected)
    # A checkpoint of 256 tokens takes a tokenizer of more: a prompt outside it is refused.
    status = main([str(tmp_path / "gone.bin"), "--tokenizer", str(path / "tokenizer.json"),
                   "-p", "        self.x = x"])
    assert_one_line_error(status, capsys.readouterr().err, "outside the model's vocabulary")


def test_ctrl_c_exits_130_without_a_traceback(tmp_path):
    tiny = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=16)
    save_checkpoint(tmp_path / "checkpoint.bin", init_params_(ParamArena(tiny), 0), step=1)
    proc = subprocess.Popen([sys.executable, "-m", "gpt2.generate",
                             str(tmp_path / "checkpoint.bin"), "-p", "x", "-n", "1000000", "--print-ids", "--no-stop"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=PACKAGE_ROOTS))
    try:
        assert proc.stdout.read(20)     # generating
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted by SIGINT" in err


def test_a_plain_prompt_through_a_sentencepiece_model(dirs, capsys, tmp_path):
    # tokenizer.model has no post-processor to run: the prompt is its pieces, as given
    import io

    import sentencepiece
    path, model, _ = dirs["llama"]
    spm = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(["def f(x):", "    return x + 1", "héllo world"] * 50),
        model_writer=spm, vocab_size=60, model_type="bpe", character_coverage=1.0,
        normalization_rule_name="identity", minloglevel=2)
    (tmp_path / "tok.model").write_bytes(spm.getvalue())
    status, out, err = run_main(capsys, path, "--tokenizer", tmp_path / "tok.model", "-p",
                                "def f", "-n", "5", "--temperature", "0", "--print-ids",
                                "--no-stop")
    assert status == 0, err
    assert len(ids_of(out)) == 5 and "Traceback" not in err
