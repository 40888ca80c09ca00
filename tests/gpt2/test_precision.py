"""--precision bf16: float32 master weights, gradients and moments; the linear layers'
products take bf16 operands and sum in float32 (adtape.nn, kernels.bf16).

The gradients of a step under bf16 point where float32's do (cosine >= 0.999 per
tensor, both families), the product inputs are saved in bf16 (fewer tape bytes),
fp32 is the float32 path unchanged, and auto picks bf16 only where the CPU multiplies it
natively and the probe measured it faster."""
import numpy as np
import pytest

from adtape import nn
from gpt2 import precision
from gpt2.config import GPT2Config, LlamaConfig
from gpt2.model import GPT2
from gpt2.train import UsageError, run


def grads_after_one_step(config, name, engine="tape"):
    previous = nn.set_precision(name)
    try:
        model = GPT2(config, seed=3, engine=engine)
        rng = np.random.default_rng(0)
        x = rng.integers(0, config.vocab_size, (2, 32)).astype(np.int32)
        y = rng.integers(0, config.vocab_size, (2, 32)).astype(np.int32)
        loss = model.loss_and_grad(x, y)
        grads = {k: np.array(v, dtype=np.float64) for k, v in model.grads.views.items()}
        saved = model._tape_engine.last_forward_bytes
        model.close()
    finally:
        nn.set_precision(previous)
    return loss, grads, saved


@pytest.mark.parametrize("config", [GPT2Config.preset("tiny"), LlamaConfig.preset("llama-tiny")],
                         ids=lambda c: type(c).__name__)
def test_bf16_gradients_point_where_fp32_gradients_do(config):
    loss32, g32, _ = grads_after_one_step(config, "fp32")
    loss16, g16, _ = grads_after_one_step(config, "bf16")
    assert abs(loss16 - loss32) <= 1e-2 * abs(loss32)
    assert g32.keys() == g16.keys()
    for name in g32:
        a, b = g32[name].ravel(), g16[name].ravel()
        if not np.any(a):
            assert not np.any(b), name
            continue
        cosine = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
        assert cosine >= 0.999, (name, cosine)
        assert not np.array_equal(a, b) or a.size < 4, name   # bf16 did run


def test_the_forward_loss_is_that_of_the_runs_products():
    # GPT-2's hand-sequenced forward is float32's: under bf16 the model's forward (the
    # validation loss) runs the tape engine's ops, as its training steps do.
    config = GPT2Config.preset("tiny")
    rng = np.random.default_rng(1)
    x = rng.integers(0, config.vocab_size, (2, 16)).astype(np.int32)
    y = rng.integers(0, config.vocab_size, (2, 16)).astype(np.int32)
    model = GPT2(config, seed=3)
    try:
        fp32 = model.forward(x, y)[1]
        previous = nn.set_precision("bf16")
        try:
            bf16 = model.forward(x, y)[1]
            step = model.loss_and_grad(x, y)
        finally:
            nn.set_precision(previous)
    finally:
        model.close()
    assert bf16 != fp32 and abs(bf16 - fp32) <= 1e-2 * abs(fp32)
    assert bf16 == pytest.approx(step, rel=1e-6)


def test_fp32_is_the_float32_path():
    config = LlamaConfig.preset("llama-tiny")
    assert nn.get_precision() == "fp32"
    a = grads_after_one_step(config, "fp32")
    b = grads_after_one_step(config, "fp32")
    assert a[0] == b[0]
    for name in a[1]:
        np.testing.assert_array_equal(a[1][name], b[1][name])


def test_products_save_their_inputs_in_bf16():
    config = LlamaConfig.preset("llama-tiny")
    saved = {name: grads_after_one_step(config, name)[2] for name in ("fp32", "bf16")}
    assert saved["bf16"] < saved["fp32"]


def test_linear_in_bf16_equals_the_product_of_rounded_operands():
    from adtape import Tensor
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 24)).astype(np.float32)
    w = rng.standard_normal((7, 24)).astype(np.float32)

    def bf16_round(a):
        u = a.view(np.uint32).astype(np.uint64)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        return u.astype(np.uint32).view(np.float32).astype(np.float64)

    previous = nn.set_precision("bf16")
    try:
        xt, wt = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
        out = nn.linear(xt, wt)
        g = rng.standard_normal(out.shape).astype(np.float32)
        out.backward(g)
    finally:
        nn.set_precision(previous)
    xr, wr, gr = bf16_round(x), bf16_round(w), bf16_round(g)
    K = 24
    bound = K * 2.0 ** -24 / (1 - K * 2.0 ** -24)
    np.testing.assert_allclose(out.data, xr @ wr.T, rtol=0, atol=bound * (abs(xr) @ abs(wr).T).max())
    np.testing.assert_allclose(xt.grad, gr @ wr, rtol=0, atol=bound * (abs(gr) @ abs(wr)).max())
    np.testing.assert_allclose(wt.grad, gr.T @ xr, rtol=0,
                               atol=5 * 2.0 ** -24 * (abs(gr).T @ abs(xr)).max())


def test_set_precision_refuses_other_names():
    with pytest.raises(ValueError, match="precision must be one of"):
        nn.set_precision("fp16")


def test_auto_picks_bf16_only_where_it_is_native_and_faster(monkeypatch):
    from kernels import bf16
    monkeypatch.setattr(bf16, "cpu_has_avx512_bf16", lambda: False)
    assert precision.choose("auto", 2, measure=pytest.fail) == (
        "fp32", "auto: this CPU has no AVX512_BF16")
    monkeypatch.setattr(bf16, "cpu_has_avx512_bf16", lambda: True)
    name, why = precision.choose("auto", 2, measure=lambda n: (1.0, 0.55))
    assert name == "bf16" and "1.82x" in why
    name, why = precision.choose("auto", 2, measure=lambda n: (1.0, 0.95))
    assert name == "fp32" and "not faster" in why
    assert precision.choose("fp32", 2, measure=pytest.fail)[0] == "fp32"
    assert precision.choose("bf16", 2, measure=pytest.fail)[0] == "bf16"


def test_the_probe_times_both_products():
    fp32_s, bf16_s = precision.probe(1, shape=(64, 96, 128), repeats=2)
    assert fp32_s > 0 and bf16_s > 0


QUICK = ["--model", "tiny", "-B", "2", "-T", "16", "--steps", "3", "--corpus-bytes", "30k",
         "--eval-interval", "0", "--sample-tokens", "0", "--no-progress", "--overwrite"]


def test_the_command_trains_in_bf16_and_says_so(tmp_path, capsys):
    summary = run(QUICK + ["--out-dir", str(tmp_path / "a"), "--precision", "bf16"])
    assert summary["precision"] == "bf16"
    header = capsys.readouterr().out.splitlines()[0]
    assert "precision bf16 (bf16 products" in header
    fp32 = run(QUICK + ["--out-dir", str(tmp_path / "b"), "--precision", "fp32"])
    assert fp32["precision"] == "fp32"
    assert nn.get_precision() == "fp32"                      # restored after the run
    auto = run(QUICK + ["--out-dir", str(tmp_path / "c"), "--precision", "auto"])
    from kernels import bf16
    if not bf16.cpu_has_avx512_bf16():
        assert auto["precision"] == "fp32"
        assert auto["precision_reason"] == "auto: this CPU has no AVX512_BF16"


@pytest.mark.parametrize("extra, culprit", [(["--engine", "manual"], "--engine manual"),
                                            (["--offload", "all"], "--offload all")])
def test_bf16_refuses_what_it_does_not_run_on(tmp_path, extra, culprit):
    with pytest.raises(UsageError, match=f"--precision bf16 runs on the tape engine.*{culprit}"):
        run(QUICK + ["--out-dir", str(tmp_path), "--precision", "bf16", *extra])
