"""The gpt2-eval command (python -m gpt2.evaluate): the loss and perplexity of a model - a
training checkpoint, a Hugging Face model directory or an llm.c model file - on a data file,
over the windows training's DataLoader cuts, in order, the whole file by default.

Every token of the file but the first is predicted once: the file is cut into
non-overlapping windows of T+1 tokens that overlap by one (window k covers
tokens[k*T : k*T + T + 1], as gpt2.data.DataLoader), B windows per batch, the last batch
with fewer rows where the windows run out, and the tokens left after the last whole window
(fewer than T) make one shorter window at the end.  The loss is the mean cross-entropy over
every predicted token (nats per token), as training computes it: no token is masked.

A JSONL file of chat or prompt/completion examples (``gpt2.data.Examples``) is evaluated
as training's validation reads it: every example in order, one a row of T positions (cut
to T+1 tokens, padded), B a batch, and the loss is the mean over their trained tokens
only (the assistant's, the completions').
"""
import argparse
import dataclasses
import json
import math
import os
import sys
import time

import numpy as np

from gpt2.train_options import (INPUT_ERRORS, OneLineErrorParser, UsageError, blame,
                                positive_int)

# -T's default for a model without a training T (a Hugging Face directory, an llm.c file):
# its block size, capped here (long-context models would take a 128k-token window).
DEFAULT_MAX_SEQ_LEN = 1024
# -B's default: enough windows for this many tokens per forward pass.
TOKENS_PER_BATCH = 1024

DESCRIPTION = """Evaluate a model's loss and perplexity on a data file: the gpt2-eval command, or
python -m gpt2.evaluate.

MODEL is a checkpoint.bin written by gpt2-train, a Hugging Face model directory (config.json
and model.safetensors: GPT-2, Llama, Qwen2) or an llm.c model file (gpt2_124M.bin).
"""

EPILOG = """\
The file is read as training reads --data: .bin an llm.c token file, .jsonl one {"text": ...}
record a line (each tokenized on its own, after the tokenizer's end-of-text token where it
has one; windows may cross records), anything else UTF-8 text.  A .jsonl file with
{"messages": [...]} or {"prompt": ..., "completion": ...} lines is examples, as gpt2-train
reads them (the chat template of the tokenizer's directory): one example a row of T
positions, in order, and the loss counts their trained tokens only (the assistant's, the
completions').  It is cut into the windows
of training's DataLoader, in order: non-overlapping windows of T+1 tokens, B per batch; the
tokens after the last whole window (fewer than T) are evaluated as one shorter window, so
the whole file is every token but the first.  The loss is the mean cross-entropy in nats
per token over all of them (no masking, as in training) and the perplexity its exponential.
The products run in float32; with --dtype bf16 the weights are held in bf16 (a Hugging Face
directory read tensor by tensor) and widened in the products, each window a pass of
gpt2-generate's decoder.

Exit status: 0 on success, 2 on a bad option or input (one line on stderr; --debug shows
the traceback), 130 when interrupted.
"""


def program_name():
    """gpt2-eval when run as the console script, python -m gpt2.evaluate as a module."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m gpt2.evaluate" if name in ("", "-c", "evaluate.py", "__main__.py") else name


def build_parser(prog=None):
    p = OneLineErrorParser(prog=prog or program_name(), description=DESCRIPTION, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL",
                   help="checkpoint.bin, a Hugging Face model directory or an llm.c model file")
    p.add_argument("--data", required=True, metavar="FILE",
                   help="a text file, a JSONL file of {\"text\": ...} records (.jsonl) or an "
                        "llm.c token file (.bin)")
    p.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="'bytes', a tiktoken file (r50k_base.tiktoken), a tokenizer.json or a "
                        "tokenizer.model (default: the checkpoint's training tokenizer, the "
                        "model directory's own; an llm.c model file needs one for text)")
    p.add_argument("-B", "--batch-size", type=positive_int, metavar="N", default=None,
                   help=f"windows per batch (default: {TOKENS_PER_BATCH:,} tokens' worth, "
                        f"at least 1)")
    p.add_argument("-T", "--seq-len", type=positive_int, metavar="N", default=None,
                   help=f"window length (default: the checkpoint's training -T, else the "
                        f"model's block size up to {DEFAULT_MAX_SEQ_LEN})")
    p.add_argument("--max-batches", type=positive_int, metavar="N", default=None,
                   help="evaluate only the first N batches (default: the whole file)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the weights in memory: fp32, or bf16 (half the memory: an 8B model "
                        "in 16 GB; the products widen them to float32 in registers, the "
                        "activations stay float32; a LoRA adapter runs unmerged over the "
                        "bf16 base) (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, metavar="N", default=None,
                   help="OpenMP threads (default: OMP_NUM_THREADS, or all cores)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (loss, perplexity, tokens, ...) instead of text")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of an error instead of one line")
    return p


def perplexity(loss):
    """exp(loss), inf where it overflows a float."""
    return math.exp(loss) if loss < math.log(sys.float_info.max) else math.inf


def describe_coverage(n_batches, batch_size, seq_len, total_tokens):
    """'8 batches of 4x64 = 2,048 of 30,000 tokens (6.8%)': what each training-time
    evaluation covers of its validation split."""
    covered = n_batches * batch_size * seq_len
    return (f"{n_batches:,} batch{'es' if n_batches != 1 else ''} of {batch_size}x{seq_len} = "
            f"{covered:,} of {total_tokens:,} tokens ({100 * covered / total_tokens:.1f}%)")


@dataclasses.dataclass(frozen=True)
class Batch:
    """``rows`` windows of ``length`` + 1 tokens from ``start``, each ``length`` after the last."""

    start: int
    rows: int
    length: int

    @property
    def predicted(self):
        return self.rows * self.length

    def arrays(self, tokens):
        """(inputs, targets), int32 (rows, length)."""
        index = (self.start + np.arange(self.rows)[:, None] * self.length
                 + np.arange(self.length + 1))
        chunk = tokens[index]
        return np.ascontiguousarray(chunk[:, :-1]), np.ascontiguousarray(chunk[:, 1:])


@dataclasses.dataclass(frozen=True)
class ExampleBatch:
    """``rows`` examples of an ExampleLoader from its ``first``, one a row of ``length``
    positions; ``predicted``: their trained targets."""

    first: int
    rows: int
    length: int
    predicted: int

    def arrays(self, loader):
        """(inputs, targets), int32 (rows, length), targets IGNORE_INDEX where untrained."""
        return loader.rows(range(self.first, self.first + self.rows))


def example_batches(loader, batch_size):
    """The batches that cover every example ``loader`` (split "all", in order) keeps,
    ``batch_size`` a batch (the last may have fewer)."""
    from adtape.nn import IGNORE_INDEX
    batches = []
    for first in range(0, loader.num_windows, batch_size):
        rows = min(batch_size, loader.num_windows - first)
        _, targets = loader.rows(range(first, first + rows))
        batches.append(ExampleBatch(first, rows, loader.seq_len,
                                    int(np.count_nonzero(targets != IGNORE_INDEX))))
    return batches


def window_batches(n_tokens, batch_size, seq_len):
    """The batches that cover a file of ``n_tokens`` (at least 2), in order: DataLoader's
    windows, ``batch_size`` a batch (the last batch may have fewer), then the rest of the
    file as one shorter window."""
    n_windows = (n_tokens - 1) // seq_len
    batches = [Batch(first * seq_len, min(batch_size, n_windows - first), seq_len)
               for first in range(0, n_windows, batch_size)]
    rest = n_tokens - 1 - n_windows * seq_len
    if rest:
        batches.append(Batch(n_windows * seq_len, 1, rest))
    return batches


@dataclasses.dataclass
class Evaluation:
    loss: float             # nats per predicted token
    tokens: int             # predicted tokens evaluated
    batches: int
    seconds: float

    @property
    def perplexity(self):
        return perplexity(self.loss)


def evaluate(model, tokens, batches, progress=None):
    """The mean loss of ``model`` over ``batches`` of ``tokens`` (or ``ExampleBatch``es of an
    ExampleLoader), weighted by their predicted tokens; ``progress(batch)`` is called after
    each."""
    total, count = 0.0, 0
    t0 = time.perf_counter()
    for batch in batches:
        inputs, targets = batch.arrays(tokens)
        _, loss = model.forward(inputs, targets, logits=False)
        total += float(loss) * batch.predicted
        count += batch.predicted
        if progress is not None:
            progress(batch)
    return Evaluation(loss=total / count, tokens=count, batches=len(batches),
                      seconds=time.perf_counter() - t0)


@dataclasses.dataclass
class ModelSource:
    """What MODEL holds: its config, how to read its parameters, and what it says of the
    tokenizer and T it was trained with."""

    path: str
    kind: str
    config: object
    params: object              # params(): the parameters, a ParamArena
    tokenizer: str = None       # a path, "bytes", or None where it says nothing
    seq_len: int = None         # the training -T of a checkpoint
    tokenizer_known: bool = False  # a checkpoint knows; a directory without one, a file do not


def open_model(path):
    """The ``ModelSource`` of a checkpoint, a Hugging Face directory or an llm.c model file."""
    from gpt2 import checkpoint as ckpt
    from gpt2 import hf, lora, tokenizer as tok
    if lora.is_adapter_dir(path):     # a peft adapter: merged into its base
        base_dir = lora.adapter_base_dir(path)
        found = tok.find_tokenizer(base_dir)
        return ModelSource(path, f"peft adapter on {base_dir}", hf.read_config(base_dir),
                           lambda: lora.merged_adapter(path)[0], tokenizer=found,
                           tokenizer_known=found is not None)
    if os.path.isdir(path):
        found = tok.find_tokenizer(path)
        return ModelSource(path, "Hugging Face directory", hf.read_config(path),
                           lambda: hf.load_dir(path), tokenizer=found,
                           tokenizer_known=found is not None)
    with open(path, "rb") as f:
        magic = f.read(len(ckpt.CHECKPOINT_MAGIC))
    if magic[:4] != np.int32(ckpt.LLMC_MODEL_MAGIC).astype("<i4").tobytes() and \
            magic != ckpt.CHECKPOINT_MAGIC:
        raise ValueError(f"{path!r} is neither a checkpoint (gpt2-train's checkpoint.bin), an "
                         f"llm.c model file nor a Hugging Face model directory")
    if magic == ckpt.CHECKPOINT_MAGIC:
        header = ckpt.read_checkpoint_header(path)
        saved = (header.extra or {}).get("args") or {}
        if header.lora is not None:     # a LoRA run: its base with the adapters merged
            return ModelSource(path, f"LoRA checkpoint at step {header.step}", header.config,
                               lambda: lora.merged_checkpoint(path, header),
                               tokenizer=saved.get("tokenizer") or "bytes",
                               seq_len=saved.get("seq_len"), tokenizer_known=True)

        def params():       # not the moments
            return ckpt.load_checkpoint(path, header.config, optimizer=False).params
        return ModelSource(path, f"checkpoint at step {header.step}", header.config, params,
                           tokenizer=saved.get("tokenizer") or "bytes",
                           seq_len=saved.get("seq_len"), tokenizer_known=True)
    arena = ckpt.import_llmc(path)
    return ModelSource(path, "llm.c model file", arena.config, lambda: arena)


def _load_tokenizer(args, source):
    from gpt2 import tokenizer as tok
    name = args.tokenizer if args.tokenizer is not None else source.tokenizer
    if name in (None, "bytes"):
        return tok.ByteTokenizer(), "bytes"
    what = ("--tokenizer" if args.tokenizer is not None
            else f"the tokenizer of MODEL {args.model} (pass --tokenizer for another)")
    with blame(what, INPUT_ERRORS + (ImportError,)):
        return tok.load_tokenizer(name), name


def _needs_tokenizer(args, source):
    return (args.tokenizer is None and not source.tokenizer_known
            and not args.data.endswith(".bin"))


def run(args, progress_bar=True):
    """Evaluate as the parsed command line ``args`` says; returns the result as a dict
    (what --json prints).  Raises UsageError for a bad option or input."""
    from gpt2.model import Model
    from gpt2.params import num_parameters
    from kernels import _openmp, threads
    with blame("MODEL " + args.model):
        source = open_model(args.model)
    config = source.config
    if _needs_tokenizer(args, source):
        raise UsageError(f"MODEL {args.model} ({source.kind}) has no tokenizer to read "
                         f"{args.data} with: pass --tokenizer (bytes, a tiktoken file such as "
                         f"r50k_base.tiktoken for GPT-2, a tokenizer.json or tokenizer.model)")
    tokenizer, tokenizer_name = _load_tokenizer(args, source)
    from gpt2 import data
    from gpt2.tokenizer import tokenizer_file
    # Its chat template and special tokens, for examples.
    tokenizer_dir = (os.path.dirname(os.path.abspath(tokenizer_file(tokenizer_name)))
                     if tokenizer_name != "bytes" else None)
    with blame("--data", INPUT_ERRORS + (ImportError,)):
        found = data.read_data(args.data, tokenizer, tokenizer_dir)
    examples = isinstance(found, data.Examples)
    tokens = found.ids if examples else found
    if tokens.size < 2:
        raise UsageError(f"--data {args.data}: {tokens.size} token{'s' if tokens.size else ''}; "
                         f"evaluating needs at least 2 (one to predict from)")
    if int(tokens.max()) >= config.vocab_size:
        raise UsageError(f"--data {args.data} has token id {int(tokens.max())}, outside the "
                         f"model's vocabulary of {config.vocab_size}; use a matching "
                         f"--tokenizer")
    seq_len = args.seq_len or source.seq_len or min(config.block_size, DEFAULT_MAX_SEQ_LEN)
    if seq_len > config.block_size:
        raise UsageError(f"-T {seq_len} exceeds the model's block_size {config.block_size}")
    batch_size = args.batch_size or max(1, TOKENS_PER_BATCH // seq_len)
    if examples:
        with blame("--data"):
            source_data = data.ExampleLoader(found, 1, seq_len, config.vocab_size, split="all",
                                             shuffle=False)
        batches = example_batches(source_data, batch_size)
        predictable = sum(b.predicted for b in batches)
    else:
        source_data = tokens
        batches = window_batches(tokens.size, batch_size, seq_len)
        predictable = int(tokens.size) - 1
    chosen = batches[:args.max_batches] if args.max_batches else batches

    ftz_before = _openmp.flush_denormal_enabled()
    _openmp.set_flush_denormal(True)
    n_threads = None
    try:
        with blame("--threads"):
            n_threads = threads.set_num_threads(args.threads)
        _openmp.set_flush_denormal(True, n_threads)
        with blame("MODEL " + args.model):
            if args.dtype == "bf16":    # gpt2-generate's decoder over bf16 weights
                from gpt2.generate import Weights, read_weights
                model = Weights(*read_weights(args.model, "bf16")[:2])
            else:
                model = Model.for_inference(source.params())
        try:
            if not args.json:
                print(f"{config.family_name} {config.preset_name() or ''}".rstrip()
                      + f" ({source.kind} {args.model}): "
                        f"{num_parameters(config) / 1e6:.2f}M parameters, {config.describe()}; "
                        f"-B {batch_size} -T {seq_len}, {n_threads} threads"
                      + (", weights in bf16" if args.dtype == "bf16" else ""), flush=True)
                print(f"data: {args.data}, {tokens.size:,} tokens (tokenizer {tokenizer_name}): "
                      + (f"{found.describe_kinds()}, {source_data.describe()}; "
                         if examples else "")
                      + f"{_describe_batches(chosen, batches)}", flush=True)
            result = _evaluate_with_bar(model, source_data, chosen,
                                        progress_bar and not args.no_progress)
        finally:
            model.close()
    finally:
        if n_threads is None:
            _openmp.set_flush_denormal(ftz_before)
        else:
            _openmp.set_flush_denormal(ftz_before, n_threads)
    whole = len(chosen) == len(batches)
    return {"model": args.model, "model_kind": source.kind, "data": args.data,
            "tokenizer": tokenizer_name, "dtype": args.dtype, "B": batch_size, "T": seq_len,
            "threads": n_threads,
            "loss": result.loss, "perplexity": result.perplexity,
            "tokens": result.tokens, "file_tokens": int(tokens.size),
            "predictable_tokens": predictable, "whole_file": whole,
            "batches": result.batches, "file_batches": len(batches),
            "seconds": result.seconds,
            "tokens_per_s": result.tokens / result.seconds if result.seconds > 0 else None}


def _describe_batches(chosen, batches):
    full = [b for b in chosen if b.length == chosen[0].length]
    rows = full[0].rows
    text = f"{len(full):,} batch{'es' if len(full) != 1 else ''} of {rows}x{full[0].length}"
    if full[-1].rows != rows:
        text += f" (the last {full[-1].rows}x{full[-1].length})"
    if len(full) < len(chosen):
        text += f" and a last window of {chosen[-1].length} tokens"
    predicted = sum(b.predicted for b in chosen)
    total = sum(b.predicted for b in batches)
    if len(chosen) == len(batches):
        return text + f": the whole file, {predicted:,} predicted tokens"
    return (text + f": {predicted:,} of the file's {total:,} predicted tokens "
                   f"({100 * predicted / total:.1f}%, --max-batches {len(chosen)} of "
                   f"{len(batches)})")


def _evaluate_with_bar(model, tokens, batches, show):
    from tqdm import tqdm
    with tqdm(total=sum(b.predicted for b in batches), disable=not show, unit="tok",
              unit_scale=True, dynamic_ncols=True, desc="evaluating") as bar:
        return evaluate(model, tokens, batches, progress=lambda b: bar.update(b.predicted))


def format_result(result):
    """The text line of a result."""
    whole = ("the whole file" if result["whole_file"]
             else f"{100 * result['tokens'] / result['predictable_tokens']:.1f}% of the file")
    rate = (f", {result['tokens_per_s']:,.0f} tokens/s" if result["tokens_per_s"] is not None
            else "")
    return (f"loss {result['loss']:.4f} nats/token, perplexity {result['perplexity']:.4g} over "
            f"{result['tokens']:,} tokens ({whole}) in {result['seconds']:.2f} s{rate}")


def main(argv=None):
    """Console entry point: evaluate; returns the exit status (2 on a bad option or input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is None:    # the process's own entry point: it may re-execute itself
        from kernels import blas_dispatch
        blas_dispatch.ensure()
    try:
        result = run(args)
    except UsageError as e:
        if args.debug:
            raise
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted by SIGINT", file=sys.stderr, flush=True)
        return 130
    print(json.dumps(result, indent=2) if args.json else format_result(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
