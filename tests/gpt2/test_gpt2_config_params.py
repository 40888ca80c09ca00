"""GPT2Config validation/presets and the parameter layout, arena and initialization."""
import math

import numpy as np
import pytest

from gpt2.config import GPT2Config
from gpt2.params import (PARAM_NAMES, ParamArena, init_params_, layer_major_offsets,
                         num_parameters, param_shapes)


def test_presets_and_padded_vocab():
    gpt2 = GPT2Config.preset("gpt2")
    assert (gpt2.n_layer, gpt2.n_head, gpt2.n_embd, gpt2.vocab_size, gpt2.block_size) == \
        (12, 12, 768, 50257, 1024)
    assert gpt2.padded_vocab_size == 50304
    assert GPT2Config.preset("tiny").padded_vocab_size == 256
    assert GPT2Config(1, 1, 4, 257, 8).padded_vocab_size == 384
    assert GPT2Config(1, 1, 4, 1, 8).padded_vocab_size == 128
    for name in ("small", "gpt2-medium", "gpt2-large", "gpt2-xl"):
        c = GPT2Config.preset(name)
        assert c.n_embd % c.n_head == 0 and c.head_size * c.n_head == c.n_embd
    assert GPT2Config.preset("gpt2-xl").n_embd == 1600


def test_gpt2_124m_parameter_count():
    c = GPT2Config.preset("gpt2")
    # 124,439,808 is GPT-2 small's published count; the 47 padded wte rows add 47 * 768.
    assert num_parameters(c) == 124_439_808 + (50304 - 50257) * 768


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_layer=0, n_head=2, n_embd=32, vocab_size=256, block_size=64), "n_layer must be positive"),
    (dict(n_layer=2, n_head=3, n_embd=32, vocab_size=256, block_size=64), "divisible by n_head"),
    (dict(n_layer=2, n_head=2, n_embd=32, vocab_size=-1, block_size=64), "vocab_size must be positive"),
    (dict(n_layer=2.0, n_head=2, n_embd=32, vocab_size=256, block_size=64), "n_layer must be an int"),
    (dict(n_layer=True, n_head=2, n_embd=32, vocab_size=256, block_size=64), "n_layer must be an int"),
])
def test_bad_configs_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPT2Config(**kwargs)


def test_unknown_preset_and_dict_round_trip():
    with pytest.raises(ValueError, match="unknown GPT-2 preset 'gpt3'"):
        GPT2Config.preset("gpt3")
    c = GPT2Config.preset("small")
    assert GPT2Config.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="missing keys"):
        GPT2Config.from_dict({"n_layer": 1})


def test_layout_order_and_shapes():
    c = GPT2Config.preset("tiny")
    shapes = param_shapes(c)
    assert tuple(shapes) == PARAM_NAMES
    L, C, Vp, T = 2, 32, 256, 64
    assert shapes == {"wte": (Vp, C), "wpe": (T, C), "ln1w": (L, C), "ln1b": (L, C),
                      "qkvw": (L, 3 * C, C), "qkvb": (L, 3 * C), "attprojw": (L, C, C),
                      "attprojb": (L, C), "ln2w": (L, C), "ln2b": (L, C), "fcw": (L, 4 * C, C),
                      "fcb": (L, 4 * C), "fcprojw": (L, C, 4 * C), "fcprojb": (L, C),
                      "lnfw": (C,), "lnfb": (C,)}
    assert num_parameters(c) == sum(math.prod(s) for s in shapes.values())


def test_arena_is_one_allocation_with_contiguous_views():
    c = GPT2Config(n_layer=3, n_head=2, n_embd=8, vocab_size=130, block_size=5)
    arena = ParamArena(c)
    assert arena.flat.dtype == np.float32 and arena.flat.size == num_parameters(c)
    assert arena.flat.ctypes.data % 64 == 0          # on a cache line, for the kernels
    offset = 0
    for name, shape in param_shapes(c).items():
        view = arena.views[name]
        assert view.shape == shape and np.shares_memory(view, arena.flat)
        assert view.__array_interface__["data"][0] == arena.flat.ctypes.data + 4 * offset
        offset += view.size
        assert getattr(arena, name) is view
    arena.qkvw[1, 2, 3] = 5.0
    assert arena.flat.sum() == 5.0
    arena.zero_()
    assert not arena.flat.any()
    with pytest.raises(AttributeError, match="no attribute or parameter 'nope'"):
        arena.nope


def test_arena_wraps_existing_buffer_and_rejects_bad_ones():
    c = GPT2Config.preset("tiny")
    buf = np.arange(num_parameters(c), dtype=np.float32)
    arena = ParamArena(c, flat=buf)
    assert arena.flat is buf and arena.wte[0, 1] == 1.0
    with pytest.raises(ValueError, match="float32"):
        ParamArena(c, flat=buf.astype(np.float64))
    with pytest.raises(ValueError, match=str(num_parameters(c))):
        ParamArena(c, flat=buf[:-1].copy())
    with pytest.raises(TypeError, match="GPT2Config"):
        ParamArena({"n_layer": 2})


def test_init_statistics_and_determinism():
    c = GPT2Config(n_layer=4, n_head=4, n_embd=64, vocab_size=1000, block_size=128)
    a = init_params_(ParamArena(c), seed=7)
    b = init_params_(ParamArena(c), seed=7)
    other = init_params_(ParamArena(c), seed=8)
    np.testing.assert_array_equal(a.flat, b.flat)
    assert not np.array_equal(a.flat, other.flat)
    for name in ("ln1w", "ln2w", "lnfw"):
        assert (a.views[name] == 1.0).all()
    for name in ("ln1b", "qkvb", "attprojb", "ln2b", "fcb", "fcprojb", "lnfb"):
        assert (a.views[name] == 0.0).all()
    assert not a.wte[c.vocab_size:].any(), "padded wte rows must be zero"
    residual = 0.02 / math.sqrt(2 * c.n_layer)
    for name, std in (("wte", 0.02), ("wpe", 0.02), ("qkvw", 0.02), ("fcw", 0.02),
                      ("attprojw", residual), ("fcprojw", residual)):
        w = a.views[name][:c.vocab_size] if name == "wte" else a.views[name]
        assert abs(w.mean()) < 0.1 * std
        assert abs(w.std() / std - 1) < 0.05, name
    # re-initialising overwrites everything, including earlier garbage
    a.flat[:] = 3.0
    init_params_(a, seed=7)
    np.testing.assert_array_equal(a.flat, b.flat)


def test_layer_major_arena_holds_each_block_in_one_run():
    c = GPT2Config(n_layer=3, n_head=2, n_embd=16, vocab_size=100, block_size=8)
    plain = init_params_(ParamArena(c), seed=5)
    plain.flat += np.arange(plain.flat.size, dtype=np.float32)     # every float distinct
    major = ParamArena(c, layer_major=True).copy_(plain)
    offsets = layer_major_offsets(c)
    for name, view in major.views.items():
        assert view.shape == plain.views[name].shape and np.shares_memory(view, major.flat)
        np.testing.assert_array_equal(view, plain.views[name])
    for (name, layer), (start, stop) in offsets.items():
        value = plain.views[name] if layer is None else plain.views[name][layer]
        np.testing.assert_array_equal(major.flat[start:stop], value.reshape(-1))
    # Block l is one run: ln1w[l] starts it, fcprojb[l] ends it, block l + 1 follows.
    for l in range(c.n_layer - 1):
        assert offsets["fcprojb", l][1] == offsets["ln1w", l + 1][0]
    assert offsets["lnfb", None][1] == num_parameters(c)
    np.testing.assert_array_equal(major.in_llmc_order().flat, plain.flat)
    assert plain.in_llmc_order() is plain
    back = ParamArena(c).copy_(major)
    np.testing.assert_array_equal(back.flat, plain.flat)
