"""The register-only peak loops (kernels.peak): each loop does the work it is timed
for (its checksum against a plain NumPy twin), the ISAs listed are the CPU's, and the
peak is a positive rate.  No timing is asserted."""
import platform

import pytest

from kernels import peak

AVAILABLE = peak.available_isas()


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    pytest.skip("no /proc/cpuinfo flags")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 loops")
def test_available_isas_are_the_cpus():
    flags = cpu_flags()
    assert ("avx2" in AVAILABLE) == ({"avx2", "fma"} <= flags)
    assert ("avx512" in AVAILABLE) == ("avx512f" in flags)
    assert ("avx512_bf16" in AVAILABLE) == ({"avx512f", "avx512_bf16"} <= flags)
    # Linux may refuse the tile state to this process: listed only where the CPU has it.
    if "amx_bf16" in AVAILABLE:
        assert {"amx_bf16", "amx_tile"} <= flags
    assert set(AVAILABLE) <= set(peak.ISA_NAMES)


def test_flops_per_iteration_follow_the_convention():
    assert peak.flops_per_iteration("avx2") == 12 * 8 * 2
    assert peak.flops_per_iteration("avx512") == 16 * 16 * 2
    assert peak.flops_per_iteration("avx512_bf16") == 16 * 64
    assert peak.flops_per_iteration("amx_bf16") == 4 * 16 * 16 * 32 * 2


# Multipliers that are powers of two keep every product exact, so an FMA and the
# twin's product-then-sum round alike at any count.
def refused_where_missing(isa):
    """Whether ``isa`` is missing here, having checked that asking for it is refused."""
    if isa in AVAILABLE:
        return False
    with pytest.raises(ValueError, match=isa):
        peak.fma_checksum(isa, 1, 1.0, 1.0)
    return True


@pytest.mark.parametrize("isa", peak.FP32_ISAS)
@pytest.mark.parametrize("iterations", [0, 1, 2, 7, 100, 120])
@pytest.mark.parametrize("mul, add", [(1.0, 1.0), (2.0, 1.0), (-1.0, 3.0), (0.5, -0.25)])
def test_fp32_checksum_matches_naive(isa, iterations, mul, add):
    if refused_where_missing(isa):
        return
    assert peak.fma_checksum(isa, iterations, mul, add) == peak.fma_checksum_naive(isa, iterations, mul, add)


@pytest.mark.parametrize("isa", peak.BF16_ISAS)
@pytest.mark.parametrize("iterations", [0, 1, 2, 7, 100])
@pytest.mark.parametrize("mul, add", [(1.0, 1.0), (3.0, -0.5), (1.0078125, 2.0)])
def test_bf16_checksum_matches_naive(isa, iterations, mul, add):
    if refused_where_missing(isa):
        return
    assert peak.fma_checksum(isa, iterations, mul, add) == peak.fma_checksum_naive(isa, iterations, mul, add)


@pytest.mark.parametrize("isa", peak.BF16_ISAS)
def test_bf16_inputs_are_cut_to_bf16(isa):
    if refused_where_missing(isa):
        return
    # 1.001 is 1.0 in bf16 (its low 16 bits dropped).
    assert peak.fma_checksum(isa, 5, 1.001, 1.0) == peak.fma_checksum(isa, 5, 1.0, 1.0)


@pytest.mark.parametrize("isa", peak.ISA_NAMES)
def test_naive_checksum_counts_every_iteration(isa):
    # A loop that skipped an iteration would not match its twin.
    sums = [peak.fma_checksum_naive(isa, n) for n in range(4)]
    assert len(set(sums)) == 4


@pytest.mark.parametrize("isa", AVAILABLE)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_peak_is_positive(isa, n_threads):
    assert peak.fma_peak(isa, n_threads, seconds=0.005, repeats=1) > 0


def test_peak_of_the_default_threads():
    if not AVAILABLE:
        pytest.skip("no peak loop for this CPU")
    assert peak.fma_peak(AVAILABLE[0], seconds=0.005, repeats=2) > 0


def test_unknown_isa_is_refused():
    with pytest.raises(ValueError, match="unknown ISA 'sse9'"):
        peak.fma_peak("sse9")
    with pytest.raises(ValueError, match="unknown ISA"):
        peak.fma_checksum_naive("neon", 1)


def test_missing_isa_is_refused_by_name():
    missing = [isa for isa in peak.ISA_NAMES if isa not in AVAILABLE]
    if not missing:
        pytest.skip("this CPU runs every loop")
    with pytest.raises(ValueError, match=f"does not run {missing[0]}"):
        peak.fma_peak(missing[0])
    with pytest.raises(ValueError, match=f"does not run {missing[-1]}"):
        peak.fma_checksum(missing[-1], 1)


@pytest.mark.parametrize("kwargs, match", [
    ({"n_threads": 0}, "n_threads"), ({"n_threads": 1.5}, "n_threads"),
    ({"seconds": 0}, "seconds"), ({"seconds": float("nan")}, "seconds"), ({"seconds": "1"}, "seconds"),
    ({"repeats": 0}, "repeats"), ({"repeats": True}, "repeats"),
])
def test_bad_arguments_are_refused(kwargs, match):
    if not AVAILABLE:
        pytest.skip("no peak loop for this CPU")
    with pytest.raises(ValueError, match=match):
        peak.fma_peak(AVAILABLE[0], **kwargs)


@pytest.mark.parametrize("iterations", [-1, 1.0, True, 2 ** 62])
def test_bad_iterations_are_refused(iterations):
    with pytest.raises(ValueError, match="iterations"):
        peak.fma_checksum_naive("avx2", iterations)
