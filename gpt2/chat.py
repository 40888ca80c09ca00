"""Chat templates: a model directory's Jinja template, rendered as transformers'
``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)``
renders it, for gpt2-generate --chat (and for training on chat data).

transformers keeps the template in ``chat_template.jinja`` (older directories: the
``chat_template`` field of ``tokenizer_config.json``, a string or a list of named templates
of which "default" is used; processors: ``chat_template.json``) and the special tokens the
template may name (``bos_token``, ``eos_token``, ...) in ``tokenizer_config.json`` (older:
``special_tokens_map.json``).  Templates come from the Hub and are untrusted code: they run
in Jinja's immutable sandbox, with transformers' settings (trim_blocks, lstrip_blocks, loop
controls) and globals (``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
non-ASCII text).  Needs jinja2 (``pip install 'adtape[hf]'``).

Training on a conversation (``conversation_tokens``) counts the loss of the assistant's
tokens only.  A template with ``{% generation %}`` blocks marks them itself (as
transformers' ``return_assistant_tokens_mask``); for the others, the conversation is
rendered prefix by prefix, as TRL's assistant-only loss does: an assistant turn's tokens
run from the end of its header (what ``add_generation_prompt`` adds after the messages
before it) to the end of its turn (what rendering the conversation through it adds), less
whatever the template writes after the turn's last special token (ChatML's newline after
``<|im_end|>``): the content and the end-of-turn marker that closes it are trained, the
headers, the other roles' messages and any default system prompt are not.
"""
import contextlib
import datetime
import importlib
import json
import os

import numpy as np

TEMPLATE_FILE = "chat_template.jinja"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# The named special tokens transformers hands every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


def _read_json(path):
    """The JSON object in ``path``, or None where there is no such file."""
    try:
        with open(path, "rb") as f:
            value = json.load(f)
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path!r} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path!r} is not a JSON object")
    return value


def _named_template(value, path):
    """A chat_template field: a string, or a list of {"name", "template"} of which the
    "default" one."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(f"{path!r}: chat_template lists templates {sorted(map(str, named))} "
                         f"but none named 'default'")
    raise ValueError(f"{path!r}: chat_template must be a string or a list of named "
                     f"templates, got {type(value).__name__}")


def read_template(directory):
    """The chat template of a tokenizer's directory (its text), or None where it has none."""
    path = os.path.join(directory, TEMPLATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        pass
    except UnicodeDecodeError as e:
        raise ValueError(f"{path!r} is not UTF-8 text: {e}") from None
    for name in (TOKENIZER_CONFIG, PROCESSOR_TEMPLATE_FILE):
        path = os.path.join(directory, name)
        config = _read_json(path)
        if config is not None and config.get("chat_template") is not None:
            return _named_template(config["chat_template"], path)
    return None


def special_tokens(directory):
    """name -> text of the named special tokens (bos_token, eos_token, ...) of a tokenizer's
    directory: tokenizer_config.json's, else special_tokens_map.json's; a token written as
    {"content": ...} (an AddedToken) is its content."""
    found = {}
    for name in (SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG):   # the later file wins
        path = os.path.join(directory, name)
        config = _read_json(path) or {}
        for key in SPECIAL_TOKEN_NAMES:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if value is None:
                continue
            if not isinstance(value, str):
                raise ValueError(f"{path!r}: {key} must be a string, got {json.dumps(value)}")
            found[key] = value
    return found


def _jinja2():
    try:
        return importlib.import_module("jinja2")
    except ImportError:
        raise ImportError("rendering a chat template needs the jinja2 package: "
                          "pip install 'adtape[hf]'") from None


def _generation_extension(jinja2):
    """The ``{% generation %}...{% endgeneration %}`` tag of transformers' templates: it
    renders its body as it is, and while ``tracking(spans)`` is on notes the characters
    the body took in the whole text (found from what the template has yielded so far)."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self.rendered = None    # the pieces the template has yielded, while tracking
            self.spans = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [],
                                          body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            if self.rendered is not None:
                start = sum(map(len, self.rendered))
                self.spans.append((start, start + len(text)))
            return text

        @contextlib.contextmanager
        def tracking(self, rendered, spans):
            self.rendered, self.spans = rendered, spans
            try:
                yield
            finally:
                self.rendered = self.spans = None

    return Generation


class ChatTemplate:
    """A compiled chat template and the special tokens it may name."""

    def __init__(self, source, special_tokens=None):
        jinja2 = _jinja2()
        import jinja2.ext
        import jinja2.sandbox

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        def strftime_now(format):
            return datetime.datetime.now().strftime(format)

        generation = _generation_extension(jinja2)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, generation])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not parse: {e} (line {e.lineno})") from None
        self._errors = jinja2.exceptions.TemplateError
        self._generation = env.extensions[generation.identifier]
        # Whether the template marks the assistant's text with {% generation %} blocks.
        self.marks_generation = _has_generation_blocks(env, source)
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_directory(cls, directory):
        """The template of a tokenizer's directory, or None where it has none."""
        source = read_template(directory)
        return None if source is None else cls(source, special_tokens(directory))

    def render(self, messages, add_generation_prompt=True, **variables):
        """The text of the conversation ``messages`` (dicts with "role" and "content"),
        ending with the assistant's header where ``add_generation_prompt``; ``variables``
        (tools, documents, ...) are the template's too.  A template's raise_exception is a
        ValueError."""
        values = {"tools": None, "documents": None, **self.special_tokens, **variables}
        try:
            return self._template.render(messages=[dict(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt, **values)
        except self._errors as e:
            raise ValueError(f"the chat template refused the conversation: {e}") from None

    def assistant_spans(self, messages, **variables):
        """(text, spans): the whole conversation ``messages`` rendered (no generation
        prompt) and the [start, end) characters of each assistant turn in it to train on:
        the template's {% generation %} blocks where it has them, else each assistant
        message's turn found by rendering prefix by prefix (the module's docstring), from
        the end of its header to the end of its turn.  ValueError where the template does
        not render the conversation prefix by prefix (a template that rewrites earlier
        turns, as one dropping past reasoning does) and has no {% generation %} blocks."""
        if self.marks_generation:
            rendered, spans = [], []
            values = {"tools": None, "documents": None, **self.special_tokens, **variables}
            try:
                with self._generation.tracking(rendered, spans):
                    for piece in self._template.generate(
                            messages=[dict(m) for m in messages], add_generation_prompt=False,
                            **values):
                        rendered.append(piece)
            except self._errors as e:
                raise ValueError(f"the chat template refused the conversation: {e}") from None
            return "".join(rendered), spans
        text = self.render(messages, add_generation_prompt=False, **variables)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            head = self.render(messages[:i], add_generation_prompt=True, **variables)
            through = self.render(messages[:i + 1], add_generation_prompt=False, **variables)
            if not (through.startswith(head) and text.startswith(through)):
                raise ValueError(f"the chat template renders message {i + 1} (the assistant's) "
                                 f"differently in the whole conversation than after the "
                                 f"messages before it, so its tokens cannot be told apart; a "
                                 f"template with {{% generation %}} blocks marks them itself")
            spans.append((len(head), len(through)))
        return text, spans


def _has_generation_blocks(env, source):
    """Whether ``source`` opens a {% generation %} block (the lexer's view: the word in a
    string or in text does not count)."""
    tokens = [(kind, value) for _, kind, value in env.lex(source) if kind != "whitespace"]
    return any(kind == "block_begin" and tokens[k + 1] == ("name", "generation")
               for k, (kind, _) in enumerate(tokens[:-1]))


def conversation_tokens(template, tokenizer, messages, **variables):
    """(ids, trained) of a conversation for training: the int32 ids of its whole text as
    transformers' ``apply_chat_template(messages, tokenize=True)`` gives them (the text
    tokenized once, no special tokens added beyond the template's) and a bool per token,
    True for the assistant's (``ChatTemplate.assistant_spans``; a token counts as the
    assistant's when any of its characters lies in an assistant span).  Without
    {% generation %} blocks, the tokens after a turn's last special token are not
    trained.  ``tokenizer``: a ``gpt2.tokenizer.HFTokenizer`` (its offsets and special
    tokens)."""
    text, spans = template.assistant_spans(messages, **variables)
    ids, offsets = tokenizer.encode_offsets(text)
    trained = np.zeros(ids.size, dtype=bool)
    special = None if template.marks_generation else tokenizer.special_token_ids()
    for start, end in spans:
        inside = np.flatnonzero((offsets[:, 0] < end) & (offsets[:, 1] > start))
        if special is not None and inside.size:
            markers = [k for k in inside if int(ids[k]) in special]
            if markers:
                inside = inside[inside <= markers[-1]]
        trained[inside] = True
    return ids, trained
