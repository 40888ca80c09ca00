"""Model states on the disk tier: adtape.statefile.StateFile and gpt2-train --offload moments.

The offloaded update must be the in-memory AdamW to the bit (the same kernel over the
same elements, deferred into the next forward pass), its file must be bounded, unlinked
and checked, and checkpoints must move between the two freely.
"""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import adtape
import gpt2
from adtape import SpillError, TapeCorruptionError
from adtape.statefile import StateFile
from gpt2 import checkpoint as ckpt
from gpt2.config import preset
from gpt2.model import GPT2
from gpt2.offload import FullOffload, MomentOffload

PACKAGE_ROOTS = os.pathsep.join({os.path.dirname(os.path.dirname(m.__file__))
                                 for m in (adtape, gpt2)})


# -- StateFile ---------------------------------------------------------------------------

def make_file(tmp_path, sizes=(40, 4096, 12, 0, 9000), units=((0, 2), (2, 4), (4, 5)), **kw):
    return StateFile(sizes, units, spill_dir=tmp_path, **kw)


def test_records_read_as_zeros_until_written_and_round_trip(tmp_path):
    f = make_file(tmp_path)
    try:
        assert os.listdir(tmp_path) == []          # unlinked at creation
        assert f.file_bytes % 4096 == 0
        assert not f.read_record(1).any()
        rng = np.random.default_rng(0)
        data = {r: rng.standard_normal(n // 4).astype(np.float32)
                for r, n in enumerate(f.record_nbytes)}
        for r, d in data.items():
            f.write_record(r, d)
        for r, d in data.items():
            assert np.array_equal(f.read_record(r), d)
        # Units through the window: read ahead, changed, written behind, read again.
        f.prefetch(range(3))
        for u, (a, b) in enumerate(f.units):
            buf = f.acquire(u)
            for r in range(a, b):
                view = f.record_view(buf, r)
                assert np.array_equal(view, data[r])
                view += 1
            f.release(u, dirty=True)
        f.flush()
        for r, d in data.items():
            assert np.array_equal(f.read_record(r), d + 1)
        assert f.stats["bytes_written"] >= sum(f.record_nbytes)
    finally:
        f.close()
    assert os.listdir(tmp_path) == []


def test_a_corrupt_byte_is_named_by_file_and_offset(tmp_path):
    f = make_file(tmp_path)
    try:
        for r, n in enumerate(f.record_nbytes):
            f.write_record(r, np.ones(n // 4, np.float32))
        f._corrupt_for_tests(4, byte=100)
        offset = f.unit_offset[2] + f.record_offset[4]
        with pytest.raises(TapeCorruptionError, match=f"record 4 at offset {offset}"):
            f.read_record(4)
        f.prefetch([2])
        with pytest.raises(TapeCorruptionError, match="AdamW|state|record 4"):
            f.acquire(2)
        assert np.array_equal(f.read_record(1), np.ones(1024, np.float32))   # the rest is intact
    finally:
        f.close()


def test_units_move_through_the_attached_tapes_io_thread(tmp_path):
    f = make_file(tmp_path)
    tape = adtape.Tape(spill_dir=tmp_path, memory_budget=1 << 16)
    try:
        data = {r: np.full(n // 4, r, np.float32) for r, n in enumerate(f.record_nbytes)}
        f.prefetch(range(len(f.units)))
        for u, (a, b) in enumerate(f.units):
            buf = f.acquire(u)
            for r in range(a, b):
                f.record_view(buf, r)[:] = data[r]
            f.release(u)
            if u == 0:
                f.attach(tape)          # mid-stream: unit 0 on the file's own tape
        # The tape spills its own slabs on the same queue meanwhile.
        tape.push_array(np.arange(1 << 16, dtype=np.float64))
        f.prefetch(range(len(f.units)))
        for u, (a, b) in enumerate(f.units):
            buf = f.acquire(u)
            for r in range(a, b):
                assert np.array_equal(f.record_view(buf, r), data[r])
            f.release(u, dirty=False)
        assert np.array_equal(tape.pop_array(), np.arange(1 << 16, dtype=np.float64))
        s = tape.stats
        assert s["state_bytes_written"] == sum(f.unit_nbytes[1:])
        assert s["state_bytes_read"] == sum(f.unit_nbytes)
        assert s["state_requests"] == 2 * len(f.units) - 1 and s["spills"] > 0
        f.detach()
    finally:
        f.close()
        tape.close()
    assert os.listdir(tmp_path) == []


def test_the_tapes_own_rewinds_do_not_wait_for_state_transfers(tmp_path):
    f = make_file(tmp_path)
    tape = adtape.Tape(spill_dir=tmp_path)
    try:
        f.attach(tape)
        tape.push(1.0)
        tape._hold_io(30.0)            # the I/O thread starts nothing for 30 s
        f.prefetch([0])                 # a state read queued behind the hold
        t0 = time.perf_counter()
        tape.clear()                    # no slab request is queued: no wait
        assert time.perf_counter() - t0 < 5.0 and len(tape) == 0
        tape._hold_io(0)
        buf = f.acquire(0)              # and the read still completes
        assert not f.record_view(buf, 0).any() and not f.record_view(buf, 1).any()
        f.release(0, dirty=False)
        f.detach()
    finally:
        f.close()
        tape.close()


def test_bad_layouts_and_a_closed_file_raise(tmp_path):
    with pytest.raises(ValueError, match="units"):
        StateFile([4, 4], [(0, 1)], spill_dir=tmp_path)
    with pytest.raises(ValueError, match="window"):
        StateFile([4], [(0, 1)], spill_dir=tmp_path, window=1)
    with pytest.raises(FileNotFoundError, match="spill_dir"):
        StateFile([4], [(0, 1)], spill_dir=tmp_path / "missing")
    f = make_file(tmp_path)
    with pytest.raises(ValueError, match="holds 40 bytes"):
        f.write_record(0, np.zeros(3, np.float32))
    f.close()
    with pytest.raises(adtape.TapeClosedError):
        f.acquire(0)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 2 MiB tmpfs: a real full disk."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_disk_is_found_when_the_file_is_made(tiny_disk):
    with pytest.raises(SpillError, match="cannot reserve 8,388,608 bytes"):
        StateFile([8 << 20], [(0, 1)], spill_dir=tiny_disk)
    assert os.listdir(tiny_disk) == []


# -- the model ---------------------------------------------------------------------------

def batches(config, n, B=2, T=16, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        tokens = rng.integers(0, config.vocab_size, (B, T + 1))
        yield tokens[:, :-1], tokens[:, 1:]


def train(model, steps, clip=1.0, seed=0):
    return [model.train_step(x, y, 1e-3, weight_decay=0.1, grad_clip=clip)
            for x, y in batches(model.config, steps, seed=seed)]


def offloaded_model(config, kind, tmp_path, small):
    """A model offloading ``kind``; ``small``: in small units and segments, many of each,
    parameters split across them."""
    if not small:
        return GPT2(config, seed=1, offload=kind, offload_dir=tmp_path)
    units = dict(unit_bytes=1 << 14, segment_floats=1000, window=3)
    if kind == "moments":
        model = GPT2(config, seed=1, offload="moments", offload_dir=tmp_path)
        model.moments.close()
        model.moments = MomentOffload.for_model(config, spill_dir=tmp_path, **units)
        assert len(model.moments.unit_segments) > 3 * config.n_layer
        return model
    # FullOffload: built directly, then given the model's initial parameters.
    model = GPT2(config, seed=1, offload="all", offload_dir=tmp_path)
    arena = model.param_arena()
    model.moments.close()
    model.moments = FullOffload(config, spill_dir=tmp_path, **units)
    model.set_params(arena)
    assert sum(len(u) for u in model.moments.mv_units.values()) > 3 * config.n_layer
    return model


@pytest.mark.parametrize("kind", ["moments", "all"])
def test_activations_and_state_share_the_engines_disk_queue(kind, tmp_path):
    config = preset("tiny")
    memory = GPT2(config, seed=1)
    offloaded = offloaded_model(config, kind, tmp_path, small=True)
    offloaded.tape_kwargs = dict(memory_budget=1 << 16, spill_dir=tmp_path)
    try:
        assert train(memory, 1) == train(offloaded, 1)
        # (the initial parameters went to the file before the engine's tape existed)
        stats0, state0 = offloaded.tape_stats, offloaded.moments.stats()
        assert train(memory, 5, seed=1) == train(offloaded, 5, seed=1)
        stats, state = offloaded.tape_stats, offloaded.moments.stats()
        assert stats["spills"] > stats0["spills"] > 0                # activations
        for tape_key, key in (("state_bytes_read", "bytes_read"),
                              ("state_bytes_written", "bytes_written")):
            assert stats[tape_key] - stats0[tape_key] == state[key] - state0[key] > 0
    finally:
        offloaded.close()
        memory.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("checkpointing", ["layer", "binomial"])
def test_moments_on_disk_with_checkpointing_and_a_tape_budget(checkpointing, tmp_path):
    # What the planner may combine: recomputed blocks rewind the tape that also carries
    # the moments; bit-identical to in memory.
    config = preset("llama-tiny")
    memory = GPT2(config, seed=1)
    offloaded = offloaded_model(config, "moments", tmp_path, small=True)
    offloaded.checkpointing = checkpointing
    offloaded.tape_kwargs = dict(memory_budget=1 << 16, spill_dir=tmp_path)
    try:
        assert train(memory, 10) == train(offloaded, 10)
        offloaded.finish_update()
        assert np.array_equal(memory.params.flat, offloaded.params.flat)
        assert offloaded.tape_stats["state_bytes_read"] > 0
    finally:
        offloaded.close()
        memory.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kind", ["moments", "all"])
@pytest.mark.parametrize("name, small", [("tiny", True), ("small", False), ("llama-tiny", True)])
def test_offloaded_state_trains_bit_identically_to_in_memory(name, small, kind, tmp_path):
    config = preset(name)
    memory = GPT2(config, seed=1)
    offloaded = offloaded_model(config, kind, tmp_path, small)
    try:
        # 50 steps with clipping, an evaluation between steps; the parameters and moments
        # the same at the end, to the bit.
        assert train(memory, 25) == train(offloaded, 25)
        x, y = next(batches(config, 1, seed=7))
        assert memory.forward(x, y)[1] == offloaded.forward(x, y)[1]
        assert train(memory, 25, seed=3) == train(offloaded, 25, seed=3)
        offloaded.finish_update()
        assert np.array_equal(memory.params.flat, offloaded.param_arena().flat)
        m, v = offloaded.optimizer_moments()
        for arena, streamed in ((memory.adam_m, m), (memory.adam_v, v)):
            whole = np.empty_like(arena.flat)
            for start, piece in streamed.pieces():
                whole[start:start + piece.size] = piece
            assert np.array_equal(arena.flat, whole)
        assert os.listdir(tmp_path) == []
        stats = offloaded.moments.stats()
        assert stats["bytes_read"] > 0
        assert stats["window_bytes"] < stats["file_bytes"] or not small
    finally:
        offloaded.close()
        memory.close()


@pytest.mark.parametrize("kind", ["moments", "all"])
def test_checkpoints_move_between_offloaded_and_in_memory_models(kind, tmp_path):
    config = preset("small")
    a = GPT2(config, seed=2)
    b = GPT2(config, seed=2, offload=kind, offload_dir=tmp_path)
    try:
        train(a, 5)
        train(b, 5)
        b.finish_update()
        for model, path in ((a, tmp_path / "a.bin"), (b, tmp_path / "b.bin")):
            m, v = model.optimizer_moments()
            ckpt.save_checkpoint(path, model.checkpoint_params(), step=5, adam_m=m, adam_v=v,
                                 adam_step=model.adam_step)
        loaded = ckpt.load_checkpoint(tmp_path / "b.bin")
        assert np.array_equal(loaded.adam_m.flat, a.adam_m.flat)
        assert np.array_equal(loaded.adam_v.flat, a.adam_v.flat)
        assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
        # An in-memory checkpoint resumed offloaded, and on: the same steps.
        c = GPT2(config, seed=9, offload=kind, offload_dir=tmp_path)
        try:
            m, v = c.optimizer_moments()
            state = ckpt.load_checkpoint(tmp_path / "a.bin", config,
                                         params=c.checkpoint_params(), adam_m=m, adam_v=v)
            c.adam_step = state.adam_step
            assert train(c, 4, seed=5) == train(a, 4, seed=5)
        finally:
            c.close()
        # A corrupt moment section is refused.
        data = bytearray((tmp_path / "a.bin").read_bytes())
        data[-5] ^= 0xFF
        (tmp_path / "bad.bin").write_bytes(bytes(data))
        d = GPT2(config, seed=9, offload=kind, offload_dir=tmp_path)
        try:
            m, v = d.optimizer_moments()
            with pytest.raises(ValueError, match="adam_v fails its CRC32"):
                ckpt.load_checkpoint(tmp_path / "bad.bin", config, params=d.checkpoint_params(),
                                     adam_m=m, adam_v=v)
        finally:
            d.close()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kind", ["moments", "all"])
def test_state_corrupted_on_disk_stops_the_next_step(kind, tmp_path):
    model = GPT2(preset("small"), seed=0, offload=kind, offload_dir=tmp_path)
    try:
        train(model, 2)
        model.finish_update()
        f = model.moments.file
        f.flush()
        # A record the next steps read from disk (not one read ahead into memory already).
        record = next(r for r in range(len(f.record_nbytes))
                      if f._state[f.unit_of[r]] == "disk" and f.written(r))
        f._corrupt_for_tests(record)
        with pytest.raises(TapeCorruptionError, match="(AdamW moments|model state) file .* offset"):
            train(model, 3)
    finally:
        model.close()


def test_full_offload_refuses_what_it_cannot_do(tmp_path):
    config = preset("tiny")
    with pytest.raises(ValueError, match="without checkpointing"):
        GPT2(config, offload="all", checkpointing="layer", offload_dir=tmp_path)
    with pytest.raises(ValueError, match="offload must be one of"):
        GPT2(config, offload="params", offload_dir=tmp_path)
    model = GPT2(config, offload="all", offload_dir=tmp_path)
    try:
        x, y = next(batches(config, 1))
        model.zero_grad()
        model.loss_and_grad(x, y)
        with pytest.raises(NotImplementedError, match="no accumulation"):
            model.loss_and_grad(x, y)
        with pytest.raises(NotImplementedError, match="grad_clip"):
            model.clip_grad_norm(1.0)
    finally:
        model.close()
    assert os.listdir(tmp_path) == []


def run_cli(*args, cwd):
    cmd = [sys.executable, "-m", "gpt2.train", "-B", "2", "-T", "16",
           "--corpus-bytes", "50K", "--eval-interval", "0", "--sample-tokens", "0",
           "--no-progress", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ, PYTHONPATH=PACKAGE_ROOTS), timeout=300)


def test_gpt2_train_offload_moments_resumes_and_reports(tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    full = run_cli("--model", "tiny", "--steps", "8", "--out-dir", tmp_path / "full",
                   cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    first = run_cli("--model", "tiny", "--steps", "4", "--offload", "moments", "--spill-dir", spill,
                    "--out-dir", tmp_path / "off", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "AdamW moments on disk" in first.stdout
    rest = run_cli("--resume", tmp_path / "off" / "checkpoint.bin", "--steps", "8",
                   "--offload", "none", "--out-dir", tmp_path / "off",
                   cwd=tmp_path)      # resumed in memory (by default it keeps --offload)
    assert rest.returncode == 0, rest.stderr
    log = lambda d: [line.split(",")[1] for line in (d / "log.csv").read_text().splitlines()]
    assert log(tmp_path / "off") == log(tmp_path / "full")
    assert os.listdir(spill) == []
    import json
    summary = json.loads((tmp_path / "off" / "summary.json").read_text())
    assert summary["memory_policy"]["offload"] == "none"


def test_gpt2_train_on_a_full_disk_is_one_error_line(tiny_disk, tmp_path):
    ok = run_cli("--model", "small", "--steps", "2", "--out-dir", tmp_path / "run", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    before = (tmp_path / "run" / "checkpoint.bin").read_bytes()
    proc = run_cli("--resume", tmp_path / "run" / "checkpoint.bin",
                   "--steps", "4", "--offload", "moments", "--spill-dir", tiny_disk,
                   cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0] and "cannot reserve" in lines[0]
    assert "No space left on device" in lines[0] and "Errno" not in lines[0]
    assert (tmp_path / "run" / "checkpoint.bin").read_bytes() == before
    assert os.listdir(tiny_disk) == []
