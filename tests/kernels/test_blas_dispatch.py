"""The BLAS dispatch fix (kernels/blas_dispatch.py): the decision from the CPU's flags and
the kernels OpenBLAS reports, and the re-execution that puts the right kernels in place.

The re-execution is reached on any CPU through ADTAPE_TEST_BLAS_REPORTS, which makes the
BLAS seem to report an older family (SSE's Prescott) than the CPU has; the re-executed
process then reports, from OpenBLAS itself, the family asked for."""
import os
import subprocess
import sys

import pytest

import adtape
import gpt2
from kernels import blas_dispatch as bd

PACKAGE_ROOTS = os.pathsep.join({os.path.dirname(os.path.dirname(m.__file__))
                                 for m in (adtape, gpt2)})
ZEN5 = frozenset("fpu sse sse2 avx fma avx2 avx512f avx512cd avx512bw avx512dq avx512vl "
                 "avx512_bf16".split())
ZEN3 = frozenset("fpu sse sse2 avx fma avx2".split())


def openblas(arch, version="0.3.30", path="/x/libscipy_openblas.so"):
    return {"user_api": "blas", "internal_api": "openblas", "filepath": path,
            "version": version, "architecture": arch}


@pytest.mark.parametrize("flags, arch, want", [
    (ZEN5, "Haswell", "SkylakeX"),          # Zen 5 unknown to the library: AVX2 kernels
    (ZEN5, "Zen", "SkylakeX"),
    (ZEN5, "Prescott", "SkylakeX"),
    (ZEN5, "SkylakeX", None),
    (ZEN5, "Cooperlake", None),
    (ZEN5, "SapphireRapids", None),
    (ZEN3, "Zen", None),                    # Zen 3 has no AVX-512: Zen's kernels are right
    (ZEN3, "Haswell", None),
    (ZEN3, "Prescott", "Haswell"),
    (ZEN3, "Sandybridge", "Haswell"),
    (ZEN3, "SomethingNew", None),           # a name we do not know: left alone
])
def test_the_decision_compares_the_reported_kernels_with_the_cpu(flags, arch, want):
    decision = bd.decide(flags, [openblas(arch)], {})
    assert decision.coretype == want, decision
    if want:
        assert arch in decision.reason


def test_any_slow_openblas_among_several_decides():
    libs = [openblas("SkylakeX", path="/numpy.so"), openblas("Haswell", path="/scipy.so"),
            {"user_api": "blas", "internal_api": "mkl", "architecture": None}]
    assert bd.decide(ZEN5, libs, {}).coretype == "SkylakeX"
    assert len(bd.decide(ZEN5, libs, {}).libraries) == 2     # the OpenBLAS ones


def test_a_variable_the_user_set_is_left_alone():
    decision = bd.decide(ZEN5, [openblas("Haswell")], {"OPENBLAS_CORETYPE": "Haswell"})
    assert decision.coretype is None
    assert "OPENBLAS_CORETYPE=Haswell" in decision.reason


def test_the_fix_is_tried_once():
    env = {bd.REEXEC_MARK: "tried", "OPENBLAS_CORETYPE": ""}
    decision = bd.decide(ZEN5, [openblas("Haswell")], env)
    assert decision.coretype is None and "did not change it" in decision.reason


def test_nothing_to_do_without_openblas():
    mkl = {"user_api": "blas", "internal_api": "mkl", "architecture": None}
    assert bd.decide(ZEN5, [mkl], {}).coretype is None


def test_cpu_flags_and_class_from_cpuinfo(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: "
                    + " ".join(sorted(ZEN5)) + "\n\nprocessor\t: 1\nflags\t\t: sse\n")
    flags = bd.cpu_flags(str(path))
    assert flags == ZEN5
    assert bd.cpu_class(flags) == bd.AVX512
    assert bd.cpu_class(ZEN3) == bd.AVX2
    assert bd.cpu_class(frozenset({"avx"})) == bd.AVX
    assert bd.cpu_class(frozenset({"sse2"})) == bd.SSE
    assert bd.cpu_flags(str(tmp_path / "missing")) == frozenset()
    # AVX-512 foundation alone (Knights Landing) lacks the BW/VL kernels SkylakeX uses.
    assert bd.cpu_class(ZEN3 | {"avx512f", "avx512cd"}) == bd.AVX2


def test_ensure_sets_the_variable_and_reexecutes_with_the_same_arguments(monkeypatch):
    calls = []
    env = {}
    decision = bd.Decision("SkylakeX", "OpenBLAS took this AVX-512 CPU for Haswell")
    monkeypatch.setitem(bd._state, "decision", decision)
    monkeypatch.setattr(sys, "orig_argv", ["python3", "-m", "gpt2.train", "--steps", "3"])
    bd.ensure(env, execv=lambda exe, argv: calls.append((exe, argv)))
    assert env["OPENBLAS_CORETYPE"] == "SkylakeX"
    assert env[bd.REEXEC_MARK] == decision.reason
    assert calls == [(sys.executable, [sys.executable, "-m", "gpt2.train", "--steps", "3"])]


def test_ensure_does_nothing_where_the_kernels_are_right(monkeypatch):
    monkeypatch.setitem(bd._state, "decision", bd.Decision(None, "fine"))
    env = {}
    bd.ensure(env, execv=lambda *a: pytest.fail("re-executed"))
    assert env == {}


def test_the_library_warns_once_with_the_fix(monkeypatch):
    monkeypatch.setitem(bd._state, "decision", bd.Decision("SkylakeX", "OpenBLAS took this "
                                                           "AVX-512 CPU for Haswell"))
    monkeypatch.setitem(bd._state, "warned", False)
    with pytest.warns(RuntimeWarning, match="OPENBLAS_CORETYPE=SkylakeX"):
        bd.warn_if_mismatched()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bd.warn_if_mismatched()                      # once


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_CORETYPE", bd.REEXEC_MARK, bd.TEST_REPORTED)}
    env.update(PYTHONPATH=PACKAGE_ROOTS, **extra)
    return env


CHILD = """
from kernels import blas_dispatch as bd
bd.ensure()
from threadpoolctl import threadpool_info
import os
print("ARCH", sorted({i["architecture"] for i in threadpool_info()
                      if i["internal_api"] == "openblas"}))
print("ENV", os.environ.get("OPENBLAS_CORETYPE"))
print("DESCRIBE", bd.describe())
"""


def test_a_wrong_dispatch_is_fixed_by_one_reexecution(tmp_path):
    want = bd.CORETYPE_FOR_CLASS[bd.cpu_class(bd.cpu_flags())]
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120,
                          env=_env(ADTAPE_TEST_BLAS_REPORTS="Prescott"))
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["ENV"] == want
    assert lines["ARCH"] == repr([want]), proc.stdout       # OpenBLAS itself says so
    assert f"OPENBLAS_CORETYPE={want} set by adtape: OpenBLAS took this" in lines["DESCRIBE"]
    assert "for Prescott" in lines["DESCRIBE"]


def test_the_training_header_names_the_blas_kernels(tmp_path):
    want = bd.CORETYPE_FOR_CLASS[bd.cpu_class(bd.cpu_flags())]
    args = ["--model", "tiny", "-B", "1", "-T", "16", "--steps", "1", "--corpus-bytes", "20k",
            "--eval-interval", "0", "--sample-tokens", "0", "--no-progress",
            "--out-dir", str(tmp_path / "run")]
    proc = subprocess.run([sys.executable, "-m", "gpt2.train", *args], capture_output=True,
                          text=True, cwd=tmp_path, timeout=300,
                          env=_env(ADTAPE_TEST_BLAS_REPORTS="Prescott"))
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.splitlines()[0]
    fixed = f"{want} kernels; OPENBLAS_CORETYPE={want} set by adtape: OpenBLAS took this"
    assert fixed in header, header
    # Without the stand-in: the kernels OpenBLAS picked, named.
    proc = subprocess.run([sys.executable, "-m", "gpt2.train", *args, "--overwrite"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr
    assert "OpenBLAS " in proc.stdout.splitlines()[0] and " kernels" in proc.stdout
