"""The gpt2-train command (python -m gpt2.train): prepares a run from its options
(gpt2.train_options), trains the model with its log and reports (gpt2.run_log), stops and
saves on signals and on a schedule (gpt2.stopping), and prints the summary and a sample.
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

import contextlib
import dataclasses
import json
import math
import time

from gpt2.units import SIZE_SUFFIXES, format_size, parse_size, peak_rss_bytes  # noqa: F401  (gpt2.train's names)

from gpt2.run_log import (LOG_FIELDS, RunLog, TapeWatch, exceeded_line, plot_losses,  # noqa: F401
                          read_log)
from gpt2.stopping import Interrupted, SaveSchedule, StopSignals  # noqa: F401
from gpt2.train_options import (  # noqa: F401  (gpt2.train's names)
    DEFAULT_MODEL, DEFAULT_OUT_DIR, INPUT_ERRORS, MEMORY_OPTIONS, PLANNED_OPTIONS,
    RESUMED_OPTIONS, UsageError, _one_line, blame, build_parser, describe_memory_policy,
    explicit_options, memory_policy, program_name)


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


def load_tokens(args, config=None):
    """(tokens, tokenizer) for --data/--tokenizer, or the built-in corpus; the tokens are
    ``gpt2.data.Examples`` for a JSONL file of chat or prompt/completion records, whose
    chat template is the tokenizer directory's.

    Without --tokenizer, an --init-from model directory's own tokenizer (tokenizer.json,
    else tokenizer.model) is used, and args.tokenizer names it so that --resume reads it too.
    A directory without one whose vocabulary (``config``) is wider than bytes is refused.
    """
    from gpt2 import data, tokenizer as tok
    given = args.tokenizer is not None
    if not given and args.init_from and os.path.isdir(args.init_from):
        args.tokenizer = tok.find_tokenizer(args.init_from)
        if args.tokenizer is None and config is not None and config.vocab_size > 256:
            raise UsageError(f"--init-from {args.init_from} has no tokenizer (tokenizer.json "
                             f"or tokenizer.model) and a vocabulary of {config.vocab_size} "
                             f"tokens, not bytes: pass --tokenizer with the model's tokenizer "
                             f"file (or --tokenizer bytes to train on bytes anyway)")
    if args.tokenizer in (None, "bytes"):
        tokenizer = tok.ByteTokenizer()
    else:
        with blame("--tokenizer" if given else f"--init-from {args.init_from}",
                   INPUT_ERRORS + (ImportError,)):
            # A directory: its tokenizer file, which --resume and --save-hf then read.
            args.tokenizer = tok.tokenizer_file(args.tokenizer)
            tokenizer = tok.load_tokenizer(args.tokenizer)
    if args.data is None:
        with blame("--corpus-bytes"):
            return data.default_corpus_tokens(tokenizer, max_bytes=args.corpus_bytes), tokenizer
    with blame("--data", INPUT_ERRORS + (ImportError,)):
        return data.read_data(args.data, tokenizer, _tokenizer_dir(args)), tokenizer


def _tokenizer_dir(args):
    """The directory of the run's tokenizer file (its tokenizer_config.json: special tokens,
    chat template), or None for bytes."""
    return (os.path.dirname(os.path.abspath(args.tokenizer))
            if args.tokenizer not in (None, "bytes") else None)


def sample(model, prompt_ids, n_tokens, temperature, top_k, rng, stop_ids=()):
    """Autoregressive sampling with temperature (0: the likeliest token) and top-k, with a
    key/value cache (gpt2.generate), until one of ``stop_ids``; returns (every token id,
    the seconds it took)."""
    from gpt2.generate import generate
    t0 = time.perf_counter()
    ids = generate(model, prompt_ids, n_tokens, temperature, top_k, rng, stop_ids=stop_ids)
    return ids, time.perf_counter() - t0


# The sample's start where the tokenizer has no beginning-of-sequence token (bytes).
DEFAULT_BYTE_PROMPT = "\n"


def _sample_start(args, tokenizer):
    """(the sample's prompt ids, the ids that end it, whether it starts from BOS): --prompt's
    text (a Hugging Face tokenizer adding what its post-processor adds, as gpt2-generate
    does), else the tokenizer's beginning-of-sequence token, else a newline; it ends at the
    tokenizer's (and the --init-from directory's) end-of-sequence tokens."""
    from gpt2 import chat
    from gpt2 import tokenizer as tok
    from gpt2.generate import sequence_ids
    tokenizer_dir = _tokenizer_dir(args)
    model_dir = args.init_from if args.init_from and os.path.isdir(args.init_from) else None
    with blame("the tokenizer's special tokens"):
        special = chat.special_tokens(tokenizer_dir) if tokenizer_dir else {}
        stop_ids, bos = sequence_ids(tokenizer, special, model_dir)
    if args.prompt:
        with blame("--prompt"):
            if isinstance(tokenizer, tok.HFTokenizer):
                return tokenizer.encode(args.prompt, add_special_tokens=True).tolist(), stop_ids, False
            return tokenizer.encode(args.prompt).tolist(), stop_ids, False
    if bos is not None:
        return [bos], stop_ids, True
    return tokenizer.encode(DEFAULT_BYTE_PROMPT).tolist(), stop_ids, False


def _describe_tokenizer(args, tokenizer, config):
    """The header's line naming the tokenizer and its vocabulary, and a warning where the
    model's vocabulary dwarfs it (rows of the embedding no token ever trains)."""
    name = ("bytes" if args.tokenizer in (None, "bytes")
            else f"{args.tokenizer} ({type(tokenizer).__name__})")
    lines = [f"tokenizer: {name}, {tokenizer.vocab_size:,} tokens; the model's vocabulary: "
             f"{config.vocab_size:,}"]
    extra = config.vocab_size - tokenizer.vocab_size
    if config.vocab_size > 2 * tokenizer.vocab_size and extra > 256:
        lines.append(f"warning: the model's vocabulary has {config.vocab_size:,} tokens, the "
                     f"tokenizer {tokenizer.vocab_size:,}: {extra:,} of its embedding rows never "
                     f"train; pass --tokenizer with the model's tokenizer (a tokenizer.json, "
                     f"tokenizer.model, r50k_base.tiktoken for GPT-2, or a directory holding one)")
    return lines


def evaluate(model, loader, n_batches):
    """The mean loss over the next ``n_batches`` of ``loader``: each batch's mean weighted
    by its targets that count (all of them, but for examples' IGNORE_INDEX)."""
    import numpy as np
    from adtape.nn import loss_denominator
    losses, counts = [], []
    for _ in range(n_batches):
        x, y = loader.next_batch()
        _, loss = model.forward(x, y, logits=False)
        losses.append(loss)
        counts.append(loss_denominator(y))
    return float(np.average(losses, weights=counts))


def _describe_validation(args, val):
    """The header's line on what each evaluation covers of the validation split."""
    from gpt2.data import ExampleLoader
    from gpt2.evaluate import describe_coverage
    B, T, n_tokens = args.batch_size, args.seq_len, val.tokens.size
    n_batches = min(args.eval_batches, val.num_batches)
    split = (f"--val-data {args.val_data}" if args.val_data is not None
             else f"the last {100 * args.val_fraction:g}% of the data")
    if isinstance(val, ExampleLoader):
        n_examples = val.num_windows
        return (f"validation: {n_batches:,} batch{'es' if n_batches != 1 else ''} of {B} "
                f"examples = {n_batches * B:,} of {n_examples:,} "
                f"({100 * n_batches * B / n_examples:.1f}%) of {split}, every "
                f"{args.eval_interval} steps and at the end; the loss of their trained "
                f"tokens")
    text = (f"validation: {describe_coverage(n_batches, B, T, n_tokens)} of {split}, every "
            f"{args.eval_interval} steps and at the end")
    if n_batches < val.num_batches:
        text += (f"; --eval-batches {val.num_batches} would cover "
                 f"{100 * val.num_batches * B * T / n_tokens:.1f}%")
    return text


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
    # Where the weights came from, for --save-hf: {"directory": the Hugging Face directory
    # or None, "dtype": its weights' format (the default of --save-dtype)}.
    export_source: dict = dataclasses.field(default_factory=lambda: dict(NO_EXPORT_SOURCE))
    own_save_hf: bool = False   # --save-hf is the resumed run's own: its weights are replaced
    lora: object = None         # the run's gpt2.lora.LoraConfig, or None: every weight trains
    precision: tuple = ("fp32", "")   # (the products' precision, why), set by _run
    stop_ids: tuple = ()    # the sample ends after one of these (end-of-sequence) ids
    from_bos: bool = False  # the sample starts from the tokenizer's BOS, not --prompt's text


# The export source of a model from scratch, an llm.c file, or a checkpoint saved before
# checkpoints recorded theirs.
NO_EXPORT_SOURCE = {"directory": None, "dtype": "fp32"}


def _run(args, explicit):
    from gpt2 import distributed
    with blame("--data-parallel", (ValueError, ImportError)):
        comm = distributed.world_from_args(args)
    with distributed.fail_together(comm, UsageError):   # one line from mpiexec's ranks
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
    resumed, memory_from_checkpoint, own_save_hf = None, (), False
    if args.resume:
        resumed, memory_from_checkpoint, own_save_hf = _resume_options(args, explicit, comm)
        if resumed is None:
            return None
    _check_options(args, explicit, comm, resumed, memory_from_checkpoint, own_save_hf)
    config, params, model_name, export_source = _model_config(args, explicit, resumed)
    lora = _lora_config(args, explicit, config, resumed)
    if lora is not None and resumed is not None:
        params = _lora_base(args, resumed)
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
    tokens, tokenizer = load_tokens(args, config)
    if args.save_gguf:
        _check_save_gguf(args, config)
    _check_ids(tokens, "the data", config)
    val_tokens = _validation_tokens(args, config, tokens, tokenizer)
    prompt_ids, stop_ids, from_bos = ([], (), False)
    if args.sample_tokens:
        prompt_ids, stop_ids, from_bos = _sample_start(args, tokenizer)
    if prompt_ids and max(prompt_ids) >= config.vocab_size:
        raise UsageError(f"--prompt {args.prompt!r} has token id {max(prompt_ids)}, outside "
                         f"the model's vocabulary of {config.vocab_size}; use a matching "
                         f"--tokenizer, or --sample-tokens 0")
    train, val = _loaders(args, config, tokens, val_tokens, resumed)
    plan = None
    if args.max_memory is not None:
        plan = _memory_plan(args, config, comm, lora, params)
    history = []
    if resumed is not None:
        # The run's log lies beside its checkpoint; rows past the checkpoint will be redone.
        with blame("--resume"):
            history = read_log(os.path.join(os.path.dirname(args.resume) or ".", "log.csv"),
                               resumed.step)
    return RunInputs(config=config, model_name=model_name, params=params, resumed=resumed,
                     history=history, tokens=tokens, tokenizer=tokenizer, prompt_ids=prompt_ids,
                     stop_ids=stop_ids, from_bos=from_bos, train=train, val=val, plan=plan,
                     memory_from_checkpoint=memory_from_checkpoint, export_source=export_source,
                     own_save_hf=own_save_hf, lora=lora)


def _resume_options(args, explicit, comm):
    """--resume: the checkpoint's header, with the saved run's options taken where this
    command line leaves them out.  Returns (header, the memory options taken from it,
    whether --save-hf is the run's own), or a header of None when the run is done (its
    export written where asked)."""
    from gpt2 import checkpoint as ckpt
    if args.init_from:
        raise UsageError("--resume and --init-from exclude each other: the checkpoint "
                         "holds the weights")
    with blame("--resume"):
        resumed = ckpt.read_checkpoint_header(args.resume)
    saved = (resumed.extra or {}).get("args") or {}
    for name in RESUMED_OPTIONS:
        if name in saved and name not in explicit:
            setattr(args, name, saved[name])
    own_save_hf = False
    if "hf_export" in (resumed.extra or {}):
        # Saved since the checkpoint records its export; older ones take neither.
        for name in ("save_hf", "save_dtype"):
            if saved.get(name) is not None and name not in explicit:
                setattr(args, name, saved[name])
        # The run's own --save-hf, written by an earlier stretch of it: replaced.
        own_save_hf = "save_hf" not in explicit and args.save_hf is not None
    memory_from_checkpoint = _restore_memory_policy(args, explicit, saved)
    if args.decay_steps is None and "steps" in saved:
        # Saved before --decay-steps existed: that run decayed over its own --steps.
        args.decay_steps = saved["steps"]
    if args.out_dir is None:
        args.out_dir = os.path.dirname(args.resume) or "."
    if resumed.step >= args.steps:
        from gpt2 import hf
        if args.save_hf and ("save_hf" in explicit or not hf.weight_files(args.save_hf)):
            if comm is None or comm.Get_rank() == 0:    # under mpiexec, rank 0 writes
                _export_checkpoint(args, resumed)
            return None, memory_from_checkpoint, own_save_hf
        print(f"{args.resume} is at step {resumed.step} of --steps {args.steps}: nothing "
              f"left to do (pass a larger --steps to train further); "
              f"{args.out_dir} is unchanged", flush=True)
        return None, memory_from_checkpoint, own_save_hf
    return resumed, memory_from_checkpoint, own_save_hf


def _check_options(args, explicit, comm, resumed, memory_from_checkpoint, own_save_hf):
    """The options that do not need the model: the output directory, the validation split,
    the spill directory and the combinations that cannot run together."""
    if args.out_dir is None:
        args.out_dir = DEFAULT_OUT_DIR
    if args.decay_steps is None:
        args.decay_steps = args.steps
    if not args.overwrite:
        _refuse_another_runs_output(args)
    if args.save_hf and not own_save_hf:
        _check_save_hf(args)
    if args.val_data is not None:
        if "val_fraction" in explicit:
            raise UsageError("--val-data is the validation split: leave out --val-fraction "
                             "(all of --data trains)")
        if resumed is not None and args.val_fraction:   # the saved run's
            raise UsageError(f"--val-data: the run in {args.resume} trains on all but the last "
                             f"{100 * args.val_fraction:g}% of its --data (--val-fraction), "
                             f"which it keeps for validation; it cannot change to --val-data")
        args.val_fraction = 0.0
    elif args.val_fraction == 0 and args.eval_interval:
        raise UsageError(f"--val-fraction 0 leaves no validation data for --eval-interval "
                         f"{args.eval_interval}: pass --eval-interval 0 too, or a fraction in "
                         f"(0, 1)")
    if args.spill_dir is not None and not os.path.isdir(args.spill_dir):
        saved = "spill_dir" in memory_from_checkpoint
        problem = "not a directory" if os.path.exists(args.spill_dir) else "no such directory"
        raise UsageError(f"--spill-dir {args.spill_dir}"
                         + (f" (from the checkpoint): {problem}; pass --spill-dir to choose "
                            f"another" if saved else f": {problem}"))

    # Under mpiexec the ranks' micro-batches are checked by every rank alike, as their
    # batch is (gpt2.distributed.trainer_from_args): one error line for the job.
    if comm is None and args.batch_size % args.grad_accum:
        raise UsageError(f"--grad-accum {args.grad_accum}: -B {args.batch_size} does not "
                         f"split into {args.grad_accum} equal micro-batches; use a -B that "
                         f"divides by {args.grad_accum}")
    if args.grad_accum > 1 and args.offload == "all":
        raise UsageError("--grad-accum runs without --offload all (each backward writes the "
                         "offloaded gradients anew): use --offload moments")
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


def _validation_tokens(args, config, tokens, tokenizer):
    """--val-data read (None without it), and each split of the data checked to hold a
    batch."""
    from gpt2.data import Examples, split_sizes
    val_tokens = None
    if args.val_data is not None and args.eval_interval:
        from gpt2.data import read_data
        with blame("--val-data", INPUT_ERRORS + (ImportError,)):
            val_tokens = read_data(args.val_data, tokenizer, _tokenizer_dir(args))
        _check_ids(val_tokens, "--val-data", config)
    # The splits of text (ExampleLoader counts the examples a batch can take itself).
    sizes = []
    if not isinstance(tokens, Examples):
        n_train, n_val = split_sizes(tokens.size, args.val_fraction)
        sizes.append(("training", n_train))
        if val_tokens is None and args.eval_interval:
            sizes.append(("validation", n_val))
    if val_tokens is not None and not isinstance(val_tokens, Examples):
        sizes.append(("validation", val_tokens.size))
    needed = args.batch_size * args.seq_len + 1
    for split, n in sizes:
        if n < needed:
            raise UsageError(f"the {split} data has {n} tokens, too few for one batch of "
                             f"-B {args.batch_size} x -T {args.seq_len} (needs {needed}); use a "
                             f"smaller -B or -T, more data, or another --val-fraction")
    return val_tokens


def _loaders(args, config, tokens, val_tokens, resumed):
    """(training loader, validation loader or None), the training loader at the
    checkpoint's place in the data."""
    from gpt2.data import make_loader
    with blame("--data"):
        train = make_loader(tokens, args.batch_size, args.seq_len, config.vocab_size,
                            split="train", val_fraction=args.val_fraction, seed=args.seed)
    if resumed is not None and resumed.data_state:
        with blame("--resume"):
            train.load_state(resumed.data_state)
    val = None
    if val_tokens is not None:
        with blame("--val-data"):
            val = make_loader(val_tokens, args.batch_size, args.seq_len, config.vocab_size,
                              split="all", shuffle=False, seed=args.seed)
    elif args.eval_interval:
        with blame("--data"):
            val = make_loader(tokens, args.batch_size, args.seq_len, config.vocab_size,
                              split="val", val_fraction=args.val_fraction, shuffle=False,
                              seed=args.seed)
    return train, val


def _memory_plan(args, config, comm, lora, params):
    """--max-memory: the memory policy the planner picks (gpt2.perfmodel.plan), the
    libraries a run loads resident first so that the baseline counts them."""
    import psutil
    from tqdm import tqdm  # noqa: F401  (loaded before the baseline is taken)
    # The loss plot's libraries (about 50 MiB resident) load after training, on top of
    # the heap's high water: loaded now, the baseline counts them.
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401

    import gpt2.model  # noqa: F401
    import gpt2.tape_engine  # noqa: F401
    from gpt2.perfmodel.plan import plan_memory
    # RuntimeError: the first use's calibration of this machine failed.
    with blame("--max-memory", INPUT_ERRORS + (RuntimeError,)):
        ranks = comm.Get_size() if comm is not None else 1
        # A step holds the activations of one micro-batch at a time.
        return plan_memory(config, max(1, args.batch_size // ranks // args.grad_accum),
                           args.seq_len,
                           args.max_memory,
                           spill_dir=args.spill_dir, threads=args.threads,
                           baseline_bytes=psutil.Process().memory_info().rss,
                           # auto's choice is made later: plan for fp32, the larger
                           precision="bf16" if args.precision == "bf16" else "fp32",
                           # LoRA's base, if read already, is in the baseline and becomes
                           # the model's (no copy of it is made)
                           **({} if lora is None else dict(
                               lora=lora, base_dtype=args.base_dtype,
                               base_read_bytes=params.nbytes if params is not None else 0)))


def _check_ids(tokens, what, config):
    """A UsageError where the data (a token array or Examples) holds an id outside the
    model's vocabulary."""
    ids = getattr(tokens, "ids", tokens)
    if ids.size and int(ids.max()) >= config.vocab_size:
        raise UsageError(f"{what} has token id {int(ids.max())}, outside the model's "
                         f"vocabulary of {config.vocab_size}; use a matching --tokenizer")


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


def _gguf_tokenizer(args):
    """The tokenizer --save-gguf writes: the run's file, None for bytes."""
    return None if args.tokenizer in (None, "bytes") else args.tokenizer


def _check_save_gguf(args, config):
    """A UsageError, before any training, if --save-gguf cannot be written: its path, the
    model's family, the tokenizer."""
    from gpt2.gguf_export import check_gguf_export
    with blame(f"--save-gguf {args.save_gguf}", (OSError, ValueError, ImportError)):
        check_gguf_export(args.save_gguf, config, args.gguf_type, _gguf_tokenizer(args))


def _save_gguf(args, params):
    """Write --save-gguf: ``params`` in --gguf-type with the run's tokenizer."""
    from gpt2.gguf_export import save_gguf
    with blame(f"--save-gguf {args.save_gguf}", (OSError, ValueError, ImportError)):
        save_gguf(args.save_gguf, params.config, params, dtype=args.gguf_type,
                  tokenizer_dir=_gguf_tokenizer(args))


def _export_source(extra):
    """The export source a checkpoint's header (``extra``) records, or NO_EXPORT_SOURCE."""
    source = ((extra or {}).get("hf_export") or {}).get("source") or {}
    return {**NO_EXPORT_SOURCE, **{k: v for k, v in source.items() if k in NO_EXPORT_SOURCE}}


def _save_hf(args, params, source, overwrite=False):
    """Write --save-hf: the weights in --save-dtype (default: the source's), with the source
    directory's or the run's tokenizer files and special-token ids."""
    from gpt2 import hf
    dtype = args.save_dtype or source["dtype"]
    with blame("--save-hf", (OSError, ValueError)):
        hf.save_dir(args.save_hf, params, overwrite=args.overwrite or overwrite, dtype=dtype,
                    source=source["directory"], tokenizer=args.tokenizer)
    return dtype


def _export_checkpoint(args, resumed):
    """--save-hf of a finished --resume checkpoint: the directory, without training."""
    from gpt2 import checkpoint as ckpt
    _check_save_hf(args)
    with blame("--resume"):
        if resumed.lora is None:
            params = ckpt.load_checkpoint(args.resume, resumed.config, optimizer=False).params
        else:   # the base and the checkpoint's adapters, merged
            from gpt2.model import Model
            model = Model(resumed.config, seed=args.seed, lora=resumed.lora,
                          base_dtype=args.base_dtype, base=_lora_base(args, resumed))
            ckpt.load_checkpoint(args.resume, resumed.config, params=model.adapter.params,
                                 optimizer=False, lora=True)
            params = model.merged_params()
    dtype = _save_hf(args, params, _export_source(resumed.extra))
    print(f"{args.resume} is at step {resumed.step} of --steps {args.steps}: nothing left to "
          f"train; wrote its model to {args.save_hf} ({dtype})", flush=True)


def _resume_command(args, ckpt_path):
    """The command line that continues this run from ``ckpt_path``: --resume, and the
    --save-hf and memory options it had (the checkpoint holds them too)."""
    import shlex
    words = [program_name(), "--resume", ckpt_path]
    if args.save_hf:
        words += ["--save-hf", args.save_hf]
    if args.save_dtype:
        words += ["--save-dtype", args.save_dtype]
    if args.save_gguf:
        words += ["--save-gguf", args.save_gguf, "--gguf-type", args.gguf_type]
    if args.max_memory is not None:     # it chose the others: plan again
        words += ["--max-memory", str(args.max_memory)]
    else:
        if args.tape_budget is not None:
            words += ["--tape-budget", str(args.tape_budget)]
        if args.checkpointing != "none":
            words += ["--checkpointing", args.checkpointing]
            if args.checkpointing == "binomial":
                words += ["--snapshots", str(args.snapshots)]
        if args.offload != "none":
            words += ["--offload", args.offload]
    if args.spill_dir is not None:
        words += ["--spill-dir", args.spill_dir]
    return " ".join(shlex.quote(str(w)) for w in words)


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
    """(config, params or None, what the model is called, its export source): from --resume,
    --init-from or --model."""
    from gpt2 import checkpoint as ckpt
    from gpt2.config import preset
    params, export_source = None, dict(NO_EXPORT_SOURCE)
    if resumed is not None:
        config, source = resumed.config, args.resume
        export_source = _export_source(resumed.extra)
    elif args.init_from:
        from gpt2 import hf
        if os.path.isdir(args.init_from):
            with blame("--init-from"):
                if (args.lora or args.lora_from) and args.base_dtype == "bf16":
                    from gpt2.lora import Bf16Base    # LoRA's frozen base, read as bf16
                    params = Bf16Base.load_hf(args.init_from)
                else:
                    params = hf.load_dir(args.init_from)
                export_source = {"directory": os.path.abspath(args.init_from),
                                 "dtype": hf.weights_dtype(args.init_from)}
        elif _is_checkpoint(args.init_from):
            # A new run from a checkpoint's weights (not its optimizer, step or data
            # position), with its tokenizer unless --tokenizer is given.
            with blame("--init-from"):
                state = ckpt.load_checkpoint(args.init_from, optimizer=False)
            params, export_source = state.params, _export_source(state.extra)
            saved_tokenizer = ((state.extra or {}).get("args") or {}).get("tokenizer")
            if args.tokenizer is None and saved_tokenizer is not None:
                args.tokenizer = saved_tokenizer
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
                export_source = {"directory": os.path.dirname(os.path.abspath(args.init_from)),
                                 "dtype": hf.weights_dtype(args.init_from)}
        config, source = params.config, args.init_from
    else:
        return (preset(args.model or DEFAULT_MODEL), None, args.model or DEFAULT_MODEL,
                export_source)
    if "model" in explicit and preset(args.model) != config:
        raise UsageError(f"--model {args.model} does not match {source}, which holds "
                         f"{config.preset_name() or 'a model'} with "
                         + ", ".join(f"{k}={v}" for k, v in config.to_dict().items())
                         + "; leave --model out to use the file's sizes")
    return config, params, config.preset_name() or source, export_source


LORA_OPTIONS = ("lora", "lora_alpha", "lora_dropout", "lora_targets", "rslora", "lora_from")


def _lora_config(args, explicit, config, resumed):
    """The run's LoraConfig from --lora and its options (or --lora-from, or the resumed
    run's), or None; a UsageError for what LoRA cannot run with."""
    from gpt2.lora import LoraConfig, read_adapter_config
    given = [f"--{n.replace('_', '-')}" for n in LORA_OPTIONS + ("base_dtype",)
             if n in explicit]
    if resumed is not None:
        if resumed.lora is None:
            if given:
                raise UsageError(f"{given[0]}: the run in {args.resume} trains every weight; "
                                 f"start a LoRA run from its weights with --init-from "
                                 f"{args.resume}")
            return None
        lora = resumed.lora
        clash = [f"--{n.replace('_', '-')}" for n, v in (
            ("lora", lora.r), ("lora_alpha", lora.alpha), ("lora_dropout", lora.dropout),
            ("lora_targets", lora.targets), ("rslora", lora.rslora))
            if n in explicit and getattr(args, n) not in (v, None)]
        if clash or "lora_from" in explicit:
            raise UsageError(f"{(clash or ['--lora-from'])[0]}: the run in {args.resume} has "
                             f"its adapters (r {lora.r}, alpha {lora.alpha:g}); leave the "
                             f"LoRA options out to continue it")
    elif args.lora_from:
        with blame("--lora-from"):
            lora = read_adapter_config(args.lora_from, config)
        if args.lora is not None and args.lora != lora.r:
            raise UsageError(f"--lora {args.lora}: the adapter in --lora-from {args.lora_from} "
                             f"has rank {lora.r}")
        if args.lora_targets is not None and set(args.lora_targets) != set(lora.targets):
            raise UsageError(f"--lora-targets: the adapter in --lora-from {args.lora_from} "
                             f"adapts {','.join(lora.targets)}")
        with blame("--lora-alpha"):
            lora = LoraConfig(r=lora.r, targets=lora.targets,
                              alpha=args.lora_alpha if args.lora_alpha else lora.alpha,
                              dropout=args.lora_dropout if "lora_dropout" in explicit
                              else lora.dropout,
                              rslora=args.rslora or lora.rslora)
    elif args.lora is not None:
        with blame("--lora-targets"):
            lora = LoraConfig(r=args.lora, alpha=args.lora_alpha or 2.0 * args.lora,
                              dropout=args.lora_dropout, targets=args.lora_targets,
                              rslora=args.rslora)
            lora.groups(config)
    else:
        if given:
            raise UsageError(f"{given[0]} is a LoRA option: add --lora R (the adapters' rank)")
        return None
    for problem, refused in (("--engine manual", args.engine != "tape"),
                             (f"--offload {args.offload}", args.offload != "none")):
        if refused:
            raise UsageError(f"--lora runs without {problem} (the adapters' state is small; "
                             f"--base-dtype bf16 halves the base, --checkpointing and "
                             f"--tape-budget bound the activations)")
    return lora


def _lora_base(args, resumed):
    """The frozen base of a resumed LoRA run: its --init-from read again, or None (the
    run's seed made it)."""
    saved = ((resumed.extra or {}).get("args") or {}).get("init_from")
    if saved is None:
        return None
    if not os.path.exists(saved):
        raise UsageError(f"--resume {args.resume}: the run's base model {saved} (its "
                         f"--init-from) is gone; a LoRA checkpoint holds only the adapters")
    args.init_from = saved
    try:
        return _model_config(args, set(), None)[1]
    finally:
        args.init_from = None


def _is_checkpoint(path):
    """Whether ``path`` is our training checkpoint; a file that cannot be opened is
    reported by the reader of its kind."""
    from gpt2 import checkpoint as ckpt
    try:
        return ckpt.is_checkpoint(path)
    except OSError:
        return False


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
        if args.offload == "all" and args.grad_accum > 1:
            raise UsageError(f"--max-memory {args.max_memory:,} plans --offload all, which "
                             f"does not accumulate gradients: raise --max-memory or leave out "
                             f"--grad-accum")
    tape_kwargs = {}
    if args.tape_budget is not None:
        tape_kwargs["memory_budget"] = args.tape_budget
    if args.spill_dir is not None:
        tape_kwargs["spill_dir"] = args.spill_dir
    lora = {}
    if inputs.lora is not None:
        # The base is the model's from the start (in bf16 without a float32 copy kept).
        lora = dict(lora=inputs.lora, base_dtype=args.base_dtype, base=inputs.params)
        inputs.params = None
    with blame("model"):
        model = Model(inputs.config, seed=args.seed, engine=args.engine, tape_kwargs=tape_kwargs,
                     checkpointing=args.checkpointing, snapshots=args.snapshots,
                     offload=None if args.offload == "none" else args.offload,
                     offload_dir=args.spill_dir, **lora)
    lora = None     # the model holds the base: a float32 one it rounded to bf16 is freed
    if inputs.lora is not None and args.lora_from and inputs.resumed is None:
        from gpt2.lora import load_adapter
        with blame("--lora-from"):
            load_adapter(args.lora_from, model.adapter)
    try:
        return _train_model(args, inputs, model, n_threads, comm)
    except TapeCorruptionError as e:
        # The disk gave back other bytes than it was given (spill or offload file): the run
        # cannot go on, and the last checkpoint, written before, is what is left.
        raise UsageError(f"{_one_line(e)}{_last_checkpoint(args)}") from e
    finally:
        model.close()


def _print_header(args, inputs, model, n_threads, start_step):
    """The run's header lines (model, batch, threads and BLAS, engine, precision, memory
    policy, data, tokenizer, validation); returns the parameters that train."""
    from gpt2.data import Examples
    from gpt2.params import num_parameters as _num_parameters
    from kernels import blas_dispatch
    config, train, val = inputs.config, inputs.train, inputs.val
    examples = isinstance(inputs.tokens, Examples)
    data_ids = inputs.tokens.ids if examples else inputs.tokens
    n_params = _num_parameters(config)
    lora_words = ""
    if model.adapter is not None:
        lo = model.lora
        n_params = model.adapter.num_parameters      # what trains (and is checkpointed)
        lora_words = (f", LoRA r={lo.r} alpha={lo.alpha:g}{' (rsLoRA)' if lo.rslora else ''}"
                      f" on {','.join(m for _, ps in lo.groups(config) for m, *_ in ps)}: "
                      f"{n_params / 1e6:.2f}M trained "
                      f"({100 * n_params / _num_parameters(config):.2f}%), the base frozen in "
                      f"{args.base_dtype}")
    # "GPT-2 preset small", not "GPT-2 small": that names the 124M model, preset gpt2
    preset_words = "preset " if inputs.model_name == config.preset_name() else ""
    print(f"{config.family_name} {preset_words}{inputs.model_name}: "
          f"{_num_parameters(config) / 1e6:.2f}M parameters, "
          f"{config.describe()}{lora_words}; B={args.batch_size} "
          f"T={args.seq_len}"
          + (f" (--grad-accum {args.grad_accum}: micro-batches of "
             f"{args.batch_size // args.grad_accum})" if args.grad_accum > 1 else "")
          + f", {n_threads} threads ({blas_dispatch.describe()}), "
          f"engine={args.engine}, precision {inputs.precision[0]} ({inputs.precision[1]}), "
          f"memory: "
          f"{describe_memory_policy(args, inputs.plan, inputs.memory_from_checkpoint)}, "
          + (f"data {inputs.tokens.describe_kinds()} ({data_ids.size:,} tokens)" if examples
             else f"corpus {data_ids.size:,} tokens")
          + (f"; resuming at step {start_step}" if start_step else ""), flush=True)
    if examples:
        print(f"training split: {train.describe()}; the loss counts the trained tokens only "
              f"(the assistant's, the completions')", flush=True)
    for line in _describe_tokenizer(args, inputs.tokenizer, config):
        print(line, flush=True)
    if val is not None:
        print(_describe_validation(args, val), flush=True)
    return n_params


def _checkpoint_extra(args, inputs):
    """(the run's options as a checkpoint keeps them, the checkpoint's extra record): paths
    made absolute, since a resumed run may start elsewhere, and the weights' source for
    --save-hf of this run and of a run resuming it."""
    saved_args = dict(vars(args))
    for name in ("data", "val_data", "tokenizer"):
        # Keep where the files are, not how they were named ("bytes" names no file).
        if saved_args[name] not in (None, "bytes"):
            saved_args[name] = os.path.abspath(saved_args[name])
    for name in ("spill_dir", "save_hf", "init_from", "lora_from"):
        if saved_args[name] is not None:
            saved_args[name] = os.path.abspath(saved_args[name])
    return saved_args, {"args": saved_args, "hf_export": {"source": inputs.export_source}}


def _train_model(args, inputs, model, n_threads, comm=None):
    """Load the starting state, then the training loop, logging and saving as it goes."""
    from tqdm import tqdm

    from gpt2 import checkpoint as ckpt
    from gpt2 import distributed
    from gpt2.data import Examples
    from gpt2.evaluate import perplexity

    config, train, val = inputs.config, inputs.train, inputs.val
    if inputs.params is not None:
        model.set_params(inputs.params)
    adapter_dir = os.path.join(args.out_dir, "adapter")
    data_ids = inputs.tokens.ids if isinstance(inputs.tokens, Examples) else inputs.tokens
    # Over MPI: every rank trains its rows of the global batch; rank 0 alone writes.
    trainer = distributed.trainer_from_args(model, comm, args, data_ids)
    writer = trainer is None or trainer.rank == 0
    start_step = 0
    if inputs.resumed is not None:
        with blame("--resume"):
            state = (trainer.load_checkpoint(args.resume) if trainer
                     else ckpt.load_state(args.resume, model.state, config))
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

    n_params = _print_header(args, inputs, model, n_threads, start_step)
    saved_args, extra = _checkpoint_extra(args, inputs)

    # Parameters and both AdamW moments, in float32.
    schedule = SaveSchedule(args.checkpoint_interval, 12 * n_params)

    def save(step):
        t0 = time.perf_counter()
        after_write = save_adapter if model.adapter is not None else None
        if trainer:  # collective: rank 0 gathers the sharded state and writes
            trainer.save_checkpoint(ckpt_path, step=step, data_state=train.state(),
                                    extra=extra, after_write=after_write)
        else:
            ckpt.save_state(ckpt_path, model.state, step=step, data_state=train.state(),
                            extra=extra)
            if after_write is not None:
                after_write()
        schedule.saved(time.perf_counter() - t0)

    def save_adapter():
        from gpt2.lora import save_adapter as write
        write(adapter_dir, model.adapter, base_model=saved_args["init_from"])

    def interrupted(signum, step):
        name = signal.Signals(signum).name
        if not writer:
            return Interrupted(signum, "")   # rank 0 says it
        if step == args.steps:      # the run is complete: nothing to continue
            saved = (([] if args.no_checkpoint else [ckpt_path])
                     + ([args.save_hf] if args.save_hf else [])
                     + ([args.save_gguf] if args.save_gguf else []))
            return Interrupted(signum, f"interrupted by {name} at the end of the run (step "
                                       f"{step} of {args.steps}): "
                                       + (f"saved {' and '.join(saved)}" if saved
                                          else "no checkpoint (--no-checkpoint)")
                                       + "; skipped the summary, the plot and the sample")
        if args.no_checkpoint:
            return Interrupted(signum, f"interrupted by {name} after step {step} of "
                                       f"{args.steps}; no checkpoint (--no-checkpoint)")
        return Interrupted(signum, f"interrupted by {name} after step {step} of {args.steps}: "
                                   f"saved {ckpt_path}; continue with: "
                                   f"{_resume_command(args, ckpt_path)}")

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
                                                           grad_clip=args.grad_clip or None,
                                                           grad_accum=args.grad_accum)
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
                          + (f" val {row['val_loss']:.4f} ppl {perplexity(row['val_loss']):.2f}"
                             if row["val_loss"] is not None else ""), flush=True)
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
            elif model.adapter is not None and writer:
                save_adapter()
            model.finish_update()
            if args.save_hf and writer:
                _save_hf(args, model.merged_params(), inputs.export_source, inputs.own_save_hf)
            if args.save_gguf and writer:
                _save_gguf(args, model.merged_params())
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
    checkpoints = dict(schedule.summary(), train_seconds=time.perf_counter() - loop_start)
    if not writer:
        return None
    return _finish(args, inputs, model, n_threads, log.rows, rows, start_step,
                   trainer, tape_watch.summary(), checkpoints, tape_watch.offload_summary())


def _describe_outputs(args, all_rows):
    """'wrote <every file the run wrote> in OUT_DIR/ [and the Hugging Face model in DIR/]'
    (summary.json is written after the sample)."""
    names = (["log.csv"] + (["loss.png"] if all_rows else [])
             + ([] if args.no_checkpoint else ["checkpoint.bin"]) + ["summary.json"])
    if args.lora is not None or args.lora_from:
        names.insert(-1, "adapter/")
    words = f"wrote {', '.join(names[:-1])} and {names[-1]} in {args.out_dir}/"
    if args.save_hf:
        words += f", and the Hugging Face model in {args.save_hf}/"
    if args.save_gguf:
        words += f", and the GGUF file {args.save_gguf} ({args.gguf_type})"
    return words


def _finish(args, inputs, model, n_threads, all_rows, rows, start_step, trainer=None,
            tape=None, checkpoints=None, offload=None):
    """summary.json and loss.png of the whole run, then the sample.

    The peak resident memory reported is the process's own high-water mark (VmHWM) read
    after the plot and the sample, the run's last allocations, so that it is the whole
    run's: training, saves, plot and sample."""
    import numpy as np

    from gpt2.evaluate import perplexity
    config, tokenizer = inputs.config, inputs.tokenizer
    if all_rows:
        plot_losses(os.path.join(args.out_dir, "loss.png"), all_rows)
    # A run's first step includes one-time set-up; time the steady state.
    timed = [r["ms"] for r in rows[1:]] or [r["ms"] for r in rows]
    median_ms = float(np.median(timed)) if timed else None
    summary = {"model": inputs.model_name, "init_from": args.init_from, "resumed_from": args.resume,
               "config": config.to_dict(), "engine": args.engine,
               "precision": inputs.precision[0], "precision_reason": inputs.precision[1],
               "B": args.batch_size, "grad_accum": args.grad_accum,
               "T": args.seq_len, "threads": n_threads, "start_step": start_step,
               "steps": args.steps,
               "first_loss": all_rows[0]["loss"] if all_rows else None,
               "final_loss": all_rows[-1]["loss"] if all_rows else None,
               "final_val_loss": next((r["val_loss"] for r in reversed(all_rows)
                                       if r["val_loss"] is not None), None),
               "median_ms_per_step": median_ms,
               "tokens_per_s": args.batch_size * args.seq_len / (median_ms / 1e3)
                               if median_ms else None}
    summary["final_val_perplexity"] = (perplexity(summary["final_val_loss"])
                                       if summary["final_val_loss"] is not None else None)
    summary.update(ranks=trainer.size if trainer else 1, global_batch=args.batch_size,
                   zero=args.zero if trainer else 0, tape=tape)
    summary["memory_policy"] = memory_policy(args, inputs.plan, inputs.memory_from_checkpoint)
    summary["lora"] = None if model.adapter is None else dict(
        model.lora.to_dict(), base_dtype=args.base_dtype,
        trained_parameters=model.adapter.num_parameters)
    summary["checkpoints"] = checkpoints
    summary["offload"] = offload
    summary["sample_tokens_per_s"] = None
    if args.sample_tokens:
        ids, seconds = sample(model, inputs.prompt_ids, args.sample_tokens, args.temperature,
                              args.top_k, np.random.default_rng(args.seed), inputs.stop_ids)
        n_sampled = len(ids) - max(1, len(inputs.prompt_ids))
        stopped = n_sampled < args.sample_tokens or ids[-1] in inputs.stop_ids
        summary["sample_tokens_per_s"] = n_sampled / seconds
    # The kernel's count, children none (gpt2.units.peak_rss_bytes).
    peak_rss = peak_rss_bytes()
    summary["peak_rss_bytes"] = peak_rss
    if inputs.plan is not None:
        summary["memory_plan"] = {"policy": inputs.plan.policy, "max_memory": args.max_memory,
                                  "tape_budget": args.tape_budget,
                                  "checkpointing": args.checkpointing,
                                  "snapshots": args.snapshots, "offload": args.offload,
                                  "predicted_ms": inputs.plan.predicted_ms,
                                  "predicted_peak_bytes": inputs.plan.predicted_peak_bytes,
                                  "peak_rss_bytes": peak_rss,
                                  "exceeded": peak_rss > args.max_memory}
    print(f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"
          + (f" (validation {summary['final_val_loss']:.3f}, perplexity "
             f"{summary['final_val_perplexity']:.2f})"
             if summary["final_val_loss"] is not None else "")
          + f"; {median_ms:.0f} ms/step, {summary['tokens_per_s']:.0f} tokens/s; "
          + _describe_outputs(args, all_rows), flush=True)
    if tape is not None:
        print(TapeWatch.describe(tape), flush=True)
    if offload is not None:
        print(TapeWatch.describe_offload(offload), flush=True)
    if inputs.plan is not None and median_ms is not None:
        print(f"--max-memory: {inputs.plan.compare(median_ms, peak_rss)}", flush=True)
    if inputs.plan is not None and summary["memory_plan"]["exceeded"]:
        print(exceeded_line(peak_rss, args.max_memory), flush=True)
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
            # The text from the prompt on: without the BOS it started from or the
            # end-of-sequence token it stopped at.
            shown = ids[1 if inputs.from_bos else 0:len(ids) - 1 if stopped else None]
            print(tokenizer.decode(shown))
        print(f"({n_sampled} tokens in {seconds:.2f} s, "
              f"{summary['sample_tokens_per_s']:.1f} tokens/s"
              + ("; stopped at end-of-sequence" if stopped else "") + ")")
        print("------------------")
    return summary


if __name__ == "__main__":
    sys.exit(main())
