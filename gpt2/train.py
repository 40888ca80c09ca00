"""Train GPT-2 on the CPU: ``python -m gpt2.train`` (or the ``gpt2-train`` command).

With no arguments it trains a small byte-level GPT-2 on the built-in corpus (the
Python standard library's own source files, so nothing is downloaded), shows
loss, tokens/s and ms/step in a progress bar, evaluates on a held-out split,
writes a CSV log, a JSON summary and a loss-curve PNG to ``--out-dir``, and
prints a text sample at the end.  ``--help`` lists every option.
"""
import argparse
import csv
import json
import math
import os
import sys
import time

SIZE_SUFFIXES = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
                 "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text):
    """'512M', '2GiB', '1048576' -> bytes."""
    s = text.strip().lower()
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    suffix = s[len(number):]
    if suffix not in SIZE_SUFFIXES or not number:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M or 2G)")
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a size cannot be negative: {text!r}")
    return int(value * SIZE_SUFFIXES[suffix])


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser():
    p = argparse.ArgumentParser(prog="python -m gpt2.train", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", default="small",
                   help="preset: tiny, small, gpt2 (124M), gpt2-medium, gpt2-large, gpt2-xl")
    m.add_argument("--init-from", default=None,
                   help="start from weights: an llm.c gpt2_124M.bin or a Hugging Face "
                        "model.safetensors (its config.json beside it)")
    m.add_argument("--engine", choices=("tape", "manual"), default="tape",
                   help="tape: backward derived by the adtape tape; manual: hand-sequenced")
    d = p.add_argument_group("data")
    d.add_argument("--data", default=None,
                   help="a text file or an llm.c token file (.bin); default: the built-in corpus")
    d.add_argument("--tokenizer", default=None,
                   help="bytes (default for text), or a tiktoken .tiktoken file for GPT-2 BPE")
    d.add_argument("--corpus-bytes", type=parse_size, default="3M",
                   help="size of the built-in corpus")
    d.add_argument("--val-fraction", type=float, default=0.05)
    t = p.add_argument_group("training")
    t.add_argument("-B", "--batch-size", type=positive_int, default=8)
    t.add_argument("-T", "--seq-len", type=positive_int, default=None,
                   help="sequence length (default: 128 or the model's block_size if smaller)")
    t.add_argument("--steps", type=positive_int, default=1500)
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    t.add_argument("--min-lr", type=float, default=None, help="cosine floor (default lr/10)")
    t.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    t.add_argument("--schedule", choices=("cosine", "constant"), default="cosine")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--grad-clip", type=float, default=1.0, help="max global norm (0: off)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=positive_int, default=None,
                   help="OpenMP and BLAS threads (default: OMP_NUM_THREADS or all cores)")
    t.add_argument("--no-flush-denormal", action="store_true",
                   help="keep denormal floats (slow); by default FTZ/DAZ are set")
    mem = p.add_argument_group("memory")
    mem.add_argument("--tape-budget", type=parse_size, default=None,
                     help="bytes of saved activations kept in RAM; the rest spills to disk")
    mem.add_argument("--spill-dir", default=None, help="directory of the tape's spill file")
    mem.add_argument("--checkpointing", choices=("none", "layer", "binomial"), default="none",
                     help="recompute activations in the backward pass: none, per layer, or a "
                          "binomial (Revolve) schedule over the layers")
    mem.add_argument("--snapshots", type=positive_int, default=2,
                     help="snapshots for --checkpointing binomial")
    o = p.add_argument_group("evaluation and output")
    o.add_argument("--eval-interval", type=int, default=250)
    o.add_argument("--eval-batches", type=positive_int, default=8)
    o.add_argument("--out-dir", default="gpt2_run", help="log, plot and checkpoints go here")
    o.add_argument("--checkpoint-interval", type=int, default=0,
                   help="save a checkpoint every N steps (0: only at the end)")
    o.add_argument("--no-checkpoint", action="store_true", help="write no checkpoint at all")
    o.add_argument("--resume", default=None, help="continue from this checkpoint file")
    o.add_argument("--sample-tokens", type=int, default=300)
    o.add_argument("--temperature", type=float, default=0.8)
    o.add_argument("--top-k", type=int, default=40)
    o.add_argument("--prompt", default="def ", help="text the sample starts from")
    o.add_argument("--no-progress", action="store_true", help="no progress bar (log lines)")
    par = p.add_argument_group(
        "data parallelism", "Launch N ranks with `mpiexec -n N gpt2-train ...` (across hosts: "
        "`mpiexec -hosts a,b -n N ...`; needs pip install 'adtape[mpi]'). -B is the global "
        "batch: each rank trains on B/N of its rows, so B must divide by N. Rank 0 prints, "
        "evaluates, samples and writes the log, plot, summary and checkpoint.")
    par.add_argument("--data-parallel", choices=("auto", "on", "off"), default="auto",
                     help="auto: when an MPI launcher started more than one rank; on: over "
                          "MPI even with one rank")
    par.add_argument("--zero", type=int, choices=(0, 1), default=0,
                     help="1: shard the AdamW moments across the ranks (ZeRO stage 1)")
    par.add_argument("--bucket-size", type=parse_size, default="25M",
                     help="gradient bytes per allreduce bucket")
    return p


def learning_rate(step, args):
    """Linear warmup to --lr, then cosine decay to --min-lr over the remaining steps."""
    if args.warmup and step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.schedule == "constant":
        return args.lr
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    span = max(1, args.steps - args.warmup)
    progress = min(1.0, (step - args.warmup) / span)
    return min_lr + 0.5 * (args.lr - min_lr) * (1 + math.cos(math.pi * progress))


def load_tokens(args, vocab_size_hint):
    """(tokens, tokenizer) for --data/--tokenizer, or the built-in corpus."""
    from gpt2 import data, tokenizer as tok
    if args.tokenizer in (None, "bytes"):
        tokenizer = tok.ByteTokenizer()
    else:
        tokenizer = tok.GPT2BPETokenizer(args.tokenizer)
    if args.data is None:
        return data.default_corpus_tokens(tokenizer, max_bytes=args.corpus_bytes), tokenizer
    if args.data.endswith(".bin"):
        return data.read_llmc_tokens(args.data), tokenizer
    return data.text_file_tokens(args.data, tokenizer), tokenizer


def sample(model, tokenizer, prompt, n_tokens, temperature, top_k, rng):
    """Autoregressive sampling with temperature and top-k; returns the text."""
    import numpy as np
    cfg = model.config
    ids = list(tokenizer.encode(prompt)) or [0]
    for _ in range(n_tokens):
        context = np.array([ids[-cfg.block_size:]], dtype=np.int32)
        logits, _ = model.forward(context)
        row = logits[0, -1, :cfg.vocab_size].astype(np.float64) / max(temperature, 1e-6)
        if 0 < top_k < row.size:
            cut = np.partition(row, -top_k)[-top_k]
            row[row < cut] = -np.inf
        row -= row.max()
        probs = np.exp(row)
        probs /= probs.sum()
        ids.append(int(rng.choice(row.size, p=probs)))
    return tokenizer.decode(ids)


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
    ax.set_title("GPT-2 training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    """Console entry point: train, return the exit status."""
    run(argv)
    return 0


def run(argv=None):
    """Train as the command line says; returns the run's summary (also in summary.json).

    Flush-to-zero is set for the run (unless --no-flush-denormal) and the previous
    floating-point mode is restored afterwards, in this thread and the OpenMP pool.
    """
    args = build_parser().parse_args(argv)
    from gpt2 import distributed
    comm = distributed.world_from_args(args)
    from kernels import _openmp, threads
    ftz_before = _openmp.flush_denormal_enabled()
    # FTZ/DAZ first: threads started later inherit this thread's MXCSR.
    _openmp.set_flush_denormal(not args.no_flush_denormal)
    # Every step frees and reallocates the same large buffers: keep them mapped.
    _openmp.set_malloc_retention()
    n_threads = threads.set_num_threads(args.threads)
    _openmp.set_flush_denormal(not args.no_flush_denormal, n_threads)
    try:
        with distributed.abort_on_error(comm):
            return _train(args, n_threads, comm)
    finally:
        _openmp.set_flush_denormal(ftz_before, n_threads)


def _train(args, n_threads, comm=None):
    """The training run proper, with threads and floating-point mode already set."""
    import numpy as np
    from tqdm import tqdm

    from gpt2 import checkpoint as ckpt
    from gpt2 import distributed
    from gpt2.config import GPT2Config
    from gpt2.data import DataLoader
    from gpt2.model import GPT2

    if args.init_from:
        if args.init_from.endswith(".bin"):
            params = ckpt.import_llmc(args.init_from)
        else:
            params = ckpt.import_hf_gpt2(args.init_from)
        config = params.config
    else:
        params = None
        config = GPT2Config.preset(args.model)
    if args.seq_len is None:
        args.seq_len = min(128, config.block_size)
    if args.seq_len > config.block_size:
        raise SystemExit(f"error: -T {args.seq_len} exceeds the model's block_size "
                         f"{config.block_size}")
    tokens, tokenizer = load_tokens(args, config.vocab_size)
    if tokens.size and int(tokens.max()) >= config.vocab_size:
        raise SystemExit(f"error: the data has token id {int(tokens.max())}, outside the "
                         f"model's vocabulary of {config.vocab_size}; use a matching tokenizer")
    train = DataLoader(tokens, args.batch_size, args.seq_len, config.vocab_size, split="train",
                       val_fraction=args.val_fraction, seed=args.seed)
    val = DataLoader(tokens, args.batch_size, args.seq_len, config.vocab_size, split="val",
                     val_fraction=args.val_fraction, shuffle=False, seed=args.seed)

    tape_kwargs = {}
    if args.tape_budget is not None:
        tape_kwargs["memory_budget"] = args.tape_budget
    if args.spill_dir is not None:
        tape_kwargs["spill_dir"] = args.spill_dir
    model = GPT2(config, seed=args.seed, engine=args.engine, tape_kwargs=tape_kwargs,
                 checkpointing=args.checkpointing, snapshots=args.snapshots)
    if params is not None:
        model.params.copy_(params)
    trainer = distributed.trainer_from_args(model, comm, args, tokens)
    start_step = 0
    if args.resume:
        state = (trainer.load_checkpoint(args.resume) if trainer else
                 ckpt.load_checkpoint(args.resume, config, params=model.params,
                                      adam_m=model.adam_m, adam_v=model.adam_v))
        model.adam_step = state.adam_step
        start_step = state.step
        if state.data_state:
            train.load_state(state.data_state)
    os.makedirs(args.out_dir, exist_ok=True)
    log_path = os.path.join(args.out_dir, "log.csv")
    ckpt_path = os.path.join(args.out_dir, "checkpoint.bin")

    n_params = sum(v.size for k, v in model.params.views.items())
    print(f"GPT-2 {args.model if not args.init_from else args.init_from}: {n_params / 1e6:.2f}M "
          f"parameters, L={config.n_layer} H={config.n_head} C={config.n_embd} "
          f"V={config.vocab_size}; B={args.batch_size} T={args.seq_len}, {n_threads} threads, "
          f"engine={args.engine}, corpus {tokens.size:,} tokens", flush=True)

    def save(step):
        if trainer:
            trainer.save_checkpoint(ckpt_path, step=step, data_state=train.state(),
                                    extra={"args": vars(args)})
            return
        ckpt.save_checkpoint(ckpt_path, model.params, step=step, adam_m=model.adam_m,
                             adam_v=model.adam_v, adam_step=model.adam_step,
                             data_state=train.state(), extra={"args": vars(args)})

    rows = []
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(range(start_step, args.steps), initial=start_step, total=args.steps,
               disable=args.no_progress, unit="step", dynamic_ncols=True)
    try:
        for step in bar:
            x, y = train.next_batch()
            lr = learning_rate(step, args)
            t0 = time.perf_counter()
            loss, norm = (trainer or model).train_step(x, y, lr, weight_decay=args.weight_decay,
                                                       grad_clip=args.grad_clip or None)
            dt = time.perf_counter() - t0
            if not math.isfinite(loss):
                raise FloatingPointError(f"the loss became {loss} at step {step}; "
                                         f"try a lower --lr")
            row = {"step": step + 1, "loss": loss, "lr": lr, "ms": dt * 1e3,
                   "tokens_per_s": tokens_per_step / dt,
                   "grad_norm": None if norm is None else float(norm), "val_loss": None}
            last = step + 1 == args.steps
            if args.eval_interval and ((step + 1) % args.eval_interval == 0 or last):
                val.reset()
                row["val_loss"] = evaluate(model, val, min(args.eval_batches, val.num_batches))
            rows.append(row)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tokens_per_s']:.0f}",
                            ms=f"{row['ms']:.0f}")
            if args.no_progress and (step % 20 == 0 or last or row["val_loss"] is not None):
                print(f"step {step + 1}/{args.steps} loss {loss:.4f} "
                      f"{row['tokens_per_s']:.0f} tok/s {row['ms']:.0f} ms"
                      + (f" val {row['val_loss']:.4f}" if row["val_loss"] is not None else ""),
                      flush=True)
            if (not args.no_checkpoint and args.checkpoint_interval
                    and (step + 1) % args.checkpoint_interval == 0):
                save(step + 1)
    finally:
        bar.close()
    if not args.no_checkpoint:
        save(args.steps)
    if trainer and trainer.rank:
        model.close()
        return None
    with open(log_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["step"])
        writer.writeheader()
        writer.writerows(rows)
    if rows:
        plot_losses(os.path.join(args.out_dir, "loss.png"), rows)
    timed = [r["ms"] for r in rows[1:]] or [r["ms"] for r in rows]
    summary = {"model": args.model, "config": config.to_dict(), "engine": args.engine,
               "B": args.batch_size, "T": args.seq_len, "threads": n_threads,
               "steps": args.steps, "first_loss": rows[0]["loss"] if rows else None,
               "final_loss": rows[-1]["loss"] if rows else None,
               "final_val_loss": next((r["val_loss"] for r in reversed(rows)
                                       if r["val_loss"] is not None), None),
               "median_ms_per_step": float(np.median(timed)) if timed else None,
               "tokens_per_s": tokens_per_step / (np.median(timed) / 1e3) if timed else None}
    summary.update(ranks=trainer.size if trainer else 1, global_batch=args.batch_size,
                   zero=args.zero if trainer else 0)
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if rows:
        print(f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"
              + (f" (validation {summary['final_val_loss']:.3f})"
                 if summary["final_val_loss"] is not None else "")
              + f"; {summary['median_ms_per_step']:.0f} ms/step, "
                f"{summary['tokens_per_s']:.0f} tokens/s; log, plot and checkpoint in "
                f"{args.out_dir}/")
    if args.sample_tokens > 0:
        text = sample(model, tokenizer, args.prompt, args.sample_tokens, args.temperature,
                      args.top_k, np.random.default_rng(args.seed))
        print("----- sample -----")
        print(text)
        print("------------------")
    model.close()
    return summary


if __name__ == "__main__":
    sys.exit(main())
