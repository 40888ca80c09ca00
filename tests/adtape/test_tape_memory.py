"""The memory budget holds for real: 1 GiB through a 32 MiB budget, RSS sampled throughout."""
import os

import numpy as np
import psutil
from harness import RssSampler

from adtape import Tape

MiB = 1 << 20


def test_one_gib_through_a_32_mib_budget(tmp_path):
    budget = 32 * MiB
    chunk = 2 * MiB // 8                  # 2 MiB of float64 per push_many
    n_chunks = 1024 * MiB // (chunk * 8)  # 1 GiB in all
    base = np.arange(chunk, dtype=np.float64)
    buf = np.empty_like(base)
    out = np.empty_like(base)
    start = psutil.Process().memory_info().rss
    with Tape(memory_budget=budget, spill_dir=tmp_path) as tape, RssSampler(interval=0.002) as rss:
        for k in range(n_chunks):
            np.add(base, k * chunk, out=buf)
            tape.push_many(buf)
        assert len(tape) == n_chunks * chunk
        st = tape.stats
        assert st["spilled_bytes"] >= 1024 * MiB - budget - 2 * MiB
        for k in reversed(range(n_chunks)):
            got = tape.pop_many(chunk)
            np.add(base, k * chunk, out=out)
            assert np.array_equal(got, out), f"chunk {k} came back wrong"
        st = tape.stats
        assert len(tape) == 0 and st["reloads"] > 0 and st["spilled_bytes"] == 0
        assert st["peak_resident_bytes"] <= budget + 2 * MiB
    assert rss.peak - start <= budget + 32 * MiB, (
        f"RSS grew by {(rss.peak - start) / MiB:.1f} MiB for a {budget / MiB:.0f} MiB budget")
    assert os.listdir(tmp_path) == []
