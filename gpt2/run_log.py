"""What a training run writes as it goes: log.csv (``RunLog``, read back on --resume by
``read_log``), the loss curve (``plot_losses``), a peak over --max-memory
(``exceeded_line``), and what the tape's and the offloaded state's disk traffic came to
(``TapeWatch``), for summary.json and the closing lines."""
import csv
import io

from gpt2.train_options import _one_line
from gpt2.units import format_size

LOG_FIELDS = ("step", "loss", "lr", "ms", "tokens_per_s", "grad_norm", "val_loss")


def exceeded_line(peak_bytes, max_memory):
    """One line saying the run's peak resident memory exceeded --max-memory, and by how much."""
    return (f"peak RSS {format_size(peak_bytes)} exceeded --max-memory {format_size(max_memory)} "
            f"by {peak_bytes / max_memory - 1:.1%}")


def plot_losses(path, rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
    val = [r for r in rows if r.get("val_loss") is not None]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_log(path, up_to_step):
    """Rows of an earlier run's log.csv with step <= up_to_step; [] where there is none.

    A last row cut short (a crash while it was written) is dropped; a file that is not
    such a log is refused (ValueError naming it), never overwritten.
    """
    foreign = f"{path} is not a log of this program"
    advice = "move it away to resume without the history"
    try:
        with open(path, newline="") as f:
            lines = f.read().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    except UnicodeDecodeError:
        raise ValueError(f"{foreign}: it is not text; {advice}") from None
    if lines and not lines[-1].endswith("\n"):
        lines.pop()  # cut short by a crash while it was written
    reader = csv.DictReader(lines)
    try:
        records = list(reader)
    except csv.Error as e:
        raise ValueError(f"{foreign}: not CSV ({e}); {advice}") from None
    rows = []
    if reader.fieldnames is None:   # empty, or only a header cut short
        return rows
    if not records and set(reader.fieldnames) <= set(LOG_FIELDS):
        return rows                 # only a header of ours (older versions left "step")
    if tuple(reader.fieldnames) != LOG_FIELDS:
        shown = _one_line(str(reader.fieldnames))[:200]
        raise ValueError(f"{foreign}: its columns are {shown}, expected {list(LOG_FIELDS)}; "
                         f"{advice}")
    for line, record in enumerate(records, 2):
        try:
            if None in record or None in record.values():
                raise ValueError("wrong number of fields")
            row = {k: float(v) if v else None for k, v in record.items()}
            row["step"] = int(record["step"])
        except ValueError:
            shown = _one_line(str(list(record.values())))[:200]
            raise ValueError(f"{path} line {line}: not a row of numbers: {shown}; "
                             f"{advice}") from None
        if row["step"] <= up_to_step:
            rows.append(row)
    return rows


class TapeWatch:
    """What the tape's disk tier did in a run: per step (the steady state: after the
    first step, as the median time), bytes written to the spill file and read back,
    the time the forward pass waited on writes and the backward on reads, prefetch
    hits and misses; and the most bytes ever on disk and the spill file's largest size."""
    PER_STEP = ("bytes_written", "bytes_read", "io_wait_ns", "push_wait_ns",
                "prefetch_hits", "prefetch_misses", "state_bytes_read", "state_bytes_written",
                "state_wait_ns")

    def __init__(self, model):
        self.model = model
        self.first = self.last = None       # Tape.stats after the first and the last step
        self.steps = 0
        self.offload_first = self.offload_last = None
        self.offload_steps = 0

    def after_step(self):
        if self.model.moments is not None:
            self.offload_steps += 1
            self.offload_last = self.model.moments.stats()
            if self.offload_first is None:
                self.offload_first = self.offload_last
        stats = self.model.tape_stats
        if stats is None or stats["memory_budget"] is None:
            return
        self.steps += 1
        self.last = stats
        if self.first is None:
            self.first = stats

    def summary(self):
        """A dict for summary.json, or None when no budget was set."""
        if self.last is None:
            return None
        n = self.steps - 1 if self.steps > 1 else 1
        base = self.first if self.steps > 1 else dict.fromkeys(self.PER_STEP, 0)
        per = {k: (self.last[k] - base[k]) / n for k in self.PER_STEP}
        return {**{k: self.last[k] for k in ("memory_budget", "peak_spilled_bytes",
                                             "peak_spill_file_bytes")},
                "written_bytes_per_step": per["bytes_written"],
                "read_bytes_per_step": per["bytes_read"],
                "io_wait_ms_per_step": per["io_wait_ns"] / 1e6,
                "push_wait_ms_per_step": per["push_wait_ns"] / 1e6,
                "prefetch_hits_per_step": per["prefetch_hits"],
                "prefetch_misses_per_step": per["prefetch_misses"],
                # offloaded model state through the same tape's I/O thread
                "state_read_bytes_per_step": per["state_bytes_read"],
                "state_written_bytes_per_step": per["state_bytes_written"],
                "state_wait_ms_per_step": per["state_wait_ns"] / 1e6}

    def offload_summary(self):
        """The offloaded moments' traffic per step (after the first), or None."""
        last = self.offload_last
        if last is None:
            return None
        n = max(1, self.offload_steps - 1)
        base = self.offload_first if self.offload_steps > 1 else dict.fromkeys(last, 0)
        per = {k: (last[k] - base[k]) / n for k in ("bytes_read", "bytes_written",
                                                      "read_wait_ns", "prefetch_misses")}
        return {"state": self.model.offload, "file_bytes": last["file_bytes"],
                "window_bytes": last["window_bytes"],
                "read_bytes_per_step": per["bytes_read"],
                "written_bytes_per_step": per["bytes_written"],
                "read_wait_ms_per_step": per["read_wait_ns"] / 1e6,
                "units_waited_per_step": per["prefetch_misses"]}

    @staticmethod
    def describe_offload(o):
        what = "AdamW moments" if o["state"] == "moments" else "model state"
        return (f"{what} on disk ({format_size(o['file_bytes'])} file, "
                f"{format_size(o['window_bytes'])} window in RAM): per step "
                f"{format_size(o['read_bytes_per_step'])} read and "
                f"{format_size(o['written_bytes_per_step'])} written, the update waited "
                f"{o['read_wait_ms_per_step']:.0f} ms on reads")

    @staticmethod
    def describe(t):
        hits, misses = t["prefetch_hits_per_step"], t["prefetch_misses_per_step"]
        rate = f"{hits / (hits + misses):.0%}" if hits + misses else "-"
        return (f"tape (budget {format_size(t['memory_budget'])}): per step "
                f"{format_size(t['written_bytes_per_step'])} written to the spill file and "
                f"{format_size(t['read_bytes_per_step'])} read back, the forward waited "
                f"{t['push_wait_ms_per_step']:.0f} ms on writes and the backward "
                f"{t['io_wait_ms_per_step']:.0f} ms on reads, prefetch hits {rate}; at most "
                f"{format_size(t['peak_spilled_bytes'])} on disk, in a spill file of at most "
                f"{format_size(t['peak_spill_file_bytes'])}")


class RunLog:
    """log.csv of the run: the history kept from before a resume, then one row per step,
    each flushed as it is written, so a crash loses no finished step.  Without a path
    (the ranks other than 0 of a data-parallel run) it only keeps the rows."""

    def __init__(self, path, history):
        self.rows = list(history)
        self._file = None
        if path is None:
            return
        from gpt2.checkpoint import atomic_writer
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=LOG_FIELDS)
        writer.writeheader()
        writer.writerows(history)
        # Atomic: on a resume the history being rewritten is the file's own.
        with atomic_writer(path) as f:
            f.write(text.getvalue().encode("utf-8"))
        self._file = open(path, "a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=LOG_FIELDS)

    def append(self, row):
        if self._file is not None:
            self._writer.writerow(row)
            self._file.flush()
        self.rows.append(row)

    def close(self):
        if self._file is not None:
            self._file.close()
