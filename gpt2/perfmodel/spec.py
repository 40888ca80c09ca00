"""What is being modelled: the transformer, the batch, and how the work is split.

``ModelSpec`` is a GPT-style decoder (llm.c parameter layout, optionally with
mixture-of-experts MLPs).  ``ParallelConfig`` holds every distributed-training
feature; each one at its neutral value (size 1, stage 0, "none", False) switches its
terms off exactly.
"""
from dataclasses import dataclass, replace

RECOMPUTE_POLICIES = ("none", "selective", "full", "per_layer", "binomial")
PRECISION_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}


def _positive_int(owner, name, value, minimum=1):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class ModelSpec:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    block_size: int = 1024
    ffn_mult: int = 4
    vocab_multiple: int = 128      # the embedding is padded to a multiple of this (llm.c: 128)
    n_experts: int = 0             # 0: dense MLP; >0: mixture of experts in every layer
    top_k: int = 1
    capacity_factor: float = 1.0

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size", "ffn_mult",
                     "vocab_multiple", "top_k"):
            _positive_int("ModelSpec", name, getattr(self, name))
        _positive_int("ModelSpec", "n_experts", self.n_experts, minimum=0)
        if self.n_embd % self.n_head:
            raise ValueError(f"ModelSpec.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_experts and self.top_k > self.n_experts:
            raise ValueError(f"ModelSpec.top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")
        if not self.capacity_factor > 0:
            raise ValueError(f"ModelSpec.capacity_factor must be > 0, got {self.capacity_factor!r}")

    @classmethod
    def from_config(cls, config, **extra):
        """From any object with n_layer, n_head, n_embd, vocab_size, block_size (GPT2Config)."""
        fields = {k: getattr(config, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")}
        fields.update(extra)
        return cls(**fields)

    @property
    def head_size(self):
        return self.n_embd // self.n_head

    @property
    def padded_vocab(self):
        m = self.vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def ffn_hidden(self):
        return self.ffn_mult * self.n_embd

    @property
    def mlp_params_per_expert(self):
        C, F = self.n_embd, self.ffn_hidden
        return C * F + F + F * C + C

    def layer_params(self):
        """Parameters of one transformer block (all experts counted)."""
        C = self.n_embd
        attention = 2 * C + 3 * C * C + 3 * C + C * C + C      # ln1, qkv, attproj
        experts = max(self.n_experts, 1)
        mlp = 2 * C + experts * self.mlp_params_per_expert    # ln2, experts
        router = C * self.n_experts
        return attention + mlp + router

    def embedding_params(self):
        return self.padded_vocab * self.n_embd + self.block_size * self.n_embd

    def num_parameters(self):
        """All parameters, llm.c layout (padded vocab, tied LM head, final layernorm)."""
        return self.embedding_params() + self.n_layer * self.layer_params() + 2 * self.n_embd

    def active_parameters(self):
        """Parameters one token passes through (MoE: top_k experts instead of all)."""
        if not self.n_experts:
            return self.num_parameters()
        inactive = (self.n_experts - self.top_k) * self.mlp_params_per_expert
        return self.num_parameters() - self.n_layer * inactive


@dataclass(frozen=True)
class ParallelConfig:
    """How one training step is spread over devices.

    Batch: ``global_batch`` sequences per step, split over ``dp`` replicas, each
    running ``global_batch / (dp * micro_batch)`` micro-batches.
    """
    dp: int = 1                    # data-parallel replicas
    tp: int = 1                    # tensor (Megatron) parallel size
    pp: int = 1                    # pipeline stages
    ep: int = 1                    # expert-parallel size (MoE), carved out of dp
    sequence_parallel: bool = False
    interleave: int = 1            # virtual pipeline chunks per device
    zero_stage: int = 0            # 0 (plain DP), 1, 2, 3; FSDP full sharding = stage 3
    fsdp: bool = False
    recompute: str = "none"        # none, selective, full (Megatron); per_layer, binomial (our tape)
    checkpoints: int = 0           # binomial: checkpoint slots
    flash_attention: bool = False
    overlap_dp_comm: bool = False  # gradient reduction hidden behind backward compute
    dp_bucket_bytes: float = 0.0   # gradients reduced in buckets of this size (0: one collective)
    tape_budget: float = -1.0      # bytes of activations kept in memory; -1: no budget (no spill)
    overlap_spill_io: bool = False

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "ep", "interleave"):
            _positive_int("ParallelConfig", name, getattr(self, name))
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"ParallelConfig.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(f"ParallelConfig.recompute must be one of {RECOMPUTE_POLICIES}, "
                             f"got {self.recompute!r}")
        if self.recompute == "binomial":
            _positive_int("ParallelConfig", "checkpoints", self.checkpoints)
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("ParallelConfig.sequence_parallel needs tp > 1 (it splits the tensor-parallel "
                             "group's replicated activations)")
        if self.interleave > 1 and self.pp == 1:
            raise ValueError("ParallelConfig.interleave > 1 needs pp > 1")
        if self.dp % self.ep:
            raise ValueError(f"ParallelConfig.ep ({self.ep}) must divide dp ({self.dp})")
        if not self.dp_bucket_bytes >= 0:
            raise ValueError(f"ParallelConfig.dp_bucket_bytes must be >= 0, got {self.dp_bucket_bytes!r}")
        if self.tape_budget != -1.0 and self.tape_budget < 0:
            raise ValueError(f"ParallelConfig.tape_budget must be >= 0 or -1, got {self.tape_budget!r}")

    @property
    def sharding(self):
        """ZeRO stage in force (FSDP full sharding is stage 3)."""
        return 3 if self.fsdp else self.zero_stage

    @property
    def world_size(self):
        return self.dp * self.tp * self.pp

    def with_changes(self, **changes):
        return replace(self, **changes)


@dataclass(frozen=True)
class Workload:
    """One training step: sequences, their length, and the arithmetic precision."""
    global_batch: int
    seq_len: int
    micro_batch: int = 0           # 0: global_batch / dp (one micro-batch per replica)
    precision: str = "fp32"        # matmul precision (the peak used)
    weight_decay: bool = True

    def __post_init__(self):
        _positive_int("Workload", "global_batch", self.global_batch)
        _positive_int("Workload", "seq_len", self.seq_len)
        _positive_int("Workload", "micro_batch", self.micro_batch, minimum=0)
        if self.precision not in PRECISION_BYTES:
            raise ValueError(f"Workload.precision must be one of {sorted(PRECISION_BYTES)}, "
                             f"got {self.precision!r}")

    @property
    def act_bytes(self):
        """Bytes per activation element (fp32 for our CPU, 2 for mixed precision)."""
        return PRECISION_BYTES[self.precision]

    def micro_batch_size(self, parallel):
        per_replica, rem = divmod(self.global_batch, parallel.dp)
        if rem:
            raise ValueError(f"Workload.global_batch ({self.global_batch}) must be divisible by dp "
                             f"({parallel.dp})")
        b = self.micro_batch or per_replica
        if per_replica % b:
            raise ValueError(f"Workload.micro_batch ({b}) must divide the per-replica batch ({per_replica})")
        return b

    def num_micro_batches(self, parallel):
        return self.global_batch // (parallel.dp * self.micro_batch_size(parallel))
