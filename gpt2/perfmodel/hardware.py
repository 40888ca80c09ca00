"""Hardware profiles: peak rates, efficiency curves and interconnect, as plain JSON data.

A profile says how fast one device computes and moves bytes, and how devices talk.
Published profiles (A100, H100, a generic CPU) and the profiles measured on our own
machines (``zen4-2core-vm``) ship in ``profiles/``.  ``this-machine`` is not a file in the
package: it names the profile measured here, kept in the user's cache
(``$XDG_CACHE_HOME/adtape/profiles/``, default ``~/.cache/adtape/profiles/``) under a
name made of the CPU (model name, family, model, feature flags) and the thread count,
and measured by a quick calibration the first time it is asked for
(``this_machine_profile``); ``python -m gpt2.perfmodel.calibrate`` measures it in full.

Efficiency is not one number: a small op reaches a smaller share of the peak than a
large one.  A curve is either ``eff(x) = max_efficiency * x / (x + half_size)``, where x
is the op's FLOPs (matmuls) or bytes (memory-bound ops), or, when calibration measured
it, a table of (size, efficiency) points interpolated in log(size) and held flat past
its ends (caches make small copies faster than large ones, which no saturating curve
can say).  Matmuls have one curve per product: the forward product and the two
backward ones (input gradient, weight gradient), because BLAS runs their transposes at
different speeds; a calibrated profile also has, per product, a curve by rows for each
shape it measured (``matmul_shape_efficiency``), which products of that shape take.  ``kernel_efficiency`` holds measured curves of our other kernels
(attention, layernorm, ...) by op class, as a share of the fp32 peak by FLOPs.

A calibrated CPU profile's ``peak_flops`` is what a large sgemm reaches (the curves are
shares of it); its ``physical_peak_flops`` is what the cores can do at all, measured by
register-only multiply-add loops (kernels.peak), and MFU is taken against that.
Profiles without it (published ones, older calibrations) take MFU against
``peak_flops``.
"""
import bisect
import contextlib
import hashlib
import json
import math
import os
import platform
import re
import secrets
import sys
from dataclasses import asdict, dataclass, field, replace

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
THIS_MACHINE = "this-machine"

MATMUL_VARIANTS = ("fwd", "bwd_input", "bwd_weight")
# The suffix of a variant's curves measured with bf16 operands ("fwd_bf16": the products
# --precision bf16 runs, shares of peak_flops["bf16"]); optional: a profile without
# them takes the float32 curves for bf16 products too.
BF16_VARIANT = "_bf16"
CURVE_VARIANTS = MATMUL_VARIANTS + tuple(v + BF16_VARIANT for v in MATMUL_VARIANTS)
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


def shape_key(fan_in, fan_out):
    """The key of a product shape in ``matmul_shape_efficiency``: "768x2304"."""
    return f"{int(fan_in)}x{int(fan_out)}"


def _shape_of(key, name):
    try:
        fan_in, fan_out = (int(part) for part in str(key).split("x"))
    except ValueError:
        raise ValueError(f"profile {name!r}: matmul_shape_efficiency keys are 'FAN_INxFAN_OUT', "
                         f"got {key!r}") from None
    return fan_in, fan_out


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
    # CPU: precision -> FLOP/s of the cores' register-only multiply-add loops (kernels.peak:
    # fp32 from the widest fp32 FMA, bf16 from the widest bf16 dot product), {} where not
    # measured; what MFU is taken against (``mfu_peak``).
    physical_peak_flops: dict = field(default_factory=dict)
    # CPU: variant -> {"FAN_INxFAN_OUT": EfficiencyCurve by rows} for the product shapes
    # calibration measured.  A product of a measured shape takes its efficiency from its
    # own rows (a 128-row LM head lies between the 64- and 256-row heads); other shapes
    # take ``matmul_efficiency``'s curve by FLOPs, where products of different shapes and
    # rows with the same FLOPs meet (the 128-row head's 9.9 GFLOP sit beside 1024-row MLP
    # products: its step predicted 11% slow on the Zen 3).
    matmul_shape_efficiency: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in ("cpu", "gpu"):
            raise ValueError(f"profile {self.name!r}: kind must be 'cpu' or 'gpu', got {self.kind!r}")
        if not self.peak_flops or any(p not in PRECISIONS for p in self.peak_flops):
            raise ValueError(f"profile {self.name!r}: peak_flops keys must be among {PRECISIONS}, "
                             f"got {sorted(self.peak_flops)}")
        for key, value in self.peak_flops.items():
            if not value > 0:
                raise ValueError(f"profile {self.name!r}: peak_flops[{key!r}] must be > 0, got {value!r}")
        for key, value in self.physical_peak_flops.items():
            if key not in PRECISIONS or not value > 0:
                raise ValueError(f"profile {self.name!r}: physical_peak_flops needs precisions among "
                                 f"{PRECISIONS} and FLOP/s > 0, got {key!r}: {value!r}")
        missing = [v for v in MATMUL_VARIANTS if v not in self.matmul_efficiency]
        if missing:
            raise ValueError(f"profile {self.name!r}: matmul_efficiency lacks {missing}")
        unknown = [v for v in self.matmul_efficiency if v not in CURVE_VARIANTS]
        if unknown:
            raise ValueError(f"profile {self.name!r}: matmul_efficiency has unknown variants {unknown} "
                             f"(known: {', '.join(CURVE_VARIANTS)})")
        for variant, shapes in self.matmul_shape_efficiency.items():
            if variant not in CURVE_VARIANTS or not isinstance(shapes, dict):
                raise ValueError(f"profile {self.name!r}: matmul_shape_efficiency needs variants among "
                                 f"{CURVE_VARIANTS}, each a dict of shapes, got {variant!r}")
            for key, curve in shapes.items():
                if shape_key(*_shape_of(key, self.name)) != key or not isinstance(curve, EfficiencyCurve):
                    raise ValueError(f"profile {self.name!r}: matmul_shape_efficiency[{variant!r}] needs "
                                     f"'FAN_INxFAN_OUT' keys and curves, got {key!r}")
        for key in ("memory_bandwidth", "memory_capacity"):
            if not getattr(self, key) > 0:
                raise ValueError(f"profile {self.name!r}: {key} must be > 0, got {getattr(self, key)!r}")
        for key in ("op_overhead", "tape_overhead", "disk_write_bandwidth", "disk_read_bandwidth", "sram_bytes",
                    "baseline_rss"):
            if getattr(self, key) < 0:
                raise ValueError(f"profile {self.name!r}: {key} must be >= 0, got {getattr(self, key)!r}")

    @property
    def approximate(self):
        """Datasheet peaks and assumed efficiency curves, not a calibration's measurements."""
        return not self.calibration

    def describe(self):
        """The profile's name, and what its figures are worth: approximate, or measured with
        how many threads on which CPU."""
        if self.approximate:
            return f"{self.name} (approximate: datasheet figures and assumed efficiencies, not measured)"
        cpu = self.calibration.get("cpu", {}).get("model_name")
        return f"{self.name} (measured{' on ' + cpu if cpu else ''}, {self.threads} threads)"

    def peak(self, precision):
        try:
            return self.peak_flops[precision]
        except KeyError:
            raise ValueError(f"profile {self.name!r} has no peak for precision {precision!r}; "
                             f"it has {sorted(self.peak_flops)}") from None

    def mfu_peak(self, precision):
        """FLOP/s that MFU is taken against: the physical peak where the profile has one for
        ``precision``, else ``peak(precision)``; bf16 on a profile that knows nothing of
        it (no bf16 rate at all), fp32's."""
        if precision == "bf16" and "bf16" not in self.peak_flops and "bf16" not in self.physical_peak_flops:
            return self.mfu_peak("fp32")
        return self.physical_peak_flops.get(precision) or self.peak(precision)

    def matmul_peak(self, precision):
        """FLOP/s of a large product in ``precision`` (what the matmul curves are shares of):
        ``peak(precision)``; bf16 falls back to fp32's where the profile has no bf16 rate
        (profiles calibrated before it was measured; CPUs whose bf16 products are
        emulated run at about the fp32 rate)."""
        if precision == "bf16" and "bf16" not in self.peak_flops:
            return self.peak("fp32")
        return self.peak(precision)

    def matmul_time(self, flops, variant, precision, dims=()):
        """Seconds for a matmul of ``flops`` FLOPs, without the per-call overhead: at the
        efficiency its shape's curve gives its rows where ``dims`` = (rows, fan_in,
        fan_out) names a measured shape, else at the variant's curve by FLOPs.  A bf16
        product takes the variant's bf16 curves where calibration measured them."""
        if flops <= 0:
            return 0.0
        if precision == "bf16" and variant + BF16_VARIANT in self.matmul_efficiency:
            variant += BF16_VARIANT
        curve = self.matmul_shape_efficiency.get(variant, {}).get(shape_key(*dims[1:])) if dims else None
        efficiency = curve(dims[0]) if curve is not None else self.matmul_efficiency[variant](flops)
        return flops / (self.matmul_peak(precision) * efficiency)

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
            physical_peak_flops={k: v / stretch for k, v in self.physical_peak_flops.items()},
            memory_bandwidth=self.memory_bandwidth * bw_scale,
            memory_capacity=self.memory_capacity / ranks,
            matmul_efficiency={k: c.stretched(stretch) for k, c in self.matmul_efficiency.items()},
            matmul_shape_efficiency={v: {k: c.stretched(stretch) for k, c in shapes.items()}
                                     for v, shapes in self.matmul_shape_efficiency.items()},
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
        data["matmul_shape_efficiency"] = {
            variant: {k: EfficiencyCurve(**v) for k, v in shapes.items()}
            for variant, shapes in data.get("matmul_shape_efficiency", {}).items()}
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


def load_profile(name_or_path, threads=None):
    """Load a profile by file path, by the name of a shipped profile (``a100-80gb-sxm``), or
    ``this-machine``: this machine's profile for ``threads`` threads (``this_machine_profile``,
    which calibrates it once where it has not been measured)."""
    if name_or_path == THIS_MACHINE:
        return this_machine_profile(threads)
    path = name_or_path
    if not os.path.exists(path):
        path = os.path.join(PROFILE_DIR, f"{name_or_path}.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"hardware profile {name_or_path!r} not found (as a path or in "
                                f"{PROFILE_DIR}: {', '.join(available_profiles())}; or {THIS_MACHINE})")
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
    return profile_from_dict(data, origin=path)


def save_profile(profile, path):
    """Write ``profile`` to ``path`` atomically: a file of its own beside it (writers at once do
    not share one), then renamed over it."""
    tmp = f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)   # the umask decides, as for open()
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(profile.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def available_profiles():
    """Names of the profiles shipped in PROFILE_DIR (``this-machine`` is not one of them)."""
    if not os.path.isdir(PROFILE_DIR):
        return []
    return sorted(n[:-5] for n in os.listdir(PROFILE_DIR) if n.endswith(".json"))


def profile_cache_dir():
    """Where this machine's profiles are kept: ``$XDG_CACHE_HOME/adtape/profiles``, by default
    ``~/.cache/adtape/profiles`` (a relative XDG_CACHE_HOME is ignored, as the XDG spec says)."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):
        cache = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "adtape", "profiles")


def cpu_identity():
    """What this machine's profile is keyed by: the CPU's model name, family, model and a
    digest of its feature flags, from /proc/cpuinfo's first processor (x86 and ARM fields)
    where there is one, else what the platform module says."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if info:
                        break
                    continue
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    flags = sorted((info.get("flags") or info.get("Features") or "").split())
    return {"model_name": info.get("model name") or platform.processor() or platform.machine() or "unknown cpu",
            "family": info.get("cpu family") or info.get("CPU implementer", ""),
            "model": info.get("model") or info.get("CPU part", ""),
            "flags_sha256": hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16],
            "machine": f"{platform.system()} {platform.machine()}"}


def this_machine_name(threads, identity=None):
    """The file name (without .json) of this machine's profile for ``threads`` threads: the CPU
    readably, then a digest of ``cpu_identity()``, then the threads, e.g.
    ``amd-epyc-9r14-f25m17-1a2b3c4d-2t``."""
    identity = identity or cpu_identity()
    words = re.sub(r"\((r|tm)\)|@.*|\b(cpu|processor|\d+-core)\b", " ", identity["model_name"].lower())
    slug = "-".join(re.findall(r"[a-z0-9]+", words))[:40].strip("-") or "cpu"
    if identity["family"] or identity["model"]:
        slug += "-" + re.sub(r"[^a-z0-9]", "", f"f{identity['family']}m{identity['model']}".lower())
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
    return f"{slug}-{digest}-{threads}t"


def this_machine_path(threads=None):
    """Where this machine's profile for ``threads`` threads (None: the kernels' count) is kept
    (see ``this_machine_name``)."""
    return os.path.join(profile_cache_dir(), f"{this_machine_name(resolve_threads(threads))}.json")


def resolve_threads(threads=None):
    """``threads``, or the count the kernels use when it is None (kernels.threads:
    ``set_num_threads``, OMP_NUM_THREADS, the cores this process may run on)."""
    if threads is None:
        from kernels import threads as kernel_threads
        return kernel_threads.get_num_threads()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    return threads


def this_machine_profile(threads=None, calibrate_if_missing=True, progress=None):
    """This machine's profile for ``threads`` threads (None: the kernels' count), from the cache.

    Where there is none, ``calibrate_if_missing`` runs the quick calibration in a child
    process (GPT-2 124M's shapes, about 15 s on two cores: calibrate.calibrate_once), says
    so in one line on ``progress`` (a text stream, by default sys.stderr) and keeps the
    result for the next time; otherwise raises FileNotFoundError.  A cached profile whose
    recorded CPU or thread count is not this one's raises ValueError.  Calibrations are
    serialised by a lock on the cache directory, so that ranks started together measure
    one at a time and the others read the result.
    """
    threads = resolve_threads(threads)
    identity = cpu_identity()
    path = this_machine_path(threads)
    if not os.path.exists(path):
        if not calibrate_if_missing:
            raise FileNotFoundError(f"no profile of this machine for {threads} threads ({path}): run python -m "
                                    f"gpt2.perfmodel.calibrate --threads {threads}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with _cache_lock(os.path.dirname(path)):
            if not os.path.exists(path):
                from .calibrate import calibrate_once
                calibrate_once(threads, progress or sys.stderr, path)
    profile = load_profile(path)
    recorded = profile.calibration.get("cpu")
    if recorded != identity or profile.threads != threads:
        raise ValueError(f"{path} was measured on {recorded or 'an unrecorded CPU'} with {profile.threads} threads, "
                         f"not on this CPU ({identity}) with {threads}: remove it, or recalibrate with python -m "
                         f"gpt2.perfmodel.calibrate --threads {threads}")
    return profile


@contextlib.contextmanager
def _cache_lock(path):
    """An exclusive lock on directory ``path`` while the block runs (flock; none where the
    platform lacks it)."""
    try:
        import fcntl
    except ImportError:   # pragma: no cover - Windows
        yield
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # closing releases the lock
