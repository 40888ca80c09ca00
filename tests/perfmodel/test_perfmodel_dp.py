"""Tests of the data-parallel side of the performance model: the link fit from the probe's
timings, the ranks' share of a CPU, ZeRO-1 memory, exposed communication and the CLI."""
import pytest

from gpt2.perfmodel import GraphOptions, ModelSpec, ParallelConfig, Workload, all_gather, all_reduce, estimate, \
    load_profile, reduce_scatter
from gpt2.perfmodel import calibrate, cli
from gpt2.perfmodel.calibrate import LinkUnavailable, fit_collective, link_from_probe
from gpt2.perfmodel.hardware import Interconnect, save_profile

GPT2 = ModelSpec(12, 12, 768, 50257)
SIZES = [64, 512, 4096, 32768, 262144, 2 << 20, 8 << 20, 32 << 20, 100 << 20]
FORMULAS = {"all_reduce": all_reduce, "reduce_scatter": reduce_scatter, "all_gather": all_gather}
LINKS = {"all_reduce": (3e9, 5e-6), "reduce_scatter": (2e9, 7e-6), "all_gather": (6e9, 4e-6)}


def synthetic_probe(ranks=2):
    """The link probe's JSON for a link that follows collectives.py's formulas exactly."""
    timings = {name: [[n, FORMULAS[name](n, ranks, *LINKS[name])] for n in SIZES] for name in LINKS}
    bucket = 25 << 20
    overlap = {}
    for name, share in (("all_reduce", 0.5), ("reduce_scatter", 0.25)):
        alone = 8 * FORMULAS[name](bucket, ranks, *LINKS[name])
        overlap[name] = {"bytes": 8 * bucket, "buckets": 8, "alone_s": alone, "compute_s": 1.0,
                         "extra_s": share * alone, "cost": share}
    return {"ranks": ranks, "threads": 1, "collectives": timings, "overlap": overlap, "runtime_rss": 32 << 20,
            "buffers": {"all_reduce": 0.5, "reduce_scatter": 0.5},
            "rank_rates": {"threads": 1, "sgemm_shape": [1024, 768, 3072], "sgemm_flops": 80e9,
                           "copy_bytes": 256 << 20, "copy_bandwidth": 15e9}}


def unlinked(profile):
    return profile.with_changes(interconnect=Interconnect(), rank_rates={})


@pytest.fixture(scope="module")
def machine():
    return unlinked(load_profile("zen4-2core-vm"))


@pytest.fixture(scope="module")
def linked(machine):
    link, rates = link_from_probe(synthetic_probe())
    return machine.with_changes(interconnect=link, rank_rates=rates)


def test_link_fit_recovers_bandwidth_and_latency_of_each_collective():
    raw = synthetic_probe()
    for name, (bw, lat) in LINKS.items():
        fit = fit_collective(name, raw["collectives"][name], 2)
        assert fit["bandwidth"] == pytest.approx(bw, rel=1e-3)
        assert fit["latency"] == pytest.approx(lat, rel=1e-3)


def test_link_fit_is_not_pulled_by_one_noisy_size():
    points = [[n, all_reduce(n, 2, 3e9, 5e-6) * (1.3 if n == 8 << 20 else 1.0)] for n in SIZES]
    assert fit_collective("all_reduce", points, 2)["bandwidth"] == pytest.approx(3e9, rel=0.15)


def test_link_fit_needs_small_and_large_sizes():
    with pytest.raises(ValueError, match="needs sizes"):
        fit_collective("all_reduce", [[64, 1e-5], [512, 1e-5]], 2)


def test_probe_becomes_an_interconnect():
    link, rates = link_from_probe(synthetic_probe())
    assert link.devices_per_node == 2 and link.measured
    assert link.collective_link("reduce_scatter", 2, False) == pytest.approx(LINKS["reduce_scatter"], rel=1e-3)
    assert (link.intra_node_bandwidth, link.intra_node_latency) == pytest.approx(LINKS["all_reduce"], rel=1e-3)
    # The overlap cost is relative to the fitted time of the buckets in flight.
    assert link.overlap_cost == pytest.approx({"all_reduce": 0.5, "reduce_scatter": 0.25}, rel=1e-3)
    assert link.runtime_rss == 32 << 20 and rates["2"]["threads"] == 1


def test_rank_view_reproduces_the_measured_rank_rates(linked):
    view = linked.rank_view(2)
    flops = 2.0 * 1024 * 768 * 3072
    assert flops / view.matmul_time(flops, "fwd", "fp32") == pytest.approx(80e9, rel=1e-9)
    copied = 2.0 * (256 << 20)
    assert copied / view.memory_time(copied) == pytest.approx(15e9, rel=1e-9)
    assert view.threads == 1 and view.memory_capacity == linked.memory_capacity / 2
    assert view.baseline_rss == linked.baseline_rss + (32 << 20)
    with pytest.raises(ValueError, match="--link-only --ranks 4"):
        linked.rank_view(4)


def test_zero1_shards_the_optimizer_per_rank(linked):
    w = Workload(8, 64)
    plain = estimate(GPT2, w, ParallelConfig(dp=2), linked).memory
    zero1 = estimate(GPT2, w, ParallelConfig(dp=2, zero_stage=1), linked).memory
    assert zero1.optimizer == pytest.approx(plain.optimizer / 2)
    assert zero1.parameters == plain.parameters
    # Our engine keeps the rank's reduced gradient shard beside the whole arena.
    assert zero1.gradients == pytest.approx(plain.gradients * 1.5)
    four = estimate(GPT2, Workload(16, 64), ParallelConfig(dp=4, zero_stage=1), load_profile("a100-80gb-sxm"))
    assert four.memory.optimizer == pytest.approx(8 * GPT2.num_parameters() / 4)


def test_exposed_communication_follows_the_measured_overlap_cost(linked):
    w = Workload(8, 64)
    base = dict(dp=2, zero_stage=1, dp_bucket_bytes=25 << 20)
    blocking = estimate(GPT2, w, ParallelConfig(**base), linked)
    overlapped = estimate(GPT2, w, ParallelConfig(**base, overlap_dp_comm=True), linked)
    reduce, gather = blocking.details["data_parallel_reduce"], blocking.details["data_parallel_gather"]
    assert blocking.communication["data_parallel"] == pytest.approx(reduce + gather)
    assert overlapped.communication["data_parallel"] == pytest.approx(0.25 * reduce + gather)
    # Buckets pay the latency once each.
    one = estimate(GPT2, w, ParallelConfig(dp=2, zero_stage=1), linked).details["data_parallel_reduce"]
    buckets = -(-4 * GPT2.num_parameters() // (25 << 20))
    assert reduce - one == pytest.approx((buckets - 1) * LINKS["reduce_scatter"][1], rel=1e-3)


def test_a_profile_without_a_measured_link_says_so(machine, tmp_path):
    with pytest.raises(ValueError, match="no measured link between ranks.*--link-only"):
        estimate(GPT2, Workload(8, 64), ParallelConfig(dp=2, zero_stage=1), machine)
    path = tmp_path / "unlinked.json"
    save_profile(machine, str(path))
    with pytest.raises(SystemExit, match="--link-only"):
        cli.main(["--model", "gpt2", "--batch", "8", "--seq", "64", "--dp", "2", "--zero", "1",
                  "--hardware", str(path)])


def test_cli_prints_per_rank_time_and_memory(linked, tmp_path, capsys):
    path = tmp_path / "linked.json"
    save_profile(linked, str(path))
    assert cli.main(["--model", "gpt2", "--batch", "8", "--seq", "64", "--dp", "2", "--zero", "1",
                     "--hardware", str(path)]) == 0
    out = capsys.readouterr().out
    assert "per rank: batch 4 x seq 64, 2 ranks share this machine" in out
    assert "memory per rank" in out and "step (per rank)" in out
    assert "exposed (overlapped with the backward)" in out
    est = estimate(GPT2, Workload(8, 64), ParallelConfig(dp=2, zero_stage=1, overlap_dp_comm=True,
                                                        dp_bucket_bytes=25 << 20), linked, GraphOptions())
    assert f"{est.step_time:9.3f} s" in out


def test_link_measurement_needs_mpiexec(monkeypatch):
    monkeypatch.setattr(calibrate.shutil, "which", lambda name: None)
    with pytest.raises(LinkUnavailable, match="mpiexec not found"):
        calibrate.measure_link()
