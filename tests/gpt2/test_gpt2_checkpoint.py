"""Checkpoints: our format (round trip, atomicity, validation), llm.c model files, HF safetensors."""
import json
import os
import pathlib
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import gpt2
from gpt2 import checkpoint as ckpt
from gpt2.checkpoint import (SafetensorsFile, export_hf_gpt2, export_llmc, import_hf_gpt2,
                             import_llmc, load_checkpoint, save_checkpoint, write_safetensors)
from gpt2.config import GPT2Config
from gpt2.data import DataLoader
from gpt2.params import ParamArena, init_params_

TINY = GPT2Config.preset("tiny")
# a vocabulary that is not a multiple of 128, so the padded wte rows are exercised
ODD = GPT2Config(n_layer=2, n_head=4, n_embd=16, vocab_size=200, block_size=24)


def random_arena(config, seed):
    arena = init_params_(ParamArena(config), seed)
    # non-trivial biases and layernorm params so a swapped or skipped tensor shows up
    rng = np.random.default_rng(seed + 100)
    arena.flat += rng.standard_normal(arena.flat.size, dtype=np.float32) * 0.01
    arena.wte[config.vocab_size:] = 0.0
    return arena


def saved_state(tmp_path, name="ck.bin"):
    params = random_arena(TINY, 1)
    m, v = random_arena(TINY, 2), random_arena(TINY, 3)
    v.flat[:] = np.abs(v.flat)
    loader = DataLoader(np.arange(5000) % 256, 2, 16, 256, seed=9)
    for _ in range(7):
        loader.next_batch()
    path = tmp_path / name
    save_checkpoint(path, params, step=123, adam_m=m, adam_v=v.flat, adam_step=120,
                    data_state=loader.state(), extra={"lr": 3e-4, "note": "x"})
    return path, params, m, v, loader


# ---------------------------------------------------------------------------- own format

def test_checkpoint_round_trip(tmp_path):
    path, params, m, v, loader = saved_state(tmp_path)
    ck = load_checkpoint(path, TINY)
    assert ck.config == TINY and ck.step == 123 and ck.adam_step == 120
    np.testing.assert_array_equal(ck.params.flat, params.flat)
    np.testing.assert_array_equal(ck.adam_m.flat, m.flat)
    np.testing.assert_array_equal(ck.adam_v.flat, v.flat)
    assert ck.extra == {"lr": 3e-4, "note": "x"}
    resumed = DataLoader(np.arange(5000) % 256, 2, 16, 256, seed=9)
    resumed.load_state(ck.data_state)
    np.testing.assert_array_equal(resumed.next_batch()[0], loader.next_batch()[0])


def test_layer_major_arenas_are_written_and_read_in_llmc_order(tmp_path):
    path, params, m, v, _ = saved_state(tmp_path)
    major = [ParamArena(TINY, layer_major=True).copy_(a) for a in (params, m, v)]
    again = tmp_path / "again.bin"
    save_checkpoint(again, major[0], step=123, adam_m=major[1], adam_v=major[2],
                    adam_step=120, extra={"lr": 3e-4, "note": "x"})
    ck = load_checkpoint(again, TINY)
    for loaded, original in zip((ck.params, ck.adam_m, ck.adam_v), (params, m, v)):
        np.testing.assert_array_equal(loaded.flat, original.flat)
    dest = [ParamArena(TINY, layer_major=True) for _ in range(3)]
    ck = load_checkpoint(path, params=dest[0], adam_m=dest[1], adam_v=dest[2])
    assert ck.params is dest[0] and ck.adam_v is dest[2]
    for loaded, original in zip(dest, major):
        np.testing.assert_array_equal(loaded.flat, original.flat)
    export_llmc(tmp_path / "model.bin", major[0])
    np.testing.assert_array_equal(import_llmc(tmp_path / "model.bin").flat, params.flat)


def test_checkpoint_loads_in_place_and_without_optimizer(tmp_path):
    path, params, m, _, _ = saved_state(tmp_path)
    dest_p, dest_m, dest_v = ParamArena(TINY), ParamArena(TINY), ParamArena(TINY)
    ck = load_checkpoint(path, params=dest_p, adam_m=dest_m, adam_v=dest_v)
    assert ck.params is dest_p and ck.adam_m is dest_m
    np.testing.assert_array_equal(dest_p.flat, params.flat)
    np.testing.assert_array_equal(dest_m.flat, m.flat)
    only_params = tmp_path / "p.bin"
    save_checkpoint(only_params, params, step=0)
    ck = load_checkpoint(only_params)
    assert ck.adam_m is None and ck.adam_v is None and ck.data_state is None
    with pytest.raises(ValueError, match="destination must be a ParamArena"):
        load_checkpoint(path, params=ParamArena(ODD))


def test_checkpoint_config_mismatch_and_bad_arguments(tmp_path):
    path, params, m, _, _ = saved_state(tmp_path)
    other = GPT2Config(n_layer=3, n_head=2, n_embd=32, vocab_size=256, block_size=64)
    with pytest.raises(ValueError, match="n_layer: expected 3, file has 2"):
        load_checkpoint(path, other)
    with pytest.raises(ValueError, match="together"):
        save_checkpoint(tmp_path / "x.bin", params, step=1, adam_m=m)
    with pytest.raises(ValueError, match="float32 array of shape"):
        save_checkpoint(tmp_path / "x.bin", params, step=1, adam_m=m, adam_v=np.zeros(3))
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        save_checkpoint(tmp_path / "x.bin", params, step=-1)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "absent.bin")
    assert not (tmp_path / "x.bin").exists()


def test_checkpoint_rejects_foreign_truncated_and_corrupt_files(tmp_path):
    path, *_ = saved_state(tmp_path)
    good = path.read_bytes()
    bad = tmp_path / "bad.bin"
    cases = [
        (good[:-10], "truncated"),
        (good[:30], "truncated or corrupt"),
        (b"PK\x03\x04" + good[4:], "not an adtape GPT-2 checkpoint"),
        (good[:8] + struct.pack("<I", 99) + good[12:], "format version 99"),
        (good[:-5] + bytes(b ^ 0xFF for b in good[-5:]), "CRC32"),
    ]
    header_len = struct.unpack("<Q", good[16:24])[0]
    broken_json = good[:24] + b"{" * header_len + good[24 + header_len:]
    cases.append((broken_json, "corrupt header"))
    for content, message in cases:
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            load_checkpoint(bad)
    export_llmc(bad, random_arena(TINY, 0))
    with pytest.raises(ValueError, match="not an adtape GPT-2 checkpoint"):
        load_checkpoint(bad)


@pytest.mark.parametrize("failing", ["fsync", "replace", "json"])
def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch, failing):
    path, params, *_ = saved_state(tmp_path)
    before = path.read_bytes()
    newer = random_arena(TINY, 50)

    def boom(*args, **kwargs):
        raise OSError("disk on fire")

    if failing == "json":
        with pytest.raises(ValueError, match="JSON-serializable"):
            save_checkpoint(path, newer, step=5, extra={"bad": object()})
    else:
        monkeypatch.setattr(ckpt.os, failing, boom)
        with pytest.raises(OSError, match="disk on fire"):
            save_checkpoint(path, newer, step=5)
        monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ck.bin"], "temporary file left behind"
    np.testing.assert_array_equal(load_checkpoint(path).params.flat, params.flat)


def test_process_killed_while_saving_keeps_previous_checkpoint_and_next_save_cleans_up(tmp_path):
    path, params, *_ = saved_state(tmp_path)
    before = path.read_bytes()
    # The child writes a new checkpoint and is SIGKILLed after the data, before the rename.
    child = textwrap.dedent(f"""
        import os, signal
        from gpt2 import checkpoint
        from gpt2.config import GPT2Config
        from gpt2.params import ParamArena, init_params_
        checkpoint.os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
        params = init_params_(ParamArena(GPT2Config.preset("tiny")), 77)
        checkpoint.save_checkpoint({str(path)!r}, params, step=999)
    """)
    package_root = str(pathlib.Path(gpt2.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": package_root}
    # Run outside the source tree (``-c`` puts the working directory first on sys.path).
    result = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True,
                            cwd=tmp_path.parent)
    assert result.returncode == -9, result.stderr.decode()
    leftovers = [p for p in os.listdir(tmp_path) if p != "ck.bin"]
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp")
    assert (tmp_path / leftovers[0]).stat().st_size > params.nbytes, "the child got to write"
    assert path.read_bytes() == before
    ck = load_checkpoint(path)
    assert ck.step == 123
    np.testing.assert_array_equal(ck.params.flat, params.flat)

    # A live writer's temporary (this process's pid) beside it must survive the next save.
    live = tmp_path / f".ck.bin.{os.getpid()}-0123abcd.tmp"
    live.write_bytes(b"in progress")
    save_checkpoint(path, params, step=124)
    assert sorted(os.listdir(tmp_path)) == sorted(["ck.bin", live.name])
    assert load_checkpoint(path).step == 124


def test_stale_temporaries_of_other_files_are_left_alone(tmp_path):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
    dead_pid = int(finished.stdout)
    mine = tmp_path / f".ck.bin.{dead_pid}-89abcdef.tmp"
    other = tmp_path / f".other.bin.{dead_pid}-89abcdef.tmp"
    for p in (mine, other):
        p.write_bytes(b"x")
    assert ckpt.remove_stale_temporaries(tmp_path / "ck.bin") == [mine.name]
    assert sorted(os.listdir(tmp_path)) == [other.name]


def test_edited_header_fails_its_crc(tmp_path):
    path, *_ = saved_state(tmp_path)
    good = path.read_bytes()
    assert b'"step": 123' in good
    path.write_bytes(good.replace(b'"step": 123', b'"step": 923'))
    with pytest.raises(ValueError, match="corrupt header: it fails its CRC32 check"):
        load_checkpoint(path)
    with pytest.raises(ValueError, match="CRC32"):
        ckpt.read_checkpoint_header(path)


def test_version_1_checkpoints_still_load(tmp_path):
    """Version 1 had the same layout with the header CRC field zero (and unchecked)."""
    path, params, *_ = saved_state(tmp_path)
    good = path.read_bytes()
    magic, version, _, header_len = struct.unpack("<8sIIQ", good[:24])
    assert version == 2
    path.write_bytes(struct.pack("<8sIIQ", magic, 1, 0, header_len) + good[24:])
    ck = load_checkpoint(path)
    assert ck.step == 123
    np.testing.assert_array_equal(ck.params.flat, params.flat)
    info = ckpt.read_checkpoint_header(path)
    assert info.step == 123 and info.config == TINY and info.params is None


# ---------------------------------------------------------------------------- llm.c

def test_llmc_model_export_layout_and_import(tmp_path):
    params = random_arena(ODD, 4)
    path = tmp_path / "model.bin"
    export_llmc(path, params)
    raw = path.read_bytes()
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert list(header[:8]) == [20240326, 3, 24, 200, 2, 4, 16, 256] and not header[8:].any()
    assert raw[1024:] == params.flat.tobytes()
    back = import_llmc(path)
    assert back.config == ODD
    np.testing.assert_array_equal(back.flat, params.flat)


def test_llmc_model_import_errors(tmp_path):
    path = tmp_path / "model.bin"
    export_llmc(path, random_arena(TINY, 0))
    good = path.read_bytes()
    header = np.frombuffer(good[:1024], dtype="<i4").copy()

    def with_header(**changes):
        h = header.copy()
        for index, value in changes.items():
            h[int(index[1:])] = value
        return h.tobytes() + good[1024:]

    cases = [
        (good[:-4], "truncated"),
        (good[:100], "truncated"),
        (with_header(i1=5), "version 5"),
        (with_header(i0=20240520), "not an llm.c model file"),
        (with_header(i7=512), "pads the vocabulary to 512"),
        (with_header(i5=3), "divisible by n_head"),
        (good + b"\0" * 4, "needs"),
    ]
    for content, message in cases:
        path.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            import_llmc(path)


# ---------------------------------------------------------------------------- Hugging Face

def hf_tensors(params, prefix=""):
    """HF GPT-2 tensors of our params, written out independently of the exporter."""
    c = params.config
    t = {"wte.weight": params.wte[:c.vocab_size], "wpe.weight": params.wpe,
         "ln_f.weight": params.lnfw, "ln_f.bias": params.lnfb}
    for i in range(c.n_layer):
        t[f"h.{i}.ln_1.weight"], t[f"h.{i}.ln_1.bias"] = params.ln1w[i], params.ln1b[i]
        t[f"h.{i}.attn.c_attn.weight"] = params.qkvw[i].T
        t[f"h.{i}.attn.c_attn.bias"] = params.qkvb[i]
        t[f"h.{i}.attn.c_proj.weight"] = params.attprojw[i].T
        t[f"h.{i}.attn.c_proj.bias"] = params.attprojb[i]
        t[f"h.{i}.ln_2.weight"], t[f"h.{i}.ln_2.bias"] = params.ln2w[i], params.ln2b[i]
        t[f"h.{i}.mlp.c_fc.weight"], t[f"h.{i}.mlp.c_fc.bias"] = params.fcw[i].T, params.fcb[i]
        t[f"h.{i}.mlp.c_proj.weight"] = params.fcprojw[i].T
        t[f"h.{i}.mlp.c_proj.bias"] = params.fcprojb[i]
        t[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, c.block_size, c.block_size), np.float32))
        t[f"h.{i}.attn.masked_bias"] = np.array(-1e4, dtype=np.float32)
    return {prefix + k: v for k, v in t.items()}


def test_hf_export_import_round_trip(tmp_path):
    params = random_arena(ODD, 5)
    path = tmp_path / "model.safetensors"
    export_hf_gpt2(path, params, write_config=True)
    st = SafetensorsFile(path)
    assert st.metadata == {"format": "pt"}
    assert st.entries["wte.weight"].shape == (200, 16)
    assert st.entries["h.1.attn.c_attn.weight"].shape == (16, 48)
    assert st.entries["h.0.mlp.c_proj.weight"].shape == (64, 16)
    assert (8 + struct.unpack("<Q", path.read_bytes()[:8])[0]) % 8 == 0
    config_json = json.loads((tmp_path / "config.json").read_text())
    assert config_json["n_head"] == 4 and config_json["n_positions"] == 24
    back = import_hf_gpt2(path)  # n_head from config.json
    assert back.config == ODD
    np.testing.assert_array_equal(back.flat, params.flat)


def test_hf_conv1d_weights_act_like_our_linear_layers(tmp_path):
    # HF Conv1D computes x @ W + b with W (in, out); ours is x @ w.T + b with w (out, in).
    params = random_arena(ODD, 6)
    path = tmp_path / "m.safetensors"
    export_hf_gpt2(path, params)
    st = SafetensorsFile(path)
    # In float64 so that the two BLAS summation orders agree to rounding.
    f64 = lambda a: np.asarray(a, dtype=np.float64)
    x = np.random.default_rng(0).standard_normal((3, 16))
    np.testing.assert_allclose(x @ f64(st.read("h.1.attn.c_attn.weight")) + f64(st.read("h.1.attn.c_attn.bias")),
                               x @ f64(params.qkvw[1]).T + f64(params.qkvb[1]), rtol=1e-12, atol=1e-12)
    h = np.random.default_rng(1).standard_normal((3, 64))
    np.testing.assert_allclose(h @ f64(st.read("h.0.mlp.c_proj.weight")), h @ f64(params.fcprojw[0]).T,
                               rtol=1e-12, atol=1e-12)


def test_hf_import_prefix_buffers_tied_head_and_half_precision(tmp_path):
    params = random_arena(ODD, 7)
    tensors = hf_tensors(params, prefix="transformer.")
    tensors["lm_head.weight"] = params.wte[:200]
    path = tmp_path / "model.safetensors"
    write_safetensors(path, tensors, metadata={"format": "pt"})
    np.testing.assert_array_equal(import_hf_gpt2(path, n_head=4).flat, params.flat)

    write_safetensors(path, {k: v.astype(np.float16) for k, v in hf_tensors(params).items()})
    half = import_hf_gpt2(path, config=ODD)
    np.testing.assert_array_equal(half.flat, params.flat.astype(np.float16).astype(np.float32))

    # bfloat16 is written by hand: the top 16 bits of each float32
    bf16 = {k: (np.ascontiguousarray(v, np.float32).view(np.uint32) >> 16).astype(np.uint16)
            for k, v in hf_tensors(params).items()}
    write_safetensors(path, bf16)
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    for entry in header.values():
        entry["dtype"] = "BF16"
    header = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])
    got = import_hf_gpt2(path, config=ODD)
    truncated = (params.flat.view(np.uint32) & 0xFFFF0000).view(np.float32)
    np.testing.assert_array_equal(got.flat, truncated)


def test_hf_import_errors(tmp_path):
    params = random_arena(ODD, 8)
    path = tmp_path / "model.safetensors"
    tensors = hf_tensors(params)

    def expect(tensors, message, **kwargs):
        write_safetensors(path, tensors)
        with pytest.raises(ValueError, match=message):
            import_hf_gpt2(path, **kwargs)

    expect(tensors, "cannot tell n_head")
    expect(tensors, "divisible by n_head", n_head=3)
    expect({k: v for k, v in tensors.items() if k != "h.1.ln_2.bias"}, "missing.*h.1.ln_2.bias",
           n_head=4)
    expect({**tensors, "h.0.attn.c_attn.weight": params.qkvw[0]}, "shape \\[48, 16\\], "
           "expected \\[16, 48\\]", n_head=4)
    expect({**tensors, "lm_head.weight": params.wte[:200] + 1}, "lm_head.weight differs",
           n_head=4)
    expect({**tensors, "h.0.extra.weight": params.lnfw}, "unexpected.*h.0.extra.weight",
           n_head=4)
    expect({"bert.embeddings.weight": params.wpe}, "not a GPT-2 model", n_head=4)
    expect(tensors, "holds weights for", config=TINY)
    expect({**tensors, "h.0.ln_1.weight": np.ones(16, np.int32)}, "expected a float type",
           n_head=4)

    write_safetensors(path, tensors)
    good = path.read_bytes()
    for content, message in [(good[:-3], "truncated"), (good[:6], "only 6 bytes"),
                             (struct.pack("<Q", 10**12) + good[8:], "not a safetensors"),
                             (struct.pack("<Q", 4) + b"[1] " + good[12:], "not a JSON object"),
                             (struct.pack("<Q", 4) + b"\xff\xfe{}" + good[12:], "bad JSON")]:
        path.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            import_hf_gpt2(path, n_head=4)
    path.write_bytes(good.replace(b'"F32"', b'"F99"', 1))
    with pytest.raises(ValueError, match="unsupported dtype 'F99'"):
        import_hf_gpt2(path, n_head=4)
    save_checkpoint(path, params, step=0)
    with pytest.raises(ValueError, match="not a safetensors file"):
        import_hf_gpt2(path, n_head=4)
    with pytest.raises(FileNotFoundError):
        import_hf_gpt2(tmp_path / "absent.safetensors", n_head=4)
