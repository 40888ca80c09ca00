"""Data-parallel training of any family over MPI (mpi4py): ``mpiexec -n N gpt2-train ...``.

Every rank holds the whole model.  Rank 0's weights are broadcast at the start; each
rank takes its 1/N of every global batch; the gradients are summed across ranks in
buckets, contiguous slices of the gradient arena (25 MB by default), each launched as
a non-blocking collective as soon as the reverse sweep has made its gradients final
(``Tensor.register_grad_hook``), so the communication runs beside the rest of
the backward pass, as PyTorch DDP's hooks do.  Then AdamW.

The trainer's arenas (parameters, gradients, moments) are layer-major
(``ParamArena(layer_major=True)``): wte, wpe, block 0, ..., block L-1, lnf.  The
reverse sweep finishes them from the end towards the start, so each bucket (a block's
attention projection and MLP, or its ln1 and qkv) is final as soon as the sweep has
left it and is reduced while the blocks below are still being differentiated; only
block 0's ln1 and qkv (7 MB), wpe and the encoder's rows of wte are left when the
sweep ends.  In llm.c's
type-major order (all ln1w, all ln1b, all qkvw ...) most buckets held some of block
0 and waited for the end of the sweep.  The other ways there: buckets of leaves in
sweep order, copied into a staging buffer and back (two passes over the 500 MB
gradient of GPT-2 124M per step, for nothing the order does not give), or MPI
derived datatypes over the scattered slices (MPICH packs them, the same copies, and
its reduction algorithms allocate temporaries of the type's extent).  Checkpoints
stay in llm.c order: ``gpt2.checkpoint`` reorders a layer-major arena on the way.

``zero=1`` (ZeRO stage 1) shards the AdamW moments: each bucket is reduce-scattered
rather than allreduced, rank r owns the r-th part of every bucket and steps only
those parameters and moments (1/N of the optimizer memory per rank), and the
parameters are all-gathered afterwards.

Clipping by global norm uses the norm of the averaged gradient on every rank, so the
update matches one process on the whole batch.  Checkpoints are written by rank 0 in
the ordinary format (``gpt2.checkpoint``) and read back at any number of ranks.

A LoRA model (``Model(lora=...)``) trains its adapters only: the frozen base is
broadcast from rank 0 at the start (each rank read it or made it from the seed, and a
rank whose file differs would otherwise train another model), and the buckets, the
moments and ZeRO-1's shards are those of the adapter arena (r=16 on every projection:
43 MiB for Llama 3.2 1B, 160 MiB for Llama 3.1 8B).  That arena is ordered weight by
weight (each adapted weight's A of every block, then its B), so a bucket is final when
the sweep leaves the lowest block it holds: the buckets of a weight's upper blocks are
reduced during the sweep, those reaching block 0 as it ends.  With dropout, each rank draws its masks
from the model's stream jumped ``rank`` times, so no two ranks share masks (the masks
differ from one process's, as they do with micro-batches).  Checkpoints hold the
adapters and their moments (``gpt2.checkpoint.save_checkpoint(..., lora=)``).

Failures: a rank that raises prints one line, ``error: rank r of N: ...`` (its
traceback too with ``debug``), waits until the launcher has read it, and calls
``MPI_Abort``, which takes every rank down at once (a rank that merely exited would
leave the others blocked in a collective); a rank killed outright is reaped by the
launcher (MPICH's hydra, Open MPI's mpirun), which then kills the rest.  Checks that
every rank makes alike on the same data (settings differing across ranks, a batch
the ranks do not divide) raise ``CollectiveError`` on every rank, and the job exits
with status 2 and one message.

mpi4py is imported only when data parallelism is asked for (``pip install
'adtape[mpi]'``).
"""
import array
import contextlib
import fcntl
import functools
import os
import stat
import sys
import termios
import time
import traceback
import zlib

import numpy as np

from adtape import buffers, nn
from gpt2 import checkpoint as ckpt
from gpt2.offload import MomentOffload
from gpt2.params import ParamArena, layer_major_offsets, num_parameters
from gpt2.state import TrainingState
from kernels import optim

DEFAULT_BUCKET_BYTES = 25 << 20
# Each rank's part of a bucket is a whole number of cache lines (16 floats).
_PART_ALIGN = 16
# Environment variables through which launchers announce the job's size (MPICH and
# Intel MPI's hydra, Open MPI, PMIx launchers such as srun --mpi=pmix).
_SIZE_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")
_LOCAL_SIZE_ENV = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
# The longest a failing rank waits for the launcher to read its error line (see
# _write_before_abort); the launcher reads it within milliseconds even on a loaded machine.
_DRAIN_SECONDS = 2.0
# The largest piece of a LoRA model's frozen base one broadcast sends.
_BROADCAST_BYTES = 1 << 30


class CollectiveError(RuntimeError):
    """An error every rank raises alike (a check made on the same or all-gathered data),
    so the ranks can stop together without ``MPI_Abort``."""


def launched_ranks(environ=None):
    """How many ranks the MPI launcher started (1 outside a launcher)."""
    environ = os.environ if environ is None else environ
    for name in _SIZE_ENV:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return 1


def local_ranks(environ=None):
    """Ranks of this job on this host, as the launcher says (1 if it does not)."""
    environ = os.environ if environ is None else environ
    for name in _LOCAL_SIZE_ENV:
        if environ.get(name, "").isdigit():
            return max(1, int(environ[name]))
    return 1


def import_mpi():
    """mpi4py's ``MPI`` module, or an ImportError that says how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError("data-parallel training needs mpi4py and an MPI library: "
                          f"pip install 'adtape[mpi]' ({e})") from e
    return MPI


def check_same_settings(comm, settings):
    """Raise CollectiveError on every rank unless all ranks pass equal ``settings``
    (a dict of plain values: model config, batch, sequence length, seed, ...)."""
    everyone = comm.allgather(settings)
    problems = []
    for key in sorted(set().union(*everyone), key=str):
        values = [s.get(key) for s in everyone]
        if any(v != values[0] for v in values):
            shown = ", ".join(f"rank {r} has {v!r}" for r, v in enumerate(values))
            problems.append(f"{key}: {shown}")
    if problems:
        raise CollectiveError("the ranks were started with different settings: "
                              + "; ".join(problems))


def report_and_abort(comm, exc, debug=False):
    """Print ``exc`` naming this rank and stop the whole job.  A CollectiveError is
    raised by every rank alike: rank 0 prints it once and all exit with status 2
    without aborting; an exception whose ``every_rank`` is true (a stop on a signal that
    the ranks agreed on) is raised again as it is.  Anything else aborts the job: the
    other ranks may be blocked in a collective that this rank will never join.  The
    failing rank prints one line, ``error: rank r of N: ...``; ``debug`` adds the
    traceback after it and leaves MPI's own abort message in place."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if isinstance(exc, CollectiveError):
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    if getattr(exc, "every_rank", False):
        raise exc
    detail = ""
    if isinstance(exc, KeyboardInterrupt) or hasattr(exc, "exit_status"):
        # A signal (gpt2.train.Interrupted): no traceback, its exit status.
        text, code = str(exc) or "interrupted", getattr(exc, "exit_status", 130)
    elif isinstance(exc, SystemExit):
        if exc.code in (None, 0):
            raise exc
        text = exc.code if isinstance(exc.code, str) else f"exit status {exc.code}"
        text = text[len("error: "):] if text.startswith("error: ") else text
        code = exc.code if isinstance(exc.code, int) else 2
    else:
        text, code = f"{type(exc).__name__}: {exc}", 1
        if debug:
            detail = f"rank {rank} of {size}: " + "".join(traceback.format_exception(exc))
    _write_before_abort(f"error: rank {rank} of {size}: {text}; aborting all ranks\n{detail}")
    if not debug:
        # MPICH's own "Abort(1) on node ...: application called MPI_Abort" line, which
        # reaches the terminal or not as the teardown goes: the rank's one line is ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    comm.Abort(code)
    # MPICH's MPI_Abort returns while the launcher tears the job down: print nothing more.
    os._exit(code)


def _write_before_abort(text):
    """Write ``text`` to stderr (fd 2) and return once the launcher has read it, or
    after _DRAIN_SECONDS.  MPICH's mpiexec exits as soon as it handles the abort: what
    the rank wrote to its stdout or stderr pipe and the launcher's proxy has not read
    yet is lost.  The proxy reads the pipe and forwards the text upstream in one step,
    ahead of the abort that MPI_Abort sends after it, so the text arrives once the pipe
    is empty.  A stream that is not a pipe (a file, a terminal) is written through."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):    # closed or broken: the error line still goes
            pass
    data = text.encode(errors="backslashreplace")
    try:
        while data:
            data = data[os.write(2, data):]
    except OSError:     # no stderr to write to: nothing to wait for either
        return
    deadline = time.monotonic() + _DRAIN_SECONDS
    for fd in (1, 2):
        while _unread_bytes(fd) and time.monotonic() < deadline:
            time.sleep(0.001)


def _unread_bytes(fd):
    """Bytes written to ``fd`` that its reader has not read yet: those in the pipe when
    ``fd`` is one (Linux's FIONREAD answers on either end), else 0."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        count = array.array("i", [0])
        fcntl.ioctl(fd, termios.FIONREAD, count, True)
    except OSError:
        return 0
    return count[0]


@contextlib.contextmanager
def fail_together(comm, error_type):
    """Run the block on every rank of ``comm`` (nothing more with none) and agree on its
    outcome: where it raised ``error_type`` on any rank, rank 0 raises that error (its
    own, or the lowest failing rank's, named) and the other ranks exit with status 2
    silently, so that a bad option the ranks all see is one line, not one a rank."""
    if comm is None:
        yield
        return
    caught = None
    try:
        yield
    except error_type as e:
        caught = e
    failures = comm.allgather(None if caught is None else str(caught))
    failed = [r for r, f in enumerate(failures) if f is not None]
    if not failed:
        return
    if comm.Get_rank() != 0:
        raise SystemExit(2)
    if caught is not None:
        raise caught
    raise error_type(f"rank {failed[0]} of {comm.Get_size()}: {failures[failed[0]]}")


@contextlib.contextmanager
def abort_on_error(comm, debug=False):
    """Run the block; on any exception in this rank, ``report_and_abort`` (with no
    communicator, nothing: one process)."""
    try:
        yield
    except BaseException as exc:
        if comm is not None:
            report_and_abort(comm, exc, debug)
        raise


def install_abort_hook(comm, debug=False):
    """Make an uncaught exception in this process abort the whole job (for scripts
    that run under mpiexec without ``abort_on_error``)."""
    def hook(kind, exc, tb):
        if isinstance(exc, CollectiveError):
            if comm.Get_rank() == 0:
                print(f"error: {exc}", file=sys.stderr, flush=True)
            return
        report_and_abort(comm, exc, debug)

    sys.excepthook = hook


class BucketLayout:
    """The gradient arena of ``n`` floats, padded to ``padded`` (a multiple of N part
    alignments), cut into buckets [start, stop) whose sizes divide by N: rank r's part
    of bucket b is [start + r * part, start + (r + 1) * part), and under ZeRO-1 it sits
    at ``shard_offsets[b]`` of the rank's shard."""

    def __init__(self, n, ranks, bucket_bytes, cuts=()):
        if bucket_bytes < 4:
            raise ValueError(f"bucket_bytes must be at least 4, got {bucket_bytes}")
        quantum = ranks * _PART_ALIGN
        self.n = n
        self.ranks = ranks
        self.padded = -(-n // quantum) * quantum
        size = max(quantum, bucket_bytes // 4 // quantum * quantum)
        # A bucket ends at each cut (rounded down to whole parts), so the buckets before
        # it can be launched on their own.  Each run between cuts is cut from its end:
        # the reverse sweep finishes it from there, and its last bucket, the one the
        # sweep leaves exposed, is the short remainder.
        edges = sorted({0, self.padded} | {c // quantum * quantum for c in cuts
                                           if 0 < c < self.padded})
        self.bounds = [(max(start, e - size), e) for start, stop in zip(edges, edges[1:])
                       for e in reversed(range(stop, start, -size))]
        self.parts = [(stop - start) // ranks for start, stop in self.bounds]
        self.shard_offsets = np.concatenate(([0], np.cumsum(self.parts)[:-1])).tolist()
        self.shard_size = self.padded // ranks

    def buckets_overlapping(self, start, stop):
        """Indices of the buckets that [start, stop) touches."""
        return [b for b, (s, e) in enumerate(self.bounds) if s < stop and start < e]

    def shard_to_full(self, shards):
        """Arrays (N, shard_size), rank r's shard in row r -> the flat arena of n."""
        full = np.empty(self.padded, np.float32)
        for (start, stop), part, off in zip(self.bounds, self.parts, self.shard_offsets):
            full[start:stop] = shards[:, off:off + part].reshape(-1)
        return full[:self.n]

    def full_to_shards(self, flat):
        """The flat arena of n -> (N, shard_size), rank r's shard in row r."""
        padded = np.zeros(self.padded, np.float32)
        padded[:self.n] = flat
        shards = np.empty((self.ranks, self.shard_size), np.float32)
        for (start, stop), part, off in zip(self.bounds, self.parts, self.shard_offsets):
            shards[:, off:off + part] = padded[start:stop].reshape(self.ranks, part)
        return shards


class ZeroShardState(TrainingState):
    """ZeRO-1's training state: a replicated state's parameters and gradients (in the
    sweep's order, over the trainer's padded buffers) with this rank's share of the
    moments only, ``shard_m`` and ``shard_v`` (each bucket's part ``layout`` gives this
    rank), or with ``offloaded`` their ``MomentOffload`` on disk (``shard_offload``: its
    file moves on its own I/O thread, not the tape engine's, so ``offload`` is None).
    The reduce-scatter leaves this rank's part of the summed gradient in ``shard_grad``;
    ``adamw`` updates this rank's part of every bucket and all-gathers the parameters,
    bucket by bucket.  Anything else is the replicated state's (a LoRA state's adapters,
    dropout stream and merge)."""

    def __init__(self, replica, layout, comm, params_padded, offloaded=False, spill_dir=None):
        super().__init__()
        self.replica, self.layout, self.comm = replica, layout, comm
        self.MPI = import_mpi()
        self.rank = comm.Get_rank()
        self.params, self.grads, self.lora = replica.params, replica.grads, replica.lora
        self.step = replica.step
        self.params_padded = params_padded
        self.shard_grad = buffers.zeros(layout.shard_size)
        self.shard_offload = self.shard_m = self.shard_v = None
        if offloaded:
            r = self.rank
            self.shard_offload = MomentOffload.for_shard(
                [(start + r * part, off, part) for (start, _), part, off
                 in zip(layout.bounds, layout.parts, layout.shard_offsets)],
                spill_dir=spill_dir)
        else:
            self.shard_m = buffers.zeros(layout.shard_size)
            self.shard_v = buffers.zeros(layout.shard_size)

    def __getattr__(self, name):
        # Only reached when normal lookup fails.
        if name == "replica":
            raise AttributeError(name)
        return getattr(self.replica, name)

    def begin_step(self):
        if self.shard_offload is not None:
            self.shard_offload.read_ahead()     # the first units, while the step computes

    def grad_norm(self):
        """The norm of this rank's part of the summed gradient."""
        return optim.grad_norm(self.shard_grad)

    def clip_grad_norm(self, max_norm):
        raise NotImplementedError("under ZeRO-1 each rank holds a part of the gradient: clip "
                                  "through DataParallelTrainer.train_step(..., grad_clip=)")

    def adamw(self, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, grad_scale=1.0,
              defer=False):
        self.step += 1
        layout, r, offload = self.layout, self.rank, self.shard_offload
        requests = []
        if offload is not None:
            offload.begin(self.params_padded, self.shard_grad, self.step, lr, beta1, beta2,
                          eps, weight_decay, grad_scale)
        for b, ((start, stop), part, off) in enumerate(zip(layout.bounds, layout.parts,
                                                          layout.shard_offsets)):
            if offload is not None:
                offload.ready(b)          # this bucket's share, streamed from disk
            else:
                mine = slice(start + r * part, start + (r + 1) * part)
                shard = slice(off, off + part)
                optim.adamw_step(self.params_padded[mine], self.shard_grad[shard],
                                 self.shard_m[shard], self.shard_v[shard], self.step, lr,
                                 beta1, beta2, eps, weight_decay, grad_scale=grad_scale)
            requests.append(self.comm.Iallgather(self.MPI.IN_PLACE,
                                                 self.params_padded[start:stop]))
        self.MPI.Request.Waitall(requests)

    def sections(self):
        """Collective: the moments gathered from the shards into whole arenas on rank 0
        (None on the others)."""
        moments = []
        shards_of = ((self.shard_m, self.shard_v) if self.shard_offload is None
                     else (self.shard_offload.read_flat(0), self.shard_offload.read_flat(1)))
        for moment in shards_of:
            shards = (np.empty((self.comm.Get_size(), self.layout.shard_size), np.float32)
                      if self.rank == 0 else None)
            self.comm.Gather(moment, shards, root=0)
            moments.append(self.params.in_sweep_order(self.layout.shard_to_full(shards))
                           if self.rank == 0 else None)
        return (self.params, *moments)

    def load_moment(self, which, flat):
        """Set this rank's share of moment ``which`` from the whole ``flat`` (None:
        zeros)."""
        flat = None if flat is None else self.layout.full_to_shards(flat)[self.rank]
        self._set_shard(which, flat)

    def share_moment(self, which, flat, comm):
        """Collective: each rank's share of moment ``which`` scattered from rank 0's whole
        ``flat`` (the others pass None)."""
        mine = buffers.empty(self.layout.shard_size)
        comm.Scatter(self.layout.full_to_shards(flat) if self.rank == 0 else None, mine,
                     root=0)
        self._set_shard(which, mine)

    def _set_shard(self, which, shard):
        if self.shard_offload is not None:
            self.shard_offload.write_flat(which, np.zeros(self.shard_offload.n, np.float32)
                                          if shard is None else shard)
        elif shard is None:
            (self.shard_m, self.shard_v)[which].fill(0.0)
        else:
            (self.shard_m, self.shard_v)[which][...] = shard

    @property
    def nbytes(self):
        shards = (self.shard_offload.window_bytes if self.shard_offload is not None
                  else self.shard_m.nbytes + self.shard_v.nbytes)
        return self.params.nbytes + self.grads.nbytes + self.shard_grad.nbytes + shards

    def close(self):
        if self.shard_offload is not None:
            self.shard_offload.close()


class DataParallelTrainer:
    """Trains a ``Model`` with the ranks of ``comm`` sharing each global batch.

    ``train_step(inputs, targets, ...)`` takes the *global* batch (every rank passes
    the same one) and uses its rank's rows; it returns the loss and gradient norm of
    the whole batch, the same on every rank.  ``settings``: values every rank must
    agree on (batch size, sequence length, seed, data checksum ...) besides the model
    config, checked at construction.
    """

    def __init__(self, model, comm, zero=0, bucket_bytes=DEFAULT_BUCKET_BYTES, settings=None):
        if zero not in (0, 1):
            raise ValueError(f"zero must be 0 or 1, got {zero!r}")
        self.MPI = import_mpi()
        self.model = model
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.zero = zero
        model_settings = {f"model {k}": v for k, v in model.config.to_dict().items()}
        adapter = model.adapter
        if adapter is not None:
            model_settings.update({f"lora {k}": v for k, v in model.lora.to_dict().items()},
                                  base_dtype=model.base_dtype)
        check_same_settings(comm, {**model_settings, "engine": model.engine, "zero": zero,
                                   "bucket_bytes": int(bucket_bytes), **(settings or {})})
        config = model.config
        if adapter is not None:
            n, cuts = adapter.num_parameters, ()
        else:
            n = num_parameters(config)
            offsets = layer_major_offsets(config)
            # A bucket never straddles the end of a parameter before the blocks (GPT-2:
            # wte, wpe), a block boundary or the start of a block's attention projection:
            # the upper part of each block (attention projection and MLP, 21 MB in GPT-2
            # 124M) is final before the sweep runs the block's attention backward, the
            # lower part (ln1, qkv: 7 MB) when it leaves the block; block 0's lower part
            # is all of the blocks the sweep leaves exposed.
            first_block = offsets[config.per_layer[0], 0][0]
            cuts = [stop for (name, l), (_, stop) in offsets.items() if stop <= first_block]
            cuts += [offsets[name, l][0] for l in range(config.n_layer)
                     for name in (config.per_layer[0], "attprojw")]
        self.layout = BucketLayout(n, self.size, bucket_bytes, cuts=cuts)
        if model._tape_engine is not None:
            raise ValueError("build the DataParallelTrainer before the model's first step")
        state = model.state
        if state.params is None:
            raise ValueError(f"data parallel training offloads the AdamW moments only, not "
                             f"offload={model.offload!r}")
        # Parameters and gradients move into arenas in the sweep's order (layer-major, or
        # the adapters') padded to the layout, so every bucket divides evenly among the
        # ranks; the padding stays zero.
        self.params_padded = buffers.zeros(self.layout.padded)
        self.grads_padded = buffers.zeros(self.layout.padded)
        state.params = state.params.in_sweep_order(self.params_padded[:n]).copy_(state.params)
        state.grads = state.grads.in_sweep_order(self.grads_padded[:n])
        if adapter is not None:
            adapter.rng = np.random.Generator(adapter.rng.bit_generator.jumped(self.rank))
            self._broadcast_base()
        comm.Bcast(self.params_padded, root=0)
        # The moments: in the sweep's order too (on disk where they were), or under
        # ZeRO-1 this rank's share only (ZeroShardState, around the state's parameters
        # and gradients).
        offload = state.offload
        if offload is not None:
            offload.close()
            state.offload = None
        if zero:
            state.adam_m = state.adam_v = None
            state = ZeroShardState(state, self.layout, comm, self.params_padded,
                                   offload is not None,
                                   offload.spill_dir if offload is not None else None)
        elif offload is not None:
            state.offload = MomentOffload.for_model(config, spill_dir=offload.spill_dir,
                                                    layer_major=True)
        else:
            state.adam_m, state.adam_v = (m.in_sweep_order(buffers.empty(n)).copy_(m)
                                          for m in (state.adam_m, state.adam_v))
        self.state = model.state = state
        self._requests = []
        self._pending = None
        self._initial_pending = [0] * len(self.layout.bounds)
        # The tied embedding: the rows of wte the step's encoder adds to, and the
        # encoder's part of their gradient (see _wte_hook).
        self._batch_rows = None
        self._wte_scratch = None
        self._wte_view = None
        self._encoder_rows = None
        if model.engine == "tape":
            self._hook_leaves()
        # The last step: milliseconds of "backward" (forward and backward), "wait"
        # (blocked on the gradient collectives after the backward) and "update" (norm,
        # AdamW and, under ZeRO-1, the parameter all-gather); "buckets_in_backward":
        # buckets the sweep's hooks launched before the backward ended.
        self.last_step = {}

    # This rank's moments and its part of the reduced gradient, by the names they have
    # always had here.

    @property
    def adam_m(self):
        """This rank's first moment as a flat array: ZeRO-1's shard, else the whole
        arena's; None on disk."""
        return self._moment(0)

    @property
    def adam_v(self):
        return self._moment(1)

    def _moment(self, which):
        if self.zero:
            return (self.state.shard_m, self.state.shard_v)[which]
        arena = (self.state.adam_m, self.state.adam_v)[which]
        return None if arena is None else arena.flat

    @property
    def shard_grad(self):
        return self.state.shard_grad

    def _broadcast_base(self):
        """Give every rank rank 0's frozen base (a LoRA model's), in pieces of at most
        _BROADCAST_BYTES (MPI counts are ints)."""
        base = self.model.params
        tensors = [base.flat] if isinstance(base, ParamArena) else list(base.views.values())
        for tensor in tensors:
            raw = memoryview(tensor).cast("B")     # a TypeError if not contiguous
            for start in range(0, len(raw), _BROADCAST_BYTES):
                self.comm.Bcast(raw[start:start + _BROADCAST_BYTES], root=0)

    # -- gradient buckets -----------------------------------------------------------

    def _hook_leaves(self):
        from gpt2.tape_engine import TapeEngine
        model = self.model
        engine = model._tape_engine = TapeEngine(model, model.tape_kwargs, model.checkpointing,
                                                 model.snapshots)
        base = self.grads_padded.ctypes.data
        for leaf in engine.leaves():
            start = (leaf.grad.ctypes.data - base) // 4
            stop = start + leaf.grad.size
            buckets = tuple(self.layout.buckets_overlapping(start, stop))
            for b in buckets:
                self._initial_pending[b] += 1
            if leaf is engine.globals["wte"]:
                inside = tuple(b for b in buckets if self.layout.bounds[b][1] <= stop)
                rest = tuple(b for b in buckets if b not in inside)
                leaf.register_grad_hook(functools.partial(self._wte_hook, inside, rest))
            else:
                leaf.register_grad_hook(functools.partial(self._leaf_hook, buckets))

    def _leaf_hook(self, buckets, leaf, remaining):
        if self._pending is None:       # a backward outside a step
            return
        # MPICH advances non-blocking collectives only inside MPI calls, one stage of a
        # bucket's algorithm per call (about six for 25 MB on 2 ranks): poke it at
        # every hook, between backward kernels.
        self.MPI.Request.Testall(self._requests)
        if remaining:                   # not final yet
            return
        pending = self._pending
        for b in buckets:
            pending[b] -= 1
            if pending[b] == 0:
                self._launch(b)
            elif pending[b] < 0:
                raise RuntimeError("a parameter's gradient changed after its bucket's "
                                   "allreduce was launched (a leaf swept twice in one step)")

    def _wte_hook(self, inside, rest, leaf, remaining):
        """The tied embedding is read first by the encoder and last by the LM head, so
        the sweep finishes its gradient only at the very end (a third of GPT-2 124M's
        gradient); but the encoder adds to the rows of the batch's tokens alone.  Once
        the LM head's dense part is in, the buckets wholly inside wte are launched and
        the encoder adds into a scratch buffer instead; those rows are summed across
        ranks on their own (a few MB) and added to the reduced gradient after the wait
        (``_add_encoder_rows``)."""
        if self._pending is None:
            return
        if remaining == 1:
            for b in inside:
                self._launch(b)
            if self._wte_scratch is None:
                # Only the batch's rows are ever written, so only their pages are touched.
                self._wte_scratch = buffers.empty(leaf.grad.shape)
            self._wte_scratch[self._batch_rows] = 0.0
            self._wte_view = leaf.grad
            leaf.grad = self._wte_scratch
            self.MPI.Request.Testall(self._requests)
        elif remaining == 0:
            if self._wte_view is None:
                self._leaf_hook(inside + rest, leaf, 0)
                return
            leaf.grad, self._wte_view = self._wte_view, None
            self._encoder_rows = self._wte_scratch[self._batch_rows]
            self._requests.append(self.comm.Iallreduce(self.MPI.IN_PLACE, self._encoder_rows,
                                                       op=self.MPI.SUM))
            self._leaf_hook(rest, leaf, 0)

    def _add_encoder_rows(self):
        """Add the encoder's rows of wte, summed across ranks, where the reduced
        gradient lives (this rank's shard under ZeRO-1)."""
        rows, values = self._batch_rows, self._encoder_rows
        self._encoder_rows = None
        if not self.zero:
            self.model.grads.wte[rows] += values
            return
        # Rank r holds [start + r * part, start + (r + 1) * part) of each bucket: the rows
        # wholly inside it are added as rows of a 2-D view of the shard, the at most two
        # rows cut by its ends float by float (an index per float took 35-60 ms for GPT-2
        # 124M at a global (8, 256) on a 2-core Zen 3, this 6-10 ms, all inside the wait).
        C = values.shape[1]
        wte_size = self.model.grads.wte.size
        layout = self.layout
        for b in layout.buckets_overlapping(0, wte_size):
            (start, _), part, off = layout.bounds[b], layout.parts[b], layout.shard_offsets[b]
            lo = start + self.rank * part
            hi = min(lo + part, wte_size)
            if lo >= hi:
                continue
            shard = self.shard_grad[off:off + hi - lo]
            first, end = -(-lo // C), hi // C                  # rows wholly in [lo, hi)
            if first < end:
                i, j = np.searchsorted(rows, (first, end))
                whole = shard[first * C - lo:end * C - lo].reshape(end - first, C)
                whole[rows[i:j] - first] += values[i:j]
            for row in sorted({lo // C, (hi - 1) // C}):
                i = np.searchsorted(rows, row)
                if not first <= row < end and i < rows.size and rows[i] == row:
                    a, e = max(lo, row * C), min(hi, (row + 1) * C)
                    shard[a - lo:e - lo] += values[i, a - row * C:e - row * C]

    def _launch(self, b):
        MPI = self.MPI
        start, stop = self.layout.bounds[b]
        grads = self.grads_padded[start:stop]
        if self.zero:
            off, part = self.layout.shard_offsets[b], self.layout.parts[b]
            request = self.comm.Ireduce_scatter_block(grads, self.shard_grad[off:off + part],
                                                      op=MPI.SUM)
        else:
            request = self.comm.Iallreduce(MPI.IN_PLACE, grads, op=MPI.SUM)
        self._pending[b] = -1 << 30     # launched: no further hook may touch it
        self._requests.append(request)

    # -- the step ---------------------------------------------------------------------

    def local_rows(self, batch_size):
        """The rows of a global batch of ``batch_size`` that this rank trains on."""
        if batch_size % self.size:
            raise CollectiveError(f"the global batch size B={batch_size} is not divisible by "
                                  f"the {self.size} ranks: use a multiple of {self.size}")
        per_rank = batch_size // self.size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def micro_batches(self, batch_size, grad_accum):
        """This rank's rows of a global batch of ``batch_size`` as ``grad_accum`` equal
        micro-batches (slices of those rows); CollectiveError if they cannot be equal."""
        from gpt2.model import micro_batches
        per_rank = self.local_rows(batch_size)
        per_rank = per_rank.stop - per_rank.start
        if per_rank % grad_accum:
            raise CollectiveError(f"--grad-accum {grad_accum}: -B {batch_size} does not split "
                                  f"into {grad_accum} equal micro-batches per rank (B/"
                                  f"{self.size} = {per_rank}); use a -B that divides by "
                                  f"{self.size * grad_accum}")
        return micro_batches(per_rank, grad_accum)

    def train_step(self, inputs, targets, lr, weight_decay=0.0, grad_clip=None, grad_accum=1):
        """One step on the global batch; returns (loss, gradient norm or None), both of
        the whole batch and equal on every rank.

        ``grad_accum`` N > 1: this rank's B/ranks rows run as N micro-batches, their
        gradients summed locally; only the last micro-batch's backward launches the
        bucket collectives (the hooks are off during the others), so the gradients
        cross the network once per step, as without accumulation.

        Targets of IGNORE_INDEX take no loss: each micro-batch's loss sum divides by
        1/(ranks x N) of the global batch's counted targets (every rank has the global
        batch), so that the summed gradients, scaled by 1/(ranks x N) in AdamW, are the
        global batch's mean; with nothing ignored that share is a micro-batch's size, the
        plain mean of each."""
        MPI = self.MPI
        model = self.model
        inputs, targets = np.asarray(inputs), np.asarray(targets)
        if inputs.ndim != 2:
            raise ValueError(f"inputs must have shape (B, T), got {inputs.shape}")
        rows = self.local_rows(inputs.shape[0])
        micro = self.micro_batches(inputs.shape[0], grad_accum)
        # The rows of wte the encoder may write: of the global batch, so that every rank
        # reduces the same rows (see _wte_hook).
        batch_rows = np.unique(inputs)
        share = nn.loss_denominator(targets) / (self.size * grad_accum)
        inputs, targets = inputs[rows], targets[rows]
        self.state.begin_step()
        t0 = time.perf_counter()
        model.zero_grad(deferred=True)
        self._requests = []
        self._pending = None        # the hooks do nothing until the last micro-batch
        try:
            loss = 0.0
            for i, part in enumerate(micro):
                if i == len(micro) - 1:
                    self._pending = list(self._initial_pending)
                    self._batch_rows = batch_rows
                loss += model.loss_and_grad(inputs[part], targets[part],
                                            loss_denominator=share)
            if grad_accum > 1:
                loss /= grad_accum
            # Buckets no hook launched (the manual engine has no hooks), in reverse
            # arena order, as the backward finishes them.
            late = [b for b in reversed(range(len(self.layout.bounds))) if self._pending[b] >= 0]
            for b in late:
                self._launch(b)
        finally:
            self._pending = None
            if self._wte_view is not None:      # a sweep that failed between the wte hooks
                model._tape_engine.globals["wte"].grad = self._wte_view
                self._wte_view = None
        t1 = time.perf_counter()
        MPI.Request.Waitall(self._requests)
        self._requests = []
        if self._encoder_rows is not None:
            self._add_encoder_rows()
        t2 = time.perf_counter()
        local = self.state.grad_norm()
        if self.zero:       # each rank holds a part of the summed gradient
            gathered = self.comm.allgather((loss, local ** 2))
            sq = sum(g[1] for g in gathered)    # rank order: the same bits everywhere
            norm = float(np.sqrt(sq)) / self.size
        else:
            gathered = self.comm.allgather((loss, 0.0))
            norm = local / self.size
        loss = sum(g[0] for g in gathered) / self.size
        if grad_accum > 1:
            norm /= grad_accum          # the local sums were over grad_accum micro-batches
        scale = optim.clip_coefficient(norm, grad_clip) if grad_clip else 1.0
        # The collectives summed the gradients: 1/N makes them the mean (and 1/grad_accum
        # the mean over the micro-batches).
        self.state.adamw(lr, weight_decay=weight_decay, grad_scale=scale / self.size / grad_accum)
        t3 = time.perf_counter()
        self.last_step = {"backward_ms": (t1 - t0) * 1e3, "wait_ms": (t2 - t1) * 1e3,
                          "update_ms": (t3 - t2) * 1e3,
                          "buckets_in_backward": len(self.layout.bounds) - len(late)}
        return loss, (norm if grad_clip else None)

    def communication_ms(self, repeats=5):
        """This step's collectives run alone, blocking, bucket by bucket, on scratch
        buffers: {"reduce_ms": the gradient allreduce (ZeRO-1: reduce-scatter),
        "allgather_ms": ZeRO-1's parameter all-gather (0 without)}, medians of
        ``repeats``: the communication the overlap has to hide."""
        MPI = self.MPI
        scratch = buffers.zeros(self.layout.padded)
        shard = buffers.zeros(self.layout.shard_size)
        buckets = list(zip(self.layout.bounds, self.layout.parts, self.layout.shard_offsets))
        reduce_ms, allgather_ms = [], []
        for _ in range(repeats):
            self.comm.Barrier()
            t0 = time.perf_counter()
            for (start, stop), part, off in buckets:
                if self.zero:
                    self.comm.Reduce_scatter_block(scratch[start:stop], shard[off:off + part],
                                                   op=MPI.SUM)
                else:
                    self.comm.Allreduce(MPI.IN_PLACE, scratch[start:stop], op=MPI.SUM)
            t1 = time.perf_counter()
            if self.zero:
                for (start, stop), _, _ in buckets:
                    self.comm.Allgather(MPI.IN_PLACE, scratch[start:stop])
            reduce_ms.append((t1 - t0) * 1e3)
            allgather_ms.append((time.perf_counter() - t1) * 1e3)
        return {"reduce_ms": float(np.median(reduce_ms)),
                "allgather_ms": float(np.median(allgather_ms))}

    # -- checkpoints --------------------------------------------------------------------

    def optimizer_state(self):
        """(adam_m, adam_v) as whole arenas in the trainer's order on rank 0 (gathered
        from the shards under ZeRO-1), None on the other ranks; collective."""
        _, adam_m, adam_v = self.state.sections()
        return (adam_m, adam_v) if self.rank == 0 else (None, None)

    def _agree(self, fn):
        """Run ``fn`` on rank 0 and share its outcome: its result on every rank, or the
        same CollectiveError on every rank if it raised."""
        result, failure = None, None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as e:     # reported on every rank just below
                failure = f"{type(e).__name__}: {e}"
        result, failure = self.comm.bcast((result, failure), root=0)
        if failure is not None:
            raise CollectiveError(f"rank 0: {failure}")
        return result

    def agree_max(self, values):
        """The elementwise maximum over the ranks of small non-negative ints (a signal
        number, a flag): what one rank saw, every rank acts on at the same step."""
        local = np.asarray(values, np.int64)
        result = np.empty_like(local)
        self.comm.Allreduce(local, result, op=import_mpi().MAX)
        return tuple(int(v) for v in result)

    def save_checkpoint(self, path, *, step, data_state=None, extra=None, after_write=None):
        """Write the ordinary checkpoint (``gpt2.checkpoint.save_state``; a LoRA model's:
        its adapters) from rank 0, then call ``after_write()`` there if given (a LoRA
        run's peft adapter directory); every rank calls it.  A failure to write fails
        every rank alike."""
        sections = self.state.sections()       # collective: ZeRO-1 gathers the moments
        extra = {**(extra or {}), "ranks": self.size, "zero": self.zero}

        def write():
            ckpt.save_state(path, self.state, step=step, data_state=data_state, extra=extra,
                            sections=sections)
            if after_write is not None:
                after_write()

        self._agree(write)

    def load_checkpoint(self, path):
        """Read a checkpoint written at any number of ranks (or by one process) on rank 0,
        broadcast the parameters and hand each rank its moments (its shard under
        ZeRO-1).  Returns the ``Checkpoint`` with the state's parameters as ``params`` and
        no moments (they are in the state).  A LoRA model reads a LoRA run's checkpoint
        of the same adapters (its base is the model's own)."""
        state, n = self.state, self.layout.n
        loaded = {}

        def read():
            # The moments into whole arenas in the trainer's order (the file's are in
            # llm.c order; an adapter arena's order is the same in both).
            moments = [state.params.in_sweep_order(buffers.empty(n)) for _ in range(2)]
            loaded["state"] = ckpt.load_state(path, state, self.model.config,
                                              sections=(state.params, *moments))
            return {"step": loaded["state"].step, "adam_step": loaded["state"].adam_step,
                    "data_state": loaded["state"].data_state, "extra": loaded["state"].extra,
                    "has_moments": loaded["state"].adam_m is not None}

        header = self._agree(read)
        self.comm.Bcast(self.params_padded, root=0)
        state.step = header["adam_step"]
        for which, name in enumerate(("adam_m", "adam_v")):
            if not header["has_moments"]:
                state.load_moment(which, None)
            else:
                state.share_moment(which, getattr(loaded["state"], name).flat
                                   if self.rank == 0 else None, self.comm)
        return ckpt.Checkpoint(config=self.model.config, params=state.params,
                               step=header["step"], adam_m=None, adam_v=None,
                               adam_step=header["adam_step"], data_state=header["data_state"],
                               extra=header["extra"], lora=state.lora)


def tokens_checksum(tokens):
    """CRC32 of a token array: ranks reading different data disagree on it."""
    return zlib.crc32(memoryview(np.ascontiguousarray(tokens)).cast("B"))


# -- the command line (gpt2.train) ----------------------------------------------------------

def world_from_args(args):
    """The communicator ``gpt2-train``'s options and launcher ask for, or None for one
    process.  On a data-parallel run, each rank defaults to its share of this host's
    cores, and the ranks other than 0 print nothing and skip evaluation and sampling
    (rank 0 shows the progress and writes the log, plot and summary)."""
    ranks = launched_ranks()
    if args.data_parallel == "off":
        if ranks > 1:
            raise ValueError(f"off, but the launcher started {ranks} ranks: each would "
                             "train alone into the same --out-dir")
        return None
    if args.data_parallel == "auto" and ranks == 1:
        return None
    MPI = import_mpi()
    comm = MPI.COMM_WORLD
    if args.threads is None and not os.environ.get("OMP_NUM_THREADS"):
        from kernels.threads import available_cores
        args.threads = max(1, available_cores() // local_ranks())
    if comm.Get_rank() != 0:
        sys.stdout = open(os.devnull, "w")
        args.no_progress = True
        args.eval_interval = 0
        args.sample_tokens = 0
    return comm


def trainer_from_args(model, comm, args, tokens):
    """The DataParallelTrainer for ``gpt2-train``'s options (None without ``comm``);
    every rank must agree on the settings that shape the global batch and the data."""
    if comm is None:
        return None
    settings = {"B": args.batch_size, "grad_accum": args.grad_accum, "T": args.seq_len,
                "seed": args.seed,
                "steps": args.steps, "lr": args.lr, "grad_clip": args.grad_clip,
                "weight_decay": args.weight_decay, "resume": args.resume,
                "data tokens": int(tokens.size), "data checksum": tokens_checksum(tokens)}
    trainer = DataParallelTrainer(model, comm, zero=args.zero, bucket_bytes=args.bucket_size,
                                  settings=settings)
    trainer.local_rows(args.batch_size)
    trainer.micro_batches(args.batch_size, args.grad_accum)
    from kernels import threads
    print(f"data parallel: {trainer.size} ranks x {threads.get_num_threads()} threads, global "
          f"batch B={args.batch_size} ({args.batch_size // trainer.size} per rank), "
          f"ZeRO-{args.zero}, {len(trainer.layout.bounds)} gradient buckets", flush=True)
    return trainer
