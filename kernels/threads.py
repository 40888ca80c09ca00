"""Thread-count policy for the kernels: resolved once, shared by OpenMP and BLAS.

The count comes from, in order: an explicit ``set_num_threads(n)``, the
``OMP_NUM_THREADS`` environment variable, then the cores this process may run on
(its CPU affinity, which honours cgroup/taskset limits).  Only our OpenMP threads
use the cores: ``set_num_threads`` sets BLAS's own pool to one thread (through
threadpoolctl), and the kernels split every matrix product across their OpenMP
threads, each calling BLAS on its own block (kernels/gemm.pyx).  Two pools would
fight over the cores: BLAS workers spin after each call while the next OpenMP
loop waits for a core.
"""
import os

from threadpoolctl import threadpool_limits

from kernels import _openmp, blas_dispatch

# The most threads set_num_threads and every kernel's n_threads accept (see
# kernels/_openmp.pyx for why this many).
MAX_THREADS = _openmp.MAX_THREADS

_num_threads = None
_blas_limits = None


def available_cores():
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def _resolve_default():
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"OMP_NUM_THREADS={env!r} is not an integer") from None
        if n >= 1:
            return _openmp.check_thread_count(n, "OMP_NUM_THREADS")
    return min(available_cores(), MAX_THREADS)


def set_num_threads(n=None):
    """Use ``n`` OpenMP threads for the kernels, BLAS single-threaded inside them
    (``None``: resolve the default).  ``n`` lies in [1, MAX_THREADS].

    Returns the count in force.
    """
    global _num_threads, _blas_limits
    if n is None:
        n = _resolve_default()
    _openmp.check_thread_count(n, "the number of threads")
    _openmp._set_omp_threads(n)
    # threadpoolctl limits only libraries already loaded: load SciPy's BLAS (the
    # one the kernels call) first, or the limit would silently miss it.
    import scipy.linalg.cython_blas  # noqa: F401
    if _blas_limits is not None:
        _blas_limits.restore_original_limits()
    _blas_limits = threadpool_limits(limits=1, user_api="blas")
    _num_threads = n
    blas_dispatch.warn_if_mismatched()
    return n


def get_num_threads():
    """The thread count in force, resolving it once on first use."""
    if _num_threads is None:
        return set_num_threads(None)
    return _num_threads
