"""Tests of the analytical performance model: formulas, published figures, zeros when off,
monotonicity, the CLI, and a quick calibration that writes a valid profile."""
import json
import math

import pytest

from gpt2.perfmodel import (EfficiencyCurve, GraphOptions, ModelSpec, ParallelConfig, Workload, activation_bytes,
                            all_gather, all_reduce, all_to_all, binomial_recompute_steps, estimate,
                            korthikanti_activations_per_layer, load_profile, megatron_flops, model_state_bytes,
                            point_to_point, reduce_scatter, step_graph)
from gpt2.perfmodel import cli
from gpt2.perfmodel.estimate import op_time
from gpt2.perfmodel.calibrate import calibrate
from gpt2.perfmodel.hardware import available_profiles, profile_from_dict, save_profile
from gpt2.perfmodel.published import (GPT3_175B, korthikanti_checks, megatron_flops_checks, palm_mfu_check,
                                      zero_checks)

GPT2 = ModelSpec(12, 12, 768, 50257)
CPU = load_profile("generic-cpu")
A100 = load_profile("a100-80gb-sxm")


def test_gpt2_parameter_count_matches_llmc_layout():
    assert GPT2.num_parameters() == 124475904
    assert ModelSpec(2, 2, 32, 256, block_size=64).num_parameters() == 256 * 32 + 64 * 32 + 2 * (
        12 * 32 * 32 + 13 * 32) + 64


def test_shipped_profiles_load():
    names = available_profiles()
    for name in ("a100-40gb-sxm", "a100-80gb-sxm", "h100-sxm", "generic-cpu"):
        assert name in names
        assert load_profile(name).peak_flops["fp32"] > 0


def test_profile_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_profile("nope")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(str(bad))
    data = CPU.to_dict()
    del data["memory_bandwidth"]
    with pytest.raises(ValueError, match="memory_bandwidth"):
        profile_from_dict(data, "x")
    data = CPU.to_dict()
    data["peak_flops"] = {"fp32": -1}
    with pytest.raises(ValueError, match="peak_flops"):
        profile_from_dict(data, "x")


def test_profile_round_trip(tmp_path):
    path = tmp_path / "p.json"
    save_profile(CPU, str(path))
    assert load_profile(str(path)) == CPU


def test_efficiency_curve_forms():
    sat = EfficiencyCurve(0.8, 100.0)
    assert sat(100.0) == pytest.approx(0.4)
    assert sat(1e12) == pytest.approx(0.8, rel=1e-6)
    table = EfficiencyCurve(1.0, 0.0, points=((10, 0.2), (1000, 0.6)))
    assert table(1) == 0.2 and table(1e9) == 0.6
    assert table(100) == pytest.approx(0.4)
    with pytest.raises(ValueError):
        EfficiencyCurve(0.0, 1.0)


def test_spec_validation():
    with pytest.raises(ValueError, match="divisible"):
        ModelSpec(1, 5, 32, 10)
    with pytest.raises(ValueError, match="sequence_parallel"):
        ParallelConfig(sequence_parallel=True)
    with pytest.raises(ValueError, match="recompute"):
        ParallelConfig(recompute="sometimes")
    with pytest.raises(ValueError, match="divisible by dp"):
        Workload(5, 16).micro_batch_size(ParallelConfig(dp=2))


def test_matmul_flops_of_graph_equal_6N_plus_attention():
    b, t = 2, 32
    ops = step_graph(GPT2, Workload(b, t), ParallelConfig())
    gemm = sum(op.gemm_flops for op in ops)
    # 6 * (matmul weights) * tokens plus 12 * L * C * T^2-per-sequence attention products.
    C, L = GPT2.n_embd, GPT2.n_layer
    weights = L * 12 * C * C + GPT2.padded_vocab * C
    assert gemm == pytest.approx(6 * weights * b * t + 12 * L * C * t * t * b, rel=1e-12)


def test_published_checks_within_rounding():
    for rec in zero_checks():
        # ZeRO prints its figures rounded to 0.1 GB.
        assert abs(rec["predicted"] - rec["measured"]) <= 0.05 + 1e-9, rec
    for rec in korthikanti_checks() + megatron_flops_checks():
        assert rec["rel_error"] == pytest.approx(0.0, abs=1e-12), rec
    (palm,) = palm_mfu_check()
    assert abs(palm["predicted"] - palm["measured"]) < 0.0005


def test_korthikanti_closed_forms():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    assert korthikanti_activations_per_layer(s, b, h, a) == 34 * s * b * h + 5 * a * s * s * b
    assert korthikanti_activations_per_layer(s, b, h, a, t) == s * b * h * (10 + 24 / t) + 5 * a * s * s * b / t
    assert korthikanti_activations_per_layer(s, b, h, a, t, True, "selective") == 34 * s * b * h / t


def test_megatron_formula_matches_its_expansion():
    B, s = 3, 2048
    l, h, V = GPT3_175B.n_layer, GPT3_175B.n_embd, GPT3_175B.padded_vocab
    assert megatron_flops(GPT3_175B, B, s) == pytest.approx(
        96 * B * s * l * h * h + 16 * B * s * s * l * h + 6 * B * s * h * V)


def test_zero_sharding_is_monotone_and_exact():
    sizes = [sum(model_state_bytes(1e9, "bf16", 8, z)) for z in range(4)]
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[3] == pytest.approx(16e9 / 8)
    assert sum(model_state_bytes(1e9, "fp32", 1, 0)) == 16e9


def test_collectives_formulas_and_zero_when_off():
    n, bw, lat = 1e9, 1e11, 1e-5
    assert all_reduce(n, 8, bw, lat) == pytest.approx(14 * lat + 2 * 7 / 8 * n / bw)
    assert reduce_scatter(n, 8, bw, lat) == pytest.approx(7 * lat + 7 / 8 * n / bw)
    assert all_gather(n, 4, bw, lat) == all_to_all(n, 4, bw, lat)
    for fn in (all_reduce, reduce_scatter, all_gather, all_to_all):
        assert fn(n, 1, 0.0, lat) == 0.0
        assert fn(0.0, 8, bw, lat) == 0.0
    assert point_to_point(0.0, bw, lat) == 0.0
    with pytest.raises(ValueError, match="bandwidth"):
        all_reduce(n, 2, 0.0, lat)


def test_every_parallel_term_is_zero_when_off():
    est = estimate(GPT2, Workload(4, 64), ParallelConfig(), CPU)
    assert all(v == 0.0 for v in est.communication.values())
    assert est.bubble == 0.0 and est.bubble_fraction == 0.0 and est.spill_io == 0.0
    assert est.memory.spilled == 0.0
    assert all(phase != "recompute" for phase, _ in est.compute)
    ops = step_graph(GPT2, Workload(4, 64), ParallelConfig())
    assert not [op for op in ops if op.phase == "recompute"]


def test_each_feature_turns_its_term_on():
    w = Workload(64, 1024, micro_batch=1, precision="bf16")
    spec = ModelSpec(8, 16, 2048, 50257, block_size=1024)
    base = estimate(spec, w, ParallelConfig(dp=8), A100)
    assert base.communication["data_parallel"] > 0 and base.communication["tensor_parallel"] == 0
    tp = estimate(spec, w, ParallelConfig(dp=4, tp=2), A100)
    assert tp.communication["tensor_parallel"] > 0
    pp = estimate(spec, w, ParallelConfig(dp=4, pp=2), A100)
    n_micro = w.num_micro_batches(ParallelConfig(dp=4, pp=2))
    assert pp.bubble_fraction == pytest.approx((2 - 1) / (n_micro + 2 - 1))
    assert pp.communication["pipeline_p2p"] > 0
    inter = estimate(spec, w, ParallelConfig(dp=2, pp=4, interleave=2), A100)
    n_micro = w.num_micro_batches(ParallelConfig(dp=2, pp=4))
    assert inter.bubble_fraction == pytest.approx(3 / (2 * n_micro + 3))
    moe = ModelSpec(8, 16, 2048, 50257, block_size=1024, n_experts=8, top_k=2)
    assert estimate(moe, w, ParallelConfig(dp=8, ep=8), A100).communication["expert_all_to_all"] > 0
    assert estimate(moe, w, ParallelConfig(dp=8), A100).communication["expert_all_to_all"] == 0


def test_recompute_trades_memory_for_time():
    w = Workload(4, 256)
    results = {}
    for policy, slots in (("none", 0), ("binomial", 2), ("per_layer", 0)):
        p = ParallelConfig(recompute=policy, checkpoints=slots)
        results[policy] = estimate(GPT2, w, p, CPU)
    assert results["none"].memory.activations > results["per_layer"].memory.activations
    assert results["per_layer"].memory.activations > results["binomial"].memory.activations
    assert results["none"].step_time < results["per_layer"].step_time < results["binomial"].step_time


def test_binomial_checkpointing_counts():
    assert binomial_recompute_steps(12, 11) == 12
    assert binomial_recompute_steps(12, 0) == 12 + 66
    costs = [binomial_recompute_steps(30, c) for c in range(0, 30)]
    assert costs == sorted(costs, reverse=True)
    # Griewank: with c slots and r repetitions, binom(c + r, c) steps need at most r * steps.
    assert binomial_recompute_steps(math.comb(3 + 2, 3), 3) <= 2 * math.comb(5, 3) + math.comb(5, 3)


def test_tape_budget_spills_and_costs_io():
    w = Workload(4, 256)
    full = estimate(GPT2, w, ParallelConfig(), CPU)
    # Under a budget the byte tape takes a copy of every array each op saves: the
    # attention's output twice (the projection saves it too); held by reference, once.
    copies = estimate(GPT2, w, ParallelConfig(tape_budget=1e15), CPU).memory.activations
    assert copies - full.memory.activations == pytest.approx(4 * w.global_batch * w.seq_len * GPT2.n_embd
                                                             * GPT2.n_layer)
    budget = full.memory.activations / 2
    spilled = estimate(GPT2, w, ParallelConfig(tape_budget=budget), CPU)
    assert spilled.memory.spilled == pytest.approx(copies - budget)
    assert spilled.memory.activations == pytest.approx(budget)
    io = spilled.memory.spilled / CPU.disk_write_bandwidth + spilled.memory.spilled / CPU.disk_read_bandwidth
    assert spilled.spill_io == pytest.approx(io)
    # Every saved activation is copied onto the byte tape and back: two copies, each a read and a write.
    assert spilled.tape_copy == pytest.approx(2 * CPU.memory_time(2 * copies))
    assert spilled.step_time == pytest.approx(full.step_time + spilled.tape_copy + io)
    # Overlapped: the tape writes ahead, so the writes hide behind the whole forward
    # compute, the reads behind the whole backward.
    hidden = estimate(GPT2, w, ParallelConfig(tape_budget=budget, overlap_spill_io=True), CPU)
    fwd = sum(v for (phase, _), v in hidden.compute.items() if phase == "fwd")
    bwd = sum(hidden.compute.values()) - fwd
    write, read = CPU.spill_times(hidden.memory.spilled)
    assert hidden.spill_io == pytest.approx(max(0.0, write - fwd) + max(0.0, read - bwd))
    assert hidden.spill_io < spilled.spill_io
    # Below the loss's logits (pushed and popped whole), what of them exceeds the budget
    # is written while the push waits and read while the pop waits: nothing hides it.
    small = 64 << 20
    tight = estimate(GPT2, w, ParallelConfig(tape_budget=small, overlap_spill_io=True), CPU)
    logits = max(op.saved_bytes for op in step_graph(GPT2, w, ParallelConfig()) if op.phase == "fwd")
    assert logits >= 4 * w.global_batch * w.seq_len * GPT2.padded_vocab > small
    write, read = CPU.spill_times(tight.memory.spilled)
    fwd = sum(v for (phase, _), v in tight.compute.items() if phase == "fwd")
    bwd = sum(tight.compute.values()) - fwd
    assert tight.spill_io == pytest.approx(max(0.0, write - fwd) + max(0.0, read - bwd)
                                           + sum(CPU.spill_times(logits - small)))


def test_flash_attention_removes_quadratic_memory():
    w = Workload(1, 2048, precision="bf16")
    spec = ModelSpec(4, 16, 1024, 50257, block_size=2048)
    plain, _ = activation_bytes(spec, w, ParallelConfig(), GraphOptions("megatron"))
    flash, _ = activation_bytes(spec, w, ParallelConfig(flash_attention=True), GraphOptions("megatron"))
    assert plain - flash > 4 * 5 * 16 * 2048 * 2048 * 0.9
    ops = step_graph(spec, w, ParallelConfig(flash_attention=True), sram_bytes=192 * 1024)
    att = [op for op in ops if op.op_class == "attention" and op.phase == "fwd"]
    assert all(op.nbytes < 2 * 16 * 2048 * 2048 for op in att)


def test_time_and_memory_grow_with_batch():
    ests = [estimate(GPT2, Workload(b, 64), ParallelConfig(), CPU) for b in (1, 2, 4, 8)]
    times = [e.step_time for e in ests]
    mems = [e.memory.total for e in ests]
    assert times == sorted(times) and mems == sorted(mems)


def test_cli_table_json_and_sweep_plot(tmp_path, capsys):
    args = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--vocab", "256", "--batch", "2", "--seq", "16"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "matmul" in out and "memory per device" in out and "pipeline bubble" in out
    assert cli.main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["step_time"] > 0
    png = tmp_path / "sweep.png"
    assert cli.main(args + ["--sweep", "batch=1,2,4", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="unknown parameter"):
        cli.main(args + ["--sweep", "colour=1"])


def test_quick_calibration_writes_valid_profile(tmp_path):
    spec = ModelSpec(1, 2, 32, 256, block_size=32)
    profile = calibrate(threads=1, quick=True, spec=spec, configs=((1, 8),), repeats=1, spill_dir=str(tmp_path))
    path = tmp_path / "this.json"
    save_profile(profile, str(path))
    loaded = load_profile(str(path))
    assert loaded.kind == "cpu" and loaded.threads == 1
    assert loaded.peak("fp32") > 0 and loaded.memory_bandwidth > 0
    assert loaded.disk_write_bandwidth > 0 and loaded.disk_read_bandwidth > 0 and loaded.baseline_rss > 0
    # the float32 products' curves, and the bf16 ones where kernels.bf16 is built
    variants = ("fwd", "bwd_input", "bwd_weight")
    if "bf16" in loaded.peak_flops:
        variants += ("fwd_bf16", "bwd_input_bf16", "bwd_weight_bf16")
    assert set(loaded.matmul_efficiency) == set(variants)
    # one curve by rows for each product shape of the step (qkv, attproj, fc, fcproj, head)
    shapes = {"32x96", "32x32", "32x128", "128x32", "32x256"}
    assert {v: set(c) for v, c in loaded.matmul_shape_efficiency.items()} == dict.fromkeys(variants, shapes)
    est = estimate(spec, Workload(1, 8), ParallelConfig(), loaded)
    assert est.step_time > 0
    from kernels import peak
    if any(isa in peak.FP32_ISAS for isa in peak.available_isas()):
        assert loaded.physical_peak_flops["fp32"] > 0
        assert est.peak_flops == loaded.physical_peak_flops["fp32"]
    assert set(loaded.calibration["physical_peak"]["peak_gflops_by_isa"]) == set(peak.available_isas())


def test_mfu_is_taken_against_the_physical_peak_where_the_profile_has_one(tmp_path):
    old = CPU.to_dict()
    del old["physical_peak_flops"]          # as profiles written before it was measured
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    profile = load_profile(str(path))
    assert profile.physical_peak_flops == {} and profile.mfu_peak("fp32") == profile.peak("fp32")
    physical = profile.with_changes(physical_peak_flops={"fp32": 2 * profile.peak("fp32")})
    work = (GPT2, Workload(1, 64), ParallelConfig())
    sgemm_based, physical_based = estimate(*work, profile), estimate(*work, physical)
    assert physical_based.step_time == sgemm_based.step_time
    assert physical_based.mfu == pytest.approx(sgemm_based.mfu / 2)
    save_profile(physical, str(path))
    assert load_profile(str(path)) == physical
    with pytest.raises(ValueError, match="physical_peak_flops"):
        profile_from_dict(dict(old, physical_peak_flops={"fp32": 0.0}), "x")


def test_calibration_measures_products_at_every_power_of_two_of_rows_between_its_configs():
    from gpt2.perfmodel.calibrate import matmul_shapes
    shapes = matmul_shapes(GPT2, ((1, 64), (4, 64), (4, 256)))
    qkv = sorted(rows for variant, rows, fan_in, fan_out in shapes
                 if (variant, fan_in, fan_out) == ("fwd", 768, 2304))
    assert qkv == [64, 128, 256, 512, 1024]
    assert shapes[("bwd_weight", 128, 768, 50304)] == 2.0 * 128 * 768 * 50304
    assert len(shapes) == 3 * 5 * 5          # variants x shapes (qkv, attproj, fc, fcproj, head) x rows
    assert {rows for _, rows, _, _ in matmul_shapes(GPT2, ((2, 48),))} == {96}


def _shaped(profile):
    """``profile`` with a curve by rows for the forward product 768 x 2304 (GPT-2's qkv):
    0.25 at 64 rows, 0.75 at 256."""
    return profile.with_changes(matmul_shape_efficiency={
        "fwd": {"768x2304": EfficiencyCurve(1.0, 0.0, ((64, 0.25), (256, 0.75)))}})


def test_a_measured_product_shape_takes_its_efficiency_from_its_rows():
    shaped = _shaped(CPU)
    peak = shaped.matmul_peak("fp32")
    flops = 2.0 * 128 * 768 * 2304
    # halfway between 64 and 256 rows in log(rows): 0.5
    assert shaped.matmul_time(flops, "fwd", "fp32", (128, 768, 2304)) == flops / (peak * 0.5)
    assert shaped.matmul_time(flops, "fwd", "fp32", (1024, 768, 2304)) == flops / (peak * 0.75)
    # another shape, another variant, or no dims: the curve by FLOPs
    by_flops = flops / (peak * CPU.matmul_efficiency["fwd"](flops))
    assert shaped.matmul_time(flops, "fwd", "fp32", (128, 2304, 768)) == by_flops
    assert shaped.matmul_time(flops, "fwd", "fp32") == by_flops
    assert shaped.matmul_time(flops, "bwd_input", "fp32", (128, 768, 2304)) == CPU.matmul_time(
        flops, "bwd_input", "fp32")
    # the graph's qkv products carry their shape, and the step's time follows the curve
    work = (GPT2, Workload(1, 128), ParallelConfig())
    qkv = [op for op in step_graph(*work) if op.name == "qkv"]
    assert {op.dims for op in qkv} == {(128, 768, 2304)}
    fwd = next(op for op in qkv if op.variant == "fwd")
    assert op_time(fwd, shaped, "fp32") == (shaped.op_overhead + shaped.tape_overhead * fwd.tape_records
                                             + max(flops / (peak * 0.5), shaped.memory_time(fwd.nbytes)))
    assert estimate(*work, shaped).step_time != estimate(*work, CPU).step_time


def test_shape_curves_round_trip_stretch_with_ranks_and_reject_bad_keys(tmp_path):
    shaped = _shaped(load_profile("zen4-2core-vm"))
    path = tmp_path / "shaped.json"
    save_profile(shaped, str(path))
    assert load_profile(str(path)) == shaped
    view = shaped.rank_view(2)          # 2 ranks of 1 thread: each reaches at 32 rows what 2 threads do at 64
    assert view.matmul_shape_efficiency["fwd"]["768x2304"].points == ((32, 0.25), (128, 0.75))
    for bad in ({"fwd": {"768-2304": EfficiencyCurve(1.0, 0.0)}}, {"fwd": {"768x2304x1": EfficiencyCurve(1.0, 0.0)}},
                {"sideways": {"768x2304": EfficiencyCurve(1.0, 0.0)}}, {"fwd": {"768x2304": 0.5}}):
        with pytest.raises(ValueError, match="matmul_shape_efficiency"):
            shaped.with_changes(matmul_shape_efficiency=bad)


# -- the optimizer step: what the engine runs, at the rate calibration measured ----------

ZEN4 = load_profile("zen4-2core-vm")


def _optimizer_ops(ops):
    return [op for op in ops if op.phase == "optim"]


def test_tape_engine_step_graph_has_no_zero_grad_pass():
    # The engines defer zeroing: the backward's first write overwrites each gradient
    # (Model.zero_grad(deferred=True)), so no pass over the gradient arena is charged.
    ops = _optimizer_ops(step_graph(GPT2, Workload(1, 64), ParallelConfig()))
    assert [op.name for op in ops] == ["adamw"]
    # Megatron's accounting zeroes its gradient buffer every iteration.
    megatron = _optimizer_ops(step_graph(GPT2, Workload(1, 64), ParallelConfig(), GraphOptions("megatron")))
    assert [op.name for op in megatron] == ["zero_grad", "adamw"]


def test_optimizer_time_is_the_calibrated_kernel_time_where_measured():
    from gpt2.perfmodel.graph import ADAMW_FLOPS
    curve = ZEN4.kernel_efficiency["optimizer.optim"]
    flops = ADAMW_FLOPS * GPT2.num_parameters()
    measured = ZEN4.op_overhead + flops / (ZEN4.peak("fp32") * curve(flops))
    for b, t in ((1, 64), (4, 256)):
        est = estimate(GPT2, Workload(b, t), ParallelConfig(), ZEN4)
        assert est.optimizer == pytest.approx(measured, rel=1e-12)
    # Its bytes at the copy bandwidth would take longer: the measured time already pays them.
    (adam,) = _optimizer_ops(step_graph(GPT2, Workload(1, 64), ParallelConfig()))
    assert ZEN4.memory_time(adam.nbytes) > measured - ZEN4.op_overhead
    # Without a measured optimizer curve the roofline bound stays.
    assert estimate(GPT2, Workload(1, 64), ParallelConfig(), CPU).optimizer == pytest.approx(
        CPU.op_overhead + CPU.memory_time(adam.nbytes), rel=1e-12)
    fast = CPU.with_changes(kernel_efficiency={"optimizer.optim": EfficiencyCurve(0.5, 0.0)})
    assert estimate(GPT2, Workload(1, 64), ParallelConfig(), fast).optimizer == pytest.approx(
        fast.op_overhead + flops / (fast.peak("fp32") * 0.5), rel=1e-12)


# -- our engine's bf16 mode: bf16 products, linear inputs saved in bf16 --------------------

BF16 = GraphOptions(precision="bf16")
# what a product reads, saved in bf16: the linear layers' inputs and attention's qkv
PRODUCT_INPUTS = ("qkv.input", "attproj.input", "fc.input", "fcproj.input", "lm_head.input",
                  "attn.qkv")


def _saved(ops):
    return {s.name: s.nbytes for op in ops if op.phase == "fwd" for s in op.saved if op.layer in (-1, 0)}


def test_bf16_saves_the_products_inputs_in_half_the_bytes():
    fp32 = _saved(step_graph(GPT2, Workload(4, 64), ParallelConfig()))
    bf16 = _saved(step_graph(GPT2, Workload(4, 64), ParallelConfig(), BF16))
    assert set(fp32) == set(bf16)
    for name, nbytes in fp32.items():
        assert bf16[name] == (nbytes / 2 if name in PRODUCT_INPUTS else nbytes), name
    # Llama: the fused down projection keeps gate|up in float32 (it recomputes swiglu).
    from gpt2.config import preset
    llama = ModelSpec.from_config(preset("smollm2-135m"))
    fp32 = _saved(step_graph(llama, Workload(1, 64), ParallelConfig()))
    bf16 = _saved(step_graph(llama, Workload(1, 64), ParallelConfig(), BF16))
    halved = {n for n in fp32 if bf16[n] != fp32[n]}
    assert halved == {"qkv.input", "attproj.input", "gateup.input", "lm_head.input", "attn.qkv"}
    assert bf16["swiglu.gate_up"] == fp32["swiglu.gate_up"]


def test_bf16_products_run_at_the_bf16_rate_or_fp32_where_the_profile_has_none():
    flops = 2.0 * 1024 * 768 * 3072
    assert "bf16" not in CPU.peak_flops
    assert CPU.matmul_time(flops, "fwd", "bf16") == CPU.matmul_time(flops, "fwd", "fp32")
    assert CPU.mfu_peak("bf16") == CPU.mfu_peak("fp32")
    fast = CPU.with_changes(peak_flops={"fp32": CPU.peak("fp32"), "bf16": 2 * CPU.peak("fp32")})
    assert fast.matmul_time(flops, "fwd", "bf16") == pytest.approx(CPU.matmul_time(flops, "fwd", "fp32") / 2)
    w = Workload(4, 256)

    def matmul(est):
        return sum(v for (_, c), v in est.compute.items() if c == "matmul")
    fp32, same, doubled = (estimate(GPT2, w, ParallelConfig(), CPU), estimate(GPT2, w, ParallelConfig(), CPU, BF16),
                           estimate(GPT2, w, ParallelConfig(), fast, BF16))
    # The same rate: the conversions to bf16 cost a little on top.
    assert fp32.step_time < same.step_time < 1.1 * fp32.step_time
    assert matmul(doubled) < 0.6 * matmul(fp32) + (matmul(same) - matmul(fp32))
    assert doubled.mfu == pytest.approx(doubled.model_flops / (doubled.step_time * fast.peak("bf16")))
    # Everything but the products is the same; attention (no bf16 curve in this
    # profile: float32's rate) adds the pass that rounds its qkv to bf16.
    for (phase, c), v in fp32.compute.items():
        if c not in ("matmul", "attention"):
            assert same.compute[(phase, c)] == v
    rounding = sum(CPU.op_overhead + CPU.memory_time(op.convert_bytes)
                   for op in step_graph(GPT2, w, ParallelConfig(), BF16)
                   if op.op_class == "attention" and op.phase == "fwd")
    assert rounding > 0
    assert same.compute[("fwd", "attention")] == pytest.approx(
        fp32.compute[("fwd", "attention")] + rounding, rel=1e-9)
    assert same.compute[("bwd", "attention")] <= fp32.compute[("bwd", "attention")]
    # AdamW writes the weights' bf16 copies in its own pass: 30 bytes a parameter, not 28
    # (the bandwidth curve read at the larger size, the per-call overhead: within 1e-3)
    assert fp32.optimizer < same.optimizer == pytest.approx(fp32.optimizer * 30 / 28, rel=1e-3)


def test_the_weights_bf16_copies_come_from_the_update_in_one_process():
    # A bf16 step of the whole model in one process: AdamW writes the copies (no
    # conversion of the weights in the forward pass); data parallel ranks and a LoRA
    # run's base convert them in the forward pass as before.
    w = Workload(4, 64)

    def weight_conversions(parallel, options):
        return sum(op.weight_convert_bytes for op in step_graph(GPT2, w, parallel, options))
    assert weight_conversions(ParallelConfig(), BF16) == 0
    assert weight_conversions(ParallelConfig(dp=2), BF16) > 0
    adam = {dp: _optimizer_ops(step_graph(GPT2, w, ParallelConfig(dp=dp), BF16))[0].nbytes
            for dp in (1, 2)}
    assert adam[1] == pytest.approx(adam[2] * 30 / 28)


def test_bf16_attention_runs_at_its_own_calibrated_curve():
    # Under the engine's bf16 mode our attention takes bf16 operands: its time is the
    # "attention_bf16" curve where the profile measured one, float32's otherwise, plus
    # the pass that rounds qkv to bf16; a bf16 LoRA base alone leaves attention float32.
    from gpt2.config import preset
    from gpt2.lora import LoraConfig
    from gpt2.perfmodel.spec import LoraSpec
    w = Workload(4, 1024)
    fp32_curves = {"attention.fwd": EfficiencyCurve(0.4, 0.0), "attention.bwd": EfficiencyCurve(0.4, 0.0)}
    plain = CPU.with_changes(op_overhead=0.0, tape_overhead=0.0)   # no fixed costs: times scale
    both = plain.with_changes(kernel_efficiency={**fp32_curves, "attention_bf16.fwd": EfficiencyCurve(0.8, 0.0),
                                                 "attention_bf16.bwd": EfficiencyCurve(0.8, 0.0)})
    only_fp32 = plain.with_changes(kernel_efficiency=fp32_curves)

    def attention(hw, options=GraphOptions(), spec=GPT2):
        est = estimate(spec, w, ParallelConfig(), hw, options)
        return sum(v for (_, c), v in est.compute.items() if c == "attention")
    rounding = sum(plain.memory_time(op.convert_bytes) for op in step_graph(GPT2, w, ParallelConfig(), BF16)
                   if op.op_class == "attention")
    assert rounding > 0
    assert attention(both, BF16) == pytest.approx(attention(both) / 2 + rounding, rel=1e-9)
    assert attention(only_fp32, BF16) == pytest.approx(attention(only_fp32) + rounding, rel=1e-9)
    config = preset("smollm2-135m")
    llama = ModelSpec.from_config(config)
    base = GraphOptions(lora=LoraSpec.from_config(config, LoraConfig(r=8), "bf16"))
    assert attention(both, base, llama) == pytest.approx(attention(both, spec=llama), rel=1e-12)
    assert {op.precision for op in step_graph(GPT2, w, ParallelConfig(), BF16)
            if op.op_class == "attention"} == {"bf16"}


def test_bf16_memory_estimate_is_smaller_with_the_weights_bf16_copies():
    from gpt2.perfmodel.graph import product_weight_params
    w = Workload(8, 1024)
    fp32 = estimate(GPT2, w, ParallelConfig(), ZEN4).memory
    bf16 = estimate(GPT2, w, ParallelConfig(), ZEN4, BF16).memory
    copies = 2.0 * product_weight_params(GPT2, ParallelConfig(), 0)
    C, L = GPT2.n_embd, GPT2.n_layer
    assert copies == 2.0 * (L * 12 * C * C + GPT2.padded_vocab * C)
    assert bf16.parameters == fp32.parameters + copies
    assert (bf16.gradients, bf16.optimizer, bf16.workspace) == (fp32.gradients, fp32.optimizer, fp32.workspace)
    N = 8 * 1024
    # Each product's saved input in 2 bytes instead of 4 (q|k|v, fc, fc projection, head:
    # 6C + C), but the attention projection's: held by reference in float32 it is the
    # attention's output (counted there), in bf16 a copy of 2 bytes an element; and the
    # attention's qkv (3C) in 2 bytes.
    assert fp32.activations - bf16.activations == pytest.approx(2.0 * N * (L * 8 * C + C))
    assert bf16.total < fp32.total - 500e6
    # Under a tape budget the smaller tape spills less and copies less.
    budget = 2 << 30
    p = ParallelConfig(tape_budget=budget)
    spilled32, spilled16 = (estimate(GPT2, w, p, ZEN4), estimate(GPT2, w, p, ZEN4, BF16))
    assert spilled16.memory.spilled < spilled32.memory.spilled and spilled16.tape_copy < spilled32.tape_copy


def test_fp32_estimates_are_unchanged_by_the_precision_option():
    for options in (GraphOptions(), GraphOptions(precision="fp32")):
        a = estimate(GPT2, Workload(4, 256), ParallelConfig(recompute="per_layer"), ZEN4)
        b = estimate(GPT2, Workload(4, 256), ParallelConfig(recompute="per_layer"), ZEN4, options)
        assert (a.step_time, a.memory.total, a.compute) == (b.step_time, b.memory.total, b.compute)


def test_precision_errors_name_the_allowed_values():
    with pytest.raises(ValueError, match="must be one of fp32, bf16, got 'fp16'"):
        GraphOptions(precision="fp16")
    with pytest.raises(ValueError, match="layout 'adtape'"):
        GraphOptions("megatron", precision="bf16")
    with pytest.raises(ValueError, match="Workload.precision 'fp32'"):
        step_graph(GPT2, Workload(1, 64, precision="bf16"), ParallelConfig(), BF16)


def _without_bf16(data):
    """A profile's JSON as calibrations wrote it before they measured bf16 products."""
    data = dict(data, peak_flops={"fp32": data["peak_flops"]["fp32"]})
    for key in ("matmul_efficiency", "matmul_shape_efficiency", "kernel_efficiency"):
        data[key] = {k: v for k, v in data[key].items() if "bf16" not in k}
    return data


def test_bf16_products_take_their_calibrated_curves():
    # Where calibration measured the products with bf16 operands ("fwd_bf16", ...: by
    # FLOPs and by rows of each shape, shares of the bf16 peak), a bf16 product takes
    # them; float32 products never do; without them bf16 takes float32's curves.
    assert {"fwd_bf16", "bwd_input_bf16", "bwd_weight_bf16"} <= set(ZEN4.matmul_efficiency)
    older = profile_from_dict(_without_bf16(ZEN4.to_dict()))
    fast = older.with_changes(peak_flops={"fp32": 1e11, "bf16": 4e11})
    flops, dims = 2.0 * 128 * 768 * 2304, (128, 768, 2304)
    curves = fast.with_changes(
        matmul_efficiency={**fast.matmul_efficiency, "fwd_bf16": EfficiencyCurve(0.5, 0.0),
                           "bwd_input_bf16": EfficiencyCurve(0.25, 0.0), "bwd_weight_bf16": EfficiencyCurve(0.25, 0.0)},
        matmul_shape_efficiency={**fast.matmul_shape_efficiency, "fwd_bf16": {
            "768x2304": EfficiencyCurve(1.0, 0.0, ((64, 0.2), (256, 0.8)))}})
    # 128 rows: halfway between 64 and 256 in log(rows); another shape: the curve by FLOPs
    assert curves.matmul_time(flops, "fwd", "bf16", dims) == pytest.approx(flops / (4e11 * 0.5), rel=1e-12)
    assert curves.matmul_time(flops, "fwd", "bf16", (128, 768, 768)) == pytest.approx(flops / (4e11 * 0.5), rel=1e-12)
    assert curves.matmul_time(flops, "bwd_weight", "bf16", dims) == pytest.approx(flops / (4e11 * 0.25), rel=1e-12)
    for variant in ("fwd", "bwd_weight"):
        assert curves.matmul_time(flops, variant, "fp32", dims) == fast.matmul_time(flops, variant, "fp32", dims)
        assert fast.matmul_time(flops, variant, "bf16", dims) == pytest.approx(
            fast.matmul_time(flops, variant, "fp32", dims) / 4, rel=1e-12)
    work = (GPT2, Workload(2, 64), ParallelConfig())
    assert estimate(*work, curves, BF16).step_time > estimate(*work, fast, BF16).step_time
    assert estimate(*work, curves).step_time == estimate(*work, fast).step_time
    with pytest.raises(ValueError, match="unknown variants"):
        fast.with_changes(matmul_efficiency={**fast.matmul_efficiency, "fwd_fp8": EfficiencyCurve(0.5, 0.0)})


def test_calibration_times_bf16_products_as_a_step_runs_them():
    # Each backward half is half of the whole backward call less its rounding of dout
    # (charged as the input gradient's conversion), never below a quarter of the call.
    from gpt2.perfmodel.calibrate import _bf16_product_times, _bf16_tasks
    layer = (64, 768, 2304)
    times = {(layer, "fwd"): 1.0, (layer, "bwd"): 3.0, (layer, "round_dout"): 0.2}
    assert _bf16_product_times(times, layer) == {"fwd": 1.0, "bwd_input": 1.4, "bwd_weight": 1.4}
    times[(layer, "round_dout")] = 2.9
    assert _bf16_product_times(times, layer) == {"fwd": 1.0, "bwd_input": 0.75, "bwd_weight": 0.75}
    import numpy as np
    tasks = _bf16_tasks(16, 64, 32, np.random.default_rng(0))
    assert set(tasks) == {"fwd", "bwd", "round_dout"}
    for task in tasks.values():
        task()


def test_profiles_without_a_bf16_rate_load_and_calibration_measures_it(tmp_path):
    data = _without_bf16(ZEN4.to_dict())
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = load_profile(str(path))
    assert estimate(GPT2, Workload(1, 64), ParallelConfig(), old, BF16).step_time > 0
    from gpt2.perfmodel.calibrate import measure_bf16_peak
    pytest.importorskip("kernels.bf16")
    assert measure_bf16_peak(256, 1) > 0


def test_cli_precision(capsys):
    args = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--vocab", "256", "--batch", "2", "--seq", "16"]
    assert cli.main(args + ["--precision", "bf16"]) == 0
    assert "bf16 products, fp32 values" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        cli.main(args + ["--precision", "fp8"])
    assert str(info.value).startswith("error: ") and "\n" not in str(info.value)
    assert cli.main(args + ["--plan", "--max-memory", "1G", "--hardware", "zen4-2core-vm",
                            "--precision", "fp16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "fp32, bf16" in err[0]
