"""push_array/pop_array keep every dtype exactly or refuse it (issue 23 item 2).

Only the type number used to be stored: '>f8' came back as '<f8' denormals,
'M8[ns]' lost its unit, 'S5'/'U3'/structured arrays came back as S1/U1/V0 and
left junk entries on the tape.
"""
import numpy as np
import pytest

from adtape import Tape

EXACT = [
    np.array([1.0, 2.5, -3.0], dtype=">f8"),
    np.array([1, 2, 3], dtype=">i4"),
    np.array([1, -2], dtype="<i2"),
    np.array([1.5, 2.0], dtype=">f4"),
    np.array([1 + 2j], dtype=">c16"),
    np.array([True, False]),
    np.array(["2024-01-02T03:04:05.123456789"], dtype="M8[ns]"),
    np.array(["2024-01-02"], dtype="M8[D]"),
    np.array([7, -3], dtype="m8[ms]"),
    np.array([b"hello", b"ab"], dtype="S5"),
    np.array(["abc", "xy"], dtype="U3"),
    np.array(["abc"], dtype=">U3"),
    np.frombuffer(b"\x01\x02\x03\x04\x05\x06", dtype="V3"),
    np.array([(1, b"ab", 2.5), (-4, b"xyz", 0.25)],
             dtype=[("a", ">i4"), ("b", "S3"), ("c", "<f8")]),
    np.zeros(3, dtype=np.dtype([("a", "i1"), ("b", "f8")], align=True)),
    np.zeros((2, 2), dtype=[("p", "f4", (3,)), ("q", [("r", ">u2")])]),
    np.arange(6, dtype=np.float16).reshape(2, 3, 1),
    np.array(5, dtype=">u8"),
    np.zeros((0, 4), dtype="U2"),
]


@pytest.mark.parametrize("arr", EXACT, ids=lambda a: str(a.dtype))
def test_every_dtype_round_trips_exactly(arr):
    # Copied once: a copy of a padded struct has padding bytes of its own.
    flipped = np.ascontiguousarray(arr[::-1] if arr.ndim else arr)
    with Tape(slab_size=5, sbo_size=0) as tape:
        tape.push(1.0)
        tape.push_array(arr)
        tape.push_array(flipped)
        assert len(tape) == 3
        for want in (flipped, arr):
            got = tape.pop_array()
            assert got.dtype == want.dtype and got.dtype.str == want.dtype.str
            assert got.dtype.descr == want.dtype.descr
            assert got.shape == want.shape
            assert got.tobytes() == want.tobytes()
        assert tape.pop() == 1.0 and len(tape) == 0


def test_out_must_match_byte_order():
    with Tape() as tape:
        tape.push_array(np.array([1.0, 2.0], dtype=">f8"))
        with pytest.raises(ValueError, match="out must be"):
            tape.pop_array(out=np.empty(2, dtype="<f8"))
        got = tape.pop_array(out=np.empty(2, dtype=">f8"))
        assert got.tolist() == [1.0, 2.0]


REFUSED = [
    np.array([1, "a", None], dtype=object),
    np.zeros(2, dtype=[("a", "i4"), ("o", "O")]),
    np.zeros(2, dtype=np.dtype({"names": ["a", "b"], "formats": ["i4", "i4"], "offsets": [4, 0]})),
    np.array(["abc", "de"], dtype=np.dtypes.StringDType()),
]


@pytest.mark.parametrize("arr", REFUSED, ids=lambda a: str(a.dtype))
def test_inexact_dtypes_are_refused_and_the_tape_is_unchanged(arr):
    with Tape(slab_size=3, sbo_size=0) as tape:
        tape.push(2.0)
        tape.push_array(np.arange(3.0))
        nbytes = tape.nbytes
        with pytest.raises(TypeError, match="push_array"):
            tape.push_array(arr)
        assert len(tape) == 2 and tape.nbytes == nbytes
        assert tape.pop_array().tolist() == [0.0, 1.0, 2.0]
        assert tape.pop() == 2.0
