"""Hardware profiles: peak rates, efficiency curves and interconnect, as plain JSON data.

A profile says how fast one device computes and moves bytes, and how devices talk.
Published profiles (A100, H100, a generic CPU) ship in ``profiles/``; the profile of
this machine is written by ``python -m gpt2.perfmodel.calibrate``.

Efficiency is not one number: a small op reaches a smaller share of the peak than a
large one.  A curve is either ``eff(x) = max_efficiency * x / (x + half_size)``, where x
is the op's FLOPs (matmuls) or bytes (memory-bound ops), or, when calibration measured
it, a table of (size, efficiency) points interpolated in log(size) and held flat past
its ends (caches make small copies faster than large ones, which no saturating curve
can say).  Matmuls have one curve per product: the forward product and the two
backward ones (input gradient, weight gradient), because BLAS runs their transposes at
different speeds.  ``kernel_efficiency`` holds measured curves of our other kernels
(attention, layernorm, ...) by op class, as a share of the fp32 peak by FLOPs.
"""
import bisect
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")

MATMUL_VARIANTS = ("fwd", "bwd_input", "bwd_weight")
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True)
class EfficiencyCurve:
    """eff(x) = max_efficiency * x / (x + half_size), or interpolated ``points`` if given."""
    max_efficiency: float
    half_size: float
    points: tuple = ()             # ((size, efficiency), ...) sorted by size

    def __post_init__(self):
        # Above 1 is allowed: cache-resident data beats the DRAM bandwidth.
        if not (0.0 < self.max_efficiency <= 64.0):
            raise ValueError(f"max_efficiency must be in (0, 64], got {self.max_efficiency!r}")
        if not (self.half_size >= 0.0 and math.isfinite(self.half_size)):
            raise ValueError(f"half_size must be finite and >= 0, got {self.half_size!r}")
        points = tuple(sorted((float(x), float(e)) for x, e in self.points))
        for x, e in points:
            if not (x > 0 and 0 < e <= 64 and math.isfinite(x)):
                raise ValueError(f"efficiency point ({x}, {e}) needs size > 0 and efficiency in (0, 64]")
        object.__setattr__(self, "points", points)

    def __call__(self, size):
        if self.points:
            return self._interpolate(size)
        if size <= 0:
            return self.max_efficiency
        return self.max_efficiency * size / (size + self.half_size)

    def stretched(self, factor):
        """This curve for an op ``factor`` times smaller doing the same work per thread:
        eff'(x) = eff(x * factor)."""
        return EfficiencyCurve(self.max_efficiency, self.half_size / factor,
                               tuple((x / factor, e) for x, e in self.points))

    def _interpolate(self, size):
        xs = [x for x, _ in self.points]
        if size <= xs[0]:
            return self.points[0][1]
        if size >= xs[-1]:
            return self.points[-1][1]
        i = bisect.bisect_right(xs, size)
        (x0, e0), (x1, e1) = self.points[i - 1], self.points[i]
        if x1 == x0:
            return e1
        w = (math.log(size) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return e0 + w * (e1 - e0)


@dataclass(frozen=True)
class Interconnect:
    """Links between devices: within a node and across nodes (bytes/s, seconds).

    ``collectives``, when the link was measured (``calibrate --link-only``), holds one
    fit per collective, {name: {"bandwidth": bytes/s, "latency": s}} in the terms of
    ``collectives.py``'s formulas, so that each collective is timed by its own fit
    (on a shared-memory loopback an all-reduce also sums, an all-gather only copies).
    ``overlap_cost``: {name: share of a collective's time that the computation beside
    it loses when it runs in flight during the backward} (0: the link hides it, 1: it
    takes the cores as long as it does alone).  ``runtime_rss``: bytes the
    communication library adds to each rank; ``buffer_bytes_per_byte``: {name: bytes of
    temporary buffers it allocates per byte of a non-blocking collective in flight}.  ``measured``: how and when it was
    measured ("" for datasheet figures).
    """
    devices_per_node: int = 1
    intra_node_bandwidth: float = 0.0
    intra_node_latency: float = 0.0
    inter_node_bandwidth: float = 0.0
    inter_node_latency: float = 0.0
    collectives: dict = field(default_factory=dict)
    overlap_cost: dict = field(default_factory=dict)
    runtime_rss: float = 0.0
    buffer_bytes_per_byte: dict = field(default_factory=dict)
    measured: str = ""

    def link(self, group_size, spans_nodes):
        """(bandwidth, latency) of a collective over ``group_size`` devices."""
        if spans_nodes:
            return self.inter_node_bandwidth, self.inter_node_latency
        return self.intra_node_bandwidth, self.intra_node_latency

    def collective_link(self, name, group_size, spans_nodes):
        """(bandwidth, latency) of collective ``name``: its own measured fit within a node
        where there is one, else the link's."""
        fit = self.collectives.get(name)
        if fit and not spans_nodes:
            return fit["bandwidth"], fit["latency"]
        return self.link(group_size, spans_nodes)


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    kind: str                      # "cpu" or "gpu"
    source: str                    # where the figures come from
    peak_flops: dict               # precision -> FLOP/s of one device
    memory_bandwidth: float        # bytes/s of one device's main memory
    memory_capacity: float         # bytes of one device's main memory
    matmul_efficiency: dict        # variant -> EfficiencyCurve
    memory_efficiency: EfficiencyCurve
    op_overhead: float = 0.0       # seconds per kernel call (launch, Python call, OpenMP fork)
    tape_overhead: float = 0.0     # seconds per tape record pushed and popped
    disk_write_bandwidth: float = 0.0   # bytes/s of sequential writes to the tape's spill device
    disk_read_bandwidth: float = 0.0    # bytes/s of sequential reads back from it
    threads: int = 0               # CPU: threads the figures were measured with (0: n/a)
    sram_bytes: float = 0.0        # on-chip memory per core/SM, for FlashAttention traffic
    baseline_rss: float = 0.0      # bytes the process holds before any model memory (CPU)
    interconnect: Interconnect = field(default_factory=Interconnect)
    kernel_efficiency: dict = field(default_factory=dict)   # op class -> EfficiencyCurve (by FLOPs)
    calibration: dict = field(default_factory=dict)         # how and when the figures were measured
    # CPU: ranks sharing this machine, measured all computing at once (calibrate --link-only):
    # {str(ranks): {"threads": per rank, "sgemm_flops": one rank's FLOP/s on "sgemm_shape"
    # (rows, fan_in, fan_out, forward product), "copy_bandwidth": one rank's bytes/s}}
    rank_rates: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in ("cpu", "gpu"):
            raise ValueError(f"profile {self.name!r}: kind must be 'cpu' or 'gpu', got {self.kind!r}")
        if not self.peak_flops or any(p not in PRECISIONS for p in self.peak_flops):
            raise ValueError(f"profile {self.name!r}: peak_flops keys must be among {PRECISIONS}, "
                             f"got {sorted(self.peak_flops)}")
        for key, value in self.peak_flops.items():
            if not value > 0:
                raise ValueError(f"profile {self.name!r}: peak_flops[{key!r}] must be > 0, got {value!r}")
        missing = [v for v in MATMUL_VARIANTS if v not in self.matmul_efficiency]
        if missing:
            raise ValueError(f"profile {self.name!r}: matmul_efficiency lacks {missing}")
        for key in ("memory_bandwidth", "memory_capacity"):
            if not getattr(self, key) > 0:
                raise ValueError(f"profile {self.name!r}: {key} must be > 0, got {getattr(self, key)!r}")
        for key in ("op_overhead", "tape_overhead", "disk_write_bandwidth", "disk_read_bandwidth", "sram_bytes",
                    "baseline_rss"):
            if getattr(self, key) < 0:
                raise ValueError(f"profile {self.name!r}: {key} must be >= 0, got {getattr(self, key)!r}")

    def peak(self, precision):
        try:
            return self.peak_flops[precision]
        except KeyError:
            raise ValueError(f"profile {self.name!r} has no peak for precision {precision!r}; "
                             f"it has {sorted(self.peak_flops)}") from None

    def matmul_time(self, flops, variant, precision):
        """Seconds for a matmul of ``flops`` FLOPs, without the per-call overhead."""
        if flops <= 0:
            return 0.0
        return flops / (self.peak(precision) * self.matmul_efficiency[variant](flops))

    def spill_times(self, nbytes):
        """(seconds to write, seconds to read back) ``nbytes`` of spilled tape to the spill device."""
        if nbytes <= 0:
            return 0.0, 0.0
        if not (self.disk_write_bandwidth > 0 and self.disk_read_bandwidth > 0):
            raise ValueError(f"profile {self.name!r} has no disk_write_bandwidth / disk_read_bandwidth: "
                             f"measure them with python -m gpt2.perfmodel.calibrate --disk-only")
        return nbytes / self.disk_write_bandwidth, nbytes / self.disk_read_bandwidth

    def memory_time(self, nbytes):
        """Seconds to stream ``nbytes`` through main memory, without the per-call overhead."""
        if nbytes <= 0:
            return 0.0
        return nbytes / (self.memory_bandwidth * self.memory_efficiency(nbytes))

    def rank_view(self, ranks):
        """The share of this machine one of ``ranks`` ranks running at once gets (CPU).

        From ``rank_rates[str(ranks)]``, measured with every rank computing: a rank on t
        of the profile's T threads reaches the efficiency the whole machine reaches on an
        op T/t times larger (each thread's share of the work is the same), and its peak
        and memory bandwidth are scaled so that the view reproduces the rank's measured
        sgemm and copy rates.  Per-call and per-record overheads stay (one thread pays
        them as two do); memory capacity is shared; the baseline gains the
        communication runtime's resident bytes (``interconnect.runtime_rss``).
        """
        if ranks == 1 or self.kind != "cpu":
            return self
        rates = self.rank_rates.get(str(ranks))
        if rates is None:
            raise ValueError(f"profile {self.name!r} has no measured rates of {ranks} ranks sharing this "
                             f"machine ({sorted(self.rank_rates) or 'none'}): run python -m "
                             f"gpt2.perfmodel.calibrate --link-only --ranks {ranks}")
        if not self.threads:
            raise ValueError(f"profile {self.name!r} does not say how many threads it was measured with")
        stretch = self.threads / rates["threads"]
        rows, fan_in, fan_out = rates["sgemm_shape"]
        flops = 2.0 * rows * fan_in * fan_out
        flops_scale = rates["sgemm_flops"] / (self.peak("fp32") * self.matmul_efficiency["fwd"](flops * stretch))
        copied = 2.0 * rates["copy_bytes"]
        bw_scale = rates["copy_bandwidth"] / (self.memory_bandwidth * self.memory_efficiency(copied * stretch))
        return self.with_changes(
            peak_flops={k: v * flops_scale for k, v in self.peak_flops.items()},
            memory_bandwidth=self.memory_bandwidth * bw_scale,
            memory_capacity=self.memory_capacity / ranks,
            matmul_efficiency={k: c.stretched(stretch) for k, c in self.matmul_efficiency.items()},
            kernel_efficiency={k: c.stretched(stretch) for k, c in self.kernel_efficiency.items()},
            memory_efficiency=self.memory_efficiency.stretched(stretch),
            threads=rates["threads"], baseline_rss=self.baseline_rss + self.interconnect.runtime_rss,
            name=f"{self.name} ({ranks} ranks x {rates['threads']} thread{'s' if rates['threads'] > 1 else ''})")

    def to_dict(self):
        return asdict(self)

    def with_changes(self, **changes):
        return replace(self, **changes)


def profile_from_dict(data, origin="<dict>"):
    """Build a profile from its JSON form; errors name ``origin`` and the bad field."""
    if not isinstance(data, dict):
        raise ValueError(f"{origin}: a hardware profile must be a JSON object")
    data = dict(data)
    try:
        data["matmul_efficiency"] = {k: EfficiencyCurve(**v) for k, v in data["matmul_efficiency"].items()}
        data["memory_efficiency"] = EfficiencyCurve(**data["memory_efficiency"])
        data["interconnect"] = Interconnect(**data.get("interconnect", {}))
        data["kernel_efficiency"] = {k: EfficiencyCurve(**v) for k, v in data.get("kernel_efficiency", {}).items()}
        return HardwareProfile(**data)
    except KeyError as exc:
        raise ValueError(f"{origin}: hardware profile lacks field {exc.args[0]!r}") from None
    except TypeError as exc:
        raise ValueError(f"{origin}: malformed hardware profile: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{origin}: {exc}") from None


def load_profile(name_or_path):
    """Load a profile by file path or by the name of a shipped profile (``a100-80gb-sxm``)."""
    path = name_or_path
    if not os.path.exists(path):
        path = os.path.join(PROFILE_DIR, f"{name_or_path}.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"hardware profile {name_or_path!r} not found (as a path or in "
                                f"{PROFILE_DIR}: {', '.join(available_profiles())})")
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
    return profile_from_dict(data, origin=path)


def save_profile(profile, path):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(profile.to_dict(), f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def available_profiles():
    if not os.path.isdir(PROFILE_DIR):
        return []
    return sorted(n[:-5] for n in os.listdir(PROFILE_DIR) if n.endswith(".json"))
