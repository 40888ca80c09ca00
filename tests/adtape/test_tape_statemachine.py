"""Random operation sequences against a Python list, with tiny sizes so that every
inline-buffer, slab, spill, reload and prefetch boundary is crossed."""
import numpy as np
from hypothesis import settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from adtape import Tape

values = st.floats(allow_nan=False, width=64)


class TapeVsList(RuleBasedStateMachine):
    @initialize(sbo_size=st.sampled_from([0, 1, 4]), slab_size=st.sampled_from([1, 2, 3, 7]),
                budget_slabs=st.sampled_from([None, 0, 1, 2, 3]),
                prefetch_depth=st.sampled_from([0, 1, 2]), threadsafe=st.booleans(),
                spill_unit=st.sampled_from([1, 16, 64]))
    def make_tape(self, sbo_size, slab_size, budget_slabs, prefetch_depth, threadsafe, spill_unit):
        budget = None if budget_slabs is None else budget_slabs * slab_size * 8
        self.tape = Tape(sbo_size=sbo_size, slab_size=slab_size, memory_budget=budget,
                         prefetch_depth=prefetch_depth, threadsafe=threadsafe,
                         spill_unit=spill_unit)
        self.ref = []       # ("s", float) | ("a", ndarray) | ("b", bytes)
        self.marks = []     # (TapeMark, reference length at the mark)

    def teardown(self):
        if hasattr(self, "tape"):
            self.tape.close()

    def _scalars_on_top(self):
        n = 0
        for kind, _ in reversed(self.ref):
            if kind != "s":
                break
            n += 1
        return n

    def _shrunk_to(self, length):
        self.marks = [(m, n) for m, n in self.marks if n <= length]

    @rule(v=values)
    def push(self, v):
        self.tape.push(v)
        self.ref.append(("s", v))

    @rule(vs=st.lists(values, max_size=40))
    def push_many(self, vs):
        self.tape.push_many(np.array(vs, dtype=np.float64))
        self.ref.extend(("s", v) for v in vs)

    @rule(shape=st.sampled_from([(0,), (1,), (3,), (2, 5), (4, 1, 3)]),
          dtype=st.sampled_from([np.float32, np.float64, np.int16, np.uint8]), seed=st.integers(0, 99))
    def push_array(self, shape, dtype, seed):
        a = (np.random.default_rng(seed).standard_normal(shape) * 100).astype(dtype)
        self.tape.push_array(a)
        self.ref.append(("a", a))

    @rule(data=st.binary(max_size=30))
    def push_bytes(self, data):
        self.tape.push_bytes(data)
        self.ref.append(("b", data))

    @precondition(lambda self: self.ref and self.ref[-1][0] == "s")
    @rule()
    def pop(self):
        assert self.tape.pop() == self.ref.pop()[1]
        self._shrunk_to(len(self.ref))

    @precondition(lambda self: self.ref and self.ref[-1][0] == "s")
    @rule()
    def peek(self):
        assert self.tape.peek() == self.ref[-1][1]

    @rule(data=st.data())
    def pop_many(self, data):
        n = data.draw(st.integers(0, self._scalars_on_top()))
        got = self.tape.pop_many(n)
        want = [v for _, v in self.ref[len(self.ref) - n:]]
        del self.ref[len(self.ref) - n:]
        np.testing.assert_array_equal(got, np.array(want, dtype=np.float64))
        self._shrunk_to(len(self.ref))

    @precondition(lambda self: self.ref and self.ref[-1][0] == "a")
    @rule()
    def pop_array(self):
        got = self.tape.pop_array()
        want = self.ref.pop()[1]
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        self._shrunk_to(len(self.ref))

    @precondition(lambda self: self.ref and self.ref[-1][0] == "b")
    @rule()
    def pop_bytes(self):
        assert self.tape.pop_bytes() == self.ref.pop()[1]
        self._shrunk_to(len(self.ref))

    @precondition(lambda self: not self.ref)
    @rule()
    def pop_empty_raises(self):
        try:
            self.tape.pop()
        except IndexError:
            return
        raise AssertionError("pop from an empty tape did not raise")

    @rule()
    def mark(self):
        self.marks.append((self.tape.mark(), len(self.ref)))

    @precondition(lambda self: self.marks)
    @rule(data=st.data())
    def rewind(self, data):
        m, n = data.draw(st.sampled_from(self.marks))
        self.tape.rewind(m)
        del self.ref[n:]
        self._shrunk_to(n)

    @rule()
    def clear(self):
        self.tape.clear()
        self.ref.clear()
        self.marks.clear()

    @invariant()
    def same_length(self):
        if hasattr(self, "tape"):
            assert len(self.tape) == len(self.ref)

    @invariant()
    def within_budget(self):
        if hasattr(self, "tape"):
            st_ = self.tape.stats
            if st_["memory_budget"] is not None:
                # head slab, one slab being filled past the budget, prefetch and pool slack
                slab = st_["resident_bytes"] and max(1, st_["resident_bytes"] // max(1, st_["heap_slabs"]))
                assert st_["resident_bytes"] <= st_["memory_budget"] + 8 * slab + 4096


TapeVsList.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestTapeVsList = TapeVsList.TestCase
