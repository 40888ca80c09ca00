"""The performance model and the planner under LoRA: the frozen base's and the adapters'
bytes are the engine's to the byte, the saved activations what nn.lora_linear keeps, the
graph has no weight-gradient product for the base, and the planner's choice fits without
offloading anything."""
import numpy as np
import pytest

from gpt2.config import preset
from gpt2.lora import LoraConfig, adapter_shapes
from gpt2.model import Model
from gpt2.perfmodel import (GraphOptions, ModelSpec, ParallelConfig, Workload, cli, estimate, load_profile,
                            model_flops_per_token, step_graph)
from gpt2.perfmodel.calibrate import measure_baseline_rss
from gpt2.perfmodel.graph import ADAMW_FLOPS, palm_flops_per_token, trainable_parameters
from gpt2.perfmodel.plan import minimum_memory, plan_memory, predict_policy, required_memory
from gpt2.perfmodel.spec import LoraSpec

HUGE = 1 << 50


@pytest.fixture(scope="module")
def profile():
    return load_profile("zen4-2core-vm").with_changes(baseline_rss=measure_baseline_rss())


# (preset, LoRA, base dtype): every projection, some of them (the first adapted one after the
# attention), dropout; GPT-2 and Llama; both base dtypes.
CASES = [(name, lora, base) for name, subset in (("tiny", ("c_fc",)), ("llama-tiny", ("o_proj", "down_proj")))
         for lora in (LoraConfig(r=4), LoraConfig(r=2, targets=subset), LoraConfig(r=3, dropout=0.1))
         for base in ("fp32", "bf16")]


@pytest.mark.parametrize("name,lora,base", CASES)
def test_lora_bytes_are_the_engines(profile, name, lora, base):
    config, B, T = preset(name), 2, 32
    c = predict_policy(config, B, T, hardware=profile, lora=lora, base_dtype=base)
    model = Model(config, seed=0, lora=lora, base_dtype=base)
    try:
        ids, targets = np.random.default_rng(0).integers(0, config.vocab_size, (2, B, T)).astype(np.int32)
        model.loss_and_grad(ids, targets)
        # The base (float32, or bf16 matrices beside float32 norms) and four adapter arenas.
        states = model.params.nbytes + model.state.nbytes
        assert c.memory["model states"] == states
        assert 4 * 4 * model.adapter.num_parameters == states - model.params.nbytes
        # Held by reference, what the forward pass saved; but the first block's first adapted
        # product keeps its float32 input, a constant (the embedding is frozen), which the
        # tape holds as a leaf and does not count.
        leaf = 4 * B * T * config.n_embd
        assert c.memory["activations"] == model._tape_engine.last_forward_bytes + leaf
    finally:
        model._tape_engine.close()


def test_the_base_bytes_and_adapter_counts_are_gpt2_loras():
    for name, subset in (("tiny", ("c_proj",)), ("llama-tiny", ("k_proj", "up_proj")),
                         ("smollm2-135m", ("v_proj",)), ("llama-3.2-1b", ("o_proj", "gate_proj"))):
        config = preset(name)
        spec = ModelSpec.from_config(config)
        for lora in (LoraConfig(r=16), LoraConfig(r=8, targets=subset)):
            adapters = sum(int(np.prod(s)) for s in adapter_shapes(config, lora).values())
            assert LoraSpec.from_config(config, lora).adapter_params(spec) == adapters
        matrices = sum(int(np.prod(shape)) for n, shape in config.param_shapes().items()
                       if len(shape) >= (3 if n in config.per_layer else 2))
        bf16 = LoraSpec.from_config(config, LoraConfig(r=4), "bf16")
        assert bf16.base_bytes(spec) == 2 * matrices + 4 * (spec.num_parameters() - matrices)
        assert LoraSpec.from_config(config, LoraConfig(r=4)).base_bytes(spec) == 4 * spec.num_parameters()


def test_the_lora_graph_runs_no_weight_gradient_for_the_base():
    config = preset("smollm2-135m")
    spec = ModelSpec.from_config(config)
    lora = LoraSpec.from_config(config, LoraConfig(r=16, targets=("q_proj", "v_proj")))
    ops = step_graph(spec, Workload(2, 128), ParallelConfig(), GraphOptions(lora=lora))
    weight_grads = {op.name for op in ops if op.variant == "bwd_weight"}
    assert weight_grads == {"qkv.lora_a", "qkv.lora_b"}
    # The embedding is frozen: nothing before the first block's q|k|v records or runs backward,
    # and the q|k|v product computes no input gradient there (its base's or its adapters').
    assert not [op for op in ops if op.phase == "bwd" and op.layer == -1 and op.name == "encoder"]
    first = [op for op in ops if op.layer == 0 and op.phase == "bwd"]
    assert not [op for op in first if op.name == "rms1"]
    assert not [op for op in first if op.variant == "bwd_input" and op.name in ("qkv", "qkv.lora_a")]
    assert [op for op in ops if op.layer == 1 and op.phase == "bwd" and op.name == "rms1"]
    # Only q and v: two A matrices over C, B over q's and v's rows.
    assert lora.adapted == (("qkv", 2, spec.n_head * spec.head_dim + spec.n_kv_head * spec.head_dim),)
    adam = [op for op in ops if op.phase == "optim"]
    assert len(adam) == 1 and adam[0].flops == ADAMW_FLOPS * lora.adapter_params(spec)
    # PaLM's model FLOPs less the base's weight gradients (2 N), plus the adapters' training.
    full = model_flops_per_token(spec, 128)
    n = (full - palm_flops_per_token(0, spec.n_layer, spec.n_head, spec.head_dim, 128)) / 6
    assert model_flops_per_token(spec, 128, lora) == pytest.approx(full - 2 * n + 6 * lora.adapter_params(spec))


def test_estimate_counts_the_frozen_base_and_its_bf16_products(profile):
    config = preset("smollm2-135m")
    spec = ModelSpec.from_config(config)
    full = estimate(spec, Workload(1, 256), ParallelConfig(), profile)
    for base in ("fp32", "bf16"):
        lora = LoraSpec.from_config(config, LoraConfig(r=16), base)
        est = estimate(spec, Workload(1, 256), ParallelConfig(), profile, GraphOptions(lora=lora))
        a = lora.adapter_params(spec)
        assert est.memory.parameters == lora.base_bytes(spec) + 4 * a
        assert (est.memory.gradients, est.memory.optimizer) == (4 * a, 8 * a)
        assert est.step_time < full.step_time and est.details["products"].endswith(lora.describe())
        ops = step_graph(spec, Workload(1, 256), ParallelConfig(), GraphOptions(lora=lora))
        base_products = {op.precision for op in ops if op.op_class == "matmul" and ".lora_" not in op.name}
        assert base_products == ({"bf16"} if base == "bf16" else {""})
        assert {op.precision for op in ops if ".lora_" in op.name} == {"fp32"}
    # Data parallel: the adapters are what the replicas reduce and update.
    lora = LoraSpec.from_config(config, LoraConfig(r=16))
    assert trainable_parameters(spec, ParallelConfig(dp=2), 0, GraphOptions(lora=lora)) == lora.adapter_params(spec)


def test_lora_options_that_do_not_fit_are_refused():
    config = preset("llama-tiny")
    spec = ModelSpec.from_config(config)
    lora = LoraSpec.from_config(config, LoraConfig(r=4))
    with pytest.raises(ValueError, match="needs layout 'adtape'"):
        GraphOptions(layout="megatron", lora=lora)
    with pytest.raises(ValueError, match="runs on one process or data-parallel replicas, got tp=2"):
        step_graph(spec, Workload(2, 32), ParallelConfig(tp=2), GraphOptions(lora=lora))
    gpt2 = ModelSpec.from_config(preset("tiny"))
    with pytest.raises(ValueError, match="adapts 128 rows of 'qkv', which has 96"):
        step_graph(gpt2, Workload(2, 32), ParallelConfig(), GraphOptions(lora=lora))
    with pytest.raises(ValueError, match="adapts 'gateup', which this model has not"):
        step_graph(gpt2, Workload(2, 32), ParallelConfig(), GraphOptions(lora=LoraSpec(4, (("gateup", 2, 64),))))
    with pytest.raises(ValueError, match="base_dtype must be one of fp32, bf16, got 'fp16'"):
        LoraSpec(4, (("qkv", 1, 8),), "fp16")
    with pytest.raises(ValueError, match="is not a product of the graph"):
        LoraSpec(4, (("lm_head", 1, 8),))
    with pytest.raises(ValueError, match="is LoRA's frozen base"):
        plan_memory(config, 2, 32, HUGE, hardware="zen4-2core-vm", base_dtype="bf16")
    with pytest.raises(ValueError, match="LoRA offloads nothing"):
        predict_policy(config, 2, 32, hardware="zen4-2core-vm", offload="moments", lora=LoraConfig(r=4))


def test_the_planner_fits_lora_without_offloading(profile):
    config, B, T = preset("smollm2-135m"), 2, 512
    lora = LoraConfig(r=16)
    free = plan_memory(config, B, T, HUGE, hardware=profile, lora=lora)
    assert free.policy == "in-memory" and "LoRA r=16 on an fp32 base" in free.describe()
    least = minimum_memory(config, B, T, hardware=profile, lora=lora)
    for share in (0.0, 0.25, 0.5, 0.9):
        limit = int(least + (required_memory(free.predicted_peak_bytes) - least) * share)
        plan = plan_memory(config, B, T, limit, hardware=profile, lora=lora)
        assert all(c.offload is None for c in plan.candidates)
        assert plan.policy != "in-memory" and plan.engine_kwargs()["checkpointing"] == plan.checkpointing
        assert required_memory(plan.predicted_peak_bytes) <= limit
        assert plan.predicted_ms == min(c.predicted_ms for c in plan.candidates if c.fits)
    with pytest.raises(ValueError, match="that is the required minimum"):
        plan_memory(config, B, T, least - 1, hardware=profile, lora=lora)
    # Below the frozen base and the adapters' state: the error says what takes the memory.
    with pytest.raises(ValueError, match="the frozen base and the adapters' state .LoRA offloads nothing."):
        plan_memory(config, B, T, 256 << 20, hardware=profile, lora=lora)
    # A bf16 base needs less (at TinyLlama's size, where it outweighs an emulated bf16 lm_head's
    # float32 scratch); the fp32 plan says so where it would hold everything in memory.
    config = preset("tinyllama-1.1b")
    assert (minimum_memory(config, 1, 512, hardware=profile, lora=lora, base_dtype="bf16")
            < minimum_memory(config, 1, 512, hardware=profile, lora=lora))
    fp32 = predict_policy(config, 1, 512, hardware=profile, lora=lora)
    plan = plan_memory(config, 1, 512, required_memory(fp32.predicted_peak_bytes) - 1, hardware=profile, lora=lora)
    assert plan.policy != "in-memory" and any("--base-dtype bf16" in n for n in plan.notes), plan.table()


def test_a_float32_base_read_and_rounded_to_bf16_peaks_while_converted(profile):
    config, B, T = preset("smollm2-135m"), 1, 64
    spec = ModelSpec.from_config(config)
    lora = LoraConfig(r=8)
    baseline = profile.baseline_rss
    read = 4 * spec.num_parameters()
    kept = predict_policy(config, B, T, hardware=profile, lora=lora, base_dtype="bf16")
    # Read as float32 (in the baseline) and held in bf16: both exist while it is converted,
    # before any activation; read in bf16 (tensor by tensor) it is the base itself.
    converted = predict_policy(config, B, T, hardware=profile, lora=lora, base_dtype="bf16",
                               baseline_bytes=baseline + read, base_read_bytes=read)
    live = sum(v for k, v in kept.memory.items() if k in ("activations", "working set", "tape slack"))
    assert converted.memory["base conversion"] == read - live > 0
    assert converted.predicted_peak_bytes == pytest.approx(kept.predicted_peak_bytes + read - live, abs=1)
    base = int(LoraSpec.from_config(config, lora, "bf16").base_bytes(spec))
    same = predict_policy(config, B, T, hardware=profile, lora=lora, base_dtype="bf16",
                          baseline_bytes=baseline + base, base_read_bytes=base)
    assert "base conversion" not in same.memory and same.predicted_peak_bytes == kept.predicted_peak_bytes
    with pytest.raises(ValueError, match="base_read_bytes is a LoRA base's bytes"):
        predict_policy(config, B, T, hardware=profile, base_read_bytes=read)


def test_the_cli_estimates_and_plans_lora(capsys):
    args = ["--model", "llama-tiny", "--batch", "2", "--seq", "64", "--hardware", "zen4-2core-vm"]
    assert cli.main(args + ["--lora", "4", "--base-dtype", "bf16"]) == 0
    assert "LoRA r=4 on a bf16 base" in capsys.readouterr().out
    assert cli.main(["--plan", "--max-memory", "4G", "--lora", "4", "--lora-targets", "q_proj,v_proj"] + args) == 0
    assert "(LoRA r=4 on an fp32 base)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--base-dtype is a LoRA option: add --lora R"):
        cli.main(args + ["--base-dtype", "bf16"])
    with pytest.raises(SystemExit, match="'c_fc' are not projections of a Llama model"):
        cli.main(args + ["--lora", "4", "--lora-targets", "c_fc"])
