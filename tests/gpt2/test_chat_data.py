"""Chat and instruction data with a masked loss.

The oracles: transformers' ``apply_chat_template`` for the tokens of a conversation (a
ChatML template, Llama 3's header format, Qwen2.5's with its default system prompt) and its
``return_assistant_tokens_mask`` for a template with {% generation %} blocks; PyTorch's
``F.cross_entropy(ignore_index=-100)`` for the masked loss and its gradient (alone and
through the GPT-2 oracle, both engines).  Also: the trained tokens decode to exactly the
assistant contents and their end-of-turn markers; gradient accumulation over micro-batches
of uneven masks gives the whole batch's masked mean; the loader pads, truncates, drops and
resumes; every bad line is one ValueError naming the file and line.
"""
import json

import numpy as np
import pytest
import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

import torch_gpt2
from adtape import nn
from adtape.tensor import Tensor
from gpt2 import chat, data
from gpt2.config import GPT2Config
from gpt2.families import preset
from gpt2.model import Model
from gpt2.params import ParamArena, init_params_
from gpt2.tokenizer import load_tokenizer

TEXT = ("hello world how are you today the quick brown fox jumps over the lazy dog "
        "what is two plus two it is four thank you very much good bye ") * 4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
# Meta-Llama-3-8B-Instruct's template.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
          "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content "
          "%}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
          "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Qwen2.5-Instruct's template: a default system prompt where the conversation has none.
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# ChatML whose assistant turns are {% generation %} blocks (as TRL's training templates).
CHATML_GENERATION = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + "
    "'<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] + "
    "'<|im_end|>\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")

# name -> (template, bos, eos, the end-of-turn marker after an assistant's content, whether
# the template trims the content, whether the template sits in tokenizer_config.json)
TEMPLATES = {
    "chatml": (CHATML, "<|endoftext|>", "<|im_end|>", "<|im_end|>", False, False),
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>", True, True),
    "qwen2.5": (QWEN25, None, "<|im_end|>", "<|im_end|>", False, False),
    "generation": (CHATML_GENERATION, "<|endoftext|>", "<|im_end|>", "<|im_end|>", False, False),
}

CONVERSATIONS = [
    [{"role": "user", "content": "what is two plus two"},
     {"role": "assistant", "content": "it is four"}],
    [{"role": "system", "content": "you are a lazy dog"},
     {"role": "user", "content": "hello world"},
     {"role": "assistant", "content": "hello how are you today"},
     {"role": "user", "content": "the quick brown fox"},
     {"role": "assistant", "content": " jumps over\nthe lazy dog "},
     {"role": "user", "content": "thank you"},
     {"role": "assistant", "content": "good bye"}],
    [{"role": "user", "content": "hello"},
     {"role": "assistant", "content": ""},
     {"role": "user", "content": "héllo wörld"},
     {"role": "assistant", "content": "what is four"}],
]


def save_tokenizer(path, name, post_processor_bos=False):
    """A byte-level BPE tokenizer.json trained on TEXT with SPECIALS, saved by transformers
    with the template's bos and eos and the template (in tokenizer_config.json for
    "llama3", as older directories keep it; chat_template.jinja otherwise)."""
    template, bos, eos, _, _, in_config = TEMPLATES[name]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if post_processor_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos,
                                                eos_token=eos)
    fast.chat_template = template
    fast.save_pretrained(path)
    if in_config:
        (path / "chat_template.jinja").unlink()
        config = json.loads((path / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (path / "tokenizer_config.json").write_text(json.dumps(config))
        fast = transformers.AutoTokenizer.from_pretrained(path)
        assert fast.chat_template == template
    return fast


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: (root / name, save_tokenizer(root / name, name)) for name in TEMPLATES}


def runs(trained):
    """[start, stop) of each run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], trained.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


# -- the tokens of a conversation and its assistant mask --------------------------------

@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "system-and-three", "unicode"])
def test_tokens_as_apply_chat_template_and_the_assistant_mask(tokenizer_dirs, name, messages):
    path, fast = tokenizer_dirs[name]
    _, _, _, marker, trims, _ = TEMPLATES[name]
    template = chat.ChatTemplate.from_directory(path)
    assert template.marks_generation == (name == "generation")
    ids, trained = chat.conversation_tokens(template, load_tokenizer(path), messages)
    assert ids.tolist() == fast.apply_chat_template(messages, tokenize=True, return_dict=False)
    for prompt in (False, True):
        assert template.render(messages, add_generation_prompt=prompt) == \
            fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    # Each run of trained tokens is one assistant message's content and the end of its turn.
    tokenizer = load_tokenizer(path)
    replies = [m["content"].strip() if trims else m["content"] for m in messages
               if m["role"] == "assistant"]
    assert [tokenizer.decode(ids[a:b]) for a, b in runs(trained)] == \
        [reply + marker for reply in replies]
    if name == "generation":
        masked = fast.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        assert masked["input_ids"] == ids.tolist()
        assert masked["assistant_masks"] == trained.astype(int).tolist()


def test_prefix_rendering_marks_what_generation_blocks_mark(tokenizer_dirs):
    """ChatML found prefix by prefix trains the tokens that the same template's
    {% generation %} blocks give transformers' return_assistant_tokens_mask."""
    plain = chat.ChatTemplate.from_directory(tokenizer_dirs["chatml"][0])
    _, marked = tokenizer_dirs["generation"]
    tokenizer = load_tokenizer(tokenizer_dirs["chatml"][0])
    for messages in CONVERSATIONS:
        ids, trained = chat.conversation_tokens(plain, tokenizer, messages)
        oracle = marked.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        assert oracle["input_ids"] == ids.tolist()
        assert oracle["assistant_masks"] == trained.astype(int).tolist()


def test_the_default_system_prompt_is_rendered_and_not_trained(tokenizer_dirs):
    path, fast = tokenizer_dirs["qwen2.5"]
    tokenizer = load_tokenizer(path)
    messages = CONVERSATIONS[0]
    ids, trained = chat.conversation_tokens(chat.ChatTemplate.from_directory(path), tokenizer,
                                            messages)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert tokenizer.decode(ids[trained]) == "it is four<|im_end|>"


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    # Drops every assistant message but the last, as templates hiding past reasoning do.
    source = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
              "{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}assistant: {% endif %}")
    template = chat.ChatTemplate(source)
    with pytest.raises(ValueError, match="message 2 .*differently"):
        template.assistant_spans(CONVERSATIONS[1][1:])


# -- reading a JSONL file ------------------------------------------------------------

def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def test_a_file_of_every_form(tokenizer_dirs, tmp_path):
    path, fast = tokenizer_dirs["chatml"]
    tokenizer = load_tokenizer(path)
    file = write_jsonl(tmp_path / "mixed.jsonl", [
        {"messages": CONVERSATIONS[1], "id": 7},
        "",
        {"prompt": "what is two plus two", "completion": " it is four"},
        {"text": "the lazy dog"}])
    found = data.read_data(file, tokenizer, path)
    assert isinstance(found, data.Examples)
    assert found.kinds == {"messages": 1, "prompt/completion": 1, "text": 1}
    assert found.lines.tolist() == [1, 3, 4]
    examples = [(found.ids[a:b], found.trained[a:b])
                for a, b in zip(found.starts[:-1], found.starts[1:])]
    ids, trained = examples[0]
    assert ids.tolist() == fast.apply_chat_template(CONVERSATIONS[1], tokenize=True,
                                                    return_dict=False)
    # prompt and completion tokenized apart; the completion and the eos trained
    ids, trained = examples[1]
    prompt = tokenizer.encode("what is two plus two").tolist()
    assert ids.tolist()[:len(prompt)] == prompt and not trained[:len(prompt)].any()
    assert tokenizer.decode(ids[trained]) == " it is four<|im_end|>"
    assert trained[len(prompt):].all()
    # a text: every token but the first (nothing predicts it), and the eos
    ids, trained = examples[2]
    assert tokenizer.decode(ids) == "the lazy dog<|im_end|>"
    assert not trained[0] and trained[1:].all()
    # a file of texts alone is one stream, as before
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": "the lazy dog"}, {"text": "bye"}])
    stream = data.read_data(texts, tokenizer, path)
    assert isinstance(stream, np.ndarray)
    assert tokenizer.decode(stream) == "the lazy dogbye"


def test_a_prompt_opens_with_what_the_post_processor_adds(tmp_path):
    """A Llama-style tokenizer.json whose post-processor adds a BOS: the prompt/completion
    example opens with it, as transformers' tokenizer(prompt) does, and ends with the
    directory's eos_token."""
    fast = save_tokenizer(tmp_path, "llama3", post_processor_bos=True)
    tokenizer = load_tokenizer(tmp_path)
    file = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "hello", "completion": " world"}])
    found = data.read_data(file, tokenizer, tmp_path)
    expected = (fast("hello")["input_ids"] + fast(" world", add_special_tokens=False)["input_ids"]
                + [fast.eos_token_id])
    assert found.ids.tolist() == expected
    assert expected[0] == fast.bos_token_id
    assert tokenizer.decode(found.ids[found.trained]) == " world<|eot_id|>"


def test_bytes_read_prompts_and_completions(tmp_path):
    file = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "2+2=", "completion": "4"}])
    found = data.read_data(file)
    assert found.ids.tolist() == list(b"2+2=4")
    assert found.trained.tolist() == [False] * 4 + [True]


@pytest.mark.parametrize("line,problem", [
    ("{not json", "not JSON"),
    ('["text"]', "not a JSON object"),
    ('{"content": "hi"}', 'no "messages", "prompt"/"completion" or "text" key'),
    ('{"messages": "hi"}', "must be a non-empty list"),
    ('{"messages": []}', "must be a non-empty list"),
    ('{"messages": ["hi"]}', "message 1 is not an object"),
    ('{"messages": [{"role": "user"}]}', "message 1's \"content\" must be a string"),
    ('{"messages": [{"role": "user", "content": 3}]}', "message 1's \"content\" must be a string"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}',
     "message 2 has the unknown role 'bot'"),
    ('{"messages": [{"role": "user", "content": "a"}]}', "no assistant message"),
    ('{"messages": [{"role": "assistant", "content": "a"}], "text": "b"}', 'both "messages"'),
    ('{"prompt": "a"}', 'a "prompt" without a "completion"'),
    ('{"prompt": "a", "completion": null}', '"completion" must be a string'),
    ('{"prompt": "a", "completion": "", "text": "b"}', 'both "text" and'),
    ('{"text": 5}', '"text" must be a string'),
])
def test_a_bad_line_names_the_file_and_line(tokenizer_dirs, tmp_path, line, problem):
    path, _ = tokenizer_dirs["chatml"]
    file = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": "b"}, "", line])
    with pytest.raises(ValueError) as info:
        data.read_data(file, load_tokenizer(path), path)
    message = str(info.value)
    assert f"JSONL file {str(file)!r} line 3: " in message and problem in message, message
    assert "\n" not in message


def test_an_example_with_no_token_to_train_on_is_refused(tmp_path):
    # bytes have no end-of-sequence token: an empty completion trains nothing
    file = write_jsonl(tmp_path / "empty.jsonl", [{"prompt": "a", "completion": "b"},
                                                  {"prompt": "abc", "completion": ""}])
    with pytest.raises(ValueError, match=r"line 2: no token to train on: the completion is "
                                         r"empty"):
        data.read_data(file)


def test_messages_need_a_chat_template(tokenizer_dirs, tmp_path):
    file = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(ValueError, match="line 1: .*--tokenizer"):
        data.read_data(file)        # bytes
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((tokenizer_dirs["chatml"][0] / "tokenizer.json")
                                          .read_bytes())
    with pytest.raises(ValueError, match="line 1: .*has none"):
        data.read_data(file, load_tokenizer(bare), bare)


# -- the loader ----------------------------------------------------------------------

def small_examples():
    """Prompts and completions of bytes, a text: short, cut and dropped at T = 8."""
    return [{"prompt": "ab>", "completion": "cd"},
               {"prompt": "p" * 10, "completion": "q"},        # 11 tokens
               {"prompt": "x>", "completion": "yz" * 5},        # 12 tokens
               {"text": "hello"},
               {"prompt": "m>", "completion": "n"}]


def test_rows_are_padded_masked_and_cut(tmp_path):
    examples = data.read_data(write_jsonl(tmp_path / "d.jsonl", small_examples()))
    loader = data.ExampleLoader(examples, 4, 8, 256, split="all", shuffle=False)
    # 'pppppppppp' + 'q' cut at T+1 = 9 tokens leaves no completion: dropped;
    # 'x>yzyzyzyzyz' cut to 'x>yzyzyzy': truncated
    assert (loader.truncated, loader.dropped, loader.num_windows) == (2, 1, 4)
    with pytest.raises(ValueError, match="4 examples .* too few for one batch of B=5"):
        data.ExampleLoader(examples, 5, 8, 256, split="all")
    x, y = loader.next_batch()
    I = nn.IGNORE_INDEX
    assert x[0].tolist() == list(b"ab>c") + [0] * 4
    assert y[0].tolist() == [I, I] + list(b"cd") + [I] * 4
    assert x[1].tolist() == list(b"x>yzyzyz")
    assert y[1].tolist() == [I] + list(b"yzyzyzy")
    assert x[2].tolist() == list(b"hell") + [0] * 4
    assert y[2].tolist() == list(b"ello") + [I] * 4
    assert y[3].tolist() == [I, ord("n")] + [I] * 6
    positions = 4 * 8
    assert loader.padding_fraction == pytest.approx(1 - (4 + 8 + 4 + 2) / positions)
    assert loader.trained_fraction == pytest.approx((2 + 7 + 4 + 1) / positions)
    assert "2 truncated, 1 dropped" in loader.describe()


def test_splits_shuffle_and_resume(tmp_path):
    records = [{"prompt": f"q{i}>", "completion": f"answer {i}"} for i in range(40)]
    examples = data.read_data(write_jsonl(tmp_path / "d.jsonl", records))
    train, val = data.train_val_loaders(examples, 3, 16, 256, val_fraction=0.25, seed=2)
    assert (train.num_windows, val.num_windows) == (30, 10)
    seen = {bytes(row[:3].astype(np.uint8)) for _ in range(train.num_batches)
            for row in train.next_batch()[0]}
    assert len(seen) == 30 and not seen & {f"q{i}>".encode()[:3] for i in range(30, 40)}
    # a loader restored from state() serves what the original serves next
    for _ in range(12):         # into the second epoch
        train.next_batch()
    state = json.loads(json.dumps(train.state()))
    resumed = data.ExampleLoader(examples, 3, 16, 256, split="train", val_fraction=0.25,
                                 seed=2)
    resumed.load_state(state)
    for _ in range(5):
        for a, b in zip(train.next_batch(), resumed.next_batch()):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="saved for examples, this data is a stream"):
        data.DataLoader(np.arange(2000) % 256, 3, 16, 256).load_state(state)
    with pytest.raises(ValueError, match="saved for a stream of tokens, this data is examples"):
        resumed.load_state(data.DataLoader(np.arange(2000) % 256, 3, 16, 256).state())
    with pytest.raises(ValueError, match="num_examples"):
        data.ExampleLoader(examples, 3, 16, 256, split="train", val_fraction=0.2,
                           seed=2).load_state(state)


# -- the masked loss -------------------------------------------------------------------

def masked_targets(rng, B, T, V, counted):
    """Random targets with ``counted[r]`` leading positions of row r counted, the rest
    IGNORE_INDEX (padding), plus a few ignored inside (a prompt's)."""
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    for r, n in enumerate(counted):
        targets[r, n:] = nn.IGNORE_INDEX
        if n > 2:
            targets[r, :n // 3] = nn.IGNORE_INDEX
    return targets


def test_mean_cross_entropy_as_torch_ignore_index():
    rng = np.random.default_rng(0)
    B, T, V, Vp = 3, 7, 50, 64
    logits = (rng.standard_normal((B, T, Vp)) * 2).astype(np.float32)
    targets = masked_targets(rng, B, T, V, [7, 3, 0])
    for denominator in (None, 5.5):
        x = Tensor(logits.copy(), requires_grad=True)
        loss = nn.mean_cross_entropy(x, targets, V, denominator)
        loss.backward()
        t = torch.tensor(logits[..., :V].reshape(-1, V), requires_grad=True)
        reference = F.cross_entropy(t, torch.tensor(targets.reshape(-1), dtype=torch.long),
                                    ignore_index=-100,
                                    reduction="mean" if denominator is None else "sum")
        if denominator is not None:
            reference = reference / denominator
        reference.backward()
        assert float(loss.data) == pytest.approx(reference.item(), rel=1e-6)
        np.testing.assert_allclose(x.grad[..., :V].reshape(-1, V), t.grad.numpy(), rtol=0,
                                   atol=1e-6 * float(t.grad.abs().max()))
        np.testing.assert_array_equal(x.grad[..., V:], 0.0)
        np.testing.assert_array_equal(x.grad[targets == nn.IGNORE_INDEX], 0.0)
    # nothing ignored: the plain mean, to the bit
    full = rng.integers(0, V, (B, T)).astype(np.int32)
    assert float(nn.mean_cross_entropy(logits, full, V).data) == \
        float(nn.softmax_cross_entropy(logits, full, V).mean().data)
    with pytest.raises(ValueError, match="every target is IGNORE_INDEX"):
        nn.mean_cross_entropy(logits, np.full((B, T), -100, np.int32), V)
    with pytest.raises(ValueError, match="loss denominator must be a positive number"):
        nn.mean_cross_entropy(logits, full, V, 0)


def test_take_rows_and_its_gradient():
    rng = np.random.default_rng(2)
    data = rng.standard_normal((2, 5, 3)).astype(np.float32)
    rows = np.array([7, 0, 4])
    x = Tensor(data.copy(), requires_grad=True)
    out = nn.take_rows(x, rows)
    np.testing.assert_array_equal(out.data, data.reshape(10, 3)[rows])
    weights = rng.standard_normal((3, 3)).astype(np.float32)
    (out * Tensor(weights)).sum().backward()
    expected = np.zeros((10, 3), np.float32)
    expected[rows] = weights
    np.testing.assert_array_equal(x.grad, expected.reshape(2, 5, 3))
    (nn.take_rows(x, rows) * Tensor(weights)).sum().backward()    # accumulates
    np.testing.assert_array_equal(x.grad, 2 * expected.reshape(2, 5, 3))
    for bad in (np.array([10]), np.array([-1]), np.array([[0]])):
        with pytest.raises(ValueError, match="take_rows: rows must be"):
            nn.take_rows(x, bad)


def test_the_head_runs_on_the_rows_with_a_loss_only(monkeypatch):
    # Targets partly IGNORE_INDEX: the engine's head (final norm, LM head, loss) takes the
    # other rows only.  Same loss and gradients as the head over every row, less tape.
    import gpt2.tape_engine as tape_engine
    config = GPT2Config.preset("tiny")
    rng = np.random.default_rng(3)
    B, T = 4, 16
    inputs = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    targets = masked_targets(rng, B, T, config.vocab_size, [16, 9, 4, 1])
    masked = int(np.count_nonzero(targets == nn.IGNORE_INDEX))

    def every_row(self, inputs, targets, denominator=None):
        return nn.mean_cross_entropy(self.forward_logits(inputs), targets,
                                     self.config.vocab_size, denominator)

    runs = []
    for head in ("kept rows", "every row"):
        if head == "every row":
            monkeypatch.setattr(tape_engine.TapeEngine, "forward_loss", every_row)
        model = Model(config, seed=5)
        model.zero_grad()
        loss = model.loss_and_grad(inputs, targets)
        runs.append((loss, {k: v.copy() for k, v in model.grads.views.items()},
                     model._tape_engine.last_forward_bytes))
        model.close()
    (loss, grads, tape), (loss_all, grads_all, tape_all) = runs
    assert loss == pytest.approx(loss_all, rel=1e-6)
    for name, g in grads_all.items():
        np.testing.assert_allclose(grads[name], g, rtol=0,
                                   atol=1e-6 * max(float(np.abs(g).max()), 1e-6), err_msg=name)
    # each skipped row saved a row of logits (the padded vocabulary, float32) and more
    assert tape_all - tape >= masked * config.padded_vocab_size * 4


def test_a_validation_loss_without_logits_takes_the_counted_rows():
    config = preset("llama-tiny")
    rng = np.random.default_rng(4)
    inputs = rng.integers(0, config.vocab_size, (3, 16)).astype(np.int32)
    targets = masked_targets(rng, 3, 16, config.vocab_size, [16, 7, 2])
    model = Model(config, seed=2)
    logits, loss = model.forward(inputs, targets)
    none, counted = model.forward(inputs, targets, logits=False)
    assert none is None and counted == pytest.approx(loss, rel=1e-6)
    model.close()


@pytest.mark.parametrize("engine", ["tape", "manual"])
def test_the_model_against_the_pytorch_oracle(engine):
    config = GPT2Config.preset("tiny")
    params = init_params_(ParamArena(config), 4)
    rng = np.random.default_rng(1)
    B, T = 4, 16
    inputs = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    targets = masked_targets(rng, B, T, config.vocab_size, [16, 9, 4, 1])
    model = Model(config, engine=engine)
    model.set_params(params)
    model.zero_grad()
    loss = model.loss_and_grad(inputs, targets)
    _, forward_loss = model.forward(inputs, targets)
    oracle = torch_gpt2.build_model(config, params)
    ref_loss, ref_grads = torch_gpt2.loss_and_grads(oracle, inputs, targets)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert forward_loss == pytest.approx(ref_loss, rel=1e-5)
    for name, ref in ref_grads.items():
        ours = model.grads.views[name]
        scale = float(np.abs(ref).max())
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * max(scale, 1e-6),
                                   err_msg=name)
    model.close()


def test_check_batch_takes_ignore_index_only():
    model = Model(GPT2Config.preset("tiny"))
    inputs = np.zeros((1, 4), np.int32)
    model.check_batch(inputs, np.array([[1, -100, 2, -100]]))
    for bad in (-1, 256):
        with pytest.raises(ValueError, match=r"\[0, 256\) or be IGNORE_INDEX \(-100"):
            model.check_batch(inputs, np.array([[1, bad, 2, 3]]))
    with pytest.raises(ValueError, match="every target is IGNORE_INDEX"):
        model.loss_and_grad(inputs, np.full((1, 4), -100))
    model.close()


def _max_rel(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_accumulation_weighs_micro_batches_by_their_counted_targets(name):
    """Micro-batches with very different numbers of counted targets (16 to 1 a row):
    the accumulated gradient and loss are the whole batch's masked mean within 1e-6
    (relative to the largest gradient), where the mean of the micro-batches' means is
    far off."""
    config = preset(name)
    rng = np.random.default_rng(5)
    B, T = 8, 16
    inputs = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    targets = masked_targets(rng, B, T, config.vocab_size, [16, 16, 12, 10, 3, 1, 1, 2])
    out = {}
    for n in (1, 2, 4):
        model = Model(config, seed=3)
        loss, _ = model.train_step(inputs, targets, lr=0.0, grad_accum=n)
        out[n] = loss, model.grads.flat / n     # the step scales the sum by 1/n
        model.close()
    loss1, grads1 = out[1]
    for n in (2, 4):
        loss, grads = out[n]
        assert abs(loss - loss1) <= 1e-6 * abs(loss1), (n, loss, loss1)
        assert _max_rel(grads, grads1) <= 1e-6, (n, _max_rel(grads, grads1))
    # The unweighted mean of the micro-batches' own means (what a plain .mean() gives).
    model = Model(config, seed=3)
    model.zero_grad()
    for rows in (slice(0, 4), slice(4, 8)):
        model.loss_and_grad(inputs[rows], targets[rows])
    assert _max_rel(model.grads.flat / 2, grads1) > 1e-2
    model.close()


def test_batches_are_as_wide_as_their_longest_example(tmp_path):
    # Examples of lengths 3..60 bytes; T 64.  Each training batch is its longest example
    # rounded up to 16 (at most T), every example comes once an epoch, examples of like
    # lengths share batches, and the loss is that of the full-width padded batch.
    path = tmp_path / "pc.jsonl"
    rng = np.random.default_rng(0)
    write_jsonl(path, [{"prompt": "p" * int(n), "completion": "c" * int(rng.integers(1, 9))}
                       for n in rng.integers(1, 50, 96)])
    examples = data.read_data(str(path))
    loader = data.ExampleLoader(examples, 4, 64, 256, split="all", seed=3)
    seen = []
    for _ in range(loader.num_batches):
        inputs, targets = loader.next_batch()
        chosen = loader._order[(loader.batch_index - 1) * 4:loader.batch_index * 4]
        longest = int(loader._lengths[chosen].max()) - 1
        assert inputs.shape == targets.shape == (4, min(64, -(-longest // 16) * 16))
        seen.extend(chosen.tolist())
    assert sorted(seen) == list(range(loader.num_windows))
    assert loader.batch_padding_fraction() < 0.5 * loader.padding_fraction
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=64)
    model = Model(config, seed=1)
    chosen = loader._order[:4]
    narrow = loader.rows(chosen)
    wide = [np.zeros((4, 64), np.int32), np.full((4, 64), nn.IGNORE_INDEX, np.int32)]
    for a, w in zip(narrow, wide):
        w[:, :a.shape[1]] = a
    assert narrow[0].shape[1] < 64
    np.testing.assert_allclose(model.forward(*narrow)[1], model.forward(*wide)[1], rtol=1e-6)
