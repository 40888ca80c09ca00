"""adtape.profile(): per-op calls and self times, rules restored after the block, one
profile at a time.  The clock is replaced by a counter, so the times are exact."""
import numpy as np
import pytest

import adtape as ad
from adtape import _graph, nn, profiling
from gpt2.config import GPT2Config
from gpt2.model import GPT2


@pytest.fixture
def ticks(monkeypatch):
    """A clock that advances one second per reading."""
    now = [0.0]

    def clock():
        now[0] += 1.0
        return now[0]
    monkeypatch.setattr(profiling, "_clock", clock)
    return now


def _square():
    sq = ad.primitive(lambda x: x * x)
    sq.name = "square"
    ad.defvjp(sq, lambda g, ans, x: 2 * x * g)
    return sq


def test_calls_and_self_times_per_phase(ticks):
    sq = _square()
    x = ad.Tensor(np.arange(3.0), requires_grad=True)
    with ad.profile() as prof:                       # reads the clock: 1
        for _ in range(3):
            ad.sum(sq(x)).backward()
    # Each recording reads the clock once: a forward is one second after the event
    # before it; each reverse rule reads it twice, a second apart.
    assert prof.stats[("square", "fwd")] == [3, 3.0]
    assert prof.stats[("sum", "fwd")] == [3, 3.0]
    assert prof.stats[("square", "bwd")] == [3, 3.0]
    assert prof.stats[("sum", "bwd")] == [3, 3.0]
    np.testing.assert_array_equal(x.grad, 3 * 2 * np.arange(3.0))
    assert prof.seconds == 12.0
    text = prof.table(total=24.0)
    assert "square fwd" in text and "(not in ops)" in text and "50.0%" in text


def test_timed_calls_are_charged_without_what_they_record(ticks):
    sq = _square()
    x = ad.Tensor(np.arange(3.0), requires_grad=True)

    class Box:
        def step(self):
            return ad.sum(sq(x))
    box = Box()
    with ad.profile() as prof:                       # 1
        prof.time(box, "step", "box step")
        loss = box.step()                            # starts at 2; records at 3, 4; ends at 5
        loss.backward()                              # sum 6-7, square 8-9
    assert prof.stats[("box step", "call")] == [1, 1.0]
    assert prof.stats[("square", "fwd")] == [1, 1.0]
    assert prof.stats[("sum", "fwd")] == [1, 1.0]
    assert prof.stats[("sum", "bwd")] == [1, 1.0]
    assert prof.stats[("square", "bwd")] == [1, 1.0]


def test_rules_and_methods_are_restored_even_after_an_error():
    sq = _square()
    before = (sq.vjps, nn.LINEAR.bwd_acc, _graph.set_record_hook(_graph.set_record_hook(None)))

    class Box:
        def step(self):
            return "stepped"
    box = Box()
    with pytest.raises(ZeroDivisionError):
        with ad.profile() as prof:
            prof.time(box, "step", "box step")
            assert box.step() == "stepped"
            assert sq.vjps is not before[0]
            1 / 0
    assert (sq.vjps, nn.LINEAR.bwd_acc, _graph.set_record_hook(_graph.set_record_hook(None))) == before
    assert "step" not in vars(box)
    assert prof.stats[("box step", "call")][0] == 1


def test_one_profile_at_a_time():
    with ad.profile():
        with pytest.raises(RuntimeError, match="already active"):
            with ad.profile():
                pass
    with ad.profile():              # released after the first
        pass


def test_a_training_step_shows_its_kernel_ops():
    model = GPT2(GPT2Config.preset("tiny"), seed=0)
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, 256, (2, 16), dtype=np.int32)
    targets = rng.integers(0, 256, (2, 16), dtype=np.int32)
    with ad.profile() as prof:
        prof.time(model.state, "adamw", "adamw", "step")
        loss, _ = model.train_step(inputs, targets, 1e-3)
    calls = {key: c for key, (c, _) in prof.stats.items()}
    n_layer = model.config.n_layer
    assert calls[("layernorm", "fwd")] == calls[("layernorm", "bwd")] == 2 * n_layer + 1
    assert calls[("softmax_cross_entropy", "fwd")] == 1
    assert calls[("adamw", "step")] == 1
    assert all(s >= 0 for _, s in prof.stats.values())
    model.close()
    assert np.isfinite(loss)
