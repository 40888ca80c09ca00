"""Memory planner: the fastest way the tape engine can train a model within a memory limit.

``plan_memory(config, B, T, max_memory)`` lists the engine's memory policies -
everything in memory; a tape budget, past which saved activations spill to disk and are
prefetched back; per-layer checkpointing; binomial (Revolve) checkpointing with 1 to
n_layer - 1 snapshots; each checkpointing policy under a tape budget - predicts the step
time and the peak resident memory of each from this machine's profile, drops those over
the limit and returns the fastest as a ``MemoryPlan``.

Time is ``estimate``'s (the op graph on the calibrated roofline, recomputed blocks
included), plus the byte tape's copies and the spill I/O that compute does not hide
(the part of the largest record, the logits, that exceeds the budget: its push and
its pop wait on the disk).
Memory is counted the way the engine holds it:
- model states: parameters, gradients and both AdamW moments, four float32 arenas;
  with ``precision="bf16"`` (``--precision bf16``: the linear layers' products take bf16
  operands) also the products' weights' bf16 copies, which adtape.nn keeps from the
  forward pass until the weights change;
  under LoRA (``lora=``) the frozen base (4 bytes a parameter, or bf16 matrices) and the
  adapters' four arenas, no offload;
- saved activations, from the op graph: without a budget they are held by reference (an
  array two ops save counts once); with one they are copies on the byte tape, of which
  at most the budget, plus the slabs the tape keeps above it, stays resident;
  checkpointing keeps only block inputs (one per block, or Revolve's snapshots) and a
  re-run block's copies; under bf16 a linear layer saves its input as bf16 (half the
  bytes), so the same policy holds less and a limit that made fp32 spill or
  checkpoint may hold everything in bf16;
- the working set at the step's fullest moment, the loss's backward: the logits'
  gradient (mapped; with bf16 products also its bf16 copy, and where this machine
  emulates them the operands widened to float32) on top of the heap's high water, which
  the allocator keeps from wherever in the step it was reached (a block's forward arrays,
  or its backward's gradients and popped or recomputed activations);
- the process baseline (interpreter, libraries, thread pools, BLAS buffers) from the
  profile.
A policy fits when its predicted peak plus a safety margin (``MARGIN_FRACTION`` of it and
``MARGIN_BYTES``, ``required_memory``) is within the limit: what the count misses - the
BLAS and OpenMP buffers that a process planned before its first product touches later,
the data loader's batches, the sample - stays below the limit too.
"""
import math
import os
from dataclasses import dataclass, field, replace

from .estimate import estimate, tape_io_time
from .graph import GraphOptions, check_engine_precision, product_weight_params, step_graph
from .hardware import HardwareProfile, load_profile
from .memory import loss_backward_bytes, saved_by_layer
from .spec import LoraSpec, ModelSpec, ParallelConfig, Workload
from gpt2.state import OFFLOAD_POLICIES, planned_nbytes
from gpt2.units import UNIT_BYTES, format_size  # noqa: F401  (plan.format_size)

FLOAT_BYTES = 4
MODEL_STATE_ARENAS = 4          # parameters, gradients, AdamW m and v
# The byte tape may hold more than its budget: the head slab being filled, one spare
# slab kept for the next head (slabs are at most 2 MiB) and a spill unit (1 MiB) in
# flight to or from the disk.
TAPE_SLACK_BYTES = 2 * (2 << 20) + (1 << 20)
# The smallest tape budget considered: one spill unit.
MIN_TAPE_BUDGET = 1 << 20
HUGE_BYTES = 1 << 62
# The margin kept below --max-memory: the predicted peak times (1 + MARGIN_FRACTION) plus
# MARGIN_BYTES must fit.  Measured with gpt2-train's whole-process VmHWM on the 2-core Zen 3
# (GPT-2 small preset, (32, 128), 4 steps, in memory and under tape budgets): 13-15 MiB
# above the prediction at 158-268 MiB, the buffers the process's first products allocate
# after the planner took its baseline; GPT-2 124M at (2, 256) under a 114 MiB tape budget
# with the moments on disk: 1866.7 MiB against 1776.7 predicted (+5.1%, 90 MiB).
MARGIN_FRACTION = 0.05
MARGIN_BYTES = 16 << 20
# glibc's M_MMAP_THRESHOLD as kernels._openmp.set_malloc_retention sets it by default.
MMAP_THRESHOLD_BYTES = 1 << 30
# Tape budgets listed beside the largest one that fits: these shares of the activations.
BUDGET_SHARES = (2, 4, 8)
# Offloaded AdamW moments (gpt2.offload; what they hold in RAM: gpt2.state.planned_nbytes):
# the disk tier's checksum rate on one core (adtape.checksum_bytes: 11 GB/s on the 2-core
# Xeon), which the I/O thread spends on every byte read and written.
CHECKSUM_BYTES_PER_S = 11e9


@dataclass(frozen=True)
class Candidate:
    """One policy with its predicted step time and peak memory (``rejected``: why it was not chosen)."""
    policy: str
    checkpointing: str              # "none", "layer" or "binomial"
    snapshots: int                  # binomial: stored block inputs besides the first (0 otherwise)
    tape_budget: object             # bytes of saved activations kept in RAM, or None (no budget)
    predicted_ms: float
    predicted_peak_bytes: int
    memory: dict                    # component -> bytes
    time: dict                      # component -> ms
    rejected: str = ""
    offload: object = None          # None, or "moments": the AdamW moments on disk

    @property
    def fits(self):
        return not self.rejected


@dataclass
class MemoryPlan:
    """The chosen policy, how to run it, and every candidate that was weighed."""
    policy: str
    tape_budget: object             # bytes, or None
    checkpointing: str
    snapshots: int
    predicted_ms: float
    predicted_peak_bytes: int
    max_memory: int
    spill_dir: object
    candidates: list
    notes: list = field(default_factory=list)
    offload: object = None          # None, or "moments"
    precision: str = "fp32"         # the products' precision it was planned for
    lora: object = None             # the LoraSpec it was planned for, or None

    def describe(self):
        """One line: which policy, its predicted step time and peak against the limit."""
        products = " with bf16 products" if self.precision == "bf16" else ""
        if self.lora is not None:
            products += f" ({self.lora.describe()})"
        return (f"chose {self.policy}{products}: predicted {self.predicted_ms:.0f} ms/step, peak "
                f"{format_size(self.predicted_peak_bytes)} of {format_size(self.max_memory)} "
                f"(margin {describe_margin()} kept)")

    def engine_kwargs(self):
        """Keyword arguments of ``Model(config, engine="tape", **kwargs)`` that run this plan."""
        tape_kwargs = {}
        if self.tape_budget is not None:
            tape_kwargs["memory_budget"] = self.tape_budget
            if self.spill_dir is not None:
                tape_kwargs["spill_dir"] = self.spill_dir
        kwargs = {"tape_kwargs": tape_kwargs, "checkpointing": self.checkpointing,
                  "snapshots": self.snapshots}
        if self.offload is not None:
            kwargs.update(offload=self.offload, offload_dir=self.spill_dir)
        return kwargs

    def compare(self, measured_ms, measured_peak_bytes):
        """One line: measured step time and peak RSS against the prediction."""
        return (f"measured {measured_ms:.0f} ms/step ({measured_ms / self.predicted_ms - 1:+.1%} vs predicted "
                f"{self.predicted_ms:.0f}), peak RSS {format_size(measured_peak_bytes)} "
                f"({measured_peak_bytes / self.predicted_peak_bytes - 1:+.1%} vs predicted "
                f"{format_size(self.predicted_peak_bytes)})")

    def table(self):
        """Every candidate, fastest first, with its predicted time, peak and verdict."""
        lines = [f"{'policy':<52}{'ms/step':>10}{'peak':>12}{'spilled':>12}  verdict"]
        for c in sorted(self.candidates, key=lambda c: (c.predicted_ms, c.predicted_peak_bytes)):
            chosen = (c.policy == self.policy and c.tape_budget == self.tape_budget
                      and c.offload == self.offload)
            verdict = "CHOSEN" if chosen else (c.rejected or "fits, slower")
            lines.append(f"{c.policy:<52}{c.predicted_ms:>10.1f}{format_size(c.predicted_peak_bytes):>12}"
                         f"{format_size(c.memory['spilled']):>12}  {verdict}")
        lines += [f"note: {n}" for n in self.notes]
        lines.append(self.describe())
        return "\n".join(lines)


# kernels/bf16.pyx's emulated products widen the weight EMULATED_BLOCK floats of rows at
# a time (whole rows, at least one).
EMULATED_BLOCK = 1 << 23


def _widened_weight(fan_in, fan_out):
    """[bytes] of the emulated path's float32 block of a (fan_out x fan_in) weight."""
    rows = max(1, min(fan_out, EMULATED_BLOCK // max(fan_in, 1)))
    return 4.0 * rows * fan_in


# kernels/bf16.h's laid-out operands: depth pairs padded to 16, 32-row and 32-column
# panels, at most PACKED_CHUNK_PAIRS pairs of each operand at a time
PACKED_CHUNK_PAIRS = 1 << 21


def bf16_packed_bytes(M, N, K, a_rows_along_depth, b_in_place=False):
    """[bytes] of the buffer the packed bf16 paths (native, AMX) lay an M x N x K
    product's operands out in: B's panels (a chunk of columns; none where B is read in
    place, ``b_in_place``: the weight of dout @ W at few rows) and A's rows (a chunk of
    rows; where A's rows run along the depth, ``a_rows_along_depth``, and the depth is a
    multiple of 32, A is read in place and only its last M % 32 rows are copied)."""
    kpad = -(-((K + 1) // 2) // 16) * 16
    most = max(32, PACKED_CHUNK_PAIRS // kpad // 32 * 32)
    columns = 0 if b_in_place else min(-(-N // 32) * 32, most)
    if a_rows_along_depth and K % 32 == 0:
        a_pairs = 32 * kpad if M % 32 else 0
    else:
        a_pairs = min(-(-M // 32) * 32, most) * kpad
    return 4.0 * (a_pairs + columns * kpad)


def bf16_backward_scratch(rows, fan_in, fan_out, emulated, weight_gradient=True):
    """[bytes] of each scratch array kernels.bf16's backward of a (rows x fan_in) @ (fan_in x
    fan_out) product allocates: the output's gradient rounded to bf16; where the products
    are ``emulated`` that one in float32, the weight widened to float32 beside it, and for
    the weight's gradient the input too; else the laid-out operands of the input's
    gradient (dout read in place where it can be, the weight too at few rows) and the
    weight's (dout^T packed)."""
    if not emulated:
        laid_out = bf16_packed_bytes(rows, fan_in, fan_out, True,
                                     bf16_input_gradient_in_place(rows, fan_in, fan_out))
        if weight_gradient:
            laid_out += bf16_packed_bytes(fan_out, fan_in, rows, False)
        return [2.0 * rows * fan_out, laid_out]
    return ([4.0 * rows * fan_out, _widened_weight(fan_in, fan_out)]
            + ([4.0 * rows * fan_in] if weight_gradient else []))


def bf16_forward_transposed(rows, fan_in, fan_out):
    """Whether this machine's kernels.bf16 runs the forward as out^T = W x^T (the input
    laid out, the weight read in place: few rows on the VDPBF16PS paths); False where
    the kernels are not built."""
    try:
        from kernels import bf16
    except ImportError:
        return False
    return bf16.forward_transposed(rows, fan_in, fan_out)


def bf16_input_gradient_in_place(rows, fan_in, fan_out):
    """Whether this machine's kernels.bf16 reads the weight in place for the input's
    gradient, dout @ W (few rows on the VDPBF16PS paths); False where the kernels are
    not built."""
    try:
        from kernels import bf16
    except ImportError:
        return False
    return bf16.input_gradient_in_place(rows, fan_in, fan_out)


def bf16_forward_scratch(rows, fan_in, fan_out, emulated):
    """[bytes] of each scratch array kernels.bf16's forward product allocates: where the
    products are ``emulated``, both operands widened to float32 (the weight a block of rows
    at a time); else the laid-out weight (and the input where it cannot be read in
    place), or where the kernels run it transposed the laid-out input (and the weight's
    last rows short of a tile)."""
    if emulated:
        return [4.0 * rows * fan_in, _widened_weight(fan_in, fan_out)]
    if bf16_forward_transposed(rows, fan_in, fan_out):
        return [bf16_packed_bytes(fan_out, rows, fan_in, True)]
    return [bf16_packed_bytes(rows, fan_out, fan_in, True)]


def bf16_products_emulated(emulated=None):
    """``emulated`` where given, else whether this machine's bf16 products are emulated
    (kernels.bf16 without AVX512_BF16: the operands widened into float32 scratch); False
    where the kernels are not built."""
    if emulated is not None:
        return bool(emulated)
    try:
        from kernels import bf16
    except ImportError:
        return False
    return bf16.bf16_path() == "emulated"


def required_memory(peak_bytes):
    """The least limit (bytes) a policy predicted to peak at ``peak_bytes`` fits within: the
    peak and the planner's margin (``MARGIN_FRACTION`` of it and ``MARGIN_BYTES``)."""
    return int(math.ceil(peak_bytes * (1 + MARGIN_FRACTION) + MARGIN_BYTES))


def usable_memory(max_memory):
    """The largest predicted peak (bytes) that fits within ``max_memory`` with the margin."""
    return max(0, int(math.floor((max_memory - MARGIN_BYTES) / (1 + MARGIN_FRACTION))))


def describe_margin():
    return f"{MARGIN_FRACTION:.0%} + {format_size(MARGIN_BYTES)}"


class _Accounting:
    """The engine's bytes at one (B, T): saved activations per block and outside, working sets.

    Where an array lives decides how long it holds memory.  glibc serves arrays below
    its mmap threshold from the heap and, with the engine's malloc retention, keeps
    what they free for the next allocation: the heap stays at the most it held at any
    moment of the step (its high water), also while other arrays peak.  Arrays above
    the threshold (the logits and their gradient past ~5300 tokens at GPT-2's
    vocabulary) are mapped and unmapped.  So the step peaks at the loss's backward -
    the logits' gradient mapped - on top of the heap's high water, wherever in the
    step that was (measured with /proc/self/smaps and mallinfo2 at the peak; against
    GPT-2 124M at (4,1024) and (8,1024): within 0.5% without checkpointing, 1.6-3.3%
    above with it, bench/README.md)."""

    def __init__(self, spec, B, T, flash, precision="fp32", lora=None, base_read=0.0, emulated=False):
        ops = step_graph(spec, Workload(B, T), ParallelConfig(flash_attention=flash),
                         GraphOptions(precision=precision, lora=lora))
        by_layer = saved_by_layer(ops)
        head = by_layer.pop(-1, {})
        # A whole block's (under LoRA the first block saves less: its input is a constant).
        last = spec.n_layer - 1
        block = by_layer[last]
        e, N, C = FLOAT_BYTES, B * T, spec.n_embd
        self.n_layer = spec.n_layer
        self.spec = spec
        self.flash, self.precision, self.lora = flash, precision, lora
        self.head_saved = sum(head.values())                       # lnf input, lm_head input, logits, lse
        self.block_saved = sum(block.values())                     # copies on the byte tape
        # Held by reference, an array two ops save (the attention's output, the projection's
        # float32 input) counts once.
        shared = {}
        for op in ops:
            if op.phase == "fwd":
                shared[op.layer] = shared.get(op.layer, 0.0) + sum(t.nbytes for t in op.saved if t.shared)
        self.blocks_saved = sum(sum(by_layer[layer].values()) for layer in range(spec.n_layer))
        self.blocks_referenced = self.blocks_saved - sum(shared.get(layer, 0.0) for layer in range(spec.n_layer))
        self.block_input = e * N * C
        # Popped off the byte tape one op at a time: the largest op's residuals.
        ops_saved = [op.saved_bytes for op in ops if op.phase == "fwd" and op.layer == last]
        self.largest_op_saved = max(ops_saved)
        # The largest record pushed at once (the loss's logits): what of it exceeds a tape
        # budget moves to and from the disk while the push, and then the pop, wait
        # (estimate.tape_io_time).
        self.largest_record = max(op.saved_bytes for op in ops if op.phase == "fwd")
        # A block's arrays in the heap: copied onto the byte tape, each is freed in step
        # with the next one's allocation; the heap keeps the block's worth.
        self.block_heap = sum(v for v in block.values() if v < MMAP_THRESHOLD_BYTES)
        # Held by reference, a block's forward arrays leave a hole in the heap where one it
        # frees is refilled only in part: under rotary positions the q|k|v product is freed
        # for its rotated copy and the attention's narrower output takes its place (SmolLM2-135M
        # (4,1024): 190 MiB free in the heap at the end of the forward pass, 30 x 6 MiB here).
        rotary = spec.positions == "rope"
        self.block_hole = e * N * (spec.qkv_width - spec.n_head * spec.head_dim) if rotary else 0.0
        # The loss's backward: the logits' gradient (written over the logits popped off
        # the tape, a fresh array when they were held by reference), then the lm_head
        # input's gradient; the first is mapped at GPT-2's sizes, the second is not.
        head_working = loss_backward_bytes(spec, N, e)
        logits_gradient = head_working - e * N * C
        self.head_mapped = logits_gradient if logits_gradient >= MMAP_THRESHOLD_BYTES else 0.0
        self.head_heap = head_working - self.head_mapped
        # One block's backward at its fullest: the residual gradient coming in and the two
        # it splits into, with the widest of the MLP's gradients (GELU: of the fc and gelu
        # outputs, 2F; SwiGLU's down projection: gate|up's beside the recomputed swiglu
        # output and its gradient, 4I) and the attention's (q|k|v's beside the output's;
        # rope: q|k|v's before and after the rotation).
        F, W = spec.ffn_hidden, spec.qkv_width
        mlp = 4 * F if spec.gated_mlp else 2 * F
        attention = max(W + spec.n_head * spec.head_dim, 2 * W if rotary else 0)
        self.block_gradients = e * N * (3 * C + max(mlp, attention))
        if precision == "bf16" or (lora is not None and lora.base_dtype == "bf16"):
            # bf16 products: each backward's scratch beside its gradients, the lm_head's at the
            # loss's backward.  Where this machine emulates them (``emulated``) the forward
            # widens its operands too, and the heap keeps that scratch apart from the
            # backward's (SmolLM2-135M with a bf16 base, (1,256): the second step peaked 108
            # MiB, the lm_head's widened weight, above the first).
            trains = lora is None

            def scratch(fan_in, fan_out):
                return (bf16_backward_scratch(N, fan_in, fan_out, emulated, trains)
                        + bf16_forward_scratch(N, fan_in, fan_out, emulated))
            for piece in scratch(C, spec.padded_vocab):
                if piece >= MMAP_THRESHOLD_BYTES:
                    self.head_mapped += piece
                else:
                    self.head_heap += piece
            self.block_gradients += max(sum(scratch(*shape)) for shape in spec.product_shapes().values())
        if lora is None:
            self.model_states = MODEL_STATE_ARENAS * FLOAT_BYTES * spec.num_parameters()
        else:
            # The frozen base, and the adapters' parameters, gradients and moments.
            self.model_states = lora.base_bytes(spec) + MODEL_STATE_ARENAS * FLOAT_BYTES * lora.adapter_params(spec)
        # bf16 products: each product's weight has a bf16 copy, all of them held through the
        # step (an upper bound with everything offloaded, where only the blocks in RAM may);
        # a bf16 LoRA base is its own.
        copies = precision == "bf16" and (lora is None or lora.base_dtype == "fp32")
        self.weight_copies = 2.0 * product_weight_params(spec, ParallelConfig(), 0) if copies else 0.0
        # A LoRA base read before training (``base_read`` bytes, in the baseline) in float32
        # and held in bf16: converting it holds both, before any activation exists.
        self.base_conversion = float(base_read) if lora is not None and base_read != lora.base_bytes(spec) else 0.0

    def states(self, offload):
        """Model-state bytes in RAM with ``offload``: what the training state will hold
        (``gpt2.state.planned_nbytes``)."""
        block = self.spec.layer_params()
        return planned_nbytes(offload, self.model_states,
                              self.spec.num_parameters() - self.n_layer * block, block,
                              FLOAT_BYTES)

    def stored(self, checkpointing, snapshots, by_reference):
        """Saved activation bytes at the end of the forward pass."""
        if checkpointing == "none":
            return self.head_saved + (self.blocks_referenced if by_reference else self.blocks_saved)
        if checkpointing == "layer":
            return self.head_saved + self.n_layer * self.block_input
        # Revolve holds the loop's input and at most ``snapshots`` states at any time.
        return self.head_saved + (1 + min(snapshots, self.n_layer - 1)) * self.block_input

    def rerun(self, checkpointing):
        """Bytes a re-run block records onto the byte tape during the backward pass (copies,
        also when the rest is held by reference)."""
        return 0.0 if checkpointing == "none" else self.block_saved

    def working(self, checkpointing, by_reference):
        """Bytes live beside the stored activations and the tape at the step's fullest
        moment: the loss's backward's mapped arrays on top of the heap's high water (less
        the activations held there by reference), the most of
        - the loss's backward's heap arrays;
        - without checkpointing, one block's backward: its gradients, and under a budget
          the op being reversed, popped; under a budget, also one block's forward arrays
          before their copies free them;
        - with checkpointing, the re-run block's arrays (freed as their copies go onto the
          byte tape), its gradients and one popped op;
        and held by reference, the holes the blocks' forward passes left below them."""
        if checkpointing == "none":
            if by_reference:
                heap = self.n_layer * self.block_hole + max(self.head_heap, self.block_gradients)
            else:
                heap = max(self.head_heap, self.block_gradients + self.largest_op_saved, self.block_heap)
        else:
            heap = max(self.head_heap, self.block_heap + self.block_gradients + self.largest_op_saved)
        return self.head_mapped + heap


def plan_memory(config, B, T, max_memory, hardware="this-machine", spill_dir=None, threads=None, flash=False,
                baseline_bytes=None, precision="fp32", lora=None, base_dtype="fp32", base_read_bytes=0,
                bf16_emulated=None):
    """The fastest policy that trains ``config`` at (B, T) within ``max_memory`` bytes of RSS.

    ``hardware``: a profile name, path or ``HardwareProfile`` (its disk rates should be
    the spill directory's: ``python -m gpt2.perfmodel.calibrate --disk-only --spill-dir
    DIR``); ``this-machine``, the default, is this machine's profile for ``threads``,
    calibrated on first use (hardware.this_machine_profile); ``threads``: the threads
    training will use (None: the kernels' count; a given profile's compute rates are
    scaled from the threads they were measured with, and a note says so); ``flash``: the model's attention
    keeps O(T) per row (FlashAttention) instead of the T x T probabilities;
    ``baseline_bytes``: the resident memory of the process before the model exists
    (interpreter, libraries, the data set), when it is larger than the profile's;
    ``precision``: the products' precision training runs with, "fp32" or "bf16" (bf16
    operands: the profile's bf16 product rate, fp32's where it has none; linear inputs
    saved in half the bytes; the weights' bf16 copies).
    ``lora``: a ``gpt2.lora.LoraConfig``, LoRA fine-tuning (the adapters train, the base is
    frozen and held in ``base_dtype``, "fp32" or "bf16"; nothing is offloaded);
    ``base_read_bytes``: bytes of its base already read and counted in ``baseline_bytes``
    (gpt2-train's --init-from), which the model keeps as its base instead of new ones (a
    float32 base held in bf16: both at once while it is converted); ``bf16_emulated``:
    whether the training machine's bf16 products are emulated (float32 scratch beside
    them; None: this machine's, kernels.bf16).
    Raises ValueError naming the
    least memory needed when no policy fits.  When the chosen policy is not everything in
    memory and bf16 would hold everything in memory within the limit (bf16 products, or
    under LoRA a bf16 base), a note says so.
    """
    if not isinstance(max_memory, (int, float)) or isinstance(max_memory, bool) or not max_memory > 0:
        raise ValueError(f"max_memory must be a positive number of bytes, got {max_memory!r}")
    check_engine_precision(precision)
    lora = _lora_spec(config, lora, base_dtype)
    if not base_read_bytes >= 0 or (base_read_bytes and lora is None):
        raise ValueError(f"base_read_bytes is a LoRA base's bytes (>= 0, with lora), got {base_read_bytes!r}")
    if baseline_bytes is not None:
        baseline_bytes -= base_read_bytes
    profile, notes = _prepare(config, B, T, hardware, threads, baseline_bytes)
    notes += _spill_dir_notes(profile, spill_dir)
    spec = ModelSpec.from_config(config)
    emulated = bf16_products_emulated(bf16_emulated)
    acc = _Accounting(spec, B, T, flash, precision, lora, base_read_bytes, emulated)
    least_states = min(acc.states(offload) for offload in _offloads("none", precision, lora))
    least_fixed = required_memory(least_states + profile.baseline_rss + acc.weight_copies)
    if least_fixed > max_memory:
        held = ("the frozen base and the adapters' state (LoRA offloads nothing)" if lora is not None else
                f"the model states that stay in RAM with the rest on disk "
                f"({'--offload all' if precision == 'fp32' else '--offload moments: bf16 runs without --offload all'})")
        raise ValueError(
            f"max_memory {format_size(max_memory)} cannot be met: {held} "
            f"take {format_size(least_states)} and the process baseline "
            f"{format_size(profile.baseline_rss)}, so with the planner's margin ({describe_margin()}) at least "
            f"{format_size(least_fixed)} ({least_fixed} bytes) is needed before any activation")

    candidates = []
    policies = _policies(spec)
    for checkpointing, snapshots in policies:
        compute = _compute_estimate(spec, B, T, flash, checkpointing, snapshots, profile, precision, lora)
        for offload in _offloads(checkpointing, precision, lora):
            # bf16: the weights' bf16 copies are resident beside the states
            fixed = acc.states(offload) + profile.baseline_rss + acc.weight_copies
            candidates.append(_candidate(acc, compute, profile, checkpointing, snapshots, None, max_memory,
                                         offload))
            # The tape's peak holds the stored activations plus, under checkpointing, one re-run block.
            tape_peak = acc.stored(checkpointing, snapshots, by_reference=False) + acc.rerun(checkpointing)
            headroom = usable_memory(max_memory) - fixed - acc.working(checkpointing, False) - TAPE_SLACK_BYTES
            # Spilling less is never slower: the largest budget that fits is the one to weigh;
            # without checkpointing, fixed shares of the activations are listed beside it.
            budgets = ({int(tape_peak) // share for share in BUDGET_SHARES}
                       if checkpointing == "none" and offload is None else set())
            if acc.rerun(checkpointing) <= headroom < tape_peak:
                budgets.add(int(headroom) >> 20 << 20)
            for budget in sorted(budgets, reverse=True):
                if budget > 0:
                    candidates.append(_candidate(acc, compute, profile, checkpointing, snapshots, budget,
                                                 max_memory, offload))

    fitting = [c for c in candidates if c.fits]
    if not fitting:
        least = _least_memory(acc, profile, B, T, flash, policies, max_memory)
        need = required_memory(least.predicted_peak_bytes)
        raise ValueError(
            f"max_memory {format_size(max_memory)} cannot be met: the policy needing the least memory, "
            f"{least.policy}, peaks at {format_size(least.predicted_peak_bytes)}, with the planner's margin "
            f"({describe_margin()}) {format_size(need)} ({need} bytes); that is the required minimum at "
            f"B={B}, T={T}")
    best = min(fitting, key=lambda c: (c.predicted_ms, c.predicted_peak_bytes))
    if best.policy != "in-memory":
        notes += _bf16_note(spec, B, T, flash, profile, max_memory, precision, lora, emulated)
    return MemoryPlan(best.policy, best.tape_budget, best.checkpointing, best.snapshots, best.predicted_ms,
                      best.predicted_peak_bytes, int(max_memory), spill_dir, candidates, notes,
                      best.offload, precision, lora)


def _lora_spec(config, lora, base_dtype):
    """The ``LoraSpec`` of a ``gpt2.lora.LoraConfig`` (None: no LoRA, and then ``base_dtype``
    must be "fp32")."""
    if lora is None:
        if base_dtype != "fp32":
            raise ValueError(f"base_dtype={base_dtype!r} is LoRA's frozen base: give lora=LoraConfig(...)")
        return None
    if not hasattr(lora, "groups"):
        raise ValueError(f"lora must be a gpt2.lora.LoraConfig or None, got {type(lora).__name__}")
    return LoraSpec.from_config(config, lora, base_dtype)


def _bf16_note(spec, B, T, flash, profile, max_memory, precision, lora, emulated):
    """[a note] when bf16 would hold everything in memory within ``max_memory``: bf16
    products (an fp32 run without LoRA), or a bf16 base (LoRA on an fp32 base)."""
    if lora is None and precision == "fp32":
        acc = _Accounting(spec, B, T, flash, "bf16", emulated=emulated)
        how = "--precision bf16 (bf16 products; other numbers than fp32's)"
        precision = "bf16"
    elif lora is not None and lora.base_dtype == "fp32":
        lora = replace(lora, base_dtype="bf16")
        acc = _Accounting(spec, B, T, flash, precision, lora, emulated=emulated)
        how = "--base-dtype bf16 (the frozen base rounded to bf16, its products in bf16)"
    else:
        return []
    compute = _compute_estimate(spec, B, T, flash, "none", 0, profile, precision, lora)
    c = _candidate(acc, compute, profile, "none", 0, None, max_memory)
    if not c.fits:
        return []
    return [f"with {how} everything fits in memory: "
            f"predicted {c.predicted_ms:.0f} ms/step, peak {format_size(c.predicted_peak_bytes)}"]


def predict_policy(config, B, T, tape_budget=None, checkpointing="none", snapshots=0, hardware="this-machine",
                   threads=None, flash=False, baseline_bytes=None, offload=None, precision="fp32", lora=None,
                   base_dtype="fp32", base_read_bytes=0, bf16_emulated=None):
    """The predicted step time and peak memory (a ``Candidate``) of one policy, chosen or
    not: ``tape_budget`` bytes (None: everything in memory), ``checkpointing`` "none",
    "layer" or "binomial" with ``snapshots``, ``offload`` None or "moments"; the other
    arguments as ``plan_memory``'s."""
    if offload not in OFFLOAD_POLICIES:
        raise ValueError(f"offload must be None, 'moments' or 'all', got {offload!r}")
    if offload not in _offloads(checkpointing):
        raise ValueError(f"offload='all' runs without checkpointing, got {checkpointing!r}")
    if offload not in _offloads(checkpointing, precision):
        raise ValueError("offload='all' runs in fp32 (gpt2-train refuses --precision bf16 "
                         "with --offload all)")
    if checkpointing not in ("none", "layer", "binomial"):
        raise ValueError(f"checkpointing must be 'none', 'layer' or 'binomial', got {checkpointing!r}")
    if tape_budget is not None and not (isinstance(tape_budget, int) and tape_budget > 0):
        raise ValueError(f"tape_budget must be a positive int or None, got {tape_budget!r}")
    check_engine_precision(precision)
    lora = _lora_spec(config, lora, base_dtype)
    if offload is not None and lora is not None:
        raise ValueError(f"offload={offload!r}: LoRA offloads nothing (gpt2-train refuses --offload with --lora)")
    if not base_read_bytes >= 0 or (base_read_bytes and lora is None):
        raise ValueError(f"base_read_bytes is a LoRA base's bytes (>= 0, with lora), got {base_read_bytes!r}")
    if baseline_bytes is not None:
        baseline_bytes -= base_read_bytes
    profile, _ = _prepare(config, B, T, hardware, threads, baseline_bytes)
    spec = ModelSpec.from_config(config)
    snapshots = snapshots if checkpointing == "binomial" else 0
    compute = _compute_estimate(spec, B, T, flash, checkpointing, snapshots, profile, precision, lora)
    acc = _Accounting(spec, B, T, flash, precision, lora, base_read_bytes, bf16_products_emulated(bf16_emulated))
    return _candidate(acc, compute, profile, checkpointing, snapshots, tape_budget, HUGE_BYTES, offload)


def _prepare(config, B, T, hardware, threads, baseline_bytes):
    """(the profile as training will see it, notes): (B, T) checked, compute rates scaled
    to ``threads``, the baseline raised to ``baseline_bytes``."""
    for name, value in (("B", B), ("T", T)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if T > config.block_size:
        raise ValueError(f"T={T} exceeds the model's block_size {config.block_size}")
    profile = hardware if isinstance(hardware, HardwareProfile) else load_profile(hardware, threads)
    notes = [f"profile {profile.describe()}"] if profile.approximate else []
    if threads is not None and profile.threads and threads != profile.threads:
        scale = threads / profile.threads
        profile = profile.with_changes(
            peak_flops={k: v * scale for k, v in profile.peak_flops.items()},
            physical_peak_flops={k: v * scale for k, v in profile.physical_peak_flops.items()})
        notes.append(f"compute rates scaled from the profile's {profile.threads} threads to {threads}")
    if baseline_bytes is not None and baseline_bytes > profile.baseline_rss:
        profile = profile.with_changes(baseline_rss=float(baseline_bytes))
    return profile, notes


def _compute_estimate(spec, B, T, flash, checkpointing, snapshots, profile, precision="fp32", lora=None):
    """The step's compute (recomputation included) and optimizer time, without a tape budget."""
    recompute = {"none": "none", "layer": "per_layer", "binomial": "binomial"}[checkpointing]
    return estimate(spec, Workload(B, T), ParallelConfig(recompute=recompute, checkpoints=snapshots,
                                                         flash_attention=flash), profile,
                    GraphOptions(precision=precision, lora=lora))


def _least_memory(acc, profile, B, T, flash, policies, max_memory):
    """The candidate with the least predicted peak: each policy without a budget and under the
    smallest budget it can run with (a spill unit without checkpointing, one re-run block's
    activations with it)."""
    least = []
    for checkpointing, snapshots in policies:
        compute = _compute_estimate(acc.spec, B, T, flash, checkpointing, snapshots, profile, acc.precision,
                                    acc.lora)
        for budget in (None, int(acc.rerun(checkpointing)) or MIN_TAPE_BUDGET):
            for offload in _offloads(checkpointing, acc.precision, acc.lora):
                least.append(_candidate(acc, compute, profile, checkpointing, snapshots, budget, max_memory,
                                        offload))
    return min(least, key=lambda c: c.predicted_peak_bytes)


def minimum_memory(config, B, T, hardware="this-machine", flash=False, precision="fp32", lora=None,
                   base_dtype="fp32", bf16_emulated=None):
    """The least ``max_memory`` (bytes) any policy can train ``config`` at (B, T) within:
    the least predicted peak and the planner's margin (the other arguments as
    ``plan_memory``'s)."""
    check_engine_precision(precision)
    lora = _lora_spec(config, lora, base_dtype)
    profile = hardware if isinstance(hardware, HardwareProfile) else load_profile(hardware)
    spec = ModelSpec.from_config(config)
    acc = _Accounting(spec, B, T, flash, precision, lora, emulated=bf16_products_emulated(bf16_emulated))
    least = _least_memory(acc, profile, B, T, flash, _policies(spec), HUGE_BYTES)
    return required_memory(least.predicted_peak_bytes)


def _offloads(checkpointing, precision="fp32", lora=None):
    """The offload policies that run with ``checkpointing``, ``precision`` and ``lora``
    (everything offloaded: without checkpointing, in fp32: gpt2-train refuses
    --precision bf16 with --offload all; LoRA: none, its state is small)."""
    if lora is not None:
        return OFFLOAD_POLICIES[:1]
    return (OFFLOAD_POLICIES if checkpointing == "none" and precision == "fp32"
            else OFFLOAD_POLICIES[:2])


def _policies(spec):
    """(checkpointing, snapshots) of every policy: none, per layer, binomial with 1 to n_layer - 1
    snapshots (n_layer - 1 already stores every block input)."""
    return [("none", 0), ("layer", 0)] + [("binomial", s) for s in range(1, spec.n_layer)]


def _policy_name(checkpointing, snapshots, budget, offload=None):
    name = {"none": "in-memory" if budget is None else "",
            "layer": "layer checkpointing",
            "binomial": f"binomial checkpointing ({snapshots} snapshot{'s' if snapshots > 1 else ''})"}[checkpointing]
    if budget is not None:
        tape = f"{format_size(budget)} tape budget"
        name = f"{name} + {tape}" if name else tape
    if offload:
        name = (("activations in memory" if name == "in-memory" else name)
                + (" + moments on disk" if offload == "moments" else " + blocks and moments on disk"))
    return name


def offload_time(spec, offload, forward, backward, profile):
    """Seconds of a step that streaming the model states (``--offload moments`` or
    ``all``) adds.

    The update runs as the next forward pass reaches each block: the I/O thread reads
    ahead of it what it needs (the moments, 8 bytes per parameter; with everything
    offloaded also the blocks' parameters and gradients, 8 more per block parameter)
    and writes behind it what it changed (the moments; the blocks' parameters, 4).  The
    writes share the disk with the reads and lag them by a few units at most, so the
    forward pass hides both or waits for the rest.  With everything offloaded the
    backward pass reads each block's parameters again and writes its gradients (4 and
    4), hidden by the backward pass.  The first unit is read while the step waits, and
    every byte moved is checksummed on the I/O thread, whose core time the compute
    threads lose."""
    moments = 2 * FLOAT_BYTES * spec.num_parameters()
    blocks = FLOAT_BYTES * spec.n_layer * spec.layer_params() if offload == "all" else 0.0
    read_f = sum(profile.spill_times(moments + 2 * blocks)[1:])
    write_f = profile.spill_times(moments + blocks)[0]
    write_b, read_b = profile.spill_times(blocks)
    first = profile.spill_times(min(UNIT_BYTES, moments))[1]
    moved = 2 * moments + 6 * blocks
    checksums = moved / CHECKSUM_BYTES_PER_S / max(1, profile.threads)
    return (max(0.0, read_f + write_f - forward) + max(0.0, read_b + write_b - backward)
            + first + checksums)


def _candidate(acc, compute, profile, checkpointing, snapshots, budget, max_memory, offload=None):
    """Predicted time and peak of one policy; ``compute`` is its estimate without a tape budget."""
    by_reference = budget is None
    stored = acc.stored(checkpointing, snapshots, by_reference)
    working = acc.working(checkpointing, by_reference)
    forward = sum(v for (phase, _), v in compute.compute.items() if phase == "fwd")
    backward = sum(compute.compute.values()) - forward
    rejected = ""
    copy_s = spill_s = 0.0
    spilled = 0.0
    # A re-run block records onto the byte tape (copies) in every policy.
    rerun = acc.rerun(checkpointing)
    if by_reference:
        resident, slack = stored + rerun, 0.0
    else:
        # Under a budget the re-run block shares it with the stored activations.
        spilled = max(0.0, stored + rerun - budget)
        resident, slack = min(stored + rerun, budget), TAPE_SLACK_BYTES
        if rerun and budget < rerun:
            rejected = f"budget below one re-run block's activations ({format_size(rerun)})"
        # Pushed and popped: the stored activations and every re-run block's (the spill
        # file moves with O_DIRECT, straight from and into the slabs).
        copied = stored + acc.n_layer * rerun
        copy_s, spill_s = tape_io_time(copied, spilled, forward, backward, profile,
                                       record_over_budget=max(0.0, acc.largest_record - budget))
    state_s = offload_time(acc.spec, offload, forward, backward, profile) if offload else 0.0
    memory = {"model states": acc.states(offload), "activations": resident, "working set": working,
              "tape slack": slack, "baseline": profile.baseline_rss, "spilled": spilled}
    if acc.weight_copies:
        memory["bf16 weight copies"] = acc.weight_copies
    if acc.base_conversion:
        # The float32 base read and its bf16 copy, before any activation: what of the read
        # base the step's activations do not outweigh.
        memory["base conversion"] = max(0.0, acc.base_conversion - (resident + working + slack))
    peak = int(math.ceil(sum(v for k, v in memory.items() if k != "spilled")))
    if not rejected and peak > max_memory:
        rejected = f"over the limit by {format_size(peak - max_memory)}"
    elif not rejected and required_memory(peak) > max_memory:
        rejected = f"within the limit but not its margin ({describe_margin()})"
    recompute = sum(v for (phase, _), v in compute.compute.items() if phase == "recompute")
    time = {"compute": (compute.step_time - compute.optimizer - recompute) * 1e3, "recompute": recompute * 1e3,
            "optimizer": compute.optimizer * 1e3, "tape copies": copy_s * 1e3, "spill I/O exposed": spill_s * 1e3,
            "state I/O exposed": state_s * 1e3}
    return Candidate(_policy_name(checkpointing, snapshots, budget, offload), checkpointing, snapshots, budget,
                     sum(time.values()), peak, memory, time, rejected, offload)


def _spill_dir_notes(profile, spill_dir):
    """A note when the profile's disk rates were measured on another device than ``spill_dir``."""
    measured = profile.calibration.get("spill_dir")
    if not measured:
        return [f"profile {profile.name!r} does not say where its disk rates were measured"]
    target = spill_dir or _default_spill_dir()
    try:
        same = os.stat(measured).st_dev == os.stat(target).st_dev
    except OSError:
        same = False
    if same:
        return []
    return [f"disk rates were measured in {measured}, not on {target}'s device: run python -m "
            f"gpt2.perfmodel.calibrate --disk-only --spill-dir {target}"]


def _default_spill_dir():
    import tempfile
    return tempfile.gettempdir()
