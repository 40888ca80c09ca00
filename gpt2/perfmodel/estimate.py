"""Step time and memory of one training step: the op graph on a roofline, plus parallelism.

Each op takes ``overhead + tape records * tape_overhead + max(compute, memory)``: its
FLOPs at the efficiency its size reaches, or its bytes at the bandwidth its size
reaches, whichever is slower.  A device runs its ops one after the other.  On top:
tensor-parallel collectives per layer, expert all-to-all, pipeline point-to-point
transfers and the bubble, the data-parallel gradient reduction (ZeRO/FSDP), and the
tape's byte-tape copies and spill I/O.  Every term is zero when its feature is off.
"""
import math
from collections import defaultdict
from dataclasses import dataclass, field

from . import collectives
from .graph import BF16_CURVE, GraphOptions, engine_bf16, model_flops_per_token, step_graph, trainable_parameters
from .memory import memory_breakdown


@dataclass
class Estimate:
    step_time: float
    compute: dict                 # (phase, op_class) -> seconds per step (all micro-batches)
    communication: dict           # tp, sequence/experts, pp, dp -> exposed seconds per step
    bubble: float
    bubble_fraction: float
    optimizer: float
    spill_io: float
    memory: object                # MemoryBreakdown of the most loaded stage
    model_flops: float            # PaLM model FLOPs of the step (all devices)
    hardware_flops: float         # FLOPs actually executed (incl. recompute), all devices
    tokens: int
    world_size: int
    peak_flops: float             # of one device, what mfu and hfu are taken against
    tape_copy: float = 0.0        # copying saved activations onto the byte tape and back (budget set)
    details: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self):
        return self.tokens / self.step_time

    @property
    def mfu(self):
        return self.model_flops / (self.step_time * self.peak_flops * self.world_size)

    @property
    def hfu(self):
        return self.hardware_flops / (self.step_time * self.peak_flops * self.world_size)

    def by_class(self):
        out = defaultdict(float)
        for (_, op_class), seconds in self.compute.items():
            out[op_class] += seconds
        return dict(out)

    def as_dict(self):
        return {"step_time": self.step_time, "tokens_per_second": self.tokens_per_second,
                "compute": {f"{p}/{c}": v for (p, c), v in sorted(self.compute.items())},
                "communication": dict(self.communication), "bubble": self.bubble,
                "bubble_fraction": self.bubble_fraction, "optimizer": self.optimizer,
                "spill_io": self.spill_io, "tape_copy": self.tape_copy, "memory": self.memory.as_dict(), "model_flops": self.model_flops,
                "hardware_flops": self.hardware_flops, "mfu": self.mfu, "hfu": self.hfu,
                "world_size": self.world_size}


# Op classes whose calibrated curve times the op itself, at its own sizes: the time is
# the op's, memory traffic included (kernels.optim.adamw_step over the whole parameter
# arena, one call as training makes it).  The other classes' curves are by FLOPs and
# shared by kernels of different arithmetic intensity (elementwise: GELU, 10 FLOPs an
# element, and the residual add, 1), measured at a few small shapes: past those a
# residual's FLOPs say little of its bytes, so they keep the bandwidth bound.
MEASURED_WHOLE = ("optimizer",)


def op_time(op, hardware, precision):
    """Seconds one op takes on one device: its FLOPs at the efficiency its size reaches
    (an op the profile did not measure: its dense-product FLOPs at the product rate of
    ``precision``, the rest at the fp32 rate), or its bytes at the bandwidth, whichever
    is slower; where the profile measured the op itself (``MEASURED_WHOLE``), that
    measured time alone, which already includes its memory traffic (taking the larger of
    it and a bandwidth time charged AdamW's bytes twice: 150-190 ms predicted on GPT-2
    124M against 62 ms measured)."""
    curve = None
    if op.op_class == "matmul":
        compute = hardware.matmul_time(op.flops, op.variant, op.precision or precision, op.dims)
    elif op.flops > 0:
        phase = "fwd" if op.phase == "recompute" else op.phase
        if op.precision == "bf16":
            # our attention with bf16 operands: its own curve where calibration measured it
            curve = hardware.kernel_efficiency.get(f"{op.op_class}{BF16_CURVE}.{phase}")
        if curve is None:
            curve = hardware.kernel_efficiency.get(f"{op.op_class}.{phase}")
        if curve is not None:
            compute = op.flops / (hardware.peak("fp32") * curve(op.flops))
        else:
            # Not measured: the op's dense products (an unfused attention's batched
            # Q K^T and P V) run on the product units in the step's precision (a GPU's
            # tensor cores), the rest at the fp32 rate.
            products = min(op.gemm_flops, op.flops)
            compute = (hardware.matmul_time(products, "fwd", precision)
                       + (op.flops - products) / (hardware.peak("fp32")
                                                  * hardware.matmul_efficiency["fwd"].max_efficiency))
    else:
        compute = 0.0
    tape = hardware.tape_overhead * op.tape_records if op.phase == "fwd" else 0.0
    if curve is not None and op.op_class in MEASURED_WHOLE:
        return hardware.op_overhead + tape + compute
    memory = hardware.memory_time(op.nbytes)
    seconds = hardware.op_overhead + tape + max(compute, memory)
    if op.convert_bytes or op.weight_convert_bytes:
        # bf16 products: each conversion is a kernel call of its own, at the bandwidth.
        calls = (op.convert_bytes > 0) + (op.weight_convert_bytes > 0)
        seconds += calls * hardware.op_overhead + hardware.memory_time(op.convert_bytes) + hardware.memory_time(
            op.weight_convert_bytes)
    return seconds


def _group_link(hardware, size, stride):
    """(bandwidth, latency) of a group of ``size`` devices ``stride`` apart (tp innermost)."""
    ic = hardware.interconnect
    spans = size > 1 and stride * size > ic.devices_per_node
    return ic.link(size, spans)


def _tensor_parallel_time(spec, workload, parallel, hardware, n_layers):
    """Per micro-batch: 2 all-reduces forward and 2 backward per layer (Megatron), 2 more
    per re-run layer; sequence parallelism replaces each by all-gather + reduce-scatter."""
    t = parallel.tp
    if t == 1:
        return 0.0
    bw, lat = _group_link(hardware, t, 1)
    n = workload.act_bytes * workload.micro_batch_size(parallel) * workload.seq_len * spec.n_embd
    if parallel.sequence_parallel:
        one = collectives.all_gather(n, t, bw, lat) + collectives.reduce_scatter(n, t, bw, lat)
    else:
        one = collectives.all_reduce(n, t, bw, lat)
    per_layer = 4 + (2 if parallel.recompute in ("full", "per_layer") else 0)
    # Embedding output (forward) and its gradient (backward) are all-reduced over the
    # vocabulary-parallel group as well.
    return (per_layer * n_layers + 2) * one


def _expert_time(spec, workload, parallel, hardware, n_layers):
    """Per micro-batch: dispatch and combine all-to-all, forward and backward, per MoE layer."""
    if not spec.n_experts or parallel.ep == 1:
        return 0.0
    bw, lat = _group_link(hardware, parallel.ep, parallel.tp)
    tokens = workload.micro_batch_size(parallel) * workload.seq_len
    n = workload.act_bytes * tokens * spec.n_embd * spec.top_k * spec.capacity_factor / (
        parallel.tp if parallel.sequence_parallel else 1)
    per_layer = 4 + (2 if parallel.recompute in ("full", "per_layer") else 0)
    return per_layer * n_layers * collectives.all_to_all(n, parallel.ep, bw, lat)


def _pipeline_p2p_time(spec, workload, parallel, hardware):
    """Per micro-batch: one activation sent forward and one gradient sent back per virtual stage."""
    if parallel.pp == 1:
        return 0.0
    bw, lat = _group_link(hardware, parallel.pp, parallel.tp * parallel.dp)
    n = workload.act_bytes * workload.micro_batch_size(parallel) * workload.seq_len * spec.n_embd
    if parallel.sequence_parallel:
        n /= parallel.tp    # scatter-gather: each tensor-parallel rank sends its slice
    return 2 * parallel.interleave * collectives.point_to_point(n, bw, lat)


def _data_parallel_time(spec, workload, parallel, hardware, stage, options=GraphOptions()):
    """(gradient reduction, parameter gathering) seconds per step of the trained parameters
    (under LoRA the adapters): all-reduce (ZeRO 0),
    reduce-scatter then all-gather of the updated parameters (ZeRO 1, 2), and for ZeRO 3
    / FSDP parameter all-gathers in both forward and backward (1.5x the all-reduce
    volume).  With ``parallel.dp_bucket_bytes`` the gradients go in buckets of that size,
    one collective each (its latency paid per bucket)."""
    dp = parallel.dp
    if dp == 1:
        return 0.0, 0.0
    params = trainable_parameters(spec, parallel, stage, options)
    expert = 0.0
    if spec.n_experts:
        expert = (spec.n_layer // parallel.pp) * spec.mlp_params_per_expert * spec.n_experts / (
            parallel.ep * parallel.tp)
    groups = [(params - expert, dp), (expert, dp // parallel.ep)]
    reduce = gather = 0.0
    for count, size in groups:
        if count <= 0 or size == 1:
            continue
        n = workload.act_bytes * count
        buckets = max(1, math.ceil(n / parallel.dp_bucket_bytes)) if parallel.dp_bucket_bytes > 0 else 1

        def timed(name):
            bw, lat = _collective_link(hardware, name, size, parallel.tp)
            return buckets * getattr(collectives, name)(n / buckets, size, bw, lat)
        if parallel.sharding == 0:
            reduce += timed("all_reduce")
        else:
            reduce += timed("reduce_scatter")
            gather += timed("all_gather") * (2 if parallel.sharding == 3 else 1)
    return reduce, gather


def _collective_link(hardware, name, size, stride):
    """(bandwidth, latency) of collective ``name`` over ``size`` devices ``stride`` apart."""
    ic = hardware.interconnect
    spans = size > 1 and stride * size > ic.devices_per_node
    bw, lat = ic.collective_link(name, size, spans)
    if not bw > 0:
        if hardware.kind == "cpu" and not ic.measured:
            raise ValueError(f"profile {hardware.name!r} has no measured link between ranks, so a {name} over "
                             f"{size} ranks cannot be timed: run python -m gpt2.perfmodel.calibrate --link-only "
                             f"(mpiexec and mpi4py) to measure this machine's")
        where = "between nodes" if spans else "within a node"
        raise ValueError(f"profile {hardware.name!r} has no {where} bandwidth for a {name} over {size} devices "
                         f"(its interconnect lacks it)")
    return bw, lat


def exposed_data_parallel(reduce, gather, backward, hardware, parallel):
    """Seconds of the data-parallel communication the step waits for.

    Without overlap, all of it.  With overlap the gradient reduction runs during the
    backward pass: it adds what outlasts the backward, or, where the link's overlap cost
    was measured (ranks sharing a CPU: the copies and sums run on the same cores), the
    compute time it takes from the backward, whichever is larger.  Parameter
    gathering (ZeRO) follows the optimizer and is exposed in full."""
    if not parallel.overlap_dp_comm:
        return reduce + gather
    name = "all_reduce" if parallel.sharding == 0 else "reduce_scatter"
    cost = hardware.interconnect.overlap_cost.get(name, 0.0)
    return max(cost * reduce, reduce - backward) + gather


def tape_io_time(copied, spilled, forward, backward, hardware, overlap=True, record_over_budget=0.0):
    """(copy seconds, exposed spill seconds) of the byte tape in one micro-batch.

    ``copied`` bytes are pushed onto the byte tape and popped back (a read and a write
    each way).  ``spilled`` bytes go to disk and come back, moved by the I/O thread with
    O_DIRECT from the slabs themselves (no page-cache copy).  In steady state the tape
    writes ahead (it learned the last step's peak), from the first slab of the forward
    pass, so the whole ``forward`` can hide the writes; the reads are prefetched ahead
    of the pops, so the whole ``backward`` (recomputation included) can hide them -
    except ``record_over_budget``, the bytes by which one record (the loss's logits,
    pushed and popped whole) exceeds the budget: they are written while its push waits
    and read while its pop waits (measured at GPT-2 124M (8, 1024) under an 815 MiB
    budget: 179 ms of push and 465 ms of read waits).
    Without ``overlap`` both transfers add to the step in full.
    """
    copy = 2 * hardware.memory_time(2 * copied)
    if spilled <= 0:
        return copy, 0.0
    write, read = hardware.spill_times(spilled)
    if not overlap:
        return copy, write + read
    unhidden = sum(hardware.spill_times(record_over_budget))
    return copy, max(0.0, write - forward) + max(0.0, read - backward) + unhidden


def device_view(hardware, parallel):
    """(the profile one rank sees, ranks sharing its machine): a CPU profile whose link
    was measured is shared by up to ``interconnect.devices_per_node`` ranks of the job."""
    if hardware.kind == "cpu" and parallel.world_size > 1 and (hardware.rank_rates or hardware.interconnect.measured):
        ranks = min(parallel.world_size, hardware.interconnect.devices_per_node)
        return hardware.rank_view(ranks), ranks
    return hardware, 1


def estimate(spec, workload, parallel, hardware, options=GraphOptions()):
    """Predicted time and memory of one training step on ``hardware`` (one device's view).

    A CPU profile describes the whole machine: where its link between ranks was
    measured, the ranks of the job that share the machine (up to
    ``interconnect.devices_per_node``) each get the share ``HardwareProfile.rank_view``
    says."""
    hardware, ranks_per_node = device_view(hardware, parallel)
    n_micro = workload.num_micro_batches(parallel)
    # The products' precision: our engine's bf16 mode keeps the values (activations,
    # gradients: what the ranks exchange) in the workload's float32.
    # A bf16 LoRA base's products are bf16 too (the adapters' say fp32 themselves).
    bf16_base = options.lora is not None and options.lora.base_dtype == "bf16"
    precision = "bf16" if engine_bf16(workload, options) or bf16_base else workload.precision
    stages = sorted({0, parallel.pp - 1} | ({parallel.pp // 2} if parallel.pp > 2 else set()))
    per_stage_layers = spec.n_layer // parallel.pp
    tp_time = _tensor_parallel_time(spec, workload, parallel, hardware, per_stage_layers)
    moe_time = _expert_time(spec, workload, parallel, hardware, per_stage_layers)
    p2p_time = _pipeline_p2p_time(spec, workload, parallel, hardware)

    best = None
    for stage in stages:
        ops = step_graph(spec, workload, parallel, options, stage, hardware.sram_bytes)
        compute = defaultdict(float)
        optimizer = 0.0
        for op in ops:
            seconds = op_time(op, hardware, precision)
            if op.phase == "optim":
                optimizer += seconds
            else:
                compute[(op.phase, op.op_class)] += seconds
        micro = sum(compute.values()) + tp_time + moe_time
        flops = sum(op.flops for op in ops if op.phase != "optim")
        reduce, gather = _data_parallel_time(spec, workload, parallel, hardware, stage, options)
        dp_time = reduce + gather
        key = micro + optimizer + dp_time / max(n_micro, 1)
        if best is None or key > best[0]:
            best = (key, stage, ops, compute, micro, optimizer, flops, reduce, gather)
    _, stage, ops, compute, micro, optimizer, flops, reduce, gather = best

    bubble = (parallel.pp - 1) / parallel.interleave * micro
    busy = n_micro * micro
    bubble_fraction = bubble / (busy + bubble) if bubble else 0.0
    backward = sum(v for (phase, _), v in compute.items() if phase == "bwd")
    dp_exposed = exposed_data_parallel(reduce, gather, backward, hardware, parallel)

    memory = memory_breakdown(spec, workload, parallel, hardware, options, stage, ops)
    tape_copy = spill_io = 0.0
    if parallel.tape_budget >= 0:
        stored = memory.activations_unbudgeted
        forward = sum(v for (phase, _), v in compute.items() if phase == "fwd")
        largest = max(op.saved_bytes for op in ops if op.phase == "fwd")
        tape_copy, spill_io = tape_io_time(stored, memory.spilled, forward, sum(compute.values()) - forward,
                                           hardware, parallel.overlap_spill_io,
                                           max(0.0, largest - parallel.tape_budget))
    tape_copy *= n_micro
    spill_io *= n_micro

    step = busy + bubble + optimizer + dp_exposed + n_micro * p2p_time + tape_copy + spill_io
    tokens = workload.global_batch * workload.seq_len
    # Hardware FLOPs are per device; every device of a stage does the same work, and the
    # stages' work adds up (approximately equal stages).
    devices = parallel.world_size
    hardware_flops = flops * n_micro * devices
    return Estimate(
        step_time=step,
        compute={k: v * n_micro for k, v in compute.items()},
        communication={"tensor_parallel": tp_time * n_micro, "expert_all_to_all": moe_time * n_micro,
                       "pipeline_p2p": p2p_time * n_micro, "data_parallel": dp_exposed},
        bubble=bubble, bubble_fraction=bubble_fraction, optimizer=optimizer, spill_io=spill_io,
        memory=memory, model_flops=model_flops_per_token(spec, workload.seq_len, options.lora) * tokens,
        hardware_flops=hardware_flops, tokens=tokens, world_size=devices,
        peak_flops=hardware.mfu_peak(precision), tape_copy=tape_copy,
        details={"stage": stage, "micro_batches": n_micro, "micro_batch_time": micro,
                 "data_parallel_unhidden": reduce + gather, "data_parallel_reduce": reduce,
                 "data_parallel_gather": gather, "ranks_per_node": ranks_per_node,
                 "products": _products(workload, options)})


def _products(workload, options):
    """The step's products in words: "fp32", "bf16 products, fp32 values", with LoRA's base."""
    words = "bf16 products, fp32 values" if options.precision == "bf16" else workload.precision
    return words if options.lora is None else f"{words}, {options.lora.describe()}"
