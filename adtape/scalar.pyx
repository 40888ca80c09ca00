"""Scalar-mode reverse AD: a float64 variable type for plain Python functions.

Every op on ``Scalar`` values pushes one statement onto the ``Tape`` of a
``ScalarTape`` through the nogil C API: for each active operand its identifier
and the partial derivative of the result with respect to it, then the operand
count.  Identifiers are consecutive, so the statement for identifier ``k`` is
the ``k``-th pushed and the reverse sweep (``gradient``) pops statements while
walking identifiers downward, in nogil Cython, with one adjoint array.  Under a
``memory_budget`` the statements spill to disk like any tape content.
"""
cimport cython
from libc.math cimport (acos, acosh, asin, asinh, atan, atan2, atanh, cbrt, cos, cosh, erf,
                        erfc, exp, exp2, expm1, fabs, hypot, log, log1p, log2, log10, pow,
                        sin, sinh, sqrt, tan, tanh, M_PI)
from libc.stdint cimport int64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy

import math as _m

import numpy as np

from adtape._tape cimport (Tape, TapeStruct, tape_pop_f64_unlocked, tape_pop_i64_unlocked,
                           tape_push_slow)

from adtape._tape import TapeClosedError

__all__ = ["ScalarTape", "Scalar", "exp_", "log_", "sin_", "cos_", "tan_", "tanh_", "sqrt_",
           "atan2_", "hypot_", "copysign_"]

cdef enum BinaryOp:
    OP_ADD
    OP_SUB
    OP_MUL
    OP_DIV
    OP_POW


cdef inline int push_words(TapeStruct* t, const int64_t* words, int n) noexcept nogil:
    """Push n 8-byte words; one bounds check when they fit in the head slab."""
    cdef size_t nbytes = 8 * <size_t>n
    cdef int i
    if <size_t>(t.limit - t.top) >= nbytes:
        memcpy(t.top, words, nbytes)
        t.top += nbytes
        return 0
    for i in range(n):
        if tape_push_slow(t, &words[i]) != 0:
            return -1
    return 0


cdef inline int64_t bits(double x) noexcept nogil:
    cdef int64_t w
    memcpy(&w, &x, 8)
    return w


cdef int scalar_sweep(TapeStruct* t, double* adjoint, int64_t n_ids) noexcept nogil:
    cdef int64_t ident, count, j, arg
    cdef double partial, a
    for ident in range(n_ids, 0, -1):
        if tape_pop_i64_unlocked(t, &count) != 0:
            return -1
        a = adjoint[ident]
        for j in range(count):
            if tape_pop_f64_unlocked(t, &partial) != 0:
                return -1
            if tape_pop_i64_unlocked(t, &arg) != 0:
                return -1
            adjoint[arg] += partial * a
    return 0


cdef class ScalarTape:
    """Records scalar ops for one reverse sweep.

    ``with ScalarTape() as st: x = st.variable(2.0); y = x * x.sin();
    dx, = st.gradient(y, [x])``.  Keyword arguments are those of ``adtape.Tape``
    (``memory_budget``, ``spill_dir``, ``slab_size``, ...).
    """

    def __cinit__(self, **tape_kwargs):
        tape_kwargs.setdefault("threadsafe", False)
        if tape_kwargs["threadsafe"]:
            raise ValueError("a ScalarTape records from one thread: threadsafe must be False")
        self.tape = Tape(np.float64, **tape_kwargs)
        self.t = &self.tape.t
        self.n_ids = 0
        self.swept = False

    cdef int ensure_recording(self) except -1:
        if self.t.closed:
            raise TapeClosedError("cannot record on a closed ScalarTape")
        if self.swept:
            raise RuntimeError("this ScalarTape was already swept by gradient(); "
                               "record on a new ScalarTape")
        return 0

    cdef int fail(self, int rc) except -1:
        # A statement was cut short: the tape no longer parses, so it cannot be swept.
        self.swept = True
        self.tape.check(rc)
        return -1

    cdef Scalar emit1(self, double value, int64_t a, double da):
        cdef int64_t words[3]
        cdef Scalar out
        self.ensure_recording()
        words[0] = a
        words[1] = bits(da)
        words[2] = 1
        if push_words(self.t, words, 3) != 0:
            self.fail(-1)
        self.n_ids += 1
        out = Scalar.__new__(Scalar)
        out.value = value
        out.index = self.n_ids
        out.tape = self
        return out

    cdef Scalar emit2(self, double value, int64_t a, double da, int64_t b, double db):
        cdef int64_t words[5]
        cdef Scalar out
        self.ensure_recording()
        words[0] = a
        words[1] = bits(da)
        words[2] = b
        words[3] = bits(db)
        words[4] = 2
        if push_words(self.t, words, 5) != 0:
            self.fail(-1)
        self.n_ids += 1
        out = Scalar.__new__(Scalar)
        out.value = value
        out.index = self.n_ids
        out.tape = self
        return out

    def variable(self, double value):
        """A new independent variable with this value."""
        cdef int64_t zero = 0
        cdef Scalar out
        self.ensure_recording()
        if push_words(self.t, &zero, 1) != 0:
            self.fail(-1)
        self.n_ids += 1
        out = Scalar.__new__(Scalar)
        out.value = value
        out.index = self.n_ids
        out.tape = self
        return out

    def gradient(self, Scalar output, inputs, double seed=1.0):
        """d(output)/d(input) for each input (a list of floats), by one reverse sweep.

        The sweep pops the whole tape: a ScalarTape is swept once."""
        cdef double* adjoint
        cdef int rc
        cdef Scalar v
        self.ensure_recording()
        if output.index != 0 and output.tape is not self:
            raise ValueError("output was recorded on another ScalarTape")
        checked = []
        for x in inputs:
            if not isinstance(x, Scalar):
                raise TypeError(f"gradient() inputs must be Scalars from variable(), "
                                f"got {type(x).__name__}")
            v = <Scalar>x
            if v.index == 0 or v.tape is not self:
                raise ValueError("gradient() input is not a variable of this ScalarTape")
            checked.append(v.index)
        adjoint = <double*>calloc(self.n_ids + 1, sizeof(double))
        if adjoint == NULL:
            raise MemoryError(f"cannot allocate {self.n_ids + 1} adjoints")
        try:
            adjoint[output.index] = seed
            with nogil:
                rc = scalar_sweep(self.t, adjoint, self.n_ids)
            self.swept = True
            if rc != 0:
                self.tape.check(rc)
            return [adjoint[i] for i in checked]
        finally:
            free(adjoint)

    def __len__(self):
        """Statements recorded (variables included)."""
        return self.n_ids

    @property
    def nbytes(self):
        return self.tape.nbytes

    @property
    def stats(self):
        s = self.tape.stats
        s["statements"] = self.n_ids
        return s

    def close(self):
        self.tape.close()

    def __enter__(self):
        self.ensure_recording()
        return self

    def __exit__(self, *exc):
        self.close()
        return False


cdef inline bint read_real(object o, double* value) except -1:
    """Read a real number (not a Scalar); False for anything else."""
    if isinstance(o, (float, int)) or isinstance(o, np.floating) or isinstance(o, np.integer):
        value[0] = o
        return True
    return False


cdef object binary(object x, object y, int op):
    cdef double xv, yv, v, dx = 0.0, dy = 0.0
    cdef int64_t xi = 0, yi = 0
    cdef ScalarTape xt = None, yt = None
    if type(x) is Scalar:
        xv = (<Scalar>x).value
        xi = (<Scalar>x).index
        xt = (<Scalar>x).tape
    elif not read_real(x, &xv):
        return NotImplemented
    if type(y) is Scalar:
        yv = (<Scalar>y).value
        yi = (<Scalar>y).index
        yt = (<Scalar>y).tape
    elif not read_real(y, &yv):
        return NotImplemented
    if op == OP_ADD:
        v = xv + yv
        dx = 1.0
        dy = 1.0
    elif op == OP_SUB:
        v = xv - yv
        dx = 1.0
        dy = -1.0
    elif op == OP_MUL:
        v = xv * yv
        dx = yv
        dy = xv
    elif op == OP_DIV:
        v = xv / yv
        dx = 1.0 / yv
        dy = -v / yv
    else:
        v = pow(xv, yv)
        if xi:
            dx = 0.0 if yv == 0.0 else yv * pow(xv, yv - 1.0)
        if yi:
            dy = v * log(xv)
    if xi and yi:
        if xt is not yt:
            raise ValueError("Scalars from two different ScalarTapes cannot be combined")
        return xt.emit2(v, xi, dx, yi, dy)
    if xi:
        return xt.emit1(v, xi, dx)
    if yi:
        return yt.emit1(v, yi, dy)
    return constant(v)


cdef object record2(object x, object y, double v, double dx, double dy):
    """The result ``v`` of a function of two operands (Scalars or reals) with these
    partials, recorded on the operands' tape."""
    cdef int64_t xi = 0, yi = 0
    cdef ScalarTape xt = None, yt = None
    if type(x) is Scalar:
        xi = (<Scalar>x).index
        xt = (<Scalar>x).tape
    if type(y) is Scalar:
        yi = (<Scalar>y).index
        yt = (<Scalar>y).tape
    if xi and yi:
        if xt is not yt:
            raise ValueError("Scalars from two different ScalarTapes cannot be combined")
        return xt.emit2(v, xi, dx, yi, dy)
    if xi:
        return xt.emit1(v, xi, dx)
    if yi:
        return yt.emit1(v, yi, dy)
    return constant(v)


cdef double real_value(object o) except? -1.0:
    """The value of a Scalar or a real number; TypeError for anything else."""
    cdef double v
    if type(o) is Scalar:
        return (<Scalar>o).value
    if read_real(o, &v):
        return v
    raise TypeError(f"expected a Scalar or a real number, got {type(o).__name__}")


def atan2_(y, x):
    """atan2(y, x) of Scalars or reals, recorded."""
    cdef double yv = real_value(y), xv = real_value(x)
    cdef double r2 = xv * xv + yv * yv
    return record2(y, x, atan2(yv, xv), xv / r2, -yv / r2)


def hypot_(x, y):
    """hypot(x, y) of Scalars or reals, recorded."""
    cdef double xv = real_value(x), yv = real_value(y)
    cdef double v = hypot(xv, yv)
    return record2(x, y, v, xv / v, yv / v)


def copysign_(x, y):
    """copysign(x, y): ``|x|`` with the sign of ``y`` (its derivative in ``y`` is zero)."""
    cdef double xv = real_value(x), yv = real_value(y)
    cdef double v = fabs(xv) if (yv > 0 or (yv == 0 and 1.0 / yv > 0)) else -fabs(xv)
    return record2(x, y, v, 1.0 if (v >= 0) == (xv >= 0) else -1.0, 0.0)


cdef inline Scalar constant(double v):
    cdef Scalar out = Scalar.__new__(Scalar)
    out.value = v
    out.index = 0
    out.tape = None
    return out


cdef inline object unary(Scalar x, double v, double d):
    if x.index == 0:
        return constant(v)
    return x.tape.emit1(v, x.index, d)


@cython.freelist(64)
cdef class Scalar:
    """A float64 value recorded on a ScalarTape (index 0: a constant)."""

    def __init__(self, double value=0.0):
        self.value = value
        self.index = 0
        self.tape = None

    def __add__(self, other):
        return binary(self, other, OP_ADD)

    def __radd__(self, other):
        return binary(other, self, OP_ADD)

    def __sub__(self, other):
        return binary(self, other, OP_SUB)

    def __rsub__(self, other):
        return binary(other, self, OP_SUB)

    def __mul__(self, other):
        return binary(self, other, OP_MUL)

    def __rmul__(self, other):
        return binary(other, self, OP_MUL)

    def __truediv__(self, other):
        return binary(self, other, OP_DIV)

    def __rtruediv__(self, other):
        return binary(other, self, OP_DIV)

    def __pow__(self, other, mod):
        if mod is not None:
            return NotImplemented
        return binary(self, other, OP_POW)

    def __rpow__(self, other, mod):
        if mod is not None:
            return NotImplemented
        return binary(other, self, OP_POW)

    def __neg__(self):
        return unary(self, -self.value, -1.0)

    def __pos__(self):
        return self

    def __abs__(self):
        return unary(self, fabs(self.value), 1.0 if self.value >= 0 else -1.0)

    def exp(self):
        cdef double v = exp(self.value)
        return unary(self, v, v)

    def log(self):
        return unary(self, log(self.value), 1.0 / self.value)

    def sin(self):
        return unary(self, sin(self.value), cos(self.value))

    def cos(self):
        return unary(self, cos(self.value), -sin(self.value))

    def tan(self):
        cdef double v = tan(self.value)
        return unary(self, v, 1.0 + v * v)

    def tanh(self):
        cdef double v = tanh(self.value)
        return unary(self, v, 1.0 - v * v)

    def sqrt(self):
        cdef double v = sqrt(self.value)
        return unary(self, v, 0.5 / v)

    def asin(self):
        return unary(self, asin(self.value), 1.0 / sqrt(1.0 - self.value * self.value))

    def acos(self):
        return unary(self, acos(self.value), -1.0 / sqrt(1.0 - self.value * self.value))

    def atan(self):
        return unary(self, atan(self.value), 1.0 / (1.0 + self.value * self.value))

    def sinh(self):
        return unary(self, sinh(self.value), cosh(self.value))

    def cosh(self):
        return unary(self, cosh(self.value), sinh(self.value))

    def asinh(self):
        return unary(self, asinh(self.value), 1.0 / sqrt(self.value * self.value + 1.0))

    def acosh(self):
        return unary(self, acosh(self.value), 1.0 / sqrt(self.value * self.value - 1.0))

    def atanh(self):
        return unary(self, atanh(self.value), 1.0 / (1.0 - self.value * self.value))

    def exp2(self):
        cdef double v = exp2(self.value)
        return unary(self, v, v * log(2.0))

    def expm1(self):
        cdef double v = expm1(self.value)
        return unary(self, v, v + 1.0)

    def log2(self):
        return unary(self, log2(self.value), 1.0 / (self.value * log(2.0)))

    def log10(self):
        return unary(self, log10(self.value), 1.0 / (self.value * log(10.0)))

    def log1p(self):
        return unary(self, log1p(self.value), 1.0 / (1.0 + self.value))

    def cbrt(self):
        cdef double v = cbrt(self.value)
        return unary(self, v, 1.0 / (3.0 * v * v))

    def erf(self):
        return unary(self, erf(self.value),
                     2.0 / sqrt(M_PI) * exp(-self.value * self.value))

    def erfc(self):
        return unary(self, erfc(self.value),
                     -2.0 / sqrt(M_PI) * exp(-self.value * self.value))

    def fabs(self):
        return unary(self, fabs(self.value), 1.0 if self.value >= 0 else -1.0)

    def apply(self, double value, double derivative):
        """A function's result ``value`` whose derivative at this Scalar is
        ``derivative``, recorded (how ``adtape.math`` adds functions in Python)."""
        return unary(self, value, derivative)

    # Comparisons read values, so control flow can branch on them.
    def __lt__(self, other):
        return self.value < real_value(other)

    def __le__(self, other):
        return self.value <= real_value(other)

    def __gt__(self, other):
        return self.value > real_value(other)

    def __ge__(self, other):
        return self.value >= real_value(other)

    # Integer-valued: the derivative is zero wherever it exists.
    def __floor__(self):
        return _m.floor(self.value)

    def __ceil__(self):
        return _m.ceil(self.value)

    def __trunc__(self):
        return _m.trunc(self.value)

    def __round__(self, ndigits=None):
        if ndigits is None:
            return round(self.value)
        return unary(self, round(self.value, ndigits), 0.0)

    def __float__(self):
        if self.index != 0:
            # math.sin(x) and friends call this: a float would carry no derivative.
            raise TypeError(
                "float() of a Scalar recorded on a ScalarTape would drop its derivative "
                "(the math module's functions do this): use adtape.math's functions "
                "(adtape.math.sin(x)), or x.value to take the value as a constant")
        return self.value

    def __repr__(self):
        return f"Scalar({self.value!r}, index={self.index})"


def _math(name, fn):
    def f(x):
        if type(x) is Scalar:
            return getattr(x, name)()
        return fn(float(x))
    f.__name__ = f"{name}_"
    f.__doc__ = f"{name} of a Scalar (recorded) or of a real number (a float)."
    return f


exp_ = _math("exp", _m.exp)
log_ = _math("log", _m.log)
sin_ = _math("sin", _m.sin)
cos_ = _math("cos", _m.cos)
tan_ = _math("tan", _m.tan)
tanh_ = _math("tanh", _m.tanh)
sqrt_ = _math("sqrt", _m.sqrt)
