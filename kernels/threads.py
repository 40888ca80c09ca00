"""Thread-count policy for the kernels: resolved once, shared by OpenMP and BLAS.

The count comes from, in order: an explicit ``set_num_threads(n)``, the
``OMP_NUM_THREADS`` environment variable, then the cores this process may run on
(its CPU affinity, which honours cgroup/taskset limits).  ``set_num_threads``
also sets the BLAS pool (through threadpoolctl) to the same count, so a BLAS call
made outside a parallel region uses the same cores as our OpenMP loops and the two
never oversubscribe the machine.
"""
import os

from threadpoolctl import threadpool_limits

from kernels import _openmp

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
            return n
    return available_cores()


def set_num_threads(n=None):
    """Use ``n`` threads for OpenMP kernels and BLAS (``None``: resolve the default).

    Returns the count in force.
    """
    global _num_threads, _blas_limits
    if n is None:
        n = _resolve_default()
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"number of threads must be a positive integer, got {n!r}")
    _openmp._set_omp_threads(n)
    if _blas_limits is not None:
        _blas_limits.restore_original_limits()
    _blas_limits = threadpool_limits(limits=n, user_api="blas")
    _num_threads = n
    return n


def get_num_threads():
    """The thread count in force, resolving it once on first use."""
    if _num_threads is None:
        return set_num_threads(None)
    return _num_threads
