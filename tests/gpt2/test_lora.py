"""LoRA against peft on transformers (the oracle): random small Llama, Qwen2 (q/k/v
biases) and GPT-2 (Conv1D) models that transformers builds and saves, read by us; the
same adapters in both (B random, so that every gradient is non-zero).  Logits, loss and
every adapter gradient match, and so do five AdamW steps.  Then what peft does not
check for us: the base stays frozen (no gradient, no moments), a bf16 base is the
float32 base rounded, the memory policies and gradient accumulation give the same
gradients, dropout only while training, and bad settings are refused by name."""

import numpy as np
import peft
import pytest
import torch
import transformers

from adtape import nn
from gpt2 import hf
from gpt2.config import GPT2Config
from gpt2.lora import Bf16Base, LoraConfig, peft_tensors
from gpt2.model import Model
from gpt2.params import ParamArena, init_params_
from hf_models import hf_model, reduced

CONFIGS = {
    "llama": reduced("llama-3.2-1b"),
    "qwen2": reduced("qwen2.5-0.5b"),
    "gpt2": GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=384, block_size=64),
}
TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "gpt2": ["c_attn", "c_proj", "c_fc"]}


def batch(config, B=2, T=19, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, config.vocab_size, (B, T)).astype(np.int32),
            rng.integers(0, config.vocab_size, (B, T)).astype(np.int32))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(ours, peft's model, config) with the same base and adapters (r 4, alpha 8)."""
    family = request.param
    config = CONFIGS[family]
    theirs = hf_model(config)
    directory = tmp_path_factory.mktemp(family)
    theirs.save_pretrained(directory)
    base = hf.load_dir(directory)
    ours = Model(base.config, lora=LoraConfig(r=4, alpha=8), base=base)
    pcfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[family],
                           fan_in_fan_out=family == "gpt2")
    theirs = peft.get_peft_model(theirs, pcfg)
    state = theirs.state_dict()
    rng = np.random.default_rng(1)
    mine = peft_tensors(ours.adapter)
    assert {k.replace(".weight", ".default.weight") for k in mine} == {
        k for k in state if "lora_" in k}
    with torch.no_grad():
        for key, view in mine.items():
            if ".lora_B." in key:
                view[...] = rng.standard_normal(view.shape).astype(np.float32) * 0.05
            state[key.replace(".weight", ".default.weight")].copy_(torch.from_numpy(view.copy()))
    yield ours, theirs, config
    ours.close()


def torch_loss(model, x, y, V):
    logits = model(torch.from_numpy(x.astype(np.int64))).logits
    return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, V),
                                                     torch.from_numpy(y.astype(np.int64)).reshape(-1))


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def adapter_grads(model):
    class View:
        pass
    v = View()
    v.lora, v.config, v.params = model.adapter.lora, model.config, model.adapter.grads
    return peft_tensors(v)


def test_logits_loss_and_adapter_gradients_match_peft(pair):
    ours, theirs, config = pair
    x, y = batch(config)
    logits, loss = ours.forward(x, y)
    their_logits, their_loss = torch_loss(theirs, x, y, config.vocab_size)
    assert rel(logits[..., :config.vocab_size], their_logits.detach().numpy()) < 1e-5
    assert abs(loss - their_loss.item()) < 1e-5 * abs(their_loss.item())
    ours.zero_grad()
    assert abs(ours.loss_and_grad(x, y) - their_loss.item()) < 1e-5 * their_loss.item()
    theirs.zero_grad()
    their_loss.backward()
    named = dict(theirs.named_parameters())
    grads = adapter_grads(ours)
    for key, g in grads.items():
        their = named[key.replace(".weight", ".default.weight")].grad.numpy()
        assert np.abs(their).max() > 0, key
        assert rel(g, their) < 1e-4, key
    # Only the adapters train in peft, as in ours.
    assert {n for n, p in theirs.named_parameters() if p.requires_grad} == {
        k.replace(".weight", ".default.weight") for k in grads}


def test_five_adamw_steps_track_peft(pair):
    # Five AdamW steps in float32 on both sides, and peft's in float64 from the same
    # start: each float32 run drifts from the float64 one by its own roundings (AdamW's
    # normalised steps carry a gradient's rounding into an update of size lr where the
    # gradient is small), so ours must stay as close to the float64 run as peft's own
    # float32 run is, within a factor of 3, or within 1e-4 of it where both are closer.
    import copy
    ours, theirs, config = pair
    exact = copy.deepcopy(theirs).double()
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3, betas=(0.9, 0.999),
                              eps=1e-8, weight_decay=0.1) for m in (theirs, exact)]
    for step in range(5):
        x, y = batch(config, seed=10 + step)
        loss, _ = ours.train_step(x, y, lr=1e-3, weight_decay=0.1)
        for model, opt in zip((theirs, exact), opts):
            opt.zero_grad()
            _, their_loss = torch_loss(model, x, y, config.vocab_size)
            their_loss.backward()
            opt.step()
        assert abs(loss - their_loss.item()) < 1e-5 * their_loss.item()
    named, named64 = dict(theirs.named_parameters()), dict(exact.named_parameters())
    for key, value in peft_tensors(ours.adapter).items():
        name = key.replace(".weight", ".default.weight")
        want = named64[name].detach().numpy()
        theirs_off = rel(named[name].detach().numpy(), want)
        assert rel(value, want) < max(3 * theirs_off, 1e-4), (key, rel(value, want), theirs_off)


def test_the_base_is_frozen_and_carries_no_training_state():
    config = CONFIGS["llama"]
    model = Model(config, lora=LoraConfig(r=2), seed=3)
    before = model.params.flat.copy()
    x, y = batch(config)
    for _ in range(2):
        model.train_step(x, y, lr=1e-2)
    assert np.array_equal(model.params.flat, before)
    assert model.grads is None and model.adam_m is None and model.adam_v is None
    assert model.adapter.num_parameters == sum(
        v.size for v in model.adapter.params.views.values())
    # B moved off zero: the adapters trained.
    assert np.abs(model.adapter.params.views["qkvw.lora_B"]).max() > 0
    model.close()


def test_a_bf16_base_is_the_float32_base_rounded(monkeypatch):
    config = CONFIGS["qwen2"]
    rounded = Bf16Base.random(config, seed=5)
    assert all(a.dtype == np.uint16 for n, a in rounded.views.items()
               if n in ("wte", "qkvw", "attprojw", "gateupw", "downw"))
    assert rounded.views["rms1w"].dtype == np.float32
    exact = Bf16Base.from_arena(init_params_(ParamArena(config), 5))
    for name in exact.views:
        assert np.array_equal(exact.views[name], rounded.views[name]), name
    lora = LoraConfig(r=4, alpha=4)
    x, y = batch(config)
    half = Model(config, lora=lora, base_dtype="bf16", seed=5)
    assert half.params.nbytes < 0.6 * ParamArena(config).nbytes
    full = Model(config, lora=lora, base=rounded.to_arena(), seed=5)

    def bf16_products(attention_precision):
        """loss and adapter gradients of ``full`` with bf16 linear products, its
        attention's products in ``attention_precision``"""
        with monkeypatch.context() as m:
            m.setattr(nn, "_attention_precision", lambda: attention_precision)
            nn.set_precision("bf16")
            try:
                loss = full.forward(x, y)[0].copy()
                full.zero_grad()
                full.loss_and_grad(x, y)
            finally:
                nn.set_precision("fp32")
        return loss, full.adapter.grads.flat.copy()

    # The bf16 base's products run in bf16 whatever the precision (attention, which has
    # no weight, in the precision's): the same bits.
    want, grads = bf16_products("fp32")
    assert np.array_equal(half.forward(x, y)[0], want)
    half.zero_grad()
    half.loss_and_grad(x, y)
    assert np.array_equal(half.adapter.grads.flat, grads)
    want, grads = bf16_products("bf16")
    nn.set_precision("bf16")
    try:
        assert np.array_equal(half.forward(x, y)[0], want)
        half.zero_grad()
        half.loss_and_grad(x, y)
    finally:
        nn.set_precision("fp32")
    assert np.array_equal(half.adapter.grads.flat, grads)
    half.close()
    full.close()


@pytest.mark.parametrize("policy", [dict(checkpointing="layer"), dict(checkpointing="binomial"),
                                    dict(tape_kwargs={"memory_budget": 1 << 14})])
def test_the_memory_policies_give_the_same_gradients(policy, tmp_path):
    config = CONFIGS["gpt2"]
    lora = LoraConfig(r=3, alpha=6)
    x, y = batch(config)
    plain = Model(config, lora=lora, seed=1)
    plain.adapter.params.views["qkvw.lora_B"][...] = 0.01
    plain.zero_grad()
    want = plain.loss_and_grad(x, y)
    kwargs = dict(policy)
    if "tape_kwargs" in kwargs:
        kwargs["tape_kwargs"] = dict(kwargs["tape_kwargs"], spill_dir=str(tmp_path))
    other = Model(config, lora=lora, seed=1, **kwargs)
    other.adapter.params.views["qkvw.lora_B"][...] = 0.01
    other.zero_grad()
    assert other.loss_and_grad(x, y) == want
    assert np.array_equal(other.adapter.grads.flat, plain.adapter.grads.flat)
    plain.close()
    other.close()


def test_gradient_accumulation_equals_the_whole_batch():
    config = CONFIGS["llama"]
    lora = LoraConfig(r=2, alpha=4)
    x, y = batch(config, B=4)
    whole, split = Model(config, lora=lora, seed=2), Model(config, lora=lora, seed=2)
    for step in range(3):
        a = whole.train_step(x, y, lr=1e-2, grad_clip=1.0)
        b = split.train_step(x, y, lr=1e-2, grad_clip=1.0, grad_accum=2)
        assert abs(a[0] - b[0]) <= 1e-6 * abs(a[0])
        assert abs(a[1] - b[1]) <= 1e-6 * abs(a[1])     # the clipped norms
        if step == 0:
            # The gradients left behind: the whole batch's mean, the sum of 2 micro-means.
            # Their products have other row counts (76 and 38), which the kernels route
            # to other code, each float32 sum rounding in its own order: the two must be
            # as close as the whole batch is to itself with every product on BLAS instead
            # (within 3 times that, or 1e-6 of the largest gradient).
            from kernels import gemm
            other = Model(config, lora=lora, seed=2)
            old = gemm.set_packed_gemm(0), gemm.set_skinny_max_m(0)
            try:
                other.train_step(x, y, lr=1e-2, grad_clip=1.0)
            finally:
                gemm.set_packed_gemm(old[0])
                gemm.set_skinny_max_m(old[1])
            spread = rel(other.adapter.grads.flat, whole.adapter.grads.flat)
            other.close()
            got = rel(split.adapter.grads.flat / 2, whole.adapter.grads.flat)
            assert got < max(3 * spread, 1e-6), (got, spread)


def test_dropout_runs_while_training_only():
    config = CONFIGS["llama"]
    x, y = batch(config)
    model = Model(config, lora=LoraConfig(r=4, alpha=8, dropout=0.5), seed=4)
    model.adapter.params.views["gateupw.lora_B"][...] = 0.05
    same = Model(config, lora=LoraConfig(r=4, alpha=8), seed=4)
    same.adapter.params.views["gateupw.lora_B"][...] = 0.05
    # Evaluation: no dropout, so equal to the model without it.
    assert np.array_equal(model.forward(x, y)[0], same.forward(x, y)[0])
    model.zero_grad()
    same.zero_grad()
    assert model.loss_and_grad(x, y) != same.loss_and_grad(x, y)


def test_targets_rank_and_rslora_scale():
    config = CONFIGS["llama"]
    lora = LoraConfig(r=4, alpha=8, targets=("q_proj", "v_proj"), rslora=True)
    assert lora.scale == 4.0
    model = Model(config, lora=lora)
    keys = peft_tensors(model.adapter)
    assert {k.split(".")[-3] for k in keys} == {"q_proj", "v_proj"}
    assert model.adapter.params.views["qkvw.lora_A"].shape == (2, 8, config.n_embd)
    assert set(model.adapter.params.views) == {"qkvw.lora_A", "qkvw.lora_B"}
    model.close()


@pytest.mark.parametrize("kwargs,match", [
    (dict(r=0), "rank r"), (dict(alpha=-1), "alpha"), (dict(dropout=1.0), "dropout"),
    (dict(targets=("c_attn",)), "'c_attn' .* not projections of a Llama model"),
])
def test_bad_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Model(CONFIGS["llama"], lora=LoraConfig(**kwargs))


def test_lora_refuses_what_it_cannot_do():
    config = CONFIGS["gpt2"]
    with pytest.raises(ValueError, match="engine='tape'"):
        Model(config, lora=LoraConfig(), engine="manual")
    with pytest.raises(ValueError, match="nothing to offload"):
        Model(config, lora=LoraConfig(), offload="moments")
    with pytest.raises(ValueError, match="base_dtype must be"):
        Model(config, lora=LoraConfig(), base_dtype="fp16")


def test_our_adapter_directory_loads_in_peft_and_back(pair, tmp_path):
    from gpt2.lora import load_adapter, read_adapter_config, save_adapter
    ours, theirs, config = pair
    save_adapter(tmp_path / "adapter", ours.adapter, base_model="base")
    base = hf_model(config)     # the same random weights as the pair's base
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    x, y = batch(config, seed=3)
    with torch.no_grad():
        want = loaded(torch.from_numpy(x.astype(np.int64))).logits.numpy()
    assert rel(ours.forward(x, y)[0][..., :config.vocab_size], want) < 1e-5
    # The merged model, as --save-hf writes it, gives the same logits in transformers.
    merged = ours.param_arena()
    hf.save_dir(tmp_path / "merged", merged)
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        assert rel(plain(torch.from_numpy(x.astype(np.int64))).logits.numpy(), want) < 1e-5
    # And back: peft's own save_pretrained read into a fresh model.
    theirs.save_pretrained(str(tmp_path / "theirs"))
    lora = read_adapter_config(str(tmp_path / "theirs"), config)
    assert (lora.r, lora.alpha) == (4, 8)
    again = Model(config, lora=lora, base=hf.load_dir(tmp_path / "merged"))
    load_adapter(str(tmp_path / "theirs"), again.adapter)
    named = dict(theirs.named_parameters())
    for key, value in peft_tensors(again.adapter).items():
        assert np.array_equal(value, named[key.replace(".weight", ".default.weight")]
                              .detach().numpy()), key
    again.close()


def test_a_foreign_adapter_is_refused_by_name(tmp_path):
    import json

    from gpt2.lora import LoraState, load_adapter, read_adapter_config, save_adapter
    config = CONFIGS["llama"]
    state = LoraState(config, LoraConfig(r=2))
    save_adapter(tmp_path, state)
    with pytest.raises(ValueError, match="does not fit .* unexpected"):
        load_adapter(str(tmp_path), LoraState(config, LoraConfig(r=2, targets=("q_proj",))))
    fields = json.loads((tmp_path / "adapter_config.json").read_text())
    fields["use_dora"] = True
    (tmp_path / "adapter_config.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match="use_dora True is not supported"):
        read_adapter_config(str(tmp_path), config)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_adapter_config(str(tmp_path / "nowhere"), config)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_bf16_base_reads_a_directory_tensor_by_tensor(family, tmp_path):
    config = CONFIGS[family]
    hf_model(config, seed=7).save_pretrained(tmp_path)
    want = Bf16Base.from_arena(hf.load_dir(tmp_path))
    got = Bf16Base.load_hf(tmp_path)
    assert got.config == config
    for name, view in want.views.items():
        assert got.views[name].dtype == view.dtype and np.array_equal(got.views[name], view), name
