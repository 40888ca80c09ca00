"""Train a decoder-only transformer (GPT-2, the Llama family) on the CPU: the gpt2-train
command, or python -m gpt2.train.

With no arguments it trains a small byte-level GPT-2 on a built-in corpus (the Python
standard library's own source files, so nothing is downloaded), shows loss, tokens/s and
ms/step in a progress bar, evaluates on a held-out split, writes a CSV log, a JSON summary,
a loss-curve PNG and a checkpoint to the output directory, and prints a text sample at the end.
"""
import os
import signal
import sys
import threading


def _exit_while_starting(signum, frame):
    """SIGINT while the program loads its modules: exit at once, in one line.  Python's own
    KeyboardInterrupt would end in a traceback of the half-done import, or in a second one
    from whatever imported that module again while handling it."""
    os.write(2, _STARTING_MESSAGE)
    os._exit(128 + signum)


# Started as the program (python -m gpt2.train, or the gpt2-train script, whose first act is
# to import this module): until main() has loaded what the run needs (``_load_the_run``),
# Ctrl-C exits quietly.  So the handler goes in before the imports below.
if ((__name__ == "__main__" or os.path.basename(sys.argv[0] if sys.argv else "") == "gpt2-train")
        and threading.current_thread() is threading.main_thread()):
    _STARTING_MESSAGE = (f"{'python -m gpt2.train' if __name__ == '__main__' else 'gpt2-train'}: "
                         f"interrupted by SIGINT while starting; nothing was written\n").encode()
    signal.signal(signal.SIGINT, _exit_while_starting)

import argparse
import contextlib
import csv
import dataclasses
import io
import json
import math
import resource
import tempfile
import time

from gpt2.units import SIZE_SUFFIXES, format_size, parse_size  # noqa: F401  (gpt2.train's names)

DEFAULT_OUT_DIR = "gpt2_run"
DEFAULT_MODEL = "small"
LOG_FIELDS = ("step", "loss", "lr", "ms", "tokens_per_s", "grad_norm", "val_loss")
# What --resume takes from the checkpoint unless given again: everything that decides what
# the run computes. Where and how fast it runs (threads, engine, output) is this
# invocation's own, but for the memory policy below.
RESUMED_OPTIONS = ("data", "tokenizer", "corpus_bytes", "val_fraction", "batch_size", "seq_len",
                   "steps", "decay_steps", "lr", "min_lr", "warmup", "schedule",
                   "weight_decay", "grad_clip",
                   "seed", "eval_interval", "eval_batches", "checkpoint_interval",
                   "no_checkpoint", "sample_tokens", "temperature", "top_k", "prompt")
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
--decay-steps is given.

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
    p = OneLineErrorParser(prog=prog or program_name(), description=__doc__,
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
                        "model.safetensors or its shards: GPT-2, Llama, Qwen2), an llm.c model "
                        "file (gpt2_124M.bin) or a GPT-2 model.safetensors with its config.json "
                        "beside it")
    m.add_argument("--engine", choices=("tape", "manual"), default="tape",
                   help="tape: backward derived by the adtape tape; manual: hand-sequenced "
                        "(default: %(default)s)")
    m.add_argument("--precision", choices=("auto", "fp32", "bf16"),
                   default=os.environ.get("ADTAPE_PRECISION") or "auto",
                   help="the matrix products' operands: bf16 (float32 sums, master weights, "
                        "gradients and moments), fp32, or auto: bf16 where the CPU multiplies "
                        "it faster (AVX512_BF16, measured at start) (default: "
                        "$ADTAPE_PRECISION or auto)")
    d = p.add_argument_group("data")
    d.add_argument("--data", default=None, metavar="FILE",
                   help="a text file or an llm.c token file (.bin) (default: the built-in corpus)")
    d.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="'bytes', a tiktoken file (r50k_base.tiktoken) for GPT-2 BPE, or a "
                        "Hugging Face tokenizer.json or SentencePiece tokenizer.model (needs "
                        "pip install 'adtape[hf]') (default: the --init-from directory's "
                        "tokenizer.json or tokenizer.model, else bytes)")
    d.add_argument("--corpus-bytes", type=positive_size, default="3M", metavar="SIZE",
                   help="size of the built-in corpus (default: 3M)")
    d.add_argument("--val-fraction", type=fraction, metavar="F", default=0.05,
                   help="fraction of the tokens held out for validation, at the end of the "
                        "data; 0 needs --eval-interval 0 (default: %(default)s)")
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
                   help="validation batches per evaluation (default: %(default)s)")
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
                        "directory (config.json, model.safetensors) that transformers loads; "
                        "a directory holding another model's weights is refused unless "
                        "--overwrite")
    o.add_argument("--resume", default=None, metavar="FILE",
                   help="continue the run saved in this checkpoint (see below)")
    o.add_argument("--sample-tokens", type=non_negative_int, metavar="N", default=300,
                   help="tokens to sample at the end, 0: no sample (default: %(default)s)")
    o.add_argument("--temperature", type=non_negative_float, metavar="T", default=0.8,
                   help="sampling temperature, 0: always the likeliest token "
                        "(default: %(default)s)")
    o.add_argument("--top-k", type=non_negative_int, metavar="K", default=40,
                   help="sample among the k likeliest tokens, 0: all (default: %(default)s)")
    o.add_argument("--prompt", default="def ", metavar="TEXT",
                   help="text the sample starts from (default: %(default)r)")
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


def learning_rate(step, args):
    """Linear warmup to --lr, then cosine decay to --min-lr until --decay-steps (default:
    --steps), and --min-lr after it."""
    if args.warmup and step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.schedule == "constant":
        return args.lr
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    span = max(1, args.decay_steps - args.warmup)
    progress = min(1.0, (step - args.warmup) / span)
    return min_lr + 0.5 * (args.lr - min_lr) * (1 + math.cos(math.pi * progress))


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


def load_tokens(args):
    """(tokens, tokenizer) for --data/--tokenizer, or the built-in corpus.

    Without --tokenizer, an --init-from model directory's own tokenizer (tokenizer.json,
    else tokenizer.model) is used, and args.tokenizer names it so that --resume reads it too.
    """
    from gpt2 import data, tokenizer as tok
    given = args.tokenizer is not None
    if not given and args.init_from and os.path.isdir(args.init_from):
        args.tokenizer = tok.find_tokenizer(args.init_from)
    if args.tokenizer in (None, "bytes"):
        tokenizer = tok.ByteTokenizer()
    else:
        with blame("--tokenizer" if given else f"--init-from {args.init_from}",
                   INPUT_ERRORS + (ImportError,)):
            tokenizer = tok.load_tokenizer(args.tokenizer)
    if args.data is None:
        with blame("--corpus-bytes"):
            return data.default_corpus_tokens(tokenizer, max_bytes=args.corpus_bytes), tokenizer
    with blame("--data"):
        if args.data.endswith(".bin"):
            return data.read_llmc_tokens(args.data), tokenizer
        return data.text_file_tokens(args.data, tokenizer), tokenizer


def sample(model, prompt_ids, n_tokens, temperature, top_k, rng):
    """Autoregressive sampling with temperature (0: the likeliest token) and top-k, with a
    key/value cache (gpt2.generate); returns (every token id, the seconds it took)."""
    from gpt2.generate import generate
    t0 = time.perf_counter()
    ids = generate(model, prompt_ids, n_tokens, temperature, top_k, rng)
    return ids, time.perf_counter() - t0


def evaluate(model, loader, n_batches):
    import numpy as np
    losses = []
    for _ in range(n_batches):
        x, y = loader.next_batch()
        _, loss = model.forward(x, y)
        losses.append(loss)
    return float(np.mean(losses))


def plot_losses(path, rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
    val = [r for r in rows if r.get("val_loss") is not None]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_log(path, up_to_step):
    """Rows of an earlier run's log.csv with step <= up_to_step; [] where there is none.

    A last row cut short (a crash while it was written) is dropped; a file that is not
    such a log is refused (ValueError naming it), never overwritten.
    """
    foreign = f"{path} is not a log of this program"
    advice = "move it away to resume without the history"
    try:
        with open(path, newline="") as f:
            lines = f.read().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    except UnicodeDecodeError:
        raise ValueError(f"{foreign}: it is not text; {advice}") from None
    if lines and not lines[-1].endswith("\n"):
        lines.pop()  # cut short by a crash while it was written
    reader = csv.DictReader(lines)
    try:
        records = list(reader)
    except csv.Error as e:
        raise ValueError(f"{foreign}: not CSV ({e}); {advice}") from None
    rows = []
    if reader.fieldnames is None:   # empty, or only a header cut short
        return rows
    if not records and set(reader.fieldnames) <= set(LOG_FIELDS):
        return rows                 # only a header of ours (older versions left "step")
    if tuple(reader.fieldnames) != LOG_FIELDS:
        shown = _one_line(str(reader.fieldnames))[:200]
        raise ValueError(f"{foreign}: its columns are {shown}, expected {list(LOG_FIELDS)}; "
                         f"{advice}")
    for line, record in enumerate(records, 2):
        try:
            if None in record or None in record.values():
                raise ValueError("wrong number of fields")
            row = {k: float(v) if v else None for k, v in record.items()}
            row["step"] = int(record["step"])
        except ValueError:
            shown = _one_line(str(list(record.values())))[:200]
            raise ValueError(f"{path} line {line}: not a row of numbers: {shown}; "
                             f"{advice}") from None
        if row["step"] <= up_to_step:
            rows.append(row)
    return rows


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


class TapeWatch:
    """What the tape's disk tier did in a run: per step (the steady state: after the
    first step, as the median time), bytes written to the spill file and read back,
    the time the forward pass waited on writes and the backward on reads, prefetch
    hits and misses; and the most bytes ever on disk and the spill file's largest size."""
    PER_STEP = ("bytes_written", "bytes_read", "io_wait_ns", "push_wait_ns",
                "prefetch_hits", "prefetch_misses", "state_bytes_read", "state_bytes_written",
                "state_wait_ns")

    def __init__(self, model):
        self.model = model
        self.first = self.last = None       # Tape.stats after the first and the last step
        self.steps = 0
        self.offload_first = self.offload_last = None
        self.offload_steps = 0

    def after_step(self):
        if self.model.moments is not None:
            self.offload_steps += 1
            self.offload_last = self.model.moments.stats()
            if self.offload_first is None:
                self.offload_first = self.offload_last
        stats = self.model.tape_stats
        if stats is None or stats["memory_budget"] is None:
            return
        self.steps += 1
        self.last = stats
        if self.first is None:
            self.first = stats

    def summary(self):
        """A dict for summary.json, or None when no budget was set."""
        if self.last is None:
            return None
        n = self.steps - 1 if self.steps > 1 else 1
        base = self.first if self.steps > 1 else dict.fromkeys(self.PER_STEP, 0)
        per = {k: (self.last[k] - base[k]) / n for k in self.PER_STEP}
        return {**{k: self.last[k] for k in ("memory_budget", "peak_spilled_bytes",
                                             "peak_spill_file_bytes")},
                "written_bytes_per_step": per["bytes_written"],
                "read_bytes_per_step": per["bytes_read"],
                "io_wait_ms_per_step": per["io_wait_ns"] / 1e6,
                "push_wait_ms_per_step": per["push_wait_ns"] / 1e6,
                "prefetch_hits_per_step": per["prefetch_hits"],
                "prefetch_misses_per_step": per["prefetch_misses"],
                # offloaded model state through the same tape's I/O thread
                "state_read_bytes_per_step": per["state_bytes_read"],
                "state_written_bytes_per_step": per["state_bytes_written"],
                "state_wait_ms_per_step": per["state_wait_ns"] / 1e6}

    def offload_summary(self):
        """The offloaded moments' traffic per step (after the first), or None."""
        last = self.offload_last
        if last is None:
            return None
        n = max(1, self.offload_steps - 1)
        base = self.offload_first if self.offload_steps > 1 else dict.fromkeys(last, 0)
        per = {k: (last[k] - base[k]) / n for k in ("bytes_read", "bytes_written",
                                                      "read_wait_ns", "prefetch_misses")}
        return {"state": self.model.offload, "file_bytes": last["file_bytes"],
                "window_bytes": last["window_bytes"],
                "read_bytes_per_step": per["bytes_read"],
                "written_bytes_per_step": per["bytes_written"],
                "read_wait_ms_per_step": per["read_wait_ns"] / 1e6,
                "units_waited_per_step": per["prefetch_misses"]}

    @staticmethod
    def describe_offload(o):
        what = "AdamW moments" if o["state"] == "moments" else "model state"
        return (f"{what} on disk ({format_size(o['file_bytes'])} file, "
                f"{format_size(o['window_bytes'])} window in RAM): per step "
                f"{format_size(o['read_bytes_per_step'])} read and "
                f"{format_size(o['written_bytes_per_step'])} written, the update waited "
                f"{o['read_wait_ms_per_step']:.0f} ms on reads")

    @staticmethod
    def describe(t):
        hits, misses = t["prefetch_hits_per_step"], t["prefetch_misses_per_step"]
        rate = f"{hits / (hits + misses):.0%}" if hits + misses else "-"
        return (f"tape (budget {format_size(t['memory_budget'])}): per step "
                f"{format_size(t['written_bytes_per_step'])} written to the spill file and "
                f"{format_size(t['read_bytes_per_step'])} read back, the forward waited "
                f"{t['push_wait_ms_per_step']:.0f} ms on writes and the backward "
                f"{t['io_wait_ms_per_step']:.0f} ms on reads, prefetch hits {rate}; at most "
                f"{format_size(t['peak_spilled_bytes'])} on disk, in a spill file of at most "
                f"{format_size(t['peak_spill_file_bytes'])}")


class Interrupted(BaseException):
    """The run stopped on SIGINT or SIGTERM.  ``message`` is the one line to print; the exit
    status is 128 + ``signum``.  ``at_once``: a second signal, raised wherever the run was."""

    def __init__(self, signum, message, at_once=False):
        super().__init__(message)
        self.signum, self.message, self.at_once = signum, message, at_once

    @property
    def exit_status(self):
        return 128 + self.signum

    @property
    def every_rank(self):
        """Over MPI, a first signal stops every rank after the same step."""
        return not self.at_once


class StopSignals:
    """While active, the first SIGINT or SIGTERM only records itself (``signum``), so the
    training loop can finish its step and save; a second one raises ``Interrupted`` at once.
    Signals are counted as they arrive, from a wakeup pipe (Python's C-level handler writes
    a byte for each): two that come while the main thread is inside one long call (a large
    checkpoint's write) reach the Python handler as one call, and still count as two.
    The handlers and wakeup descriptor in force before are restored on exit.  Signals reach
    the main thread only: elsewhere this does nothing."""
    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum = None
        self._previous = {}
        self._pipe = None
        self._previous_wakeup = -1
        self._stopped = False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._pipe = os.pipe()
            for fd in self._pipe:
                os.set_blocking(fd, False)
            self._previous_wakeup = signal.set_wakeup_fd(self._pipe[1],
                                                         warn_on_full_buffer=False)
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None

    def _arrived(self):
        """Our signals delivered since the last call, in order."""
        data = b""
        while True:
            try:
                chunk = os.read(self._pipe[0], 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
        return [s for s in data if s in self.SIGNALS]

    def _handle(self, signum, frame):
        if self._stopped:       # part of the stop already under way
            return
        others = self._arrived()
        if signum in others:
            others.remove(signum)
        if self.signum is None:
            # Python calls the handlers of signals that came together in the order of their
            # numbers: this call's is the first.
            self.signum = signum
            if not others:
                return
            signum = others[0]
        self._stopped = True
        name, first = signal.Signals(signum).name, signal.Signals(self.signum).name
        raise Interrupted(signum, f"{name} {'again' if name == first else 'after ' + first}: "
                                  f"stopped at once", at_once=True)


class SaveSchedule:
    """When the training loop saves a checkpoint besides the end of the run: every
    ``interval`` steps, never (0), or with ``interval=None`` whenever the training time
    since the last save reaches ``COST_RATIO`` times what that save took, so that saving
    costs at most 1/COST_RATIO of the run.  Before the first save its time is estimated
    from the checkpoint's size at a pessimistic ``ASSUMED_WRITE_RATE``."""
    COST_RATIO = 200
    ASSUMED_WRITE_RATE = 200e6      # bytes/s

    def __init__(self, interval, checkpoint_bytes):
        self.interval = interval
        self.last_save_s = checkpoint_bytes / self.ASSUMED_WRITE_RATE
        self.since_save_s = 0.0
        self.saves = 0
        self.save_s = 0.0

    def due(self, step, step_s):
        """Whether to save after ``step`` steps, the last of which took ``step_s``."""
        self.since_save_s += step_s
        if self.interval is None:
            return self.since_save_s >= self.COST_RATIO * self.last_save_s
        return bool(self.interval) and step % self.interval == 0

    def saved(self, seconds):
        self.saves += 1
        self.save_s += seconds
        self.last_save_s = seconds
        self.since_save_s = 0.0

    def summary(self):
        return {"interval": "auto" if self.interval is None else self.interval,
                "saves": self.saves, "seconds": self.save_s}


class RunLog:
    """log.csv of the run: the history kept from before a resume, then one row per step,
    each flushed as it is written, so a crash loses no finished step.  Without a path
    (the ranks other than 0 of a data-parallel run) it only keeps the rows."""

    def __init__(self, path, history):
        self.rows = list(history)
        self._file = None
        if path is None:
            return
        from gpt2.checkpoint import atomic_writer
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=LOG_FIELDS)
        writer.writeheader()
        writer.writerows(history)
        # Atomic: on a resume the history being rewritten is the file's own.
        with atomic_writer(path) as f:
            f.write(text.getvalue().encode("utf-8"))
        self._file = open(path, "a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=LOG_FIELDS)

    def append(self, row):
        if self._file is not None:
            self._writer.writerow(row)
            self._file.flush()
        self.rows.append(row)

    def close(self):
        if self._file is not None:
            self._file.close()


def main(argv=None):
    """Console entry point: train; returns the exit status (2 on a bad option or input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is None:    # the process's own entry point: it may re-execute itself
        from kernels import blas_dispatch
        blas_dispatch.ensure()
    try:
        _load_the_run()
        _run(args, explicit_options(argv))
    except UsageError as e:
        if args.debug:
            raise
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        if e.message:
            print(f"{parser.prog}: {e.message}"
                  + (_last_checkpoint(args) if e.at_once else ""), file=sys.stderr, flush=True)
        return e.exit_status
    except KeyboardInterrupt:   # outside the training loop, which handles its own
        print(f"{parser.prog}: interrupted by SIGINT{_last_checkpoint(args)}", file=sys.stderr,
              flush=True)
        return 128 + signal.SIGINT
    return 0


def _load_the_run():
    """Import the modules a run uses; from then on SIGINT raises KeyboardInterrupt again,
    which main() reports in one line (with the last checkpoint) and the training loop
    replaces by its own handler (StopSignals)."""
    import numpy  # noqa: F401
    import tqdm  # noqa: F401

    from gpt2 import checkpoint, data, distributed, model  # noqa: F401
    from kernels import _openmp, threads  # noqa: F401
    if signal.getsignal(signal.SIGINT) is _exit_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _last_checkpoint(args):
    """'; <where the last checkpoint is and its step>' after a stop that saved nothing."""
    from gpt2 import checkpoint as ckpt
    path = os.path.join(args.out_dir or DEFAULT_OUT_DIR, "checkpoint.bin")
    try:
        step = ckpt.read_checkpoint_header(path).step
    except (OSError, ValueError):
        return "; no checkpoint was saved"
    return f"; the last checkpoint, at step {step}, is {path}"


def run(argv=None):
    """Train as the command line ``argv`` says; returns the run's summary (also in
    summary.json), or None when a resumed run has no steps left.

    Raises UsageError for a bad option or input. Flush-to-zero is set for the run (unless
    --no-flush-denormal) and the previous floating-point mode is restored afterwards, in this
    thread and the OpenMP pool.
    """
    return _run(build_parser().parse_args(argv), explicit_options(argv))


@dataclasses.dataclass
class RunInputs:
    """Everything a run starts from, checked before anything is written or computed."""

    config: object
    model_name: str
    params: object          # ParamArena of --init-from, or None
    resumed: object         # checkpoint.Checkpoint header of --resume, or None
    history: list           # log rows of the resumed run up to its checkpoint
    tokens: object
    tokenizer: object
    prompt_ids: list
    train: object           # DataLoader, at the resumed position
    val: object             # DataLoader, or None without evaluation
    plan: object = None     # gpt2.perfmodel.plan.MemoryPlan of --max-memory, or None
    memory_from_checkpoint: tuple = ()  # the memory options --resume took from the checkpoint
    precision: tuple = ("fp32", "")   # (the products' precision, why), set by _run


def _run(args, explicit):
    from gpt2 import distributed
    with blame("--data-parallel", (ValueError, ImportError)):
        comm = distributed.world_from_args(args)
    inputs = _prepare(args, explicit, comm)
    if inputs is None:
        return None
    from adtape import nn
    from kernels import _openmp, threads
    ftz_before = _openmp.flush_denormal_enabled()
    # FTZ/DAZ first: threads started later inherit this thread's MXCSR.
    _openmp.set_flush_denormal(not args.no_flush_denormal)
    n_threads = None
    try:
        # Every step frees and reallocates the same large buffers: keep them mapped.
        _openmp.set_malloc_retention()
        with blame("--threads"):
            n_threads = threads.set_num_threads(args.threads)
        _openmp.set_flush_denormal(not args.no_flush_denormal, n_threads)
        with distributed.abort_on_error(comm, debug=args.debug):
            inputs.precision = _choose_precision(args, n_threads)
            previous_precision = nn.set_precision(inputs.precision[0])
            try:
                return _train(args, inputs, n_threads, comm)
            finally:
                nn.set_precision(previous_precision)
    finally:
        if n_threads is None:  # the thread count was refused: OpenMP keeps its own
            _openmp.set_flush_denormal(ftz_before)
        else:
            _openmp.set_flush_denormal(ftz_before, n_threads)


def _choose_precision(args, n_threads):
    """(precision, reason) of --precision; "auto" and the manual engine (fp32 only) and
    --offload all (fp32 only) take fp32 without a probe where bf16 is not theirs."""
    from gpt2 import precision
    if args.precision == "auto" and (args.engine != "tape" or args.offload == "all"):
        return "fp32", "auto: bf16 runs on the tape engine without --offload all"
    with blame("--precision"):
        return precision.choose(args.precision, n_threads)


def _prepare(args, explicit, comm=None):
    """Check the options and read the inputs; None when a resumed run has nothing left to do."""
    from gpt2 import checkpoint as ckpt
    from gpt2.data import DataLoader, split_sizes
    resumed, memory_from_checkpoint = None, ()
    if args.resume:
        if args.init_from:
            raise UsageError("--resume and --init-from exclude each other: the checkpoint "
                             "holds the weights")
        with blame("--resume"):
            resumed = ckpt.read_checkpoint_header(args.resume)
        saved = (resumed.extra or {}).get("args") or {}
        for name in RESUMED_OPTIONS:
            if name in saved and name not in explicit:
                setattr(args, name, saved[name])
        memory_from_checkpoint = _restore_memory_policy(args, explicit, saved)
        if args.decay_steps is None and "steps" in saved:
            # Saved before --decay-steps existed: that run decayed over its own --steps.
            args.decay_steps = saved["steps"]
        if args.out_dir is None:
            args.out_dir = os.path.dirname(args.resume) or "."
        if resumed.step >= args.steps:
            print(f"{args.resume} is at step {resumed.step} of --steps {args.steps}: nothing "
                  f"left to do (pass a larger --steps to train further); "
                  f"{args.out_dir} is unchanged", flush=True)
            return None
    if args.out_dir is None:
        args.out_dir = DEFAULT_OUT_DIR
    if args.decay_steps is None:
        args.decay_steps = args.steps
    if not args.overwrite:
        _refuse_another_runs_output(args)
    if args.save_hf:
        _check_save_hf(args)
    if args.val_fraction == 0 and args.eval_interval:
        raise UsageError(f"--val-fraction 0 leaves no validation data for --eval-interval "
                         f"{args.eval_interval}: pass --eval-interval 0 too, or a fraction in "
                         f"(0, 1)")
    if args.spill_dir is not None and not os.path.isdir(args.spill_dir):
        saved = "spill_dir" in memory_from_checkpoint
        problem = "not a directory" if os.path.exists(args.spill_dir) else "no such directory"
        raise UsageError(f"--spill-dir {args.spill_dir}"
                         + (f" (from the checkpoint): {problem}; pass --spill-dir to choose "
                            f"another" if saved else f": {problem}"))

    if comm is not None and comm.Get_size() > 1 and args.offload == "all":
        raise UsageError("--offload all trains in one process: under mpiexec use --offload "
                         "moments")
    if args.offload == "all" and (args.engine != "tape" or args.checkpointing != "none"):
        raise UsageError("--offload all runs on the tape engine without --checkpointing: "
                         "leave out " + ("--engine manual" if args.engine != "tape"
                                         else f"--checkpointing {args.checkpointing}"))
    if args.precision == "bf16" and (args.engine != "tape" or args.offload == "all"):
        raise UsageError("--precision bf16 runs on the tape engine without --offload all: "
                         "leave out " + ("--engine manual" if args.engine != "tape"
                                         else "--offload all"))
    config, params, model_name = _model_config(args, explicit, resumed)
    if args.seq_len is None:
        args.seq_len = min(128, config.block_size)
    if args.seq_len > config.block_size:
        raise UsageError(f"-T {args.seq_len} exceeds the model's block_size {config.block_size}")
    if args.max_memory is not None:
        clash = [f"--{n.replace('_', '-')}" for n in ("tape_budget", "checkpointing", "snapshots",
                                                      "offload")
                 if n in explicit]
        if clash:
            raise UsageError(f"--max-memory chooses the memory policy itself: leave out "
                             f"{' and '.join(clash)}")
        if args.engine != "tape":
            raise UsageError("--max-memory plans the tape engine's memory: leave out "
                             "--engine manual")
    _check_snapshots(args, explicit, config)
    tokens, tokenizer = load_tokens(args)
    if tokens.size and int(tokens.max()) >= config.vocab_size:
        raise UsageError(f"the data has token id {int(tokens.max())}, outside the model's "
                         f"vocabulary of {config.vocab_size}; use a matching --tokenizer")
    needed = args.batch_size * args.seq_len + 1
    n_train, n_val = split_sizes(tokens.size, args.val_fraction)
    for split, n, wanted in (("training", n_train, True),
                             ("validation", n_val, bool(args.eval_interval))):
        if wanted and n < needed:
            raise UsageError(f"the {split} data has {n} tokens, too few for one batch of "
                             f"-B {args.batch_size} x -T {args.seq_len} (needs {needed}); use a "
                             f"smaller -B or -T, more data, or another --val-fraction")
    prompt_ids = tokenizer.encode(args.prompt).tolist() if args.sample_tokens else []
    if prompt_ids and max(prompt_ids) >= config.vocab_size:
        raise UsageError(f"--prompt {args.prompt!r} has token id {max(prompt_ids)}, outside "
                         f"the model's vocabulary of {config.vocab_size}; use a matching "
                         f"--tokenizer, or --sample-tokens 0")
    train = DataLoader(tokens, args.batch_size, args.seq_len, config.vocab_size, split="train",
                       val_fraction=args.val_fraction, seed=args.seed)
    if resumed is not None and resumed.data_state:
        with blame("--resume"):
            train.load_state(resumed.data_state)
    val = None
    if args.eval_interval:
        val = DataLoader(tokens, args.batch_size, args.seq_len, config.vocab_size, split="val",
                         val_fraction=args.val_fraction, shuffle=False, seed=args.seed)
    plan = None
    if args.max_memory is not None:
        import psutil
        from tqdm import tqdm  # noqa: F401  (loaded before the baseline is taken)

        import gpt2.model  # noqa: F401
        import gpt2.tape_engine  # noqa: F401
        from gpt2.perfmodel.plan import plan_memory
        # RuntimeError: the first use's calibration of this machine failed.
        with blame("--max-memory", INPUT_ERRORS + (RuntimeError,)):
            ranks = comm.Get_size() if comm is not None else 1
            plan = plan_memory(config, max(1, args.batch_size // ranks), args.seq_len,
                               args.max_memory,
                               spill_dir=args.spill_dir, threads=args.threads,
                               baseline_bytes=psutil.Process().memory_info().rss,
                               # auto's choice is made later: plan for fp32, the larger
                               precision="bf16" if args.precision == "bf16" else "fp32")
    history = []
    if resumed is not None:
        # The run's log lies beside its checkpoint; rows past the checkpoint will be redone.
        with blame("--resume"):
            history = read_log(os.path.join(os.path.dirname(args.resume) or ".", "log.csv"),
                               resumed.step)
    return RunInputs(config=config, model_name=model_name, params=params, resumed=resumed,
                     history=history, tokens=tokens, tokenizer=tokenizer, prompt_ids=prompt_ids,
                     train=train, val=val, plan=plan,
                     memory_from_checkpoint=memory_from_checkpoint)


RUN_OUTPUTS = ("checkpoint.bin", "log.csv", "summary.json", "loss.png")


def _resumes_in_place(args):
    """Whether --out-dir is the directory of the --resume checkpoint (the run's own)."""
    return bool(args.resume) and (os.path.abspath(os.path.dirname(args.resume) or ".")
                                  == os.path.abspath(args.out_dir))


def _refuse_another_runs_output(args):
    """A UsageError if --out-dir holds the output of a run other than the one resumed."""
    if _resumes_in_place(args):
        return
    found = [n for n in RUN_OUTPUTS if os.path.exists(os.path.join(args.out_dir, n))]
    if not found:
        return
    checkpoint = os.path.join(args.out_dir, "checkpoint.bin")
    what = found[0]
    if "checkpoint.bin" in found:
        from gpt2 import checkpoint as ckpt
        try:
            what = f"checkpoint.bin at step {ckpt.read_checkpoint_header(checkpoint).step}"
        except (OSError, ValueError):
            pass
    advice = f"continue it with --resume {checkpoint}, " if "checkpoint.bin" in found else ""
    raise UsageError(f"--out-dir {args.out_dir} holds another run ({what}); {advice}pass "
                     f"--overwrite to replace it, or choose another --out-dir")


def _check_save_hf(args):
    """A UsageError, before any training, if --save-hf cannot be a model directory or holds
    another model's weights (which --overwrite replaces at the end of the run)."""
    from gpt2 import hf
    if os.path.exists(args.save_hf) and not os.path.isdir(args.save_hf):
        raise UsageError(f"--save-hf {args.save_hf}: not a directory")
    with blame(f"--save-hf {args.save_hf}", (OSError,)):
        found = hf.weight_files(args.save_hf)
    if found and not args.overwrite:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise UsageError(f"--save-hf {args.save_hf} holds another model's weights ({shown}); "
                         f"pass --overwrite to replace them, or choose another --save-hf")


def _restore_memory_policy(args, explicit, saved):
    """Set the memory options not given again to the resumed run's (``saved``: its options,
    from the checkpoint; older checkpoints may lack some), one by one as RESUMED_OPTIONS
    are; returns the names of those that changed.  A saved --max-memory is planned again
    (its choices are not taken) unless the command line sets the policy itself, and a
    given --max-memory takes none of the saved policy.  --spill-dir is taken where the
    saved run used the disk."""
    planning = "max_memory" in explicit
    restored = []
    for name in MEMORY_OPTIONS:
        if name not in saved or name in explicit:
            continue
        if name == "max_memory" and any(n in explicit for n in PLANNED_OPTIONS):
            continue
        if name in PLANNED_OPTIONS and (planning or (saved.get("max_memory") is not None
                                                     and args.max_memory == saved["max_memory"])):
            continue
        if name == "snapshots" and args.checkpointing != "binomial":
            continue
        if name == "spill_dir" and saved.get("offload") in (None, "none") and all(
                saved.get(n) is None for n in ("tape_budget", "max_memory")):
            continue
        if getattr(args, name) != saved[name]:
            setattr(args, name, saved[name])
            restored.append(name)
    return tuple(restored)


def _check_snapshots(args, explicit, config):
    """--snapshots only with binomial checkpointing, and fewer than the model's layers."""
    if "snapshots" in explicit and args.checkpointing != "binomial":
        raise UsageError(f"--snapshots applies to --checkpointing binomial only (this run: "
                         f"--checkpointing {args.checkpointing})")
    if args.checkpointing == "binomial" and args.snapshots >= config.n_layer:
        most = config.n_layer - 1
        raise UsageError(f"--snapshots {args.snapshots}: binomial checkpointing of "
                         f"{config.n_layer} layers keeps at most {most} snapshot"
                         f"{'s' if most != 1 else ''} (one per layer boundary; to store every "
                         f"layer's input, use --checkpointing layer)")


def _model_config(args, explicit, resumed):
    """(config, params or None, what the model is called): from --resume, --init-from or --model."""
    from gpt2 import checkpoint as ckpt
    from gpt2.config import preset
    params = None
    if resumed is not None:
        config, source = resumed.config, args.resume
    elif args.init_from:
        if os.path.isdir(args.init_from):
            from gpt2 import hf
            with blame("--init-from"):
                params = hf.load_dir(args.init_from)
        elif args.init_from.endswith(".bin"):
            with blame("--init-from"):
                params = ckpt.import_llmc(args.init_from)
        else:
            with blame("--init-from"):
                ckpt.SafetensorsFile(args.init_from)
            # The weights do not tell n_head; Hugging Face keeps it in config.json.
            if not os.path.exists(ckpt.hf_config_path(args.init_from)):
                raise UsageError(f"--init-from {args.init_from}: a safetensors file needs the "
                                 f"model's config.json (from the same Hugging Face repository) "
                                 f"beside it, at {ckpt.hf_config_path(args.init_from)}")
            with blame("--init-from"):
                params = ckpt.import_hf_gpt2(args.init_from)
        config, source = params.config, args.init_from
    else:
        return preset(args.model or DEFAULT_MODEL), None, args.model or DEFAULT_MODEL
    if "model" in explicit and preset(args.model) != config:
        raise UsageError(f"--model {args.model} does not match {source}, which holds "
                         f"{config.preset_name() or 'a model'} with "
                         + ", ".join(f"{k}={v}" for k, v in config.to_dict().items())
                         + "; leave --model out to use the file's sizes")
    return config, params, config.preset_name() or source


def _train(args, inputs, n_threads, comm=None):
    """The training run proper, with threads and floating-point mode already set."""
    from adtape import TapeCorruptionError
    from gpt2.model import Model
    if inputs.plan is not None:
        print(f"--max-memory {args.max_memory:,} bytes: {inputs.plan.describe()}", flush=True)
        policy = inputs.plan.engine_kwargs()
        args.tape_budget = policy["tape_kwargs"].get("memory_budget")
        args.checkpointing, args.snapshots = policy["checkpointing"], policy["snapshots"]
        args.offload = policy.get("offload") or "none"
    tape_kwargs = {}
    if args.tape_budget is not None:
        tape_kwargs["memory_budget"] = args.tape_budget
    if args.spill_dir is not None:
        tape_kwargs["spill_dir"] = args.spill_dir
    with blame("model"):
        model = Model(inputs.config, seed=args.seed, engine=args.engine, tape_kwargs=tape_kwargs,
                     checkpointing=args.checkpointing, snapshots=args.snapshots,
                     offload=None if args.offload == "none" else args.offload,
                     offload_dir=args.spill_dir)
    try:
        return _train_model(args, inputs, model, n_threads, comm)
    except TapeCorruptionError as e:
        # The disk gave back other bytes than it was given (spill or offload file): the run
        # cannot go on, and the last checkpoint, written before, is what is left.
        raise UsageError(f"{_one_line(e)}{_last_checkpoint(args)}") from e
    finally:
        model.close()


def _train_model(args, inputs, model, n_threads, comm=None):
    """Load the starting state, then the training loop, logging and saving as it goes."""
    from tqdm import tqdm

    from gpt2 import checkpoint as ckpt
    from gpt2 import distributed
    from gpt2.params import num_parameters as _num_parameters
    from kernels import blas_dispatch

    config, train, val = inputs.config, inputs.train, inputs.val
    if inputs.params is not None:
        model.set_params(inputs.params)
    # Over MPI: every rank trains its rows of the global batch; rank 0 alone writes.
    trainer = distributed.trainer_from_args(model, comm, args, inputs.tokens)
    writer = trainer is None or trainer.rank == 0
    start_step = 0
    if inputs.resumed is not None:
        with blame("--resume"):
            adam_m, adam_v = model.optimizer_moments()
            state = (trainer.load_checkpoint(args.resume) if trainer else
                     ckpt.load_checkpoint(args.resume, config, params=model.checkpoint_params(),
                                          adam_m=adam_m, adam_v=adam_v))
        model.adam_step = state.adam_step
        start_step = state.step
    ckpt_path = os.path.join(args.out_dir, "checkpoint.bin")
    with blame("--out-dir"):
        if writer:
            os.makedirs(args.out_dir, exist_ok=True)
            ckpt.remove_stale_temporaries(ckpt_path)
            if args.overwrite and not _resumes_in_place(args):
                for name in RUN_OUTPUTS:   # nothing of the replaced run may pass for this one's
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(args.out_dir, name))
        log = RunLog(os.path.join(args.out_dir, "log.csv") if writer else None, inputs.history)

    n_params = _num_parameters(config)
    print(f"{config.family_name} {inputs.model_name}: {n_params / 1e6:.2f}M parameters, "
          f"{config.describe()}; B={args.batch_size} "
          f"T={args.seq_len}, {n_threads} threads ({blas_dispatch.describe()}), "
          f"engine={args.engine}, precision {inputs.precision[0]} ({inputs.precision[1]}), "
          f"memory: "
          f"{describe_memory_policy(args, inputs.plan, inputs.memory_from_checkpoint)}, "
          f"corpus {inputs.tokens.size:,} tokens"
          + (f"; resuming at step {start_step}" if start_step else ""), flush=True)
    saved_args = dict(vars(args))
    for name in ("data", "tokenizer"):
        # The resumed run may start elsewhere: keep where the files are, not how they were named.
        if saved_args[name] not in (None, "bytes"):
            saved_args[name] = os.path.abspath(saved_args[name])
    if saved_args["spill_dir"] is not None:
        saved_args["spill_dir"] = os.path.abspath(saved_args["spill_dir"])

    # Parameters and both AdamW moments, in float32.
    schedule = SaveSchedule(args.checkpoint_interval, 12 * n_params)

    def save(step):
        t0 = time.perf_counter()
        model.finish_update()
        if trainer:  # collective: rank 0 gathers the sharded state and writes
            trainer.save_checkpoint(ckpt_path, step=step, data_state=train.state(),
                                    extra={"args": saved_args})
        else:
            adam_m, adam_v = model.optimizer_moments()
            ckpt.save_checkpoint(ckpt_path, model.checkpoint_params(), step=step, adam_m=adam_m,
                                 adam_v=adam_v, adam_step=model.adam_step,
                                 data_state=train.state(), extra={"args": saved_args})
        schedule.saved(time.perf_counter() - t0)

    def interrupted(signum, step):
        name = signal.Signals(signum).name
        if not writer:
            return Interrupted(signum, "")   # rank 0 says it
        if step == args.steps:      # the run is complete: nothing to continue
            saved = (([] if args.no_checkpoint else [ckpt_path])
                     + ([args.save_hf] if args.save_hf else []))
            return Interrupted(signum, f"interrupted by {name} at the end of the run (step "
                                       f"{step} of {args.steps}): "
                                       + (f"saved {' and '.join(saved)}" if saved
                                          else "no checkpoint (--no-checkpoint)")
                                       + "; skipped the summary, the plot and the sample")
        if args.no_checkpoint:
            return Interrupted(signum, f"interrupted by {name} after step {step} of "
                                       f"{args.steps}; no checkpoint (--no-checkpoint)")
        return Interrupted(signum, f"interrupted by {name} after step {step} of {args.steps}: "
                                   f"saved {ckpt_path}; continue with: {program_name()} "
                                   f"--resume {ckpt_path}")

    rows = []
    tape_watch = TapeWatch(model)
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(range(start_step, args.steps), initial=start_step, total=args.steps,
               disable=args.no_progress, unit="step", dynamic_ncols=True)
    loop_start = time.perf_counter()
    try:
        # A full disk (spill file, checkpoint, log) or memory is the machine's limit, not a
        # bug: one line. Anything else here is a bug and keeps its traceback.
        with StopSignals() as stop, blame("training", (OSError, MemoryError)):
            for step in bar:
                x, y = train.next_batch()
                lr = learning_rate(step, args)
                t0 = time.perf_counter()
                loss, norm = (trainer or model).train_step(x, y, lr,
                                                           weight_decay=args.weight_decay,
                                                           grad_clip=args.grad_clip or None)
                dt = time.perf_counter() - t0
                tape_watch.after_step()
                if not math.isfinite(loss):
                    raise UsageError(f"the loss became {loss} at step {step + 1}; try a lower "
                                     f"--lr")
                row = {"step": step + 1, "loss": loss, "lr": lr, "ms": dt * 1e3,
                       "tokens_per_s": tokens_per_step / dt,
                       "grad_norm": None if norm is None else float(norm), "val_loss": None}
                last = step + 1 == args.steps
                if val is not None and ((step + 1) % args.eval_interval == 0 or last):
                    val.reset()
                    row["val_loss"] = evaluate(model, val,
                                               min(args.eval_batches, val.num_batches))
                log.append(row)
                rows.append(row)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tokens_per_s']:.0f}",
                                ms=f"{row['ms']:.0f}")
                if args.no_progress and (step % 20 == 0 or last or row["val_loss"] is not None):
                    print(f"step {step + 1}/{args.steps} loss {loss:.4f} "
                          f"{row['tokens_per_s']:.0f} tok/s {row['ms']:.0f} ms"
                          + (f" val {row['val_loss']:.4f}" if row["val_loss"] is not None
                             else ""), flush=True)
                signum = stop.signum or 0
                due = not last and not args.no_checkpoint and schedule.due(step + 1, dt)
                if trainer:  # every rank stops or saves at the same step
                    signum, due = trainer.agree_max((signum, due and writer))
                if signum and not last:     # after the last step, the saves below
                    if not args.no_checkpoint:
                        save(step + 1)
                    raise interrupted(signum, step + 1)
                if due:
                    save(step + 1)
            if not args.no_checkpoint:
                save(args.steps)
            model.finish_update()
            if args.save_hf and writer:
                from gpt2 import hf
                with blame("--save-hf", (OSError, ValueError)):
                    hf.save_dir(args.save_hf, model.param_arena(), overwrite=args.overwrite)
            # A first signal during the last step or the final saves: they are done, the
            # summary and the sample are not.
            signum = stop.signum or 0
            if trainer:
                signum, _ = trainer.agree_max((signum, 0))
            if signum:
                raise interrupted(signum, args.steps)
    finally:
        bar.close()
        log.close()
    # The training's peak resident memory (the kernel's count), before the plot loads its
    # libraries.
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    checkpoints = dict(schedule.summary(), train_seconds=time.perf_counter() - loop_start)
    if not writer:
        return None
    return _finish(args, inputs, model, n_threads, log.rows, rows, start_step, peak_rss,
                   trainer, tape_watch.summary(), checkpoints, tape_watch.offload_summary())


def _finish(args, inputs, model, n_threads, all_rows, rows, start_step, peak_rss, trainer=None,
            tape=None, checkpoints=None, offload=None):
    """summary.json and loss.png of the whole run, then the sample."""
    import numpy as np
    config, tokenizer = inputs.config, inputs.tokenizer
    if all_rows:
        plot_losses(os.path.join(args.out_dir, "loss.png"), all_rows)
    # A run's first step includes one-time set-up; time the steady state.
    timed = [r["ms"] for r in rows[1:]] or [r["ms"] for r in rows]
    median_ms = float(np.median(timed)) if timed else None
    summary = {"model": inputs.model_name, "init_from": args.init_from, "resumed_from": args.resume,
               "config": config.to_dict(), "engine": args.engine,
               "precision": inputs.precision[0], "precision_reason": inputs.precision[1],
               "B": args.batch_size,
               "T": args.seq_len, "threads": n_threads, "start_step": start_step,
               "steps": args.steps,
               "first_loss": all_rows[0]["loss"] if all_rows else None,
               "final_loss": all_rows[-1]["loss"] if all_rows else None,
               "final_val_loss": next((r["val_loss"] for r in reversed(all_rows)
                                       if r["val_loss"] is not None), None),
               "median_ms_per_step": median_ms,
               "tokens_per_s": args.batch_size * args.seq_len / (median_ms / 1e3)
                               if median_ms else None}
    summary["peak_rss_bytes"] = peak_rss
    summary.update(ranks=trainer.size if trainer else 1, global_batch=args.batch_size,
                   zero=args.zero if trainer else 0, tape=tape)
    summary["memory_policy"] = memory_policy(args, inputs.plan, inputs.memory_from_checkpoint)
    summary["checkpoints"] = checkpoints
    summary["offload"] = offload
    if inputs.plan is not None:
        summary["memory_plan"] = {"policy": inputs.plan.policy, "max_memory": args.max_memory,
                                  "tape_budget": args.tape_budget,
                                  "checkpointing": args.checkpointing,
                                  "snapshots": args.snapshots, "offload": args.offload,
                                  "predicted_ms": inputs.plan.predicted_ms,
                                  "predicted_peak_bytes": inputs.plan.predicted_peak_bytes}
    print(f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"
          + (f" (validation {summary['final_val_loss']:.3f})"
             if summary["final_val_loss"] is not None else "")
          + f"; {median_ms:.0f} ms/step, {summary['tokens_per_s']:.0f} tokens/s; log, plot "
            f"and {'checkpoint' if not args.no_checkpoint else 'summary'} in {args.out_dir}/",
          flush=True)
    if tape is not None:
        print(TapeWatch.describe(tape), flush=True)
    if offload is not None:
        print(TapeWatch.describe_offload(offload), flush=True)
    if inputs.plan is not None and median_ms is not None:
        print(f"--max-memory: {inputs.plan.compare(median_ms, peak_rss)}", flush=True)
    summary["sample_tokens_per_s"] = None
    if args.sample_tokens:
        ids, seconds = sample(model, inputs.prompt_ids, args.sample_tokens, args.temperature,
                              args.top_k, np.random.default_rng(args.seed))
        summary["sample_tokens_per_s"] = args.sample_tokens / seconds
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if args.sample_tokens:
        print("----- sample -----")
        if max(ids) >= tokenizer.vocab_size:
            print(f"(token ids: the model's vocabulary has {config.vocab_size} tokens, the "
                  f"{'byte' if args.tokenizer in (None, 'bytes') else 'given'} tokenizer "
                  f"{tokenizer.vocab_size}; pass --tokenizer with the model's tokenizer.json, "
                  f"tokenizer.model or tiktoken file (r50k_base.tiktoken for GPT-2) to see "
                  f"text)")
            print(" ".join(map(str, ids)))
        else:
            print(tokenizer.decode(ids))
        print(f"({args.sample_tokens} tokens in {seconds:.2f} s, "
              f"{summary['sample_tokens_per_s']:.1f} tokens/s)")
        print("------------------")
    return summary


if __name__ == "__main__":
    sys.exit(main())
