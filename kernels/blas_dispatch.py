"""Which kernels the BLAS runs, and the fix where it took this CPU for an older one.

OpenBLAS (the BLAS that NumPy and SciPy bundle, and the one our products call through
``scipy.linalg.cython_blas``) picks its kernels at load time from the CPU's model
number.  A CPU newer than the library falls back to an older family: the OpenBLAS in
SciPy 1.17 reports ``Haswell`` (AVX2, half the FMA width) on AMD Zen 5, which halves
every product on a CPU with AVX-512.  Setting ``OPENBLAS_CORETYPE`` before the library
loads makes it take the kernels named there.

``decide`` compares the kernel family the BLAS reports (threadpoolctl's
``architecture``) with the CPU's flags; ``ensure`` is called first thing by the entry
points (``gpt2-train``, the benchmarks): where the two disagree it sets the variable and
re-executes the process once, before any thread or MPI connection exists.  Library users
get one warning with the fix from ``warn_if_mismatched`` (called by
``kernels.threads.set_num_threads``).  A variable the user set is left alone.

The entry points call ``ensure`` before any thread, file or MPI connection exists (the
``kernels`` package has loaded NumPy and its BLAS by then; the re-executed process loads
them with the variable set).
"""
import dataclasses
import os
import sys
import warnings

ENV = "OPENBLAS_CORETYPE"
# Set in the re-executed process: the fix was tried, do not try again.
REEXEC_MARK = "ADTAPE_BLAS_REEXEC"
# Test hook: take the BLAS to report this architecture (the re-execution path cannot be
# reached on a CPU that OpenBLAS knows).  Ignored once REEXEC_MARK is set.
TEST_REPORTED = "ADTAPE_TEST_BLAS_REPORTS"

# Vector classes, in order: what the kernels of a family need.
SSE, AVX, AVX2, AVX512 = 1, 2, 3, 4
CLASS_NAMES = {SSE: "SSE", AVX: "AVX", AVX2: "AVX2+FMA", AVX512: "AVX-512"}
# The OpenBLAS core type that runs each class's kernels (sgemm: SkylakeX's AVX-512
# kernels are also Cooperlake's and SapphireRapids'; Haswell's AVX2 ones are Zen's).
CORETYPE_FOR_CLASS = {AVX512: "SkylakeX", AVX2: "Haswell", AVX: "Sandybridge"}
# OpenBLAS's core names (driver/others/dynamic.c), lower case, by the class they need.
_CORE_CLASS = {
    "skylakex": AVX512, "cooperlake": AVX512, "sapphirerapids": AVX512,
    "haswell": AVX2, "zen": AVX2, "excavator": AVX2,
    "sandybridge": AVX, "bulldozer": AVX, "piledriver": AVX, "steamroller": AVX,
}
_AVX512_FLAGS = ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl")


def cpu_flags(path="/proc/cpuinfo"):
    """The first processor's flags, as a frozenset (empty where there is no cpuinfo)."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_class(flags):
    """The widest vector class the CPU (and its OS) runs, from its flags."""
    if all(f in flags for f in _AVX512_FLAGS):
        return AVX512
    if "avx2" in flags and "fma" in flags:
        return AVX2
    if "avx" in flags:
        return AVX
    return SSE


def core_class(architecture):
    """The vector class an OpenBLAS core type's kernels use (SSE for the older ones);
    None for a name we do not know."""
    if not architecture:
        return None
    name = architecture.lower()
    if name in _CORE_CLASS:
        return _CORE_CLASS[name]
    if name in ("prescott", "core2", "penryn", "dunnington", "nehalem", "atom", "barcelona",
                "opteron", "opteron_sse3", "athlon", "bobcat", "nano", "northwood", "banias",
                "katmai", "coppermine"):
        return SSE
    return None


@dataclasses.dataclass(frozen=True)
class Decision:
    """What ``decide`` found.  ``coretype``: the value to give OPENBLAS_CORETYPE (None:
    nothing to do); ``reason``: one sentence; ``libraries``: (name, version, architecture)
    of each OpenBLAS loaded."""
    coretype: object
    reason: str
    libraries: tuple = ()


def decide(flags, libraries, environ):
    """Whether the OpenBLAS ``libraries`` (threadpoolctl's info dicts) run narrower
    kernels than a CPU with ``flags`` can, and the core type to ask for instead.

    Nothing to do where the user set OPENBLAS_CORETYPE, where a re-execution already
    tried, where no OpenBLAS is loaded, or where every one runs the CPU's widest class."""
    libs = tuple((lib.get("filepath", "?"), lib.get("version"), lib.get("architecture"))
                 for lib in libraries if lib.get("internal_api") == "openblas")
    want = cpu_class(flags)
    if environ.get(ENV):
        return Decision(None, f"{ENV}={environ[ENV]} was set before the start", libs)
    if not libs:
        return Decision(None, "no OpenBLAS loaded", libs)
    slow = [(path, arch) for path, _, arch in libs
            if core_class(arch) is not None and core_class(arch) < want]
    if not slow:
        return Decision(None, "the BLAS runs this CPU's widest kernels", libs)
    arch = slow[0][1]
    reason = (f"OpenBLAS took this {CLASS_NAMES[want]} CPU for {arch} "
              f"({CLASS_NAMES[core_class(arch)]} kernels)")
    if environ.get(REEXEC_MARK):
        return Decision(None, reason + f"; {ENV}={environ.get(ENV)} did not change it", libs)
    return Decision(CORETYPE_FOR_CLASS[want], reason, libs)


def blas_libraries(environ=os.environ):
    """threadpoolctl's info of the BLAS libraries, loading NumPy's and SciPy's first
    (threadpoolctl only sees what is loaded).  ``ADTAPE_TEST_BLAS_REPORTS`` replaces
    the architecture OpenBLAS reports (tests)."""
    import numpy  # noqa: F401
    import scipy.linalg.cython_blas  # noqa: F401
    from threadpoolctl import threadpool_info
    libs = [info for info in threadpool_info() if info.get("user_api") == "blas"]
    fake = environ.get(TEST_REPORTED)
    if fake and not environ.get(REEXEC_MARK):
        libs = [dict(lib, architecture=fake) if lib.get("internal_api") == "openblas" else lib
                for lib in libs]
    return libs


_state = {"decision": None, "fixed": None, "warned": False}


def current(environ=os.environ):
    """The decision for this process (computed once)."""
    if _state["decision"] is None:
        _state["decision"] = decide(cpu_flags(), blas_libraries(environ), environ)
    return _state["decision"]


def ensure(environ=os.environ, execv=os.execv):
    """For entry points, before any thread, file or MPI connection: where the BLAS runs
    narrower kernels than the CPU has, set OPENBLAS_CORETYPE and re-execute this process
    once (its arguments and environment otherwise unchanged).  Returns the decision
    where nothing was done."""
    if environ.get(REEXEC_MARK):
        _state["fixed"] = environ[REEXEC_MARK]
    decision = current(environ)
    if decision.coretype is None:
        return decision
    environ[ENV] = decision.coretype
    environ[REEXEC_MARK] = decision.reason
    sys.stdout.flush()
    sys.stderr.flush()
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable] + sys.argv)
    execv(sys.executable, [sys.executable] + argv[1:])
    return decision     # only where execv is a stand-in (tests)


def describe(environ=os.environ):
    """One phrase for a header: which kernels the BLAS runs and why, e.g. 'OpenBLAS
    SkylakeX kernels; OPENBLAS_CORETYPE=SkylakeX set by adtape: OpenBLAS took this
    AVX-512 CPU for Haswell (AVX2+FMA kernels)'."""
    decision = current(environ)
    if not decision.libraries:
        return "no OpenBLAS loaded"
    archs = []
    for _, _, arch in decision.libraries:
        if arch not in archs:
            archs.append(arch)
    text = f"OpenBLAS {'/'.join(map(str, archs))} kernels"
    fixed = _state["fixed"] or environ.get(REEXEC_MARK)
    if fixed:
        text += f"; {ENV}={environ.get(ENV)} set by adtape: {fixed}"
    elif environ.get(ENV):
        text += f"; {ENV}={environ[ENV]} from the environment"
    elif decision.coretype:
        text += f"; {decision.reason}: set {ENV}={decision.coretype} before the start"
    return text


def record(environ=os.environ):
    """The BLAS facts for a benchmark record."""
    decision = current(environ)
    return {"blas": [{"path": p, "version": v, "architecture": a}
                     for p, v, a in decision.libraries],
            "blas_coretype_env": environ.get(ENV),
            "cpu_class": CLASS_NAMES[cpu_class(cpu_flags())]}


def warn_if_mismatched(environ=os.environ):
    """Warn once where the BLAS runs narrower kernels than the CPU has (library use;
    the entry points fix it with ``ensure`` instead)."""
    if _state["warned"]:
        return
    decision = current(environ)
    _state["warned"] = True
    if decision.coretype:
        warnings.warn(f"{decision.reason}: matrix products run at about half speed. "
                      f"Set {ENV}={decision.coretype} in the environment before Python "
                      f"starts.", RuntimeWarning, stacklevel=3)
