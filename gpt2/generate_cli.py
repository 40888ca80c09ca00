"""The gpt2-generate command (python -m gpt2.generate): text from a model file, streamed
as it is generated with the key/value cache of gpt2.generate; --chat talks through the
directory's chat template (gpt2.chat).  Options and errors as gpt2-train's
(gpt2.train_options): a bad option or input is one line, exit status 2."""
import argparse
import os
import signal
import sys
import time

from gpt2.train_options import (INPUT_ERRORS, OneLineErrorParser, UsageError, blame,
                                non_negative_float, non_negative_int, positive_int)

DESCRIPTION = """Generate text from a model on the CPU: the gpt2-generate command, or
python -m gpt2.generate.

MODEL is a gpt2-train checkpoint (checkpoint.bin), a Hugging Face model directory
(config.json and model.safetensors: GPT-2, Llama, Qwen2, with its tokenizer.json or
tokenizer.model), an llm.c model file (gpt2_124M.bin) or a GPT-2 model.safetensors with its
config.json beside it. The text streams to standard output as it is generated; the speed
goes to standard error.
"""

EPILOG = """\
The prompt is --prompt's text, or --prompt-file's (- reads standard input), or standard
input where it is not a terminal, taken as it is (a final newline included); with none of
these the text starts from the tokenizer's beginning-of-sequence token. A Hugging Face
tokenizer.json adds what its post-processor adds (a Llama tokenizer's BOS), as
transformers' tokenizer(text) does.

The tokenizer: --tokenizer, else the checkpoint's (the one its run trained with), else the
model directory's tokenizer.json or tokenizer.model, else bytes (a model of 256 tokens).
Its directory's tokenizer_config.json names the special tokens and the chat template.

Generation stops after --max-tokens tokens, or at an end-of-sequence token: the model
directory's generation_config.json eos_token_id (else config.json's) and the tokenizer's
end-of-sequence token; --no-stop generates all --max-tokens. With --temperature 0 each
token is the likeliest, as transformers' generate(do_sample=False).

--chat renders the conversation with the chat template (as transformers'
apply_chat_template(..., add_generation_prompt=True)) and answers each line of standard
input as a user's turn until end of input (or the one message of --prompt or
--prompt-file); needs a tokenizer.json with a chat template and jinja2
(pip install 'adtape[hf]').

Exit status: 0 on success, 2 on a bad option or input (one line on stderr; --debug shows
the traceback), 130 when interrupted (Ctrl-C).
"""


def program_name():
    """gpt2-generate when run as the console script, python -m gpt2.generate otherwise."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return ("python -m gpt2.generate"
            if name in ("", "-c", "generate.py", "generate_cli.py", "__main__.py") else name)


def nucleus(text):
    value = non_negative_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {text}")
    return value


def build_parser(prog=None):
    p = OneLineErrorParser(prog=prog or program_name(), description=DESCRIPTION,
                           epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL",
                   help="checkpoint.bin, a Hugging Face model directory, an llm.c model file "
                        "or a GPT-2 model.safetensors")
    p.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="'bytes', a tiktoken file (r50k_base.tiktoken for GPT-2), a Hugging "
                        "Face tokenizer.json or a SentencePiece tokenizer.model, or a "
                        "directory holding one (default: the model's, see below)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("-p", "--prompt", default=None, metavar="TEXT",
                        help="the text to continue (default: standard input, see below)")
    prompt.add_argument("--prompt-file", default=None, metavar="FILE",
                        help="read the prompt from FILE; - reads standard input")
    p.add_argument("--chat", action="store_true",
                   help="a conversation through the model's chat template (see below)")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="with --chat: the system message that opens the conversation")
    s = p.add_argument_group("sampling")
    s.add_argument("-n", "--max-tokens", type=positive_int, metavar="N", default=256,
                   help="tokens to generate at most, per turn with --chat "
                        "(default: %(default)s)")
    s.add_argument("--temperature", type=non_negative_float, metavar="T", default=0.8,
                   help="sampling temperature, 0: always the likeliest token (greedy) "
                        "(default: %(default)s)")
    s.add_argument("--top-k", type=non_negative_int, metavar="K", default=40,
                   help="sample among the k likeliest tokens, 0: all (default: %(default)s)")
    s.add_argument("--top-p", type=nucleus, metavar="P", default=1.0,
                   help="sample among the likeliest tokens whose probabilities sum to P "
                        "(nucleus sampling), 1: all (default: %(default)s)")
    s.add_argument("--seed", type=non_negative_int, metavar="N", default=None,
                   help="seed of the sampling, for the same text again (default: a fresh one)")
    s.add_argument("--no-stop", action="store_true",
                   help="generate --max-tokens tokens, past end-of-sequence tokens")
    o = p.add_argument_group("output and machine")
    o.add_argument("--print-ids", action="store_true",
                   help="print the generated token ids (the end-of-sequence one included), "
                        "not their text")
    o.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the weights in memory: fp32, or bf16 (half the memory and faster "
                        "decoding, the products still float32; a Hugging Face directory is "
                        "read as bf16 tensor by tensor) (default: %(default)s)")
    o.add_argument("--threads", type=positive_int, metavar="N", default=None,
                   help="OpenMP threads (default: OMP_NUM_THREADS, or all cores)")
    o.add_argument("--debug", action="store_true",
                   help="show the traceback of an error instead of one line")
    return p


def exit_while_starting(signum, frame):
    """SIGINT while python -m gpt2.generate loads its modules, before main: exit at once,
    without the traceback of a half-done import."""
    os._exit(128 + signum)


def main(argv=None):
    """Console entry point: generate; returns the exit status (2 on a bad option or input,
    130 on Ctrl-C)."""
    if signal.getsignal(signal.SIGINT) is exit_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if argv is None:    # the process's own entry point: it may re-execute itself
            from kernels import blas_dispatch
            blas_dispatch.ensure()
        _run(args)
    except UsageError as e:
        if args.debug:
            raise
        sys.stdout.flush()
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stdout, flush=True)     # end the line the text was streaming on
        print(f"{parser.prog}: interrupted by SIGINT", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    except BrokenPipeError:     # the reader went away (| head): stop without a word
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return 0


# -- loading -------------------------------------------------------------------------

class Source:
    """What MODEL and --tokenizer give: the weights, the tokenizer, the special tokens and
    chat template of the tokenizer's directory, and the ids that end a text."""

    def __init__(self, args):
        self.name = args.model
        from gpt2.generate import Weights, read_weights
        params, adapters, named_tokenizer, self.model_dir = read_weights(args.model, args.dtype)
        self.config = params.config
        self.weights = Weights(params, adapters)
        self.tokenizer, tokenizer_dir = _read_tokenizer(args, named_tokenizer, self.config)
        from gpt2 import chat
        with blame(f"the tokenizer's directory {tokenizer_dir}"):
            self.special_tokens = chat.special_tokens(tokenizer_dir) if tokenizer_dir else {}
        self.template = None
        if args.chat:
            if not hasattr(self.tokenizer, "token_id"):
                raise UsageError(f"--chat needs a Hugging Face tokenizer.json (its special "
                                 f"tokens are the template's), not "
                                 f"{type(self.tokenizer).__name__}; pass --tokenizer")
            with blame("--chat", INPUT_ERRORS + (ImportError,)):
                self.template = chat.ChatTemplate.from_directory(tokenizer_dir)
            if self.template is None:
                raise UsageError(f"--chat: {tokenizer_dir} has no chat template "
                                 f"({chat.TEMPLATE_FILE}, or chat_template in "
                                 f"{chat.TOKENIZER_CONFIG})")
        from gpt2.generate import sequence_ids
        self.eos_ids, self.bos_id = sequence_ids(self.tokenizer, self.special_tokens,
                                                 self.model_dir)


def _read_tokenizer(args, named, config):
    """(tokenizer, the directory of its file or None): --tokenizer, else the one the model
    names, else bytes."""
    from gpt2 import tokenizer as tok
    path = args.tokenizer if args.tokenizer is not None else named
    if path in (None, "bytes"):
        if config.vocab_size > 256:
            raise UsageError(f"{args.model} has a vocabulary of {config.vocab_size} tokens and "
                             f"names no tokenizer: pass --tokenizer (a tokenizer.json, "
                             f"tokenizer.model, or r50k_base.tiktoken for GPT-2)")
        return tok.ByteTokenizer(), None
    if args.tokenizer is None and not os.path.exists(path):
        raise UsageError(f"{args.model}: its tokenizer {path} is not there any more; pass "
                         f"--tokenizer")
    with blame("--tokenizer" if args.tokenizer is not None else f"{args.model}'s tokenizer",
               INPUT_ERRORS + (ImportError,)):
        path = tok.tokenizer_file(path)
        return tok.load_tokenizer(path), os.path.dirname(os.path.abspath(path))


def _read_prompt(args):
    """The prompt's text: --prompt, --prompt-file (- standard input), or standard input where
    it is not a terminal; None where there is none."""
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file == "-" or (args.prompt_file is None and not args.chat
                                   and not sys.stdin.isatty()):
        return sys.stdin.read()
    if args.prompt_file is not None:
        with blame("--prompt-file"):
            with open(args.prompt_file, encoding="utf-8") as f:
                return f.read()
    return None


# -- generating ------------------------------------------------------------------------

class Stream:
    """Writes the text of the tokens to ``out`` as they come (a character split across
    tokens once it is whole), or their ids; counts them and times the first and the last."""

    def __init__(self, tokenizer, out, print_ids, hidden=()):
        self.tokenizer, self.out, self.print_ids = tokenizer, out, print_ids
        self.hidden = frozenset(hidden)     # not written as text: the end-of-sequence ids
        self.ids, self.shown, self.written = [], [], 0
        self.start = self.first = self.last = time.perf_counter()

    def __call__(self, token):
        self.last = time.perf_counter()
        if not self.ids:
            self.first = self.last
        self.ids.append(token)
        if token not in self.hidden:
            self.shown.append(token)
        if self.print_ids:
            self.out.write(f"{' ' if len(self.ids) > 1 else ''}{token}")
            self.out.flush()
            return
        if token in self.hidden:
            return
        text = self.text()
        if not text.endswith("\ufffd"):     # else the rest of a UTF-8 character is to come
            self.out.write(text[self.written:])
            self.out.flush()
            self.written = len(text)

    def text(self):
        """The text of the tokens shown; an id the tokenizer lacks reads [id]."""
        vocab = self.tokenizer.vocab_size
        parts, run = [], []
        for token in self.shown + [None]:
            if token is not None and token < vocab:
                run.append(token)
                continue
            if run:
                parts.append(self.tokenizer.decode(run))
                run = []
            if token is not None:
                parts.append(f"[{token}]")
        return "".join(parts)

    def finish(self):
        """End the output's line; returns the words for standard error on the speed."""
        if not self.print_ids:
            self.out.write(self.text()[self.written:])
        self.out.write("\n")
        self.out.flush()
        n = len(self.ids)
        words = f"{n} token{'s' if n != 1 else ''} in {self.last - self.start:.2f} s"
        if n > 1:
            words += (f", {(n - 1) / max(self.last - self.first, 1e-9):.1f} tokens/s after the "
                      f"first")
        return words


def _generate(args, source, prompt_ids, rng):
    """Generate after ``prompt_ids``, streaming; returns the text shown."""
    from gpt2.generate import generate
    vocab = source.config.vocab_size
    if not prompt_ids:
        prompt_ids = [source.bos_id] if source.bos_id is not None else []
    if prompt_ids and max(prompt_ids) >= vocab:
        raise UsageError(f"the prompt has token id {max(prompt_ids)}, outside the model's "
                         f"vocabulary of {vocab}; pass a matching --tokenizer")
    stops = () if args.no_stop else source.eos_ids
    stream = Stream(source.tokenizer, sys.stdout, args.print_ids, hidden=stops)
    generate(source.weights, prompt_ids, args.max_tokens, args.temperature, args.top_k, rng,
             top_p=args.top_p, stop_ids=stops, on_token=stream)
    words = stream.finish()
    print(f"({words}; prompt of {len(prompt_ids)} tokens)", file=sys.stderr, flush=True)
    return stream.text()


def _encode(source, text, plain):
    """Token ids of ``text``: with the tokenizer's post-processor for a plain prompt (as
    transformers' tokenizer(text)), without for a rendered chat (it holds its specials)."""
    from gpt2.tokenizer import HFTokenizer
    if plain and isinstance(source.tokenizer, HFTokenizer):
        return source.tokenizer.encode(text, add_special_tokens=True).tolist()
    return source.tokenizer.encode(text).tolist()


def _user_turns(args):
    """The user's messages: --prompt's or --prompt-file's one, or each line of standard
    input (a '> ' prompt on standard error at a terminal)."""
    one = _read_prompt(args)
    if one is not None:
        yield one
        return
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def _run(args):
    import numpy as np

    from kernels import threads
    if args.system is not None and not args.chat:
        raise UsageError("--system opens a --chat conversation: pass --chat too")
    with blame("--threads"):
        threads.set_num_threads(args.threads)
    source = Source(args)
    rng = np.random.default_rng(args.seed)
    if not args.chat:
        text = _read_prompt(args)
        with blame("the prompt"):
            prompt_ids = _encode(source, text or "", plain=True)
        _generate(args, source, prompt_ids, rng)
        return
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    for turn in _user_turns(args):
        messages.append({"role": "user", "content": turn})
        with blame("--chat"):
            rendered = source.template.render(messages, add_generation_prompt=True)
        reply = _generate(args, source, _encode(source, rendered, plain=False), rng)
        messages.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    sys.exit(main())
