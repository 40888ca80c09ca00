"""What the benchmarks and the tests' workers share to measure a process: its peak
resident memory, sampled (``RssSampler``) or as the kernel keeps it (``vm_hwm``,
``reset_vm_hwm``), and interleaved runs of several sides (``interleave``)."""
import threading
import time

import psutil

from gpt2.units import peak_rss_bytes, reset_peak_rss


class RssSampler:
    """The largest RSS of this process (or of process ``pid``) while the ``with`` block
    runs, sampled every ``interval`` seconds from a thread: ``before`` (at entry), ``peak`` (bytes) and
    ``samples`` (how many were taken).  A peak between two samples is missed: where
    that matters, ``vm_hwm`` is the kernel's own."""

    def __init__(self, interval=0.001, pid=None):
        self.process = psutil.Process(pid)
        self.interval = interval
        self.before = self.peak = 0
        self.samples = 0

    def _sample(self):
        try:
            self.peak = max(self.peak, self.process.memory_info().rss)
            self.samples += 1
        except psutil.Error:        # another process (``pid``) that has ended
            pass

    def _run(self):
        while not self._done.wait(self.interval):
            self._sample()

    def __enter__(self):
        self.peak = 0
        self.samples = 0
        self._sample()
        self.before = self.peak
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self._sample()
        return False

    @property
    def growth(self):
        """peak - before, in bytes."""
        return self.peak - self.before


def vm_hwm():
    """The kernel's peak RSS of this process (VmHWM of /proc/self/status), in bytes."""
    return peak_rss_bytes()


def reset_vm_hwm():
    """Set VmHWM to the current RSS, so that a later ``vm_hwm`` is the peak from now on."""
    reset_peak_rss()


def interleave(calls, rounds, warmup=0):
    """Call every function of ``calls`` (name -> fn) once a round, ``warmup`` rounds
    then ``rounds`` counted ones: ({name: [seconds]}, {name: [what fn returned]}) of
    the counted rounds.

    The order rotates by one every round, so that every side has the same
    predecessors: a side's run right after its own is faster than after another
    side's (its caches hold its own data: our SmolLM2 (1, 64) step 6-11% on the 2-core
    Xeon).  With three sides none follows itself; with two each does every other
    round.  (Reversing the order every other round let the first and last sides follow
    themselves half the time and the middle one never.)"""
    names = list(calls)
    times = {name: [] for name in names}
    results = {name: [] for name in names}
    for r in range(warmup + rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            out = calls[name]()
            elapsed = time.perf_counter() - t0
            if r >= warmup:
                times[name].append(elapsed)
                results[name].append(out)
    return times, results
