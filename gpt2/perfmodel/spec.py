"""What is being modelled: the transformer, the batch, and how the work is split.

``ModelSpec`` is a decoder-only transformer whose family differences are data: GPT-2
(llm.c parameter layout: LayerNorm, learned positions, GELU MLP, biases, tied head,
optionally mixture-of-experts MLPs) by default; any family's config with
``ModelSpec.from_config(config)``, whose fields its family gives (the Llama family: RMSNorm,
rotary positions, grouped-query attention, SwiGLU MLP, no biases but Qwen2's on q/k/v, tied
or untied head).  ``ParallelConfig`` holds every distributed-training
feature; each one at its neutral value (size 1, stage 0, "none", False) switches its
terms off exactly.  ``LoraSpec`` is LoRA fine-tuning (gpt2.lora): adapters on some of the
blocks' products, the base frozen.
"""
from dataclasses import dataclass, replace

RECOMPUTE_POLICIES = ("none", "selective", "full", "per_layer", "binomial")
PRECISION_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}


def _positive_int(owner, name, value, minimum=1):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")


NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
POSITIONS = ("learned", "rope")


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
    n_kv_head: int = None          # key/value heads (grouped-query attention); None: n_head
    head_dim: int = None           # None: n_embd // n_head
    intermediate_size: int = None  # the MLP's width; None: ffn_mult * n_embd
    norm: str = "layernorm"        # "layernorm" (weight and bias) or "rmsnorm" (weight only)
    mlp: str = "gelu"              # "gelu": fc, GELU, fcproj; "swiglu": gate|up (2I), silu(gate) * up, down
    positions: str = "learned"     # "learned": a position embedding table; "rope": rotary, no parameters
    tied_head: bool = True         # the LM head is the token embedding (else its own weights)
    linear_bias: bool = True       # biases on the attention projection and the MLP's matmuls
    qkv_bias: bool = None          # biases on the q|k|v projection; None: linear_bias

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size", "ffn_mult",
                     "vocab_multiple", "top_k"):
            _positive_int("ModelSpec", name, getattr(self, name))
        _positive_int("ModelSpec", "n_experts", self.n_experts, minimum=0)
        if self.head_dim is None:
            if self.n_embd % self.n_head:
                raise ValueError(f"ModelSpec.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        for name, default in (("n_kv_head", self.n_head), ("intermediate_size", self.ffn_mult * self.n_embd),
                              ("qkv_bias", self.linear_bias)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        for name in ("n_kv_head", "head_dim", "intermediate_size"):
            _positive_int("ModelSpec", name, getattr(self, name))
        if self.n_head % self.n_kv_head:
            raise ValueError(f"ModelSpec.n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head})")
        for name, allowed in (("norm", NORMS), ("mlp", MLPS), ("positions", POSITIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ModelSpec.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.n_experts and self.top_k > self.n_experts:
            raise ValueError(f"ModelSpec.top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")
        if not self.capacity_factor > 0:
            raise ValueError(f"ModelSpec.capacity_factor must be > 0, got {self.capacity_factor!r}")

    @classmethod
    def from_config(cls, config, **extra):
        """From a model config of any family, as its family describes it (``spec_fields``: a
        GPT2Config's n_layer, n_head, n_embd, vocab_size and block_size; a LlamaConfig's also
        its key/value heads, head size, MLP width, tied head and q/k/v biases, RMSNorm, rotary
        positions, SwiGLU and no other biases); ``extra`` fields on top."""
        from gpt2.families import family_of
        fields = family_of(config).spec_fields(config)
        fields.update(extra)
        return cls(**fields)

    @property
    def head_size(self):
        return self.head_dim

    @property
    def qkv_width(self):
        """Columns of the packed q|k|v projection: (n_head + 2 n_kv_head) head_dim (3C without GQA)."""
        return (self.n_head + 2 * self.n_kv_head) * self.head_dim

    @property
    def padded_vocab(self):
        m = self.vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def ffn_hidden(self):
        return self.intermediate_size

    @property
    def gated_mlp(self):
        """The MLP's first matmul gives gate and up (2I columns) for a gated activation."""
        return self.mlp == "swiglu"

    @property
    def norm_params(self):
        """Parameters of one normalisation: weight and bias (LayerNorm) or weight (RMSNorm)."""
        return 2 * self.n_embd if self.norm == "layernorm" else self.n_embd

    @property
    def mlp_params_per_expert(self):
        C, F = self.n_embd, self.ffn_hidden
        fan_out = 2 * F if self.gated_mlp else F
        return C * fan_out + F * C + (fan_out + C if self.linear_bias else 0)

    def product_shapes(self):
        """{name: (fan_in, fan_out)} of a block's dense products, as the op graph names them
        (one expert's MLP): qkv, attproj, then fc and fcproj (GELU) or gateup and down (SwiGLU)."""
        C, W, A, F = self.n_embd, self.qkv_width, self.n_head * self.head_dim, self.ffn_hidden
        mlp = {"gateup": (C, 2 * F), "down": (F, C)} if self.gated_mlp else {"fc": (C, F), "fcproj": (F, C)}
        return {"qkv": (C, W), "attproj": (A, C), **mlp}

    def vector_params(self):
        """Parameters that are no matrix: the norms' and the biases (what a bf16 LoRA base keeps
        in float32, gpt2.lora.Bf16Base)."""
        W, C = self.qkv_width, self.n_embd
        fan_out = 2 * self.ffn_hidden if self.gated_mlp else self.ffn_hidden
        biases = (W if self.qkv_bias else 0) + (C + max(self.n_experts, 1) * (fan_out + C) if self.linear_bias else 0)
        return self.n_layer * (2 * self.norm_params + biases) + self.norm_params

    def layer_params(self):
        """Parameters of one transformer block (all experts counted)."""
        C, W, A = self.n_embd, self.qkv_width, self.n_head * self.head_dim
        attention = self.norm_params + C * W + (W if self.qkv_bias else 0) + A * C + (C if self.linear_bias else 0)
        experts = max(self.n_experts, 1)
        mlp = self.norm_params + experts * self.mlp_params_per_expert
        router = C * self.n_experts
        return attention + mlp + router

    def position_params(self):
        """The learned position embedding's parameters (none with rotary positions)."""
        return self.block_size * self.n_embd if self.positions == "learned" else 0

    def embedding_params(self):
        return self.padded_vocab * self.n_embd + self.position_params()

    def head_params(self):
        """The LM head's own weights (none when it is the token embedding)."""
        return 0 if self.tied_head else self.padded_vocab * self.n_embd

    def num_parameters(self):
        """All parameters, llm.c layout (padded vocab, final norm; the LM head tied unless ``tied_head``
        is False)."""
        return self.embedding_params() + self.n_layer * self.layer_params() + self.norm_params + self.head_params()

    def active_parameters(self):
        """Parameters one token passes through (MoE: top_k experts instead of all)."""
        if not self.n_experts:
            return self.num_parameters()
        inactive = (self.n_experts - self.top_k) * self.mlp_params_per_expert
        return self.num_parameters() - self.n_layer * inactive


# The op graph's name of each weight LoRA adapts (gpt2.lora.LoraConfig.groups' names).
LORA_PRODUCTS = {"qkvw": "qkv", "attprojw": "attproj", "fcw": "fc", "fcprojw": "fcproj", "gateupw": "gateup",
                 "downw": "down"}
BASE_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class LoraSpec:
    """LoRA fine-tuning (gpt2.lora, adtape.nn.lora_linear): rank ``r`` adapters on some of each
    block's products; the base is frozen (no gradient, no moments, no weight-gradient
    products) and held in ``base_dtype`` (bf16: its matrices in 2 bytes and their products
    in bf16).  ``adapted``: ``((product, k, rows), ...)``, a product of the graph
    (``ModelSpec.product_shapes``), the k projections it packs that are adapted (an A of
    r x fan_in each) and their output rows (B: rows x r); ``dropout``: the adapters' input
    dropout (it keeps the dropped input and its mask for the backward)."""
    r: int
    adapted: tuple
    base_dtype: str = "fp32"
    dropout: float = 0.0

    def __post_init__(self):
        _positive_int("LoraSpec", "r", self.r)
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(f"LoraSpec.base_dtype must be one of {', '.join(BASE_DTYPES)}, got {self.base_dtype!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoraSpec.dropout must be in [0, 1), got {self.dropout!r}")
        adapted = tuple(tuple(a) for a in self.adapted)
        names = [a[0] for a in adapted if len(a) == 3]
        if not adapted or len(names) != len(adapted) or len(set(names)) != len(names):
            raise ValueError(f"LoraSpec.adapted must list each adapted product once as (product, k, rows), "
                             f"got {self.adapted!r}")
        for name, k, rows in adapted:
            if name not in LORA_PRODUCTS.values():
                raise ValueError(f"LoraSpec.adapted: {name!r} is not a product of the graph "
                                 f"({', '.join(LORA_PRODUCTS.values())})")
            _positive_int("LoraSpec", f"adapted[{name!r}] k", k)
            _positive_int("LoraSpec", f"adapted[{name!r}] rows", rows)
        object.__setattr__(self, "adapted", adapted)

    @classmethod
    def from_config(cls, config, lora, base_dtype="fp32"):
        """From a family config and a ``gpt2.lora.LoraConfig`` (its ``groups``: which weights,
        how many projections, which rows)."""
        adapted = []
        for weight, parts in lora.groups(config):
            if weight not in LORA_PRODUCTS:
                raise ValueError(f"LoRA adapts {weight!r}, which the performance model has no product for "
                                 f"(it knows {', '.join(LORA_PRODUCTS)})")
            adapted.append((LORA_PRODUCTS[weight], len(parts), sum(part[3] for part in parts)))
        return cls(lora.r, tuple(adapted), base_dtype, float(lora.dropout))

    def check(self, spec):
        """ValueError where an adapted product is not ``spec``'s or has more rows than it."""
        shapes = spec.product_shapes()
        for name, _, rows in self.adapted:
            if name not in shapes:
                raise ValueError(f"LoraSpec adapts {name!r}, which this model has not (its products: "
                                 f"{', '.join(shapes)})")
            if rows > shapes[name][1]:
                raise ValueError(f"LoraSpec adapts {rows} rows of {name!r}, which has {shapes[name][1]}")
        if spec.n_experts:
            raise ValueError("LoRA adapts dense models: the performance model has no LoRA on experts")

    def adapter_params(self, spec):
        """The adapters' parameters over the whole model (gpt2.lora.adapter_shapes)."""
        self.check(spec)
        shapes = spec.product_shapes()
        return spec.n_layer * sum(k * self.r * shapes[name][0] + rows * self.r for name, k, rows in self.adapted)

    def base_bytes(self, spec):
        """Bytes of the frozen base: 4 a parameter, or in bf16 2 a matrix parameter and 4 a
        norm or bias parameter."""
        if self.base_dtype == "fp32":
            return 4.0 * spec.num_parameters()
        vectors = spec.vector_params()
        return 2.0 * (spec.num_parameters() - vectors) + 4.0 * vectors

    def describe(self):
        """"LoRA r=16 on a bf16 base"."""
        return f"LoRA r={self.r} on a{'n' if self.base_dtype == 'fp32' else ''} {self.base_dtype} base"


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
