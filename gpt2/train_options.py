"""The gpt2-train command line: its options, their types and defaults, how a bad one
is reported (``UsageError``, ``blame``), and the words for the memory policy they set.
gpt2.train runs what they say."""
import argparse
import contextlib
import math
import os
import sys
import tempfile

from gpt2.units import format_size, parse_size

DESCRIPTION = """Train a decoder-only transformer (GPT-2, the Llama family) on the CPU: the gpt2-train
command, or python -m gpt2.train.

With no arguments it trains a small byte-level GPT-2 on a built-in corpus (the Python
standard library's own source files, so nothing is downloaded), shows loss, tokens/s and
ms/step in a progress bar, evaluates on a held-out split, writes a CSV log, a JSON summary,
a loss-curve PNG and a checkpoint to the output directory, and prints a text sample at the end.
"""

DEFAULT_OUT_DIR = "gpt2_run"
DEFAULT_MODEL = "small"
# What --resume takes from the checkpoint unless given again: everything that decides what
# the run computes. Where and how fast it runs (threads, engine, output) is this
# invocation's own, but for the memory policy below.
RESUMED_OPTIONS = ("data", "val_data", "tokenizer", "corpus_bytes", "val_fraction", "batch_size",
                   "seq_len", "steps", "decay_steps", "lr", "min_lr", "warmup", "schedule",
                   "weight_decay", "grad_clip", "grad_accum",
                   "seed", "eval_interval", "eval_batches", "checkpoint_interval",
                   "no_checkpoint", "sample_tokens", "temperature", "top_k", "prompt",
                   "lora", "lora_alpha", "lora_dropout", "lora_targets", "rslora", "base_dtype")
# --grad-accum changes only how a step is computed (its loss and update equal the
# unaccumulated step's to float rounding), but it sizes the step's activations to B/N
# rows: a resume keeps it, as it keeps the memory policy, unless given again.
# Taken too, as the memory policy (the run was sized for its machine: a resume may not fit
# in RAM without it); see _restore_memory_policy.
MEMORY_OPTIONS = ("max_memory", "tape_budget", "checkpointing", "snapshots", "offload",
                  "spill_dir")
PLANNED_OPTIONS = ("tape_budget", "checkpointing", "snapshots", "offload")  # --max-memory's

EPILOG = f"""\
Output goes to --out-dir (default: {DEFAULT_OUT_DIR} in the current directory; with --resume,
the checkpoint's directory): log.csv (one row per step, written as the run goes),
summary.json, loss.png and checkpoint.bin.

An --out-dir that holds another run's output is refused: continue that run with --resume,
or pass --overwrite to replace it.

--resume FILE continues the run saved in FILE up to --steps: the model comes from FILE, and
every training, data and memory option (--offload, --spill-dir, --tape-budget,
--checkpointing, --snapshots, --max-memory) not given again is the saved run's; log.csv and
loss.png cover the whole run. The learning rate continues the saved run's schedule: its
cosine ends at the saved run's --steps and stays at --min-lr after it, unless
--decay-steps is given. --save-hf and --save-dtype are the saved run's too; with --resume of
a run already at --steps, --save-hf writes the model directory without training.

Chat and instruction data: a --data JSONL file with a {{"messages": [...]}} or {{"prompt": ...,
"completion": ...}} line is read as examples, one a row of -T tokens (an example longer than
T+1 tokens is cut, one with no trained token left is dropped; the header counts both and
the share of padding), each padded after its end. "messages" (roles system, user,
assistant, tool) are rendered by the chat template of the tokenizer's directory (--tokenizer
DIR, or --init-from DIR: tokenizer_config.json's chat_template or chat_template.jinja), as
transformers' apply_chat_template; the loss counts each assistant message's tokens and the
end-of-turn token that closes it ({{% generation %}} blocks where the template has them), not
the headers, the other messages or a default system prompt. A prompt/completion trains the
completion and the tokenizer's end-of-sequence token after it. {{"text": ...}} lines in such a
file are examples whose tokens all count; a file of {{"text": ...}} lines alone is one stream
of tokens, as a text file. The loss is the mean over the counted tokens of the whole batch
(--grad-accum weighs micro-batches by their counted tokens); validation reports it on the
same masking.

Ctrl-C (SIGINT) or SIGTERM finishes the current step, saves a checkpoint and exits with
status 130 (143 for SIGTERM), saying how to resume; a second Ctrl-C stops at once and keeps
the last checkpoint saved. One during the final save lets it finish and exits 130 without
the summary and the sample. By default a checkpoint is also saved whenever the training
since the last save took 200 times as long as that save (half a percent of the run).

Exit status: 0 on success, 2 on a bad option or input, a full disk, or a spill or offload
file that reads back other bytes than were written (one line on stderr; --debug shows the
traceback), 130 or 143 when interrupted.
"""


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse whose mistakes are one line and a pointer to --help, not the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class UsageError(Exception):
    """A bad option or input file: the command reports it in one line, exit status 2."""


def program_name():
    """gpt2-train when run as the console script, python -m gpt2.train when run as a module."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m gpt2.train" if name in ("", "-c", "train.py", "__main__.py") else name


def positive_size(text):
    value = parse_size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def _integer(text, low):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(
            f"must be {'a positive' if low == 1 else 'a non-negative'} integer, got {text}")
    return value


def positive_int(text):
    return _integer(text, 1)


def non_negative_int(text):
    return _integer(text, 0)


def non_negative_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_float(text):
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def name_list(text):
    """'q_proj,v_proj' -> ('q_proj', 'v_proj')."""
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"must be comma-separated names, got {text!r}")
    return names


def checkpoint_interval(text):
    """'auto' -> None, else a non-negative number of steps."""
    return None if text.strip().lower() == "auto" else non_negative_int(text)


def fraction(text):
    value = non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1), got {text}")
    return value


def build_parser(prog=None):
    from gpt2 import families
    p = OneLineErrorParser(prog=prog or program_name(), description=DESCRIPTION,
                                epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    presets = " or ".join(f"{f.title} ({', '.join(f.presets)})" for f in families.families())
    m.add_argument("--model", choices=tuple(families.all_presets()), default=None,
                   metavar="PRESET",
                   help=f"the model: {presets}; gpt2 is the 124M GPT-2 "
                        f"(default: {DEFAULT_MODEL}, or the sizes of --init-from or --resume, "
                        f"which it must match if given)")
    m.add_argument("--init-from", default=None, metavar="PATH",
                   help="start from weights: a Hugging Face model directory (config.json and "
                        "model.safetensors or its shards: GPT-2, Llama, Qwen2), a checkpoint.bin "
                        "of gpt2-train (a new run from its weights and tokenizer), an llm.c "
                        "model file (gpt2_124M.bin) or a GPT-2 model.safetensors with its "
                        "config.json beside it; a directory without a tokenizer whose "
                        "vocabulary is wider than 256 needs --tokenizer")
    m.add_argument("--engine", choices=("tape", "manual"), default="tape",
                   help="tape: backward derived by the adtape tape; manual: hand-sequenced "
                        "(default: %(default)s)")
    m.add_argument("--precision", choices=("auto", "fp32", "bf16"),
                   default=os.environ.get("ADTAPE_PRECISION") or "auto",
                   help="the matrix products' operands: bf16 (float32 sums, master weights, "
                        "gradients and moments), fp32, or auto: bf16 where the CPU multiplies "
                        "it faster (AVX512_BF16, measured at start) (default: "
                        "$ADTAPE_PRECISION or auto)")
    ft = p.add_argument_group(
        "fine-tuning (LoRA)", "Train low-rank adapters on a frozen base (usually --init-from "
        "a Hugging Face directory), as peft does: only the adapters have gradients and AdamW "
        "moments. The adapter is written to OUT_DIR/adapter/ in peft's format at every "
        "checkpoint and at the end; --save-hf writes the merged model.")
    ft.add_argument("--lora", type=positive_int, metavar="R", default=None,
                    help="the adapters' rank (default: no LoRA, every weight trains)")
    ft.add_argument("--lora-alpha", type=positive_float, metavar="A", default=None,
                    help="the adapters' scale is A / R (default: 2 R)")
    ft.add_argument("--lora-dropout", type=fraction, metavar="P", default=0.0,
                    help="dropout on the adapters' input while training (default: "
                         "%(default)s)")
    ft.add_argument("--lora-targets", type=name_list, metavar="NAMES", default=None,
                    help="comma-separated projections to adapt, peft's target_modules (default: "
                         "all: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj for "
                         "Llama and Qwen2, c_attn,c_proj,c_fc for GPT-2)")
    ft.add_argument("--rslora", action="store_true",
                    help="rank-stabilized scale A / sqrt(R) (rsLoRA)")
    ft.add_argument("--lora-from", default=None, metavar="DIR",
                    help="start from a peft adapter directory (adapter_config.json and "
                         "adapter_model.safetensors): its rank, alpha and targets, unless given")
    ft.add_argument("--base-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="how the frozen base is held: bf16 halves its bytes, and its products "
                         "then run in bf16 (default: %(default)s)")
    d = p.add_argument_group("data")
    d.add_argument("--data", default=None, metavar="FILE",
                   help="a text file, a JSONL file (.jsonl) or an llm.c token file (.bin); a JSONL "
                        "line is {\"text\": ...}, or a chat or instruction example "
                        "{\"messages\": [{\"role\": ..., \"content\": ...}, ...]} or "
                        "{\"prompt\": ..., \"completion\": ...} whose loss counts only the "
                        "assistant's or the completion's tokens (see below) (default: the "
                        "built-in corpus)")
    d.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="'bytes', a tiktoken file (r50k_base.tiktoken) for GPT-2 BPE, or a "
                        "Hugging Face tokenizer.json or SentencePiece tokenizer.model (needs "
                        "pip install 'adtape[hf]'), or a model directory holding one "
                        "(default: the --init-from directory's "
                        "tokenizer.json or tokenizer.model, else bytes)")
    d.add_argument("--corpus-bytes", type=positive_size, default="3M", metavar="SIZE",
                   help="size of the built-in corpus (default: 3M)")
    d.add_argument("--val-fraction", type=fraction, metavar="F", default=0.05,
                   help="fraction of the tokens held out for validation, at the end of the "
                        "data; 0 needs --eval-interval 0 (default: %(default)s)")
    d.add_argument("--val-data", default=None, metavar="FILE",
                   help="validate on this file instead (text, .jsonl or .bin, read as --data "
                        "is); all of --data then trains, and --val-fraction is not used")
    t = p.add_argument_group("training")
    t.add_argument("-B", "--batch-size", type=positive_int, metavar="N", default=8,
                   help="sequences per step (default: %(default)s)")
    t.add_argument("-T", "--seq-len", type=positive_int, metavar="N", default=None,
                   help="sequence length (default: 128, or the model's block_size if smaller)")
    t.add_argument("--steps", type=positive_int, metavar="N", default=1500,
                   help="total optimizer steps of the run, counting those before a --resume "
                        "(default: %(default)s)")
    t.add_argument("--decay-steps", type=positive_int, metavar="N", default=None,
                   help="steps over which the cosine schedule decays to --min-lr, after which "
                        "it stays there (default: --steps; with --resume, the saved run's)")
    t.add_argument("--lr", type=non_negative_float, default=3e-3,
                   help="peak learning rate (default: %(default)s)")
    t.add_argument("--min-lr", type=non_negative_float, default=None,
                   help="floor of the cosine schedule (default: --lr / 10)")
    t.add_argument("--warmup", type=non_negative_int, metavar="N", default=20,
                   help="steps of linear warmup (default: %(default)s)")
    t.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                   help="learning rate after the warmup: cosine decay to --min-lr, or constant "
                        "(default: %(default)s)")
    t.add_argument("--weight-decay", type=non_negative_float, metavar="WD", default=0.1,
                   help="AdamW weight decay (default: %(default)s)")
    t.add_argument("--grad-clip", type=non_negative_float, metavar="NORM", default=1.0,
                   help="max global gradient norm, 0: off (default: %(default)s)")
    t.add_argument("--grad-accum", type=positive_int, metavar="N", default=1,
                   help="gradient accumulation: each step runs its B sequences as N "
                        "micro-batches of B/N (under mpiexec, each rank's B/ranks as N of "
                        "B/ranks/N), with the activations of one micro-batch at a time, and "
                        "updates once on their mean gradient: the same loss curve, about N "
                        "times less activation memory; B must divide by N (default: "
                        "%(default)s)")
    t.add_argument("--seed", type=non_negative_int, metavar="N", default=0,
                   help="seed of the initialization, the batch order and the sample "
                        "(default: %(default)s)")
    t.add_argument("--threads", type=positive_int, metavar="N", default=None,
                   help="OpenMP threads (default: OMP_NUM_THREADS, or all cores)")
    t.add_argument("--no-flush-denormal", action="store_true",
                   help="keep denormal floats (slow); by default FTZ/DAZ are set")
    mem = p.add_argument_group("memory")
    mem.add_argument("--tape-budget", type=parse_size, default=None, metavar="SIZE",
                     help="bytes of saved activations kept in RAM, the rest spills to disk "
                          "(default: no limit)")
    mem.add_argument("--spill-dir", default=None, metavar="DIR",
                     help="existing directory for the tape's spill file (default: the system's "
                          "temporary directory)")
    mem.add_argument("--checkpointing", choices=("none", "layer", "binomial"), default="none",
                     help="recompute activations in the backward pass: none, per layer, or a "
                          "binomial (Revolve) schedule over the layers (default: %(default)s)")
    mem.add_argument("--snapshots", type=positive_int, metavar="N", default=2,
                     help="snapshots for --checkpointing binomial (default: %(default)s)")
    mem.add_argument("--offload", choices=("none", "moments", "all"), default="none",
                     help="moments: keep the AdamW moments (8 bytes per parameter) in a file "
                          "in --spill-dir and stream them through RAM during the update, "
                          "which runs as the next forward pass reaches each block; all: the "
                          "blocks' parameters and gradients too (16 bytes per parameter), "
                          "two blocks in RAM at a time (default: %(default)s)")
    mem.add_argument("--max-memory", type=positive_size, default=None, metavar="SIZE",
                     help="choose --tape-budget, --checkpointing and --offload to stay within SIZE of "
                          "RAM at the fastest predicted step (the performance model's profile "
                          "of this machine for --threads, measured on first use in about 15 s, "
                          "or by python -m gpt2.perfmodel.calibrate); excludes those two "
                          "options (default: no limit)")
    o = p.add_argument_group("evaluation and output")
    o.add_argument("--eval-interval", type=non_negative_int, metavar="N", default=250,
                   help="evaluate every N steps and at the end, 0: never (default: %(default)s)")
    o.add_argument("--eval-batches", type=positive_int, metavar="N", default=8,
                   help="validation batches of B x T tokens per evaluation, from the start "
                        "of the split; the header says how much of it they cover "
                        "(gpt2-eval evaluates a whole file) (default: %(default)s)")
    o.add_argument("--out-dir", default=None, metavar="DIR",
                   help=f"where log, plot, summary and checkpoint go (default: {DEFAULT_OUT_DIR} "
                        f"in the current directory; with --resume, the checkpoint's directory)")
    o.add_argument("--checkpoint-interval", type=checkpoint_interval, metavar="N",
                   default=None,
                   help="save a checkpoint every N steps; 0: only at the end (and when "
                        "interrupted); auto: whenever the training since the last save took "
                        "200 times as long as that save (default: auto)")
    o.add_argument("--overwrite", action="store_true",
                   help="replace the output of another run in --out-dir, and another "
                        "model's weights in --save-hf (by default such a directory is refused)")
    o.add_argument("--no-checkpoint", action="store_true", help="write no checkpoint at all")
    o.add_argument("--save-hf", default=None, metavar="DIR",
                   help="at the end of the run, also write the model as a Hugging Face "
                        "directory (config.json, model.safetensors, the tokenizer's files and "
                        "generation_config.json) that transformers loads; with --resume of a "
                        "finished run, write it without training; a directory holding "
                        "another model's weights is refused unless --overwrite")
    o.add_argument("--save-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="the format of the --save-hf weights (default: that of the "
                        "--init-from weights, fp32 from scratch)")
    o.add_argument("--save-gguf", default=None, metavar="FILE",
                   help="at the end of the run, also write the model as a GGUF file for "
                        "llama.cpp (Llama, Qwen2 and GPT-2 models), with the tokenizer's "
                        "vocabulary, merges, special tokens and chat template; a finished "
                        "run's checkpoint converts with python -m gpt2.gguf_export")
    o.add_argument("--gguf-type", choices=("f32", "f16", "bf16", "q8_0"), default="f16",
                   help="the type of the --save-gguf weights; norms and biases stay f32 "
                        "(default: %(default)s)")
    o.add_argument("--resume", default=None, metavar="FILE",
                   help="continue the run saved in this checkpoint (see below)")
    o.add_argument("--sample-tokens", type=non_negative_int, metavar="N", default=300,
                   help="tokens to sample at the end, 0: no sample (default: %(default)s)")
    o.add_argument("--temperature", type=non_negative_float, metavar="T", default=0.8,
                   help="sampling temperature, 0: always the likeliest token "
                        "(default: %(default)s)")
    o.add_argument("--top-k", type=non_negative_int, metavar="K", default=40,
                   help="sample among the k likeliest tokens, 0: all (default: %(default)s)")
    o.add_argument("--prompt", default=None, metavar="TEXT",
                   help="text the sample starts from (default: the tokenizer's "
                        "beginning-of-sequence token, as gpt2-generate; bytes, which have "
                        "none: a newline); the sample stops early at an end-of-sequence token")
    o.add_argument("--no-progress", action="store_true",
                   help="log lines instead of a progress bar")
    o.add_argument("--debug", action="store_true",
                   help="show the traceback of an error instead of one line")
    par = p.add_argument_group(
        "data parallelism", "Launch N ranks with `mpiexec -n N gpt2-train ...` (across hosts: "
        "`mpiexec -hosts a,b -n N ...`; needs pip install 'adtape[mpi]'). -B is the global "
        "batch: each rank trains on B/N of its rows, so B must divide by N. Rank 0 prints, "
        "evaluates, samples and writes the log, plot, summary and checkpoint.")
    par.add_argument("--data-parallel", choices=("auto", "on", "off"), default="auto",
                     help="auto: when an MPI launcher started more than one rank; on: over "
                          "MPI even with one rank; off: refuse a multi-rank launch "
                          "(default: %(default)s)")
    par.add_argument("--zero", type=int, choices=(0, 1), default=0,
                     help="1: shard the AdamW moments across the ranks (ZeRO stage 1) "
                          "(default: %(default)s)")
    par.add_argument("--bucket-size", type=positive_size, metavar="SIZE", default="25M",
                     help="gradient bytes per allreduce bucket (default: %(default)s)")
    return p


def explicit_options(argv):
    """The options given on the command line ``argv`` (dest -> value), without the defaults."""
    parser = build_parser()
    # argparse fills in a default only where the namespace lacks the attribute: preset every
    # one to a marker, and what the command line set is what no longer holds it.
    unset = object()
    given = parser.parse_args(argv, argparse.Namespace(
        **dict.fromkeys(vars(parser.parse_args([])), unset)))
    return {name: value for name, value in vars(given).items() if value is not unset}


def _one_line(error):
    if isinstance(error, OSError) and error.strerror:
        text = error.strerror
        if error.filename and str(error.filename) not in text:
            text += f": {error.filename!r}"
    else:
        text = str(error) or type(error).__name__
    return " ".join(text.split())


INPUT_ERRORS = (ValueError, TypeError, OSError, MemoryError)


@contextlib.contextmanager
def blame(what, errors=INPUT_ERRORS):
    """Turn a failure while reading or checking ``what`` (an option) into a UsageError."""
    try:
        yield
    except errors as e:
        raise UsageError(f"{what}: {_one_line(e)}") from e


def _option_flags(names):
    return [f"--{n.replace('_', '-')}" for n in names]


def memory_policy(args, plan=None, from_checkpoint=()):
    """How the run keeps its activations and model states, for summary.json
    (``from_checkpoint``: the options --resume took from the checkpoint)."""
    return {"offload": args.offload,
            "offload_dir": ((args.spill_dir or tempfile.gettempdir())
                            if args.offload != "none" else None),
            "tape_budget": args.tape_budget,
            "spill_dir": (args.spill_dir or tempfile.gettempdir()) if args.tape_budget else None,
            "checkpointing": args.checkpointing,
            "snapshots": args.snapshots if args.checkpointing == "binomial" else None,
            "chosen_by": "--max-memory" if plan is not None else "options",
            "from_checkpoint": _option_flags(from_checkpoint)}


def describe_memory_policy(args, plan=None, from_checkpoint=()):
    """The header line's words for ``memory_policy``."""
    parts = []
    if args.tape_budget is not None:
        parts.append(f"tape budget {format_size(args.tape_budget)}, spilling to "
                     f"{args.spill_dir or tempfile.gettempdir()}")
    if args.checkpointing == "layer":
        parts.append("per-layer checkpointing")
    elif args.checkpointing == "binomial":
        parts.append(f"binomial checkpointing with {args.snapshots} snapshot"
                     + ("s" if args.snapshots != 1 else ""))
    text = " and ".join(parts) or "activations in RAM"
    if args.offload != "none":
        what = ("AdamW moments" if args.offload == "moments"
                else "AdamW moments, the blocks' parameters and gradients")
        text += f"; {what} on disk in {args.spill_dir or tempfile.gettempdir()}"
    notes = []
    if plan is not None:
        notes.append(f"chosen by --max-memory {format_size(args.max_memory)}")
    if from_checkpoint:
        notes.append(f"{', '.join(_option_flags(from_checkpoint))} from the checkpoint")
    return text + (f" ({'; '.join(notes)})" if notes else "")
