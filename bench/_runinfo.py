"""What the benchmarks that run GPT-2 workers share: the MODEL:BxT configuration lists
they take, the CPU and commit each result file names, and the machine's physical
compute peak their shares are taken against (harness.LimitProbe probes all the limits)."""
import argparse
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_configs(text, example, note=""):
    """'gpt2:4x1024,gpt2-medium:4x1024' -> (('gpt2', 4, 1024), ('gpt2-medium', 4, 1024))."""
    out = []
    for item in text.split(","):
        try:
            model, bt = item.split(":")
            b, t = (int(v) for v in bt.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"a configuration is MODEL:BxT{note}, e.g. {example}; got {item!r}") from None
        out.append((model, b, t))
    return tuple(out)


# AMD family 25 (0x19) models: 0x00-0x0f and 0x20-0x5f Zen 3, 0x10-0x1f and 0x60-0xaf Zen 4.
_AMD_ZEN = {25: lambda m: "Zen 4" if 0x10 <= m <= 0x1f or 0x60 <= m <= 0xaf else "Zen 3",
            26: lambda m: "Zen 5", 23: lambda m: "Zen 2" if m >= 0x30 else "Zen/Zen+"}


def cpu_name():
    """The CPU's model name from /proc/cpuinfo, with its family, model and vector width
    (a VM often names only "AMD EPYC": Zen 3 and Zen 4 differ by AVX-512); "unknown"
    where there is no /proc/cpuinfo."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break                                # the first processor is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return "unknown"
    name = fields.get("model name", "unknown")
    try:
        family, model = int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return name
    core = _AMD_ZEN[family](model) if "AMD" in fields.get("vendor_id", "") and family in _AMD_ZEN else None
    avx = "AVX-512" if "avx512f" in fields.get("flags", "").split() else "AVX2, no AVX-512"
    return f"{name} ({core + ', ' if core else ''}family {family} model {model}, {avx})"


# The flags that decide which kernels run: vector widths, bf16 dot products, AMX tiles.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_flags():
    """Which of KERNEL_FLAGS the CPU reports (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.partition(":")[2].split())
                    return [flag for flag in KERNEL_FLAGS if flag in have]
    except OSError:
        pass
    return []


def git_commit():
    """The checkout's short commit hash, with "+dirty" where tracked files differ from it
    (a run of uncommitted code), or None outside a git checkout."""
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+dirty" if dirty else "")


def physical_peak(n_threads, seconds=0.1, repeats=3):
    """The physical FMA peak of ``n_threads`` cores (kernels.peak.physical_peak: GFLOP/s of
    register-only multiply-add loops per ISA, ``fp32_peak_gflops`` from the widest fp32
    loop, ``bf16_peak_gflops`` from the widest bf16 one or None), the compute limit of
    every benchmark's share; the BLAS sgemm rates are reported beside it.  Its keys are
    there, with None, where the kernels have no loop for this CPU."""
    from kernels import peak
    return peak.physical_peak(n_threads, seconds, repeats)


def best_peak(*peaks):
    """physical_peak's answer from several measurements of it: each ISA's best rate (on a
    shared machine a measurement taken while a neighbour ran reads low, and a share
    against it above 100%)."""
    rates = {}
    for p in peaks:
        for isa, gflops in p["peak_gflops_by_isa"].items():
            rates[isa] = max(gflops, rates.get(isa, 0.0))
    out = {"peak_gflops_by_isa": rates}
    for kind in ("fp32", "bf16"):
        isa = peaks[0][f"{kind}_peak_isa"]
        out[f"{kind}_peak_isa"] = isa
        out[f"{kind}_peak_gflops"] = rates.get(isa)
    return out


def compute_limit(limits):
    """(GFLOP/s, what it is) of a run's compute limit: the physical fp32 peak, or the sgemm
    rate where the CPU has no peak loop (``limits`` holds ``fp32_peak_gflops`` and
    ``sgemm_gflops`` or ``sgemm_peak_gflops``)."""
    if limits.get("fp32_peak_gflops"):
        return limits["fp32_peak_gflops"], f"fp32 peak ({limits.get('fp32_peak_isa') or 'widest fp32 FMA'})"
    return limits.get("sgemm_gflops", limits.get("sgemm_peak_gflops")), "sgemm"

