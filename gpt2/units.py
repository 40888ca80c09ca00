"""Sizes, the offload's I/O constants and the process's measurements (peak RSS, median
times): what the command line, the planner, calibration and the offload share, with no
import of the compiled extensions (``gpt2.perfmodel`` imports this, not ``gpt2.train``
or ``gpt2.offload``)."""
import argparse
import math
import statistics
import sys
import time

SIZE_SUFFIXES = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
                 "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}

# gpt2.offload's state file: records and the I/O units they are moved in.
SEGMENT_FLOATS = 4 << 20     # 16 MiB per moment record at most
UNIT_BYTES = 64 << 20        # m and v of the segments of one I/O unit
WINDOW = 8                   # unit buffers: read ahead and written behind
# FullOffload's unit buffers: a block's gradients and moments take four units (GPT-2
# large), so eight let the next block's be read while this block's are written.
FULL_WINDOW = 8


def parse_size(text):
    """'512M', '2GiB', '1048576' -> bytes."""
    s = text.strip().lower()
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    suffix = s[len(number):]
    if suffix not in SIZE_SUFFIXES or not number:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M or 2G)")
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"a size must be finite and non-negative: {text!r}")
    return int(value * SIZE_SUFFIXES[suffix])


def format_size(n):
    """Bytes as a short human-readable figure (binary units)."""
    n = float(n)
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n:.0f} B"


def peak_rss_bytes(children=False):
    """This process's peak resident memory in bytes, as the kernel keeps it: VmHWM of
    /proc/self/status (the high-water mark of the resident set, file-backed and shared
    pages included), or ru_maxrss of RUSAGE_SELF where /proc is missing.

    ``children``: add the largest peak of the waited-for child processes (ru_maxrss of
    RUSAGE_CHILDREN), for a run whose children hold memory while it trains.  gpt2-train
    has none: the tape's spill, the prefetch and the offload's I/O are threads of this
    process, and the one-time calibration's child processes exit before the model
    exists, so their memory never adds to the training's."""
    import resource
    peak = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if peak is None:
        # Linux counts ru_maxrss in KiB (macOS in bytes, but has no /proc either way).
        scale = 1 if sys.platform == "darwin" else 1024
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    if children:
        scale = 1 if sys.platform == "darwin" else 1024
        peak += resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale
    return peak


def reset_peak_rss():
    """Set this process's peak resident memory (VmHWM) to its current RSS (Linux's
    clear_refs 5), so that ``peak_rss_bytes()`` then reads the peak from now on."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


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


def median_times(tasks, repeats, warmup=1):
    """{key: median seconds} of ``interleave(tasks, repeats, warmup)``: tasks is {key:
    callable}, all run in turn (so a slow stretch of a shared machine falls on every
    task alike)."""
    times, _ = interleave(tasks, repeats, warmup)
    return {key: statistics.median(v) for key, v in times.items()}
