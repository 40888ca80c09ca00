"""The spill file holds no more than the bytes spilled plus one spill unit (issue 23 item 1).

Before the fix, a prefetched unit came back lowest slab first and the file end
only moved down past the slab that ended exactly at it, so every push/pop cycle
stranded most of a tape's worth of file bytes.
"""
import numpy as np
from hypothesis import given, settings, strategies as st

from adtape import Tape

MiB = 1 << 20


def assert_file_bounded(tape, spill_unit, where):
    st_ = tape.stats
    assert st_["spill_file_bytes"] <= st_["spilled_bytes"] + spill_unit, (
        f"{where}: spill file {st_['spill_file_bytes']} bytes holds more than the "
        f"{st_['spilled_bytes']} bytes spilled plus one {spill_unit}-byte unit")
    # The peaks the stats report: never below what is there now, and the file's never
    # above the most bytes on disk plus one unit (these slabs are not page-aligned: no
    # O_DIRECT padding).
    assert st_["peak_spilled_bytes"] >= st_["spilled_bytes"], where
    assert st_["peak_spill_file_bytes"] >= st_["spill_file_bytes"], where
    assert st_["peak_spill_file_bytes"] <= st_["peak_spilled_bytes"] + spill_unit, (where, st_)


def test_file_stays_bounded_over_many_push_pop_cycles(tmp_path):
    # The case: a 1 MiB budget gives 64 KiB slabs under the 1 MiB spill unit.
    data = np.arange(MiB // 2, dtype=np.float64)       # 4 MiB a cycle
    with Tape(memory_budget=MiB, spill_dir=tmp_path) as tape:
        for cycle in range(20):
            tape.push_many(data)
            assert_file_bounded(tape, MiB, f"cycle {cycle} after the push")
            assert np.array_equal(tape.pop_many(data.size), data)
            tape._sync()
            assert_file_bounded(tape, MiB, f"cycle {cycle} after the pop")
        assert tape.stats["spills"] > 0 and tape.stats["spilled_bytes"] == 0
        assert tape.stats["spill_file_bytes"] <= MiB


ops = st.lists(st.tuples(st.sampled_from(["push_many", "pop_many", "push_array", "pop_array"]),
                         st.integers(1, 300)), min_size=1, max_size=25)


@settings(max_examples=120, deadline=None)
@given(slab_size=st.sampled_from([1, 2, 3, 7, 64]),
       spill_unit=st.sampled_from([1, 8, 24, 200, 4096]),
       budget_slabs=st.sampled_from([0, 1, 2, 5]),
       prefetch_depth=st.sampled_from([0, 1, 2, 4]),
       ops=ops)
def test_file_never_exceeds_spilled_plus_one_unit(slab_size, spill_unit, budget_slabs,
                                                    prefetch_depth, ops):
    ref = []        # ("s", value) or ("a", array)
    counter = 0
    with Tape(slab_size=slab_size, sbo_size=0, memory_budget=budget_slabs * slab_size * 8,
              spill_unit=spill_unit, prefetch_depth=prefetch_depth) as tape:
        for op, n in ops:
            if op == "push_many":
                vals = np.arange(counter, counter + n, dtype=np.float64)
                counter += n
                tape.push_many(vals)
                ref.extend(("s", v) for v in vals)
            elif op == "push_array":
                arr = np.arange(counter, counter + n, dtype=np.float64).reshape(-1, 1)
                counter += n
                tape.push_array(arr)
                ref.append(("a", arr))
            elif op == "pop_many":
                k = 0
                while k < min(n, len(ref)) and ref[-1 - k][0] == "s":
                    k += 1
                got = tape.pop_many(k)
                want = [v for _, v in ref[len(ref) - k:]]
                del ref[len(ref) - k:]
                assert np.array_equal(got, np.array(want, dtype=np.float64))
            elif ref and ref[-1][0] == "a":
                assert np.array_equal(tape.pop_array(), ref.pop()[1])
            assert_file_bounded(tape, spill_unit, f"after {op}({n})")
            assert len(tape) == len(ref)
        while ref:
            kind, v = ref.pop()
            got = tape.pop() if kind == "s" else tape.pop_array()
            assert np.array_equal(got, v)
            assert_file_bounded(tape, spill_unit, "while draining")
