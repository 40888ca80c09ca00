"""Where a program's time goes, op by op.

    with adtape.profile() as prof:
        loss = f(x); loss.backward()
    print(prof.table())

Inside the block every recorded op is timed: calls and seconds per op name and phase.
"fwd": an op's forward pass is the time from the previous event on its thread (the
block's start, the previous op's recording, the end of a timed call) to its own
recording, so it holds the op's kernel, its recording on the tape (the residuals'
copies, spilling) and the Python that led to it.  "bwd": each reverse rule (pullbacks,
``bwd``, accumulating ``bwd_acc``) as it runs in the sweep.  ``prof.time(obj, "method",
"name")`` times any other callable the same way inside the block (an optimizer step,
say).  Times are self times: a timed call that records ops or calls other timed ones
(a checkpointed block's recomputation, a rule that records) is charged without them.
What nothing covers (the sweep's own loop and pops, work between the last event and
the block's end) is ``total - prof.seconds`` when the caller knows the total; ops run
without recording (under ``no_grad``) have no forward row.

The hooks are installed for the length of the block and removed after it: outside a
profile nothing is slower (the recording checks one C pointer).  One profile at a time
per process; ops of other threads inside the block are counted too, each thread's
forward spans measured on its own clock line.
"""
import contextlib
import threading
import time

from adtape import _graph
from adtape.tensor import Primitive, all_primitives

__all__ = ["OpProfile", "profile"]

_active = threading.Lock()
_clock = time.perf_counter


class OpProfile:
    """Calls and self seconds per (name, phase); filled by ``profile()``."""

    def __init__(self):
        self.stats = {}
        self._tl = threading.local()
        self._restore = []
        self._lock = threading.Lock()

    def _add(self, key, calls, seconds):
        with self._lock:
            entry = self.stats.get(key)
            if entry is None:
                entry = self.stats[key] = [0, 0.0]
            entry[0] += calls
            entry[1] += seconds

    def _charge_parent(self, seconds):
        stack = getattr(self._tl, "stack", None)
        if stack:
            stack[-1] += seconds

    def _timed(self, fn, name, phase):
        key = (name, phase)
        tl = self._tl

        def timed(*args, **kwargs):
            stack = getattr(tl, "stack", None)
            if stack is None:
                stack = tl.stack = []
            stack.append(0.0)
            t0 = tl.last = _clock()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = tl.last = _clock()
                inner = stack.pop()
                self._charge_parent(t1 - t0)
                self._add(key, 1, t1 - t0 - inner)
        timed.__wrapped__ = fn
        return timed

    def _recorded(self, prim):
        """The record hook: ``prim``'s forward ran since the thread's last event."""
        now = _clock()
        last = getattr(self._tl, "last", None)
        self._tl.last = now
        elapsed = 0.0 if last is None else now - last
        self._charge_parent(elapsed)
        self._add((prim.name, "fwd"), 1, elapsed)

    def time(self, obj, attr, name=None, phase="call"):
        """Time ``obj.attr`` (a method or function) as ``name`` until the profile ends."""
        fn = getattr(obj, attr)
        had = attr in getattr(obj, "__dict__", {})
        setattr(obj, attr, self._timed(fn, name or attr, phase))
        self._restore.append((obj, attr, fn if had else None))

    def _install(self):
        for prim in all_primitives():
            self._restore.append((prim, None, (prim.vjps, prim.bwd, prim.bwd_acc)))
            if prim.vjps is not None:
                prim.vjps = type(prim.vjps)(None if v is None else self._timed(v, prim.name, "bwd")
                                            for v in prim.vjps)
            if prim.bwd is not None:
                prim.bwd = self._timed(prim.bwd, prim.name, "bwd")
            if prim.bwd_acc is not None:
                prim.bwd_acc = self._timed(prim.bwd_acc, prim.name, "bwd")
        self._restore.append((_graph, None, _graph.set_record_hook(self._recorded)))
        self._tl.last = _clock()

    def _uninstall(self):
        for obj, attr, saved in reversed(self._restore):
            if obj is _graph:
                _graph.set_record_hook(saved)
            elif isinstance(obj, Primitive) and attr is None:
                obj.vjps, obj.bwd, obj.bwd_acc = saved
            elif saved is None:
                delattr(obj, attr)          # it was the class's: drop the instance's wrapper
            else:
                setattr(obj, attr, saved)
        self._restore.clear()

    def merge(self, other):
        """Add ``other``'s calls and seconds to this profile's (profiles of several runs)."""
        for key, (calls, seconds) in other.stats.items():
            self._add(key, calls, seconds)

    @property
    def seconds(self):
        """Seconds in every timed call."""
        return sum(s for _, s in self.stats.values())

    def rows(self):
        """[(name, phase, calls, seconds)], the slowest first."""
        return sorted(((n, p, c, s) for (n, p), (c, s) in self.stats.items()),
                      key=lambda r: -r[3])

    def as_dict(self):
        return [{"name": n, "phase": p, "calls": c, "seconds": s} for n, p, c, s in self.rows()]

    def table(self, total=None, top=None, per=1):
        """The rows as text: ms and calls (each divided by ``per``, e.g. the number of steps
        profiled), share of ``total`` seconds (else of the timed sum); with ``total``, a
        last row for what no timed call covers."""
        whole = total if total else self.seconds / per
        rows = self.rows()[:top] if top else self.rows()
        width = max([len(n) + len(p) + 1 for n, p, _, _ in rows] + [12])
        lines = [f"{'op':<{width}} {'calls':>7} {'ms':>10} {'share':>6}"]
        for n, p, c, s in rows:
            s /= per
            lines.append(f"{n + ' ' + p:<{width}} {c / per:>7g} {1e3 * s:>10.2f} "
                         f"{100 * s / whole:>5.1f}%")
        if top and len(self.stats) > top:
            rest = sum(s for _, _, _, s in self.rows()[top:]) / per
            lines.append(f"{'(other ops)':<{width}} {'':>7} {1e3 * rest:>10.2f} "
                         f"{100 * rest / whole:>5.1f}%")
        if total:
            rest = total - self.seconds / per
            lines.append(f"{'(not in ops)':<{width}} {'':>7} {1e3 * rest:>10.2f} "
                         f"{100 * rest / whole:>5.1f}%")
        return "\n".join(lines)


@contextlib.contextmanager
def profile():
    """Time every recorded op's forward and reverse rules inside the block; yields the
    ``OpProfile``."""
    if not _active.acquire(blocking=False):
        raise RuntimeError("adtape.profile() is already active: one profile at a time")
    prof = OpProfile()
    try:
        prof._install()
        yield prof
    finally:
        prof._uninstall()
        _active.release()
