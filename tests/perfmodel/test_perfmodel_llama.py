"""The performance model and the memory planner on the Llama family: ModelSpec holds a
Llama config as data (its parameter count is the arena's for every preset), the op graph's
products and saved tensors are what the tape engine runs and saves, and a plan for a Llama
model runs within its predicted peak, also from gpt2-train --max-memory."""
import importlib.util
import json
import os

import numpy as np
import pytest

from gpt2.config import ALL_PRESETS, LlamaConfig, preset
from gpt2.model import GPT2
from gpt2.params import num_parameters
from gpt2.perfmodel import ModelSpec, ParallelConfig, Workload, load_profile, step_graph
from gpt2.perfmodel.calibrate import measure_baseline_rss
from gpt2.perfmodel.hardware import cpu_identity, resolve_threads, save_profile, this_machine_name, this_machine_path
from gpt2.perfmodel.plan import minimum_memory, plan_memory, required_memory
from gpt2.train import run

TINY = LlamaConfig.preset("llama-tiny")
# Qwen2's features at a test's size: an untied head, q/k/v biases, head_dim != n_embd / n_head.
QWEN_LIKE = LlamaConfig(**{**TINY.to_dict(), "n_layer": 3, "n_head": 6, "n_kv_head": 2, "n_embd": 96,
                           "head_dim": 24, "intermediate_size": 200, "vocab_size": 300, "qkv_bias": True,
                           "tie_embeddings": False})
HUGE = 1 << 50


@pytest.fixture(scope="module")
def profile():
    """The committed Zen 4 profile with the baseline RSS measured now (as test_planner's)."""
    return load_profile("zen4-2core-vm").with_changes(baseline_rss=measure_baseline_rss())


@pytest.mark.parametrize("name", sorted(ALL_PRESETS))
def test_parameter_count_is_the_arenas(name):
    config = preset(name)
    assert ModelSpec.from_config(config).num_parameters() == num_parameters(config)


@pytest.mark.parametrize("name,total", [("llama-3.1-8b", 8_030_261_248),
                                        ("qwen2.5-1.5b", 1_543_714_304),
                                        ("qwen2.5-7b", 7_615_616_512)])
def test_the_spec_counts_the_published_totals(name, total):
    # The models' published parameter counts (their Hugging Face weights), never allocated.
    assert ModelSpec.from_config(preset(name)).num_parameters() == total


def test_a_llama_config_is_data_of_the_spec():
    spec = ModelSpec.from_config(QWEN_LIKE)
    assert (spec.n_kv_head, spec.head_dim, spec.ffn_hidden, spec.qkv_width) == (2, 24, 200, 10 * 24)
    assert (spec.norm, spec.mlp, spec.positions, spec.tied_head, spec.linear_bias, spec.qkv_bias) == \
        ("rmsnorm", "swiglu", "rope", False, False, True)
    assert spec.num_parameters() == num_parameters(QWEN_LIKE)
    with pytest.raises(ValueError, match="n_kv_head"):
        ModelSpec(2, 6, 96, 300, n_kv_head=4)
    with pytest.raises(ValueError, match="norm"):
        ModelSpec(2, 6, 96, 300, norm="batchnorm")


@pytest.mark.parametrize("config", [TINY, QWEN_LIKE], ids=["llama-tiny", "qwen-like"])
def test_graph_products_are_6N_plus_attention(config):
    # The matmuls' FLOPs: 6 x (q|k|v of n_head + 2 n_kv_head heads, the output projection,
    # gate|up and down, the LM head) x tokens, plus the attention's 12 L (n_head head_dim) T^2.
    b, t = 2, 32
    spec = ModelSpec.from_config(config)
    gemm = sum(op.gemm_flops for op in step_graph(spec, Workload(b, t), ParallelConfig()))
    C, L, A = config.n_embd, config.n_layer, config.n_head * config.head_dim
    weights = L * (C * config.qkv_width + A * C + 3 * C * config.intermediate_size) + config.padded_vocab_size * C
    assert gemm == pytest.approx(6 * weights * b * t + 12 * L * A * t * t * b, rel=1e-12)


def _forward_bytes(config, B, T, **kwargs):
    model = GPT2(config, seed=0, **kwargs)
    ids, targets = np.random.default_rng(0).integers(0, config.vocab_size, (2, B, T)).astype(np.int32)
    model.loss_and_grad(ids, targets)
    saved = model._tape_engine.last_forward_bytes
    model.close()
    return saved


@pytest.mark.parametrize("config", [TINY, QWEN_LIKE], ids=["llama-tiny", "qwen-like"])
def test_saved_activations_are_the_engines(profile, config):
    overheads = []
    for B, T in ((2, 16), (3, 64)):
        plan = plan_memory(config, B, T, HUGE, hardware=profile)
        in_memory = next(c for c in plan.candidates if c.policy == "in-memory")
        # Held by reference: exactly the arrays the ops saved (the attention's output once,
        # though the projection saves it too).
        assert in_memory.memory["activations"] == _forward_bytes(config, B, T)
        # Copied onto the byte tape: every saved array (the attention's output twice), plus
        # the records' headers, which do not grow with B and T.
        budgeted = next(c for c in plan.candidates if c.tape_budget is not None)
        stored = budgeted.memory["activations"] + budgeted.memory["spilled"]
        overheads.append(_forward_bytes(config, B, T, tape_kwargs={"memory_budget": 1 << 30}) - stored)
    assert overheads[0] == overheads[1] and 0 <= overheads[0] < 4096


_spec = importlib.util.spec_from_file_location("plan_worker", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "plan_worker.py"))
plan_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_worker)



def test_a_plan_for_a_llama_model_runs_within_its_peak(profile, tmp_path):
    B, T = 32, 64
    free = plan_memory(TINY, B, T, HUGE, hardware=profile)
    least = minimum_memory(TINY, B, T, hardware=profile)
    # (Both with the planner's margin: minimum_memory's figure includes it.)
    limit = int(least + (required_memory(free.predicted_peak_bytes) - least) / 4)
    plan = plan_memory(TINY, B, T, limit, hardware=profile, spill_dir=str(tmp_path))
    assert plan.policy != "in-memory" and required_memory(plan.predicted_peak_bytes) <= limit
    planned = plan_worker.train("llama-tiny", plan.engine_kwargs(), tmp_path)
    reference = plan_worker.train("llama-tiny", free.engine_kwargs(), tmp_path)
    assert planned["losses"] == reference["losses"]
    assert planned["peak"] <= plan.predicted_peak_bytes, (plan.table(), planned)
    assert os.listdir(tmp_path) == []


def test_gpt2_train_plans_a_llama_model(profile, monkeypatch, tmp_path):
    # This machine's profile in a fresh cache: the Zen 4 figures (no calibration in a test).
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    threads = resolve_threads()
    os.makedirs(os.path.dirname(this_machine_path(threads)))
    save_profile(profile.with_changes(name=this_machine_name(threads), threads=threads,
                                      calibration=dict(profile.calibration, cpu=cpu_identity())),
                 this_machine_path(threads))
    # The run is planned in this process, whose baseline is what the tests before it
    # left resident (2-4 GiB in a full run): a limit 1 GiB above it, 4 GiB at least.
    import math

    import psutil
    limit = max(4, math.ceil(psutil.Process().memory_info().rss / 2**30) + 1)
    summary = run(["--model", "llama-tiny", "-B", "4", "-T", "64", "--steps", "2",
                   "--max-memory", f"{limit}G", "--corpus-bytes", "50k", "--eval-interval", "0",
                   "--sample-tokens", "0", "--no-progress", "--out-dir", str(tmp_path / "run")])
    plan = summary["memory_plan"]
    assert plan["policy"] == "in-memory" and plan["max_memory"] == limit << 30
    assert plan["predicted_peak_bytes"] <= limit << 30 and summary["final_loss"] is not None


def test_the_perfmodel_command_takes_llama_presets(capsys):
    from gpt2.perfmodel import cli
    assert cli.main(["--model", "smollm2-135m", "--batch", "4", "--seq", "1024", "--json",
                     "--hardware", "zen4-2core-vm"]) == 0
    data = json.loads(capsys.readouterr().out)
    spec = ModelSpec.from_config(preset("smollm2-135m"))
    assert data["step_time"] > 0
    assert spec.num_parameters() == num_parameters(preset("smollm2-135m"))
    assert cli.main(["--plan", "--max-memory", "20G", "--model", "tinyllama-1.1b", "--batch", "1",
                     "--seq", "1024", "--hardware", "zen4-2core-vm"]) == 0
    out = capsys.readouterr().out
    assert "22 layers, C=2048, V=32000" in out and "chose " in out
    with pytest.raises(SystemExit, match="error: .*unknown.*llama-9b|error: .*llama-9b"):
        cli.main(["--model", "llama-9b", "--batch", "1", "--seq", "8"])
