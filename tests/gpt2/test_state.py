"""One training state (gpt2.state): every layout answers the same interface, a checkpoint
moves between them, and the planner's model-state bytes are the state's own."""
import os

import numpy as np
import pytest

from gpt2 import checkpoint as ckpt
from gpt2.config import GPT2Config, LlamaConfig
from gpt2.lora import AdapterArena, LoraConfig
from gpt2.model import Model
from gpt2.offload import FullOffloadState, MomentState
from gpt2.params import FlatArena, ParamArena, layer_major_offsets
from gpt2.perfmodel import load_profile
from gpt2.perfmodel.plan import predict_policy
from gpt2.state import ArenaState, FrozenState, TrainingState

TINY = GPT2Config.preset("tiny")


def batches(config, steps, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        tokens = rng.integers(0, config.vocab_size, (2, 17)).astype(np.int32)
        yield tokens[:, :-1], tokens[:, 1:]


def train(model, steps, seed=0):
    return [model.train_step(x, y, 1e-3, weight_decay=0.1, grad_clip=1.0)
            for x, y in batches(model.config, steps, seed)]


@pytest.mark.parametrize("offload, kind", [(None, ArenaState), ("moments", MomentState),
                                           ("all", FullOffloadState)])
def test_a_checkpoint_moves_between_every_layout_through_the_state(offload, kind, tmp_path):
    memory = Model(TINY, seed=1)
    other = Model(TINY, seed=2, offload=offload, offload_dir=tmp_path)
    try:
        assert type(other.state) is kind and isinstance(other.state, TrainingState)
        train(memory, 3)
        ckpt.save_state(tmp_path / "a.bin", memory.state, step=3)
        loaded = ckpt.load_state(tmp_path / "a.bin", other.state, TINY)
        assert loaded.step == 3 and other.adam_step == memory.adam_step == 3
        assert train(other, 3, seed=1) == train(memory, 3, seed=1)
        for model, name in ((memory, "b.bin"), (other, "c.bin")):
            ckpt.save_state(tmp_path / name, model.state, step=6)
        assert (tmp_path / "b.bin").read_bytes() == (tmp_path / "c.bin").read_bytes()
    finally:
        other.close()
        memory.close()
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "b.bin", "c.bin"]


def test_a_lora_state_saves_and_loads_its_adapters_only(tmp_path):
    lora = LoraConfig(r=2)
    a, b = Model(TINY, seed=0, lora=lora), Model(TINY, seed=0, lora=lora)
    train(a, 2)
    assert a.adapter is a.state and a.grads is None and a.state.lora == lora
    ckpt.save_state(tmp_path / "a.bin", a.state, step=2)
    ckpt.load_state(tmp_path / "a.bin", b.state, TINY)
    for mine, theirs in zip(a.state.sections(), b.state.sections()):
        assert isinstance(theirs, AdapterArena) and np.array_equal(mine.flat, theirs.flat)
    assert train(a, 2, seed=1) == train(b, 2, seed=1)
    with pytest.raises(ValueError, match="holds adapters of"):
        ckpt.load_state(tmp_path / "a.bin", Model(TINY, lora=LoraConfig(r=2, alpha=3.0)).state,
                        TINY)


def test_arenas_share_one_flat_buffer_class_and_its_sweep_order():
    params = ParamArena(TINY)
    params.flat[:] = np.arange(params.flat.size)
    sweep = params.in_sweep_order(np.empty_like(params.flat)).copy_(params)
    assert sweep.layer_major and isinstance(sweep, FlatArena)
    start, stop = layer_major_offsets(TINY)["qkvw", 1]
    assert np.array_equal(sweep.flat[start:stop], params.qkvw[1].reshape(-1))
    adapters = AdapterArena(TINY, LoraConfig(r=2))
    same = adapters.in_sweep_order(np.empty_like(adapters.flat)).copy_(adapters)
    assert same.views.keys() == adapters.views.keys() and not same.flat.any()
    with pytest.raises(ValueError, match="same layout"):
        same.copy_(params)


@pytest.mark.parametrize("offload", [None, "moments", "all"])
def test_the_planners_model_state_bytes_are_the_states(offload, tmp_path):
    # A model whose embedding's moments fill a whole I/O unit, as in real sizes; the
    # slots of offload="all" are padded to whole records (a few KiB).
    config = GPT2Config(n_layer=2, n_head=4, n_embd=256, vocab_size=40000, block_size=64)
    predicted = predict_policy(config, 1, 16, hardware=load_profile("zen4-2core-vm"),
                               offload=offload).memory["model states"]
    model = Model(config, seed=0, offload=offload, offload_dir=tmp_path)
    try:
        assert model.state.nbytes == pytest.approx(predicted, rel=0 if offload != "all" else 1e-4)
    finally:
        model.close()


@pytest.mark.parametrize("config, engine", [(TINY, "tape"), (TINY, "manual"),
                                            (LlamaConfig.preset("llama-tiny"), "tape")],
                         ids=["gpt2-tape", "gpt2-manual", "llama"])
def test_an_inference_model_holds_the_parameters_alone_and_gives_the_same_logits(config,
                                                                                  engine):
    trained = Model(config, seed=3, engine=engine)
    train(trained, 2)
    params = trained.param_arena()
    frozen = Model.for_inference(params, engine=engine)
    assert frozen.params is params                      # used in place, not copied
    assert type(frozen.state) is FrozenState and not frozen.state.trains
    assert frozen.state.nbytes == params.nbytes == trained.state.nbytes // 4
    x, y = next(batches(config, 1, seed=9))
    logits, loss = trained.forward(x, y)
    logits = logits.copy()
    got_logits, got_loss = frozen.forward(x, y)
    assert got_loss == loss
    np.testing.assert_array_equal(got_logits, logits)
    for call in (lambda: frozen.loss_and_grad(x, y), lambda: frozen.train_step(x, y, 1e-3),
                 lambda: frozen.adamw_step(1e-3), lambda: frozen.clip_grad_norm(1.0)):
        with pytest.raises(RuntimeError, match="for inference"):
            call()
    with pytest.raises(TypeError, match="ParamArena"):
        Model.for_inference(params.flat)
    frozen.close()
    trained.close()
