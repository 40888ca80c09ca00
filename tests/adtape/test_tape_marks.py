"""Stale or foreign marks raise ValueError; a record whose header does not check out
raises TapeCorruptionError; nothing the caller does reads or writes outside the tape
(issue 23 item 5)."""
import gc
import struct
import subprocess
import sys

import numpy as np
import pytest

from adtape import Tape, TapeCorruptionError, TapeMark

ISSUE_REPRO = r"""
import numpy as np, adtape
t = adtape.Tape(dtype=np.int64)
t.push_array(np.zeros(1))
m = t.mark()
t.pop_array()
for v in (0, 0, 3, 12, 32, 2, 0):
    t.push(v)
t.push_bytes(b'12345678')
try:
    t.rewind(m)
except ValueError as exc:
    print("ValueError:", exc)
assert t.pop_bytes() == b'12345678'
assert [t.pop() for _ in range(7)] == [0, 2, 32, 12, 3, 0, 0]
assert len(t) == 0
"""


def test_issue_repro_raises_instead_of_crashing():
    res = subprocess.run([sys.executable, "-c", ISSUE_REPRO], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ValueError: the mark is stale"), res.stdout


def test_mark_across_a_record_popped_and_replaced_is_refused():
    with Tape() as t:
        t.push(1.0)
        t.push_bytes(b"abc")
        m = t.mark()
        t.pop_bytes()
        t.push_bytes(b"abc")          # same size, same position: only the serial differs
        with pytest.raises(ValueError, match="stale"):
            t.rewind(m)
        assert t.pop_bytes() == b"abc" and t.pop() == 1.0


def test_mark_below_a_record_pushed_after_popping_scalars_is_refused():
    with Tape() as t:
        t.push_many(np.arange(4.0))
        m = t.mark()
        t.pop_many(2)
        t.push_bytes(b"x" * 40)       # the record now covers the mark's position
        with pytest.raises(ValueError, match="stale"):
            t.rewind(m)
        assert t.pop_bytes() == b"x" * 40
        assert t.pop_many(2).tolist() == [0.0, 1.0]


def test_valid_marks_still_rewind():
    with Tape(slab_size=3, sbo_size=0) as t:
        t.push_array(np.arange(5))
        m1 = t.mark()
        t.push_many(np.arange(7.0))
        m2 = t.mark()
        t.push_bytes(b"later")
        t.push(9.0)
        t.rewind(m2)
        assert len(t) == 8
        t.rewind(m1)
        assert len(t) == 1 and t.pop_array().tolist() == list(range(5))


def test_marks_of_another_or_collected_tape_are_refused():
    a = Tape()
    a.push(1.0)
    m = a.mark()
    with Tape() as b:
        b.push(1.0)
        with pytest.raises(ValueError, match="this tape's mark"):
            b.rewind(m)
    a.close()
    del a
    gc.collect()
    for _ in range(20):           # a new tape may get the collected one's id()
        with Tape() as c:
            c.push(1.0)
            with pytest.raises(ValueError):
                c.rewind(m)


@pytest.mark.parametrize("fields", [
    dict(nbytes=10 ** 6), dict(nbytes=-8), dict(n_records=5), dict(n_records=-1),
    dict(record_serial=12345), dict(nbytes=4), dict(nbytes="x"),
])
def test_forged_marks_are_refused(fields):
    with Tape() as t:
        t.push_bytes(b"abcdefgh")
        t.push_many(np.arange(3.0))
        m = t.mark()
        forged = TapeMark(**{**{k: getattr(m, k) for k in TapeMark.__slots__}, **fields})
        with pytest.raises(ValueError):
            t.rewind(forged)
        assert len(t) == 4 and t.pop_many(3).tolist() == [0.0, 1.0, 2.0]
        assert t.pop_bytes() == b"abcdefgh"


@pytest.mark.parametrize("trailer", [
    struct.pack("<Qqq", 8, 7, 0),               # unknown kind
    struct.pack("<Qqq", 1 << 40, 1, 0),         # longer than the tape
    struct.pack("<Qqq", 16, 1, 0),              # starts where no record starts
    struct.pack("<Qqq", 8, 1, 24),              # previous record that is not there
])
def test_a_trailer_that_does_not_check_out_is_corruption(trailer):
    with Tape() as t:
        t.push(5.0)
        t.push_bytes(b"abcdefgh")
        t._overwrite_top(trailer)
        with pytest.raises(TapeCorruptionError, match="trailer"):
            t.pop_bytes()
        assert len(t) == 2        # nothing was popped


MAGIC = 0x41445441505952     # the word that ends every array header


@pytest.mark.parametrize("ndim,code_len,word", [
    (1 << 20, 4, MAGIC),        # ndim far past the limit (wrote past a stack buffer)
    (-1, 4, MAGIC),
    (1, 1 << 40, MAGIC),        # dtype description longer than allowed
    (1, 4, 1234),               # not an array header
    (2, 4, MAGIC),              # shape disagrees with the record's size
    (40, 4, MAGIC),             # header longer than the record
])
def test_an_array_header_that_does_not_check_out_is_corruption(ndim, code_len, word):
    with Tape() as t:
        t.push(1.0)
        t.push_array(np.arange(3.0))
        # From the top: trailer (64-byte payload, kind 2, no record below), then
        # the header's last 24 bytes (ndim, description length, magic).
        trailer = struct.pack("<Qqq", 64, 2, 0)
        t._overwrite_top(struct.pack("<qqq", ndim, code_len, word) + trailer)
        top = t.nbytes
        with pytest.raises(TapeCorruptionError, match="array record"):
            t.pop_array()
        assert len(t) == 2 and t.nbytes == top
        t._overwrite_top(struct.pack("<qqq", 1, 4, MAGIC) + trailer)
        assert t.pop_array().tolist() == [0.0, 1.0, 2.0] and t.pop() == 1.0
