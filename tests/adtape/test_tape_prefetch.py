"""Prefetch of bulk records and the I/O counters (issue 24)."""
import numpy as np

from adtape import Tape

MiB = 1 << 20


def test_bulk_records_come_back_prefetched_with_io_counters(tmp_path):
    arrays = [np.full(MiB // 8, float(k)) for k in range(24)]       # 24 MiB of records
    with Tape(memory_budget=4 * MiB, slab_size=8192, spill_unit=256 << 10, prefetch_depth=4,
              spill_dir=tmp_path) as tape:
        for a in arrays:
            tape.push_array(a)
        tape._sync()
        written = tape.stats["bytes_written"]
        assert written >= 19 * MiB and tape.stats["spilled_bytes"] == written
        for k in reversed(range(24)):
            tape._sync()          # the read-ahead has landed: this pop must not wait
            st = tape.stats
            misses = st["prefetch_misses"]
            assert np.array_equal(tape.pop_array(), arrays[k])
            assert tape.stats["prefetch_misses"] == misses, f"record {k} waited on a read"
        st = tape.stats
        assert st["bytes_read"] == written and st["spilled_bytes"] == 0
        assert st["prefetch_hits"] >= 19 * MiB // (64 << 10)      # every spilled slab
        assert st["io_wait_ns"] >= 0 and st["readahead_bytes"] >= 4 * (256 << 10)
        assert st["spill_file_bytes"] <= 256 << 10
