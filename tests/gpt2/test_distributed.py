"""Data-parallel training over MPI (gpt2.distributed) and the reverse sweep's grad-final hook.

The MPI tests run ``mpiexec -n 2`` on this machine (loopback) with tests/gpt2/mpi_dp_worker.py
and compare with one process on the whole batch; they need the ``mpi`` extra
(``pip install '.[mpi]'``) and never skip.
"""
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import gpt2
from adtape import Tensor
from adtape.checkpointing import checkpoint
from gpt2 import checkpoint as ckpt
from gpt2 import distributed
from gpt2.model import GPT2

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "mpi_dp_worker.py"
_spec = importlib.util.spec_from_file_location("dp_reference", HERE / "dp_reference.py")
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

RANKS = 2
TIMEOUT = 60
# A failure must bring every rank down this fast (a hang would run into TIMEOUT).
EXIT_WITHIN = 15.0


def mpiexec():
    path = shutil.which("mpiexec")
    assert path, "mpiexec not found: install the mpi extra (pip install '.[mpi]')"
    return path


def run_ranks(*args, tmp_path, ranks=RANKS):
    """Run the worker on ``ranks`` ranks; (completed process, rank 0's JSON or None, seconds)."""
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(pathlib.Path(gpt2.__file__).parent.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    start = time.time()
    proc = subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, str(WORKER), *args[:1],
                           str(out), *map(str, args[1:])],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)
    elapsed = time.time() - start
    result = json.loads(out.read_text()) if out.exists() else None
    return proc, result, elapsed


def relative_error(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


# -- the hook the data-parallel trainer launches its buckets from -------------------------

def test_grad_hook_counts_down_to_the_last_contribution():
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal(4))
    w1 = Tensor(rng.standard_normal(4), requires_grad=True)
    w2 = Tensor(rng.standard_normal(4), requires_grad=True)
    seen = []
    for w, name in ((w1, "w1"), (w2, "w2")):
        w.register_grad_hook(lambda leaf, remaining, name=name: seen.append(
            (name, remaining, np.copy(w1.grad), np.copy(w2.grad))))
    # w1 is read by the first and the last op: it is final only when the sweep is over;
    # w2, read by the middle op only, is final one node earlier.
    ((x * w1) * w2 * w1).sum().backward()
    assert [s[:2] for s in seen] == [("w1", 1), ("w2", 0), ("w1", 0)]
    x_, a, b = x.data, w1.data, w2.data
    np.testing.assert_allclose(w1.grad, 2 * x_ * a * b, rtol=1e-12)
    np.testing.assert_allclose(w2.grad, x_ * a * a, rtol=1e-12)
    # After the last op's pullback w1 holds that op's half of its gradient.
    np.testing.assert_allclose(seen[0][2], x_ * a * b, rtol=1e-12)
    assert np.array_equal(seen[1][3], w2.grad)
    assert np.array_equal(seen[2][2], w1.grad)


def test_grad_hook_can_divert_the_contributions_still_to_come():
    w = Tensor(np.full(3, 2.0), requires_grad=True)
    x = Tensor(np.arange(3.0))
    aside = np.zeros(3)
    kept = {}

    def divert(leaf, remaining):
        if remaining == 1:
            kept["first"] = leaf.grad
            leaf.grad = aside
        elif remaining == 0:
            leaf.grad = kept["first"]
    w.register_grad_hook(divert)
    ((x * w) * w).sum().backward()
    # The last op's pullback (first recorded: x * w) went to `aside`, the other stayed.
    np.testing.assert_array_equal(aside, x.data * w.data)
    np.testing.assert_array_equal(w.grad, x.data * w.data)


def test_grad_hook_on_a_leaf_nothing_flows_into_sees_zeros():
    w = Tensor(np.ones(3), requires_grad=True)
    dead = Tensor(np.ones(3), requires_grad=True)
    dead.grad = np.full(3, 7.0)             # stale values that a deferred zero hides
    dead.zero_grad(deferred=True)
    seen = []
    dead.register_grad_hook(lambda leaf, remaining: seen.append((remaining, leaf.grad.copy())))
    w.register_grad_hook(lambda leaf, remaining: seen.append("w")).remove()
    dead * 2.0                              # recorded in the same graph, but a dead branch
    (w * 3.0).sum().backward()
    assert len(seen) == 1 and seen[0][0] == 0 and np.array_equal(seen[0][1], np.zeros(3))
    with pytest.raises(RuntimeError, match="leaf tensor"):
        (w * 3.0).register_grad_hook(print)


def test_grad_hook_inside_checkpointed_block():
    w = Tensor(np.full(3, 2.0), requires_grad=True)
    x = Tensor(np.arange(3.0), requires_grad=True)
    seen = []
    w.register_grad_hook(lambda leaf, remaining: seen.append((remaining, leaf.grad.copy())))
    y = checkpoint(lambda a: (a * w) * w, x)
    y.sum().backward()
    assert [s[0] for s in seen] == [1, 0]
    np.testing.assert_array_equal(seen[-1][1], 2 * x.data * w.data)


# -- data parallelism over mpiexec -n 2 -----------------------------------------------------

@pytest.fixture(scope="module")
def two_rank_losses(tmp_path_factory):
    proc, result, _ = run_ranks("losses", tmp_path=tmp_path_factory.mktemp("losses"))
    assert proc.returncode == 0, proc.stderr
    return result


@pytest.mark.parametrize("engine", ["tape", "manual"])
@pytest.mark.parametrize("zero", [0, 1])
def test_two_ranks_match_one_process(two_rank_losses, engine, zero):
    got = two_rank_losses[f"{engine}/{zero}"]
    losses, norms, model = ref.single_process(engine)
    model.close()
    assert len(got["losses"]) == ref.STEPS
    assert relative_error(got["losses"], losses) < 1e-6
    # The clipping is active and uses the norm of the averaged gradient.
    assert min(norms) > ref.GRAD_CLIP
    assert relative_error(got["norms"], norms) < 1e-6
    assert got["params_equal_across_ranks"]
    assert got["buckets"] > 4
    # The tape's hooks launch every bucket during the backward; the manual engine has none.
    assert got["buckets_in_backward"] == (got["buckets"] if engine == "tape" else 0)
    # The tape engine sums the encoder's rows of the tied wte apart (see _wte_hook).
    assert got["wte_rows_apart"] == (engine == "tape")


def test_buckets_are_launched_as_the_sweep_leaves_them(tmp_path):
    """Each bucket is launched while the blocks below it are still being differentiated:
    in reverse arena order, and all but those holding wte, wpe or block 0 (the leaves the
    sweep finishes last) before the sweep has made any of block 0 final."""
    proc, got, _ = run_ranks("sweep_order", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    launches, last = got["launches"], got["last_leaves"]
    wte_start, wte_stop = got["wte"]
    # The buckets inside wte go first, when the LM head has added its part (_wte_hook).
    at_head = [l for l in launches if l[1] <= wte_stop]
    assert at_head == launches[:len(at_head)] and all(l[2] == 0 for l in at_head)
    rest = launches[len(at_head):]
    # The lower a bucket lies, the more of the sweep it waits for; a kernel makes at most
    # two leaves final (a weight and its bias), whose buckets may go in either order.
    finals = [l[2] for l in sorted(rest, reverse=True)]
    assert all(upper <= lower + 1 for upper, lower in zip(finals, finals[1:])), finals
    early = [l for l in rest
             if not any(start < l[1] and l[0] < stop for start, stop in last)]
    before_block0 = got["leaves"] - len(last)
    assert all(finals <= before_block0 for _, _, finals in early)
    # Most buckets: 3 of the 4 blocks, and their buckets outnumber block 0's and wpe's.
    assert len(early) >= 2 * (len(rest) - len(early))


def test_zero1_shards_the_optimizer_state(two_rank_losses):
    n = sum(v.size for v in GPT2(ref.CONFIG).params.views.values())
    full, sharded = two_rank_losses["tape/0"], two_rank_losses["tape/1"]
    assert full["adam_m"] == full["adam_v"] == n and full["model_moments"]
    assert sharded["adam_m"] == sharded["adam_v"] == sharded["params_padded"] // RANKS
    assert sharded["params_padded"] - n < RANKS * 16
    assert not sharded["model_moments"]


def test_checkpoints_move_between_rank_counts(tmp_path):
    losses, _, model = ref.single_process("tape")
    model.close()
    half = ref.STEPS // 2
    _, _, single = ref.single_process("tape", steps=half)
    ckpt.save_checkpoint(tmp_path / "single.bin", single.params, step=half,
                         adam_m=single.adam_m, adam_v=single.adam_v,
                         adam_step=single.adam_step, data_state={"position": half})
    proc, got, _ = run_ranks("checkpoints", tmp_path, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert relative_error(got["first"], losses[:half]) < 1e-6
    for name in ("resume_zero0", "resume_single_zero1"):
        assert got[name]["step"] == half and got[name]["data_state"] == {"position": half}
        assert relative_error(got[name]["losses"], losses[half:]) < 1e-6
    assert "missing.bin" in got["missing"]
    # Written at 2 ranks under ZeRO-1 (moments gathered from the shards), read by one process.
    state = ckpt.load_checkpoint(tmp_path / "two_ranks.bin", ref.CONFIG)
    assert state.extra == {"ranks": RANKS, "zero": 1}
    np.testing.assert_allclose(state.adam_v.flat, single.adam_v.flat, rtol=1e-4, atol=1e-12)
    np.testing.assert_allclose(state.adam_m.flat, single.adam_m.flat, rtol=1e-3, atol=1e-9)
    resumed = GPT2(ref.CONFIG, seed=ref.SEED + 1, engine="tape")
    resumed.params.copy_(state.params)
    resumed.adam_m.copy_(state.adam_m)
    resumed.adam_v.copy_(state.adam_v)
    resumed.adam_step = state.adam_step
    tail, _, resumed = ref.single_process("tape", model=resumed)
    resumed.close()
    single.close()
    assert relative_error(tail, losses[half:]) < 1e-6


ERROR_LINE = ("error: rank 1 of 2: ValueError: a deliberate failure in the test; "
              "aborting all ranks")


def _failure_time(stderr):
    match = re.search(r"failing at ([0-9.]+)", stderr)
    assert match, stderr
    return float(match.group(1))


def _error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _worker_alive(pid):
    """Whether ``pid`` is still a worker (a zombie's cmdline is empty)."""
    try:
        return WORKER.name.encode() in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def assert_every_rank_ended(proc, tmp_path):
    """mpiexec returned, and each rank (its id written by the worker beside result.json)
    is gone, within EXIT_WITHIN seconds of the failure."""
    ended = time.time()
    failed = _failure_time(proc.stderr)
    assert ended - failed < EXIT_WITHIN
    pids = [int((tmp_path / f"result.json.rank{r}.pid").read_text()) for r in range(RANKS)]
    while any(map(_worker_alive, pids)) and time.time() < failed + EXIT_WITHIN:
        time.sleep(0.05)
    assert not [pid for pid in pids if _worker_alive(pid)]


def test_a_raising_rank_stops_every_rank(tmp_path):
    """The failing rank's error is one line on stderr, neither its traceback nor MPICH's
    own abort message, and reaches it before MPI_Abort tears the job down."""
    proc, _, _ = run_ranks("raise", tmp_path=tmp_path)
    assert proc.returncode != 0
    assert_every_rank_ended(proc, tmp_path)
    assert _error_lines(proc.stderr) == [ERROR_LINE], proc.stderr
    assert "Traceback" not in proc.stderr and "MPI_Abort" not in proc.stderr, proc.stderr


def test_a_raising_rank_shows_its_traceback_with_debug(tmp_path):
    proc, _, _ = run_ranks("raise-debug", tmp_path=tmp_path)
    assert proc.returncode != 0
    assert_every_rank_ended(proc, tmp_path)
    assert _error_lines(proc.stderr) == [ERROR_LINE], proc.stderr
    assert f"{ERROR_LINE}\nrank 1 of 2: Traceback (most recent call last):\n" in proc.stderr
    assert 'raise ValueError("a deliberate failure in the test")' in proc.stderr
    assert "\nValueError: a deliberate failure in the test\n" in proc.stderr


def test_a_killed_rank_stops_every_rank(tmp_path):
    proc, _, _ = run_ranks("kill", tmp_path=tmp_path)
    assert proc.returncode != 0
    assert "Killed" in proc.stdout + proc.stderr
    assert_every_rank_ended(proc, tmp_path)


@pytest.mark.parametrize("what, message", [
    ("seq_len", "different settings: T: rank 0 has 16, rank 1 has 32"),
    ("model", "different settings: model n_layer: rank 0 has 2, rank 1 has 3"),
    ("batch", "global batch size B=3 is not divisible by the 2 ranks"),
])
def test_disagreeing_ranks_fail_with_one_message(tmp_path, what, message):
    proc, _, _ = run_ranks(what, tmp_path=tmp_path)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert proc.stderr.count("error:") == 1, proc.stderr


def test_bucket_layout_round_trips_shards():
    layout = distributed.BucketLayout(1000, 3, bucket_bytes=4 * 100)
    assert layout.padded % (3 * 16) == 0 and layout.padded >= 1000
    assert all((stop - start) % 3 == 0 for start, stop in layout.bounds)
    assert layout.bounds[0][0] == 0 and layout.bounds[-1][1] == layout.padded
    flat = np.arange(1000, dtype=np.float32)
    shards = layout.full_to_shards(flat)
    assert shards.shape == (3, layout.padded // 3)
    np.testing.assert_array_equal(layout.shard_to_full(shards), flat)
    # Rank r's part of each bucket is the r-th third of that bucket.
    (start, stop), part = layout.bounds[1], layout.parts[1]
    np.testing.assert_array_equal(shards[2, layout.shard_offsets[1]:][:part],
                                  flat[start + 2 * part:start + 3 * part])


@pytest.mark.parametrize("ranks", [2, 3])
def test_encoder_rows_land_in_each_ranks_shard(ranks):
    """Under ZeRO-1 each rank adds the encoder's rows of wte to its parts of the buckets,
    which start and end inside rows (parts of 16 floats, rows of 24)."""
    import types
    V, C, n = 40, 24, 1500
    layout = distributed.BucketLayout(n, ranks, bucket_bytes=4 * 16 * ranks * 5, cuts=(V * C,))
    rng = np.random.default_rng(0)
    rows = np.unique(rng.integers(0, V, 30))
    values = rng.standard_normal((rows.size, C)).astype(np.float32)
    dense = np.zeros(n, np.float32)
    dense[:V * C].reshape(V, C)[rows] = values
    expected = layout.full_to_shards(dense)
    for rank in range(ranks):
        trainer = types.SimpleNamespace(
            _batch_rows=rows, _encoder_rows=values, zero=1, rank=rank, layout=layout,
            shard_grad=np.zeros(layout.shard_size, np.float32),
            model=types.SimpleNamespace(grads=types.SimpleNamespace(wte=dense[:V * C])))
        distributed.DataParallelTrainer._add_encoder_rows(trainer)
        np.testing.assert_array_equal(trainer.shard_grad, expected[rank])


def test_launcher_environment_is_read():
    assert distributed.launched_ranks({}) == 1
    assert distributed.launched_ranks({"PMI_SIZE": "4"}) == 4
    assert distributed.launched_ranks({"OMPI_COMM_WORLD_SIZE": "3"}) == 3
    assert distributed.local_ranks({"MPI_LOCALNRANKS": "2"}) == 2


# -- gpt2-train under mpiexec ---------------------------------------------------------------

TRAIN_ARGS = ["-B", "4", "-T", "32", "--corpus-bytes", "100K",
              "--schedule", "constant", "--warmup", "0", "--eval-interval", "0",
              "--sample-tokens", "0", "--no-progress"]


def run_train(args, out_dir, ranks=None, model="tiny"):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(pathlib.Path(gpt2.__file__).parent.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "gpt2.train", "--model", model, *TRAIN_ARGS, *args,
               "--out-dir", str(out_dir)]
    if ranks:
        command = [mpiexec(), "-n", str(ranks), *command]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def logged_losses(out_dir):
    lines = (out_dir / "log.csv").read_text().splitlines()
    column = lines[0].split(",").index("loss")
    return [float(line.split(",")[column]) for line in lines[1:]]


@pytest.mark.parametrize("model, family", [("tiny", "GPT-2"), ("llama-tiny", "Llama")])
def test_gpt2_train_under_mpiexec(tmp_path, model, family):
    """2 ranks x B/2 train as 1 process x B over 10 steps, with and without --zero 1, and
    a 2-rank checkpoint resumes in one process."""
    one, plain, two, resumed = (tmp_path / name for name in ("one", "plain", "two", "resumed"))
    proc = run_train(["--steps", "10"], one, model=model)
    assert proc.returncode == 0, proc.stderr
    proc = run_train(["--steps", "10"], plain, ranks=RANKS, model=model)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((plain / "summary.json").read_text())["zero"] == 0
    assert relative_error(logged_losses(plain), logged_losses(one)) < 1e-6
    proc = run_train(["--steps", "5", "--zero", "1"], two, ranks=RANKS, model=model)
    assert proc.returncode == 0, proc.stderr
    # Rank 0 alone prints and writes.
    assert proc.stdout.count("data parallel: 2 ranks") == 1
    assert proc.stdout.count(f"{family} preset {model}") == 1
    summary = json.loads((two / "summary.json").read_text())
    assert (summary["ranks"], summary["global_batch"], summary["zero"]) == (RANKS, 4, 1)
    assert relative_error(logged_losses(two), logged_losses(one)[:5]) < 1e-6
    # The 2-rank checkpoint resumes in one process where the 2-rank run stopped.
    proc = run_train(["--steps", "10", "--resume", str(two / "checkpoint.bin")], resumed,
                     model=model)
    assert proc.returncode == 0, proc.stderr
    # Its log.csv holds the whole run: the 2-rank steps, then the resumed ones.
    assert logged_losses(resumed)[:5] == logged_losses(two)
    assert relative_error(logged_losses(resumed)[5:], logged_losses(one)[5:]) < 1e-6


def test_gpt2_train_refuses_a_batch_the_ranks_do_not_divide(tmp_path):
    proc = run_train(["--steps", "2", "-B", "3"], tmp_path, ranks=RANKS)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: the global batch size B=3 is not divisible by "
                                   "the 2 ranks: use a multiple of 2")


@pytest.mark.parametrize("zero", ["0", "1"])
def test_offloaded_moments_under_mpiexec_train_bit_identically(tmp_path, zero):
    """--offload moments over 2 ranks (each rank its shard under --zero 1) gives the
    in-memory run's losses to the bit over 50 steps; its checkpoint is the in-memory
    run's, and resumes in one process."""
    spill = tmp_path / "spill"
    spill.mkdir()
    memory, offloaded = tmp_path / "memory", tmp_path / "offloaded"
    common = ["--steps", "50", "--zero", zero, "--grad-clip", "1.0"]
    proc = run_train(common, memory, ranks=RANKS)
    assert proc.returncode == 0, proc.stderr
    proc = run_train(common + ["--offload", "moments", "--spill-dir", str(spill)], offloaded,
                     ranks=RANKS)
    assert proc.returncode == 0, proc.stderr
    assert logged_losses(offloaded) == logged_losses(memory)
    from gpt2.checkpoint import load_checkpoint
    a, b = (load_checkpoint(d / "checkpoint.bin") for d in (memory, offloaded))
    for name in ("params", "adam_m", "adam_v"):
        assert np.array_equal(getattr(a, name).flat, getattr(b, name).flat), name
    assert os.listdir(spill) == []
    proc = run_train(["--steps", "52", "--resume", str(offloaded / "checkpoint.bin"),
                      "--offload", "moments", "--spill-dir", str(spill)], tmp_path / "resumed")
    assert proc.returncode == 0, proc.stderr
    proc = run_train(["--steps", "52", "--resume", str(memory / "checkpoint.bin")],
                     tmp_path / "resumed-memory")
    assert proc.returncode == 0, proc.stderr
    assert logged_losses(tmp_path / "resumed") == logged_losses(tmp_path / "resumed-memory")


# -- --grad-accum under mpiexec ---------------------------------------------------------------

@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_grad_accum_under_mpiexec_gives_the_one_process_curve(tmp_path, model):
    """2 ranks x 2 micro-batches of 2 (and ZeRO-1 x 4 of 1) train as one process on B=8."""
    one = tmp_path / "one"
    proc = run_train(["--steps", "4", "-B", "8"], one, model=model)
    assert proc.returncode == 0, proc.stderr
    for n, zero in (("2", "0"), ("4", "1")):
        out = tmp_path / f"accum{n}"
        proc = run_train(["--steps", "4", "-B", "8", "--grad-accum", n, "--zero", zero], out,
                         ranks=RANKS, model=model)
        assert proc.returncode == 0, proc.stderr
        assert json.loads((out / "summary.json").read_text())["grad_accum"] == int(n)
        assert relative_error(logged_losses(out), logged_losses(one)) < 1e-6


def test_grad_accum_under_mpiexec_refuses_micro_batches_the_ranks_do_not_divide(tmp_path):
    proc = run_train(["--steps", "2", "-B", "4", "--grad-accum", "4"], tmp_path, ranks=RANKS)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: --grad-accum 4: -B 4 does not split into 4 equal "
                                   "micro-batches per rank (B/2 = 2); use a -B that divides "
                                   "by 8")
