"""How a training run stops and saves: SIGINT and SIGTERM finish the step and save
(``StopSignals``; a second one stops at once, ``Interrupted``), and a checkpoint is
saved on a schedule that bounds what saving costs (``SaveSchedule``)."""
import os
import signal
import threading

class Interrupted(BaseException):
    """The run stopped on SIGINT or SIGTERM.  ``message`` is the one line to print; the exit
    status is 128 + ``signum``.  ``at_once``: a second signal, raised wherever the run was."""

    def __init__(self, signum, message, at_once=False):
        super().__init__(message)
        self.signum, self.message, self.at_once = signum, message, at_once

    @property
    def exit_status(self):
        return 128 + self.signum

    @property
    def every_rank(self):
        """Over MPI, a first signal stops every rank after the same step."""
        return not self.at_once


class StopSignals:
    """While active, the first SIGINT or SIGTERM only records itself (``signum``), so the
    training loop can finish its step and save; a second one raises ``Interrupted`` at once.
    Signals are counted as they arrive, from a wakeup pipe (Python's C-level handler writes
    a byte for each): two that come while the main thread is inside one long call (a large
    checkpoint's write) reach the Python handler as one call, and still count as two.
    The handlers and wakeup descriptor in force before are restored on exit.  Signals reach
    the main thread only: elsewhere this does nothing."""
    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum = None
        self._previous = {}
        self._pipe = None
        self._previous_wakeup = -1
        self._stopped = False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._pipe = os.pipe()
            for fd in self._pipe:
                os.set_blocking(fd, False)
            self._previous_wakeup = signal.set_wakeup_fd(self._pipe[1],
                                                         warn_on_full_buffer=False)
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None

    def _arrived(self):
        """Our signals delivered since the last call, in order."""
        data = b""
        while True:
            try:
                chunk = os.read(self._pipe[0], 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
        return [s for s in data if s in self.SIGNALS]

    def _handle(self, signum, frame):
        if self._stopped:       # part of the stop already under way
            return
        others = self._arrived()
        if signum in others:
            others.remove(signum)
        if self.signum is None:
            # Python calls the handlers of signals that came together in the order of their
            # numbers: this call's is the first (signals the kernel gave to other threads
            # may reach here in either order).
            self.signum = signum
            if not others:
                return
            signum = others[0]
        self._stopped = True
        name, first = signal.Signals(signum).name, signal.Signals(self.signum).name
        raise Interrupted(signum, f"{name} {'again' if name == first else 'after ' + first}: "
                                  f"stopped at once", at_once=True)


class SaveSchedule:
    """When the training loop saves a checkpoint besides the end of the run: every
    ``interval`` steps, never (0), or with ``interval=None`` whenever the training time
    since the last save reaches ``COST_RATIO`` times what that save took, so that saving
    costs at most 1/COST_RATIO of the run.  Before the first save its time is estimated
    from the checkpoint's size at a pessimistic ``ASSUMED_WRITE_RATE``."""
    COST_RATIO = 200
    ASSUMED_WRITE_RATE = 200e6      # bytes/s

    def __init__(self, interval, checkpoint_bytes):
        self.interval = interval
        self.last_save_s = checkpoint_bytes / self.ASSUMED_WRITE_RATE
        self.since_save_s = 0.0
        self.saves = 0
        self.save_s = 0.0

    def due(self, step, step_s):
        """Whether to save after ``step`` steps, the last of which took ``step_s``."""
        self.since_save_s += step_s
        if self.interval is None:
            return self.since_save_s >= self.COST_RATIO * self.last_save_s
        return bool(self.interval) and step % self.interval == 0

    def saved(self, seconds):
        self.saves += 1
        self.save_s += seconds
        self.last_save_s = seconds
        self.since_save_s = 0.0

    def summary(self):
        return {"interval": "auto" if self.interval is None else self.interval,
                "saves": self.saves, "seconds": self.save_s}
