"""kernels.loss against its naive twins, PyTorch and float64 finite differences; targets of
IGNORE_INDEX (-100) as PyTorch's ignore_index."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import loss

# (B, T, V, Vp): T=1, V=1, V not a multiple of 8 with padding, V with every kind of
# 16-lane tail (one vector and 1, 8 or 15 more), a vocabulary spanning several chunks
# of the online log-sum-exp, and GPT-2's padded vocabulary.
CASES = [(1, 1, 1, 1), (1, 1, 5, 8), (2, 3, 13, 16), (1, 2, 17, 17), (2, 1, 24, 32),
         (1, 3, 31, 40), (3, 5, 1000, 1003), (1, 3, 2500, 2560), (1, 2, 50257, 50304)]


def close(actual, expected, rtol, scale=0.0):
    """Each element within rtol of itself or of the largest reference magnitude (or of
    `scale`, for results that cancel to about 0)."""
    expected = np.asarray(expected, dtype=np.float64)
    np.testing.assert_allclose(actual, expected, rtol=rtol,
                               atol=rtol * max(np.abs(expected).max(initial=0.0), scale, 1e-30))


def make_case(rng, B, T, V, Vp, dtype=np.float32):
    logits = (rng.standard_normal((B, T, Vp)) * 3).astype(dtype)
    logits[..., V:] = 1e4  # padding must not leak into the softmax
    targets = rng.integers(0, V, size=(B, T)).astype(np.int32)
    targets.reshape(-1)[0] = V - 1
    return logits, targets


def run_forward(fn, logits, targets, V):
    shape = logits.shape[:-1]
    losses, lse = np.empty(shape, logits.dtype), np.empty(shape, logits.dtype)
    fn(losses, lse, logits, targets, V)
    return losses, lse


@pytest.mark.parametrize("B,T,V,Vp", CASES)
def test_matches_naive_and_torch(B, T, V, Vp, vector_lanes):
    rng = np.random.default_rng(1)
    logits, targets = make_case(rng, B, T, V, Vp)
    losses, lse = run_forward(loss.softmax_crossentropy_forward, logits, targets, V)
    losses_n, lse_n = run_forward(loss.softmax_crossentropy_forward_naive, logits, targets, V)
    close(losses, losses_n, 1e-5)
    close(lse, lse_n, 1e-5)

    tlogits = torch.tensor(logits[..., :V].reshape(-1, V), requires_grad=True)
    tloss = F.cross_entropy(tlogits, torch.tensor(targets.reshape(-1), dtype=torch.long),
                            reduction="none")
    close(losses.reshape(-1), tloss.detach().numpy(), 1e-5)
    close(lse.reshape(-1), torch.logsumexp(tlogits.detach().double(), -1).numpy(), 1e-5)

    dlosses = rng.uniform(0.1, 1.0, size=(B, T)).astype(np.float32)
    tloss.backward(torch.tensor(dlosses.reshape(-1)))
    dlogits0 = rng.standard_normal(logits.shape).astype(np.float32)
    dlogits = dlogits0.copy()
    loss.softmax_crossentropy_backward(dlogits, dlosses, logits, lse, targets, V)
    # Gradients are O(dlosses); with V = 1 they cancel to about 0.
    scale = float(dlosses.max())
    close((dlogits - dlogits0)[..., :V].reshape(-1, V), tlogits.grad.numpy(), 1e-4, scale)
    np.testing.assert_array_equal(dlogits[..., V:], dlogits0[..., V:])  # padding untouched
    dlogits_n = dlogits0.copy()
    loss.softmax_crossentropy_backward_naive(dlogits_n, dlosses, logits, lse, targets, V)
    close(dlogits, dlogits_n, 1e-5, scale)

    # In place over the logits: overwritten, not accumulated, padding zeroed.
    in_place = logits.copy()
    loss.softmax_crossentropy_backward(in_place, dlosses, in_place, lse, targets, V)
    close(in_place[..., :V].reshape(-1, V), tlogits.grad.numpy(), 1e-4, scale)
    np.testing.assert_array_equal(in_place[..., V:], 0.0)
    in_place_n = logits.copy()
    loss.softmax_crossentropy_backward_naive(in_place_n, dlosses, in_place_n, lse, targets, V)
    close(in_place, in_place_n, 1e-5, scale)

    # overwrite=True into another buffer: its old contents (NaN here) never read, the
    # same values as in place, the logits untouched.
    for fn in (loss.softmax_crossentropy_backward, loss.softmax_crossentropy_backward_naive):
        fresh = np.full_like(logits, np.nan)
        before = logits.copy()
        fn(fresh, dlosses, logits, lse, targets, V, overwrite=True)
        np.testing.assert_array_equal(fresh, in_place if fn is not loss.softmax_crossentropy_backward_naive
                                      else in_place_n)
        np.testing.assert_array_equal(logits, before)


@pytest.mark.parametrize("B,T,V,Vp", [(1, 1, 5, 8), (2, 3, 13, 16), (3, 5, 1000, 1003)])
def test_ignored_targets_as_torch_ignore_index(B, T, V, Vp, vector_lanes):
    """A row whose target is IGNORE_INDEX has loss 0 and gradient 0 (whatever its dlosses),
    the others are untouched by it: as F.cross_entropy(ignore_index=-100)."""
    assert loss.IGNORE_INDEX == -100
    rng = np.random.default_rng(11)
    logits, targets = make_case(rng, B, T, V, Vp)
    ignored = rng.random((B, T)) < 0.5
    ignored.reshape(-1)[0] = True
    targets[ignored] = loss.IGNORE_INDEX
    tlogits = torch.tensor(logits[..., :V].reshape(-1, V), requires_grad=True)
    tloss = F.cross_entropy(tlogits, torch.tensor(targets.reshape(-1), dtype=torch.long),
                            reduction="none", ignore_index=-100)
    dlosses = rng.uniform(0.1, 1.0, size=(B, T)).astype(np.float32)
    tloss.backward(torch.tensor(dlosses.reshape(-1)))
    expected = tlogits.grad.numpy().reshape(B, T, V)
    for n_threads in (1, 2):
        for fwd, bwd in ((loss.softmax_crossentropy_forward, loss.softmax_crossentropy_backward),
                         (loss.softmax_crossentropy_forward_naive,
                          loss.softmax_crossentropy_backward_naive)):
            losses, lse = np.empty((B, T), np.float32), np.empty((B, T), np.float32)
            fwd(losses, lse, logits, targets, V, n_threads=n_threads)
            np.testing.assert_array_equal(losses[ignored], 0.0)
            close(losses.reshape(-1), tloss.detach().numpy(), 1e-5)
            # added into: the ignored rows untouched, padding too
            dlogits0 = rng.standard_normal(logits.shape).astype(np.float32)
            dlogits = dlogits0.copy()
            bwd(dlogits, dlosses, logits, lse, targets, V, n_threads=n_threads)
            np.testing.assert_array_equal(dlogits[ignored], dlogits0[ignored])
            close((dlogits - dlogits0)[..., :V], expected, 1e-4, 1.0)
            # written (in place over the logits): the ignored rows 0, padding 0
            in_place = logits.copy()
            bwd(in_place, dlosses, in_place, lse, targets, V, n_threads=n_threads)
            np.testing.assert_array_equal(in_place[ignored], 0.0)
            np.testing.assert_array_equal(in_place[..., V:], 0.0)
            close(in_place[..., :V], expected, 1e-4, 1.0)


def test_rows_layout_and_extreme_logits(vector_lanes):
    rng = np.random.default_rng(2)
    logits, targets = make_case(rng, 1, 4, 300, 304)
    logits[0, 0, :300] = -1e30          # all equal, hugely negative
    logits[0, 1, 7] = 80.0              # one dominant logit
    logits[0, 2, :150] = -200.0         # exp underflows for half the row
    logits[0, 3, 299] = 200.0
    losses, lse = run_forward(loss.softmax_crossentropy_forward, logits.reshape(4, 304),
                              targets.reshape(4), 300)
    ref = F.cross_entropy(torch.tensor(logits[0, :, :300]).double(),
                          torch.tensor(targets[0], dtype=torch.long), reduction="none").numpy()
    close(losses, ref, 1e-5)
    assert np.all(np.isfinite(lse))


def test_rows_with_masked_logits(vector_lanes):
    # Logits masked to -inf (a constrained vocabulary): whole leading chunks of the
    # online log-sum-exp hold nothing but -inf, then finite values follow.
    rng = np.random.default_rng(8)
    V, Vp = 3000, 3008
    logits = rng.standard_normal((4, Vp)).astype(np.float32)
    logits[0, :2000] = -np.inf                        # two whole chunks, then some
    logits[1, :1024] = -np.inf                        # exactly the first chunk
    logits[2, ::2] = -np.inf                          # every other logit
    logits[3, 1:] = -np.inf                           # a single finite logit
    targets = np.array([2500, 2000, 1, 0], np.int32)
    losses, lse = run_forward(loss.softmax_crossentropy_forward, logits, targets, V)
    tlogits = torch.tensor(logits[:, :V], requires_grad=True)
    tloss = F.cross_entropy(tlogits, torch.tensor(targets, dtype=torch.long), reduction="none")
    close(losses, tloss.detach().numpy(), 1e-5, scale=1.0)
    close(lse, torch.logsumexp(tlogits.detach().double(), -1).numpy(), 1e-6)
    dlosses = np.ones(4, np.float32)
    tloss.backward(torch.tensor(dlosses))
    dlogits = np.zeros_like(logits)
    loss.softmax_crossentropy_backward(dlogits, dlosses, logits, lse, targets, V)
    close(dlogits[:, :V], tlogits.grad.numpy(), 1e-4, scale=1.0)


@pytest.mark.parametrize("offset", [-3e4, 6e4, 7e4, -1.2e5, 3e6])
def test_logits_far_from_zero(offset, vector_lanes):
    # The sums take x log2(e) - hi in one FMA up to |max| = 2^16 (65536) and
    # (x - max) log2(e) past it; both keep the log-sum-exp to float precision.
    rng = np.random.default_rng(9)
    V = 5000
    logits = (offset + rng.standard_normal((3, V)) * np.float32(4)).astype(np.float32)
    targets = rng.integers(0, V, 3).astype(np.int32)
    losses, lse = run_forward(loss.softmax_crossentropy_forward, logits, targets, V)
    ref = torch.logsumexp(torch.tensor(logits).double(), -1).numpy()
    assert np.all(np.abs(lse - ref) <= np.spacing(np.abs(ref).astype(np.float32)))
    # the loss (about 18 here) is max - x[target], exact, plus log(sum): within 2 ulps
    exact = ref - logits[np.arange(3), targets].astype(np.float64)
    assert np.all(np.abs(losses - exact) <= 2 * np.spacing(exact.astype(np.float32)))


def test_rows_whose_max_rises_across_chunks(vector_lanes):
    # The forward's online log-sum-exp runs over chunks of 1024 logits, rescaling the
    # sum whenever a chunk raises the running max; these rows move that max in every
    # way a chunk can, from small rises to jumps far past exp's range.
    rng = np.random.default_rng(6)
    V, Vp = 5000, 5008
    logits = (rng.standard_normal((7, Vp)) * 2).astype(np.float32)
    logits[:, V:] = 1e4
    logits[0, :V] = np.linspace(-50.0, 50.0, V)       # a rise in every chunk
    logits[1, 2500] = 300.0                           # far above all before it
    logits[2, 0] = -1e30                              # the first reference far below
    logits[3, 1500:] += 60.0                          # a step up in the second chunk
    logits[4, 1500:] += 70.0                          # a larger one
    logits[5, :V] = -1e30                             # all equal, hugely negative
    logits[5, 4999] = 0.0
    targets = rng.integers(0, V, 7).astype(np.int32)
    losses, lse = run_forward(loss.softmax_crossentropy_forward, logits[:6], targets[:6], V)
    ref = torch.logsumexp(torch.tensor(logits[:6, :V]).double(), -1).numpy()
    close(lse, ref, 1e-6)
    close(losses, ref - logits[np.arange(6), targets[:6]], 1e-5, scale=1.0)
    # a NaN logit in a later chunk makes a NaN loss
    logits[6, 3333] = np.nan
    losses, lse = run_forward(loss.softmax_crossentropy_forward, logits[6:], targets[6:], V)
    assert np.isnan(losses[0]) and np.isnan(lse[0])


def test_backward_finite_differences():
    rng = np.random.default_rng(3)
    B, T, V, Vp = 2, 3, 7, 9
    logits, targets = make_case(rng, B, T, V, Vp, dtype=np.float64)
    probe = rng.uniform(0.5, 1.5, size=(B, T))

    def objective():
        losses, _ = run_forward(loss.softmax_crossentropy_forward_naive, logits, targets, V)
        return float((losses * probe).sum())

    _, lse = run_forward(loss.softmax_crossentropy_forward_naive, logits, targets, V)
    grad = np.zeros_like(logits)
    loss.softmax_crossentropy_backward_naive(grad, probe, logits, lse, targets, V)
    h = 1e-6
    for idx in np.ndindex(*logits.shape):
        orig = logits[idx]
        logits[idx] = orig + h
        plus = objective()
        logits[idx] = orig - h
        minus = objective()
        logits[idx] = orig
        numeric = (plus - minus) / (2 * h)
        assert abs(grad[idx] - numeric) <= 1e-6 * max(1.0, abs(numeric)), (idx, grad[idx], numeric)
    np.testing.assert_array_equal(grad[..., V:], 0.0)


def test_one_and_two_threads_give_identical_results(vector_lanes):
    rng = np.random.default_rng(4)
    logits, targets = make_case(rng, 3, 7, 3001, 3008)
    dlosses = np.full((3, 7), 1 / 21, np.float32)
    results = []
    for n_threads in (1, 2):
        losses, lse = np.empty((3, 7), np.float32), np.empty((3, 7), np.float32)
        loss.softmax_crossentropy_forward(losses, lse, logits, targets, 3001, n_threads=n_threads)
        dlogits = np.zeros_like(logits)
        loss.softmax_crossentropy_backward(dlogits, dlosses, logits, lse, targets, 3001,
                                           n_threads=n_threads)
        results.append((losses, lse, dlogits))
    for one, two in zip(*results):
        np.testing.assert_array_equal(one, two)


def test_a_row_gives_the_same_bits_paired_or_alone(vector_lanes):
    # The forward reads rows in pairs (the last alone when there are an odd number);
    # each row's loss must not depend on its partner.  Partners here differ in how
    # their sums run: one far past 2^16 (x - max first), one with a masked first
    # chunk, tails of every length.
    rng = np.random.default_rng(10)
    for V, Vp in ((3001, 3008), (2063, 2080), (16, 16), (1030, 1032)):
        logits = (rng.standard_normal((7, Vp)) * 3).astype(np.float32)
        logits[1, :V] += 1e5
        logits[2, :min(V, 1024)] = -np.inf
        logits[2, V - 1] = 0.5
        targets = rng.integers(0, V, 7).astype(np.int32)
        targets[2] = V - 1
        together = run_forward(loss.softmax_crossentropy_forward, logits, targets, V)
        for r in range(7):
            alone = run_forward(loss.softmax_crossentropy_forward, logits[r:r + 1], targets[r:r + 1], V)
            for both, one in zip(together, alone):
                np.testing.assert_array_equal(both[r:r + 1], one)
        # and starting the pairs one row later pairs every row with another partner
        shifted = run_forward(loss.softmax_crossentropy_forward, logits[1:], targets[1:], V)
        for both, one in zip(together, shifted):
            np.testing.assert_array_equal(both[1:], one)


def test_targets_checked_at_the_boundary():
    rng = np.random.default_rng(5)
    logits, targets = make_case(rng, 2, 3, 10, 16)
    losses, lse = run_forward(loss.softmax_crossentropy_forward, logits, targets, 10)
    for bad, ok in ((10, 9), (-1, 0), (-99, -100), (-101, -100)):
        targets[1, 1] = ok
        run_forward(loss.softmax_crossentropy_forward, logits, targets, 10)
        targets[1, 1] = bad
        with pytest.raises(ValueError, match=r"targets must lie in \[0, V=10\)"):
            run_forward(loss.softmax_crossentropy_forward, logits, targets, 10)
        with pytest.raises(ValueError, match="targets"):
            loss.softmax_crossentropy_backward(np.zeros_like(logits), losses, logits, lse,
                                               targets, 10)
        with pytest.raises(ValueError, match="targets"):
            run_forward(loss.softmax_crossentropy_forward_naive, logits, targets, 10)


def test_rejects_bad_arguments():
    rng = np.random.default_rng(6)
    logits, targets = make_case(rng, 2, 3, 10, 16)
    losses, lse = run_forward(loss.softmax_crossentropy_forward, logits, targets, 10)
    fwd = loss.softmax_crossentropy_forward
    for V in (0, 17, 3.0, True):
        with pytest.raises(ValueError, match="V must be"):
            fwd(losses, lse, logits, targets, V)
    with pytest.raises(TypeError, match="targets"):
        fwd(losses, lse, logits, targets.astype(np.int64), 10)
    with pytest.raises(TypeError, match="logits"):
        fwd(losses, lse, logits.astype(np.float64), targets, 10)
    with pytest.raises(ValueError, match="losses"):
        fwd(losses.reshape(-1), lse, logits, targets, 10)
    with pytest.raises(ValueError, match="C-contiguous"):
        fwd(losses, lse, logits[:, ::2], targets[:, ::2].copy(), 10)
    with pytest.raises(ValueError, match="targets"):
        fwd(losses, lse, logits, targets[:, :2].copy(), 10)
    with pytest.raises(ValueError, match="logits"):
        fwd(losses, lse, logits.reshape(-1), targets, 10)
    bwd = loss.softmax_crossentropy_backward
    with pytest.raises(ValueError, match="dlogits"):
        bwd(np.zeros((2, 3, 10), np.float32), losses, logits, lse, targets, 10)
    with pytest.raises(ValueError, match="dlosses"):
        bwd(np.zeros_like(logits), losses[:1], logits, lse, targets, 10)
    shifted = np.zeros(logits.size + 1, np.float32)
    with pytest.raises(ValueError, match="overlap"):
        bwd(shifted[1:].reshape(logits.shape), losses, shifted[:-1].reshape(logits.shape),
            lse, targets, 10)
