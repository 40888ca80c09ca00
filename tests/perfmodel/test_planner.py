"""The memory planner: its choice respects the limit, an impossible limit fails at once with
the minimum, its byte counts are the engine's, and training under its plan stays within
the predicted peak with the in-memory run's losses."""
import importlib.util
import os

import numpy as np
import pytest

from gpt2.config import GPT2Config
from gpt2.model import GPT2
from gpt2.params import num_parameters
from gpt2.perfmodel import cli, load_profile
from gpt2.perfmodel.calibrate import measure_baseline_rss, measure_disk
from gpt2.offload import UNIT_BYTES, WINDOW
from gpt2.perfmodel.plan import minimum_memory, plan_memory, predict_policy, required_memory

TINY = GPT2Config.preset("tiny")
GPT2_124M = GPT2Config.preset("gpt2")
GPT2_MEDIUM = GPT2Config.preset("gpt2-medium")
HUGE = 1 << 50


@pytest.fixture(scope="module")
def profile():
    """The committed Zen 4 profile (deterministic figures) with the baseline RSS measured now,
    as calibrate measures it."""
    return load_profile("zen4-2core-vm").with_changes(baseline_rss=measure_baseline_rss())


def test_generous_limit_chooses_in_memory(profile):
    for config, B, T in ((TINY, 4, 64), (GPT2_124M, 4, 256)):
        plan = plan_memory(config, B, T, HUGE, hardware=profile)
        assert plan.policy == "in-memory" and plan.tape_budget is None and plan.checkpointing == "none"
        assert plan.engine_kwargs() == {"tape_kwargs": {}, "checkpointing": "none", "snapshots": 0}
        assert "chose in-memory" in plan.describe()


@pytest.mark.parametrize("limit_gib", [4, 4.5, 5, 6, 8, 12, 16])
def test_chosen_plan_respects_the_limit(profile, limit_gib):
    limit = int(limit_gib * (1 << 30))
    plan = plan_memory(GPT2_124M, 8, 1024, limit, hardware=profile)
    assert required_memory(plan.predicted_peak_bytes) <= limit
    fitting = [c for c in plan.candidates if c.fits]
    # Each fits with the planner's margin.
    assert all(required_memory(c.predicted_peak_bytes) <= limit for c in fitting)
    assert plan.predicted_ms == min(c.predicted_ms for c in fitting)
    assert all(required_memory(c.predicted_peak_bytes) > limit or c.rejected.startswith("budget below")
               for c in plan.candidates if not c.fits)
    kwargs = plan.engine_kwargs()
    assert kwargs["checkpointing"] == plan.checkpointing
    assert kwargs["tape_kwargs"].get("memory_budget") == plan.tape_budget


def test_less_memory_is_never_faster(profile):
    for config, B, T in ((GPT2_124M, 8, 1024), (GPT2_124M, 4, 256), (TINY, 256, 64)):
        need = plan_memory(config, B, T, HUGE, hardware=profile).predicted_peak_bytes
        times = []
        for share in np.linspace(0.3, 1.2, 19):
            try:
                times.append(plan_memory(config, B, T, int(need * share), hardware=profile).predicted_ms)
            except ValueError:
                assert not times, "a larger limit failed after a smaller one fitted"
        assert len(times) > 5
        assert all(a >= b for a, b in zip(times, times[1:])), times


def test_impossible_limit_names_the_minimum(profile):
    # The least model states: everything on disk (--offload all) but for what stays in RAM.
    states = min(predict_policy(GPT2_124M, 8, 1024, hardware=profile, offload=o).memory["model states"]
                 for o in (None, "moments", "all"))
    assert states < 8 * num_parameters(GPT2_124M)
    fixed = required_memory(states + profile.baseline_rss)   # with the planner's margin
    with pytest.raises(ValueError, match=f"at least .* \\({int(fixed)} bytes\\)") as info:
        plan_memory(GPT2_124M, 8, 1024, int(fixed) - 1, hardware=profile)
    assert "the model states that stay in RAM with the rest on disk" in str(info.value)
    # Above the model states but below what any policy's activations need.
    with pytest.raises(ValueError, match="required minimum") as info:
        plan_memory(GPT2_124M, 8, 1024, int(fixed) + (1 << 20), hardware=profile)
    minimum = minimum_memory(GPT2_124M, 8, 1024, hardware=profile)
    assert f"({minimum} bytes); that is the required minimum" in str(info.value) and minimum > fixed
    plan = plan_memory(GPT2_124M, 8, 1024, minimum, hardware=profile)
    assert required_memory(plan.predicted_peak_bytes) <= minimum
    with pytest.raises(ValueError, match="max_memory"):
        plan_memory(TINY, 4, 64, -5, hardware=profile)


def test_in_memory_prediction_counts_the_engines_bytes(profile):
    B, T = 4, 64
    plan = plan_memory(TINY, B, T, HUGE, hardware=profile)
    chosen = next(c for c in plan.candidates if c.policy == "in-memory")
    # The model states are the four arenas of gpt2.params' layout, exactly.
    assert chosen.memory["model states"] == 4 * 4 * num_parameters(TINY)
    # The stored activations are what the engine's forward pass saved, exactly.
    model = GPT2(TINY, seed=0)
    ids, targets = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, B, T)).astype(np.int32)
    model.loss_and_grad(ids, targets)
    assert chosen.memory["activations"] == model._tape_engine.last_forward_bytes
    model.close()
    live = sum(v for k, v in chosen.memory.items() if k not in ("spilled", "baseline"))
    assert chosen.predicted_peak_bytes == pytest.approx(live + profile.baseline_rss, abs=1)
    # The working set is bounded: at most the stored activations again (here: the logits'
    # gradient or one block's gradients).
    assert chosen.memory["working set"] <= chosen.memory["activations"]


def test_predict_policy_is_what_the_planner_weighs(profile):
    plan = plan_memory(GPT2_124M, 8, 1024, 8 << 30, hardware=profile)
    assert len(plan.candidates) > 10
    for c in plan.candidates:
        p = predict_policy(GPT2_124M, 8, 1024, c.tape_budget, c.checkpointing, c.snapshots, hardware=profile,
                           offload=c.offload)
        assert (p.policy, p.predicted_ms, p.predicted_peak_bytes, p.memory) == \
            (c.policy, c.predicted_ms, c.predicted_peak_bytes, c.memory)
    with pytest.raises(ValueError, match="checkpointing"):
        predict_policy(GPT2_124M, 8, 1024, checkpointing="all", hardware=profile)
    with pytest.raises(ValueError, match="tape_budget"):
        predict_policy(GPT2_124M, 8, 1024, tape_budget=-1, hardware=profile)
    with pytest.raises(ValueError, match="block_size"):
        predict_policy(GPT2_124M, 8, 2048, hardware=profile)
    with pytest.raises(ValueError, match="offload"):
        predict_policy(GPT2_124M, 8, 1024, offload="everything", hardware=profile)
    # Moments on disk: 8 bytes per parameter less in RAM (but the unit buffers), and the
    # disk's time where the forward pass does not hide it.
    memory = predict_policy(GPT2_124M, 8, 1024, hardware=profile)
    moments = predict_policy(GPT2_124M, 8, 1024, hardware=profile, offload="moments")
    assert (memory.predicted_peak_bytes - moments.predicted_peak_bytes
            == 8 * num_parameters(GPT2_124M) - WINDOW * UNIT_BYTES)
    assert moments.time["state I/O exposed"] > 0 and moments.policy.endswith("moments on disk")
    with pytest.raises(ValueError, match="without checkpointing"):
        predict_policy(GPT2_124M, 8, 1024, checkpointing="layer", offload="all", hardware=profile)
    # Everything on disk: the blocks' parameters and gradients leave RAM too, for more I/O.
    full = predict_policy(GPT2_124M, 8, 1024, hardware=profile, offload="all")
    assert full.predicted_peak_bytes < moments.predicted_peak_bytes
    assert full.time["state I/O exposed"] >= moments.time["state I/O exposed"]


def test_a_budget_below_the_logits_costs_their_disk_time(profile):
    # The loss's logits are pushed and popped whole: what of them exceeds the budget is
    # written while the push waits and read while the pop waits (nothing hides it).
    logits = 4 * 8 * 1024 * GPT2_124M.padded_vocab_size
    small, large = (predict_policy(GPT2_124M, 8, 1024, b, hardware=profile) for b in (logits // 2, 2 * logits))
    write, read = profile.spill_times(logits - logits // 2)
    exposed = small.time["spill I/O exposed"] - large.time["spill I/O exposed"]
    assert exposed == pytest.approx((write + read) * 1e3, rel=1e-3) and exposed > 0   # (and the lse)
    # So at 8G the planner keeps the logits within the budget rather than take the
    # smallest budget of equal compute.
    plan = plan_memory(GPT2_124M, 8, 1024, 8 << 30, hardware=profile)
    assert plan.tape_budget is not None and plan.tape_budget >= logits


def test_attention_keeps_no_quadratic_activations(profile):
    # Our attention keeps qkv, its output and one log-sum-exp per query: the saved
    # activations grow linearly in T, and are what FlashAttention's layout counts.
    act = lambda plan: next(c for c in plan.candidates if c.policy == "in-memory").memory["activations"]  # noqa: E731
    long = plan_memory(GPT2_124M, 8, 1024, HUGE, hardware=profile)
    short = plan_memory(GPT2_124M, 8, 512, HUGE, hardware=profile)
    assert act(long) == 2 * act(short)
    assert act(plan_memory(GPT2_124M, 8, 1024, HUGE, hardware=profile, flash=True)) == act(long)


_spec = importlib.util.spec_from_file_location("plan_worker", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "plan_worker.py"))
plan_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_worker)



def test_training_under_the_plan_stays_within_its_peak(profile, tmp_path):
    B, T = 32, 64
    free = plan_memory(TINY, B, T, HUGE, hardware=profile)
    least = minimum_memory(TINY, B, T, hardware=profile)
    # Far below the in-memory need: a quarter of the way up from the least any policy needs.
    # (Both with the planner's margin: minimum_memory's figure includes it.)
    limit = int(least + (required_memory(free.predicted_peak_bytes) - least) / 4)
    plan = plan_memory(TINY, B, T, limit, hardware=profile, spill_dir=str(tmp_path))
    assert plan.policy != "in-memory" and required_memory(plan.predicted_peak_bytes) <= limit
    kwargs = plan.engine_kwargs()
    if plan.tape_budget is not None:
        assert kwargs["tape_kwargs"] == {"memory_budget": plan.tape_budget, "spill_dir": str(tmp_path)}
    planned = plan_worker.train("tiny", kwargs, tmp_path)
    reference = plan_worker.train("tiny", free.engine_kwargs(), tmp_path)
    assert planned["losses"] == reference["losses"]
    assert planned["peak"] <= plan.predicted_peak_bytes, (plan.table(), planned)
    assert "measured" in plan.compare(planned["ms"], planned["peak"])
    assert os.listdir(tmp_path) == []


def test_cli_prints_the_plan_and_errors_in_one_line(capsys):
    args = ["--plan", "--max-memory", "8G", "--model", "gpt2", "--batch", "8", "--seq", "1024",
            "--hardware", "zen4-2core-vm"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "CHOSEN" in out and "in-memory" in out and "layer checkpointing" in out and "chose " in out
    assert cli.main(args[:2] + ["1G"] + args[3:]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: max_memory 1.0 GiB cannot be met") and err.count("\n") == 1


def test_disk_probe_measures_both_directions_and_leaves_nothing(tmp_path):
    write, read, method = measure_disk(str(tmp_path), 16 << 20, chunk=1 << 20)
    assert write > 0 and read > 0
    assert method in ("O_DIRECT", "fsync + fadvise(DONTNEED)")
    assert os.listdir(tmp_path) == []


def test_bf16_fits_in_memory_where_fp32_must_spill_or_checkpoint(profile):
    # GPT-2 medium: the linear inputs bf16 halves outweigh the weights' bf16 copies and the
    # logits' gradient rounded to bf16 at the loss's backward (at GPT-2 124M's size they do
    # not); on a CPU that multiplies bf16 natively, as the profile's Zen 4 does (emulated,
    # that gradient is held in float32 once more).
    native = dict(bf16_emulated=False)
    fp32 = predict_policy(GPT2_MEDIUM, 8, 1024, hardware=profile)
    bf16 = predict_policy(GPT2_MEDIUM, 8, 1024, hardware=profile, precision="bf16", **native)
    assert bf16.predicted_peak_bytes < fp32.predicted_peak_bytes
    assert bf16.memory["activations"] < fp32.memory["activations"]
    assert bf16.memory["bf16 weight copies"] > 0 and "bf16 weight copies" not in fp32.memory
    # Midway between the two, each with the planner's margin.
    limit = (required_memory(fp32.predicted_peak_bytes) + required_memory(bf16.predicted_peak_bytes)) // 2
    plan32 = plan_memory(GPT2_MEDIUM, 8, 1024, limit, hardware=profile, **native)
    plan16 = plan_memory(GPT2_MEDIUM, 8, 1024, limit, hardware=profile, precision="bf16", **native)
    assert plan32.policy != "in-memory" and plan16.policy == "in-memory"
    assert plan16.precision == "bf16" and "with bf16 products" in plan16.describe()
    assert plan16.predicted_peak_bytes == bf16.predicted_peak_bytes <= limit
    # The fp32 plan says what bf16 would do.
    assert any("--precision bf16" in n and "fits in memory" in n for n in plan32.notes)
    # At the least memory bf16 keeps the parameters and gradients in RAM (gpt2-train
    # refuses --precision bf16 with --offload all), the weights' bf16 copies beside, and
    # at the loss's backward the logits' gradient rounded to bf16 (and the products'
    # operands laid out).
    least32 = minimum_memory(GPT2_MEDIUM, 8, 1024, hardware=profile)
    least16 = minimum_memory(GPT2_MEDIUM, 8, 1024, hardware=profile, precision="bf16", **native)
    moments32 = min(predict_policy(GPT2_MEDIUM, 8, 1024, tape_budget=b, checkpointing=c,
                                   hardware=profile, offload="moments").predicted_peak_bytes
                    for c in ("none", "layer") for b in (None, 1 << 20))
    from gpt2.perfmodel.plan import bf16_backward_scratch, bf16_forward_scratch
    from gpt2.perfmodel.spec import ModelSpec

    def scratch(fan_in, fan_out):       # dout in bf16 and the products' laid-out operands
        return sum(bf16_backward_scratch(8 * 1024, fan_in, fan_out, emulated=False)
                   + bf16_forward_scratch(8 * 1024, fan_in, fan_out, emulated=False))
    shapes = ModelSpec.from_config(GPT2_MEDIUM).product_shapes().values()
    rounded = (scratch(GPT2_MEDIUM.n_embd, GPT2_MEDIUM.padded_vocab_size)
               + max(scratch(*shape) for shape in shapes))
    assert rounded > 2 * 8 * 1024 * GPT2_MEDIUM.padded_vocab_size
    assert least32 < least16 <= required_memory(moments32 + bf16.memory["bf16 weight copies"] + rounded)
    with pytest.raises(ValueError, match="offload='all' runs in fp32"):
        predict_policy(GPT2_MEDIUM, 8, 1024, hardware=profile, offload="all", precision="bf16")


def test_planner_precision_errors_name_the_allowed_values(profile):
    for call in (lambda: plan_memory(TINY, 4, 64, HUGE, hardware=profile, precision="fp16"),
                 lambda: predict_policy(TINY, 4, 64, hardware=profile, precision="fp16"),
                 lambda: minimum_memory(TINY, 4, 64, hardware=profile, precision="fp16")):
        with pytest.raises(ValueError, match="precision must be one of fp32, bf16, got 'fp16'"):
            call()


def test_bf16_weighs_the_largest_tape_budget_that_fits(profile):
    # The headroom for the tape counts the weights' bf16 copies: the largest budget that
    # fits is among the candidates, within 2 MiB of the limit (it was rejected, over by the
    # copies, and the largest that fitted was a share of the activations far below).
    in_memory = predict_policy(GPT2_124M, 8, 1024, hardware=profile, precision="bf16")
    limit = int(in_memory.predicted_peak_bytes * 0.8)
    plan = plan_memory(GPT2_124M, 8, 1024, limit, hardware=profile, precision="bf16")
    spilling = [c for c in plan.candidates
                if c.checkpointing == "none" and c.offload is None and c.tape_budget and c.fits]
    largest = max(spilling, key=lambda c: c.tape_budget)
    assert limit - required_memory(largest.predicted_peak_bytes) < 2 << 20


@pytest.mark.parametrize("M, N, K, along", [(1024, 2304, 768, True), (1024, 768, 3072, True),
                                            (2304, 768, 1024, False), (1000, 50304, 768, True),
                                            (50304, 768, 1024, False), (97, 45, 70, True),
                                            (8192, 4096, 14336, True), (5, 3, 1, False)])
def test_bf16_laid_out_operands_are_the_kernels_bytes(M, N, K, along):
    # The planner's figure for the packed bf16 paths' buffer is the kernels' own.
    from gpt2.perfmodel.plan import bf16_packed_bytes
    from kernels import bf16
    assert bf16_packed_bytes(M, N, K, along) == bf16._packed_bytes(M, N, K, along)
