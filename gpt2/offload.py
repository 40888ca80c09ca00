"""AdamW moments on disk (``--offload moments``): 8 bytes per parameter out of RAM.

The two moments of every parameter live in an ``adtape.statefile.StateFile`` on the
tape's disk tier, laid out in the order the forward pass uses the parameters: the
embedding's, block 0's, ..., block L-1's, then the final norm's and the head's.  Each
(parameter, layer) slice is a *segment* (split at ``SEGMENT_FLOATS``), with one record
per moment; segments are grouped into I/O units of about ``UNIT_BYTES``, never across
a block boundary.

The update is deferred into the next forward pass: ``begin`` (called where the
in-memory AdamW would run, once the gradients and their global norm are final) asks
the I/O thread to read the first units; ``ready(stage)`` (called by the engine before
the embedding, before each block and before the head) updates the units of that
stage - the AdamW kernel on the stage's parameters, gradients and the unit's moments
- and hands them back to be written behind.  So the disk streams the moments while
the forward pass computes, and the update is the in-memory one element for element
(the same kernel, the same gradient scale): bit-identical.  ``finish`` completes a
pending update at once (before anything else reads the parameters: a checkpoint, an
evaluation, a sample).
"""
import numpy as np

from adtape.statefile import StateFile
from gpt2.params import layer_major_offsets, num_parameters, param_offsets
from kernels import optim

SEGMENT_FLOATS = 4 << 20     # 16 MiB per moment record at most
UNIT_BYTES = 64 << 20        # m and v of the segments of one I/O unit
WINDOW = 6                   # unit buffers: read ahead and written behind


class MomentOffload:
    """The AdamW moments of a model's parameter arena (its flat, llm.c order), on disk."""

    def __init__(self, config, spill_dir=None, window=WINDOW, unit_bytes=UNIT_BYTES,
                 segment_floats=SEGMENT_FLOATS):
        self.config = config
        self.n = num_parameters(config)
        flat = param_offsets(config)
        per_layer = set(config.per_layer)
        # Segments in forward order: (flat start, floats, stage), stage "embed", l or "head".
        segments = []
        seen_block = False
        for (name, layer), (lo, hi) in layer_major_offsets(config).items():
            if name in per_layer:
                seen_block = True
                start = flat[name][0] + layer * (hi - lo)
                stage = layer
            else:
                start = flat[name][0]
                stage = "head" if seen_block else "embed"
            for a in range(start, start + (hi - lo), segment_floats):
                segments.append((a, min(segment_floats, start + (hi - lo) - a), stage))
        self.segments = segments
        # Units: consecutive segments of one stage up to unit_bytes of m and v.
        units, stage_units = [], {}
        for i, (_, n, stage) in enumerate(segments):
            if (units and segments[units[-1][0]][2] == stage
                    and 8 * (n + sum(segments[j][1] for j in range(*units[-1]))) <= unit_bytes):
                units[-1][1] = i + 1
            else:
                units.append([i, i + 1])
                stage_units.setdefault(stage, []).append(len(units) - 1)
        self.unit_segments = [range(a, b) for a, b in units]
        self.stage_last_unit = {stage: us[-1] for stage, us in stage_units.items()}
        # Records: unit by unit, the m of its segments, then their v.
        record_nbytes, record_units, self.record = [], [], {}
        for a, b in units:
            first = len(record_nbytes)
            for moment in (0, 1):
                for i in range(a, b):
                    self.record[i, moment] = len(record_nbytes)
                    record_nbytes.append(4 * segments[i][1])
            record_units.append((first, len(record_nbytes)))
        self.file = StateFile(record_nbytes, record_units, spill_dir=spill_dir,
                              window=window, name="AdamW moments")
        self.pending = None          # the deferred update's arguments
        self.next_unit = 0           # the first unit the pending update has not reached

    @property
    def path(self):
        return self.file.path

    @property
    def window_bytes(self):
        return self.file.window * max(self.file.unit_nbytes)

    # -- the deferred update ------------------------------------------------------------

    def begin(self, params, grads, step, lr, beta1, beta2, eps, weight_decay, grad_scale):
        """Start an AdamW update of ``params`` (flat float32) from ``grads``: its units
        are read ahead now and updated by ``ready`` / ``finish``."""
        self.finish()
        self.pending = (params, grads, step, lr, beta1, beta2, eps, weight_decay, grad_scale)
        self.next_unit = 0
        self.file.prefetch(range(len(self.unit_segments)))

    def ready(self, stage):
        """Update every unit up to the last of ``stage`` (no-op without a pending update
        or once done)."""
        if self.pending is not None and stage in self.stage_last_unit:
            self._update_through(self.stage_last_unit[stage])

    def finish(self):
        """Complete the pending update, if any."""
        if self.pending is not None:
            self._update_through(len(self.unit_segments) - 1)

    def _update_through(self, last):
        params, grads, step, lr, b1, b2, eps, wd, scale = self.pending
        f = self.file
        while self.next_unit <= last:
            u = self.next_unit
            buf = f.acquire(u)
            try:
                for i in self.unit_segments[u]:
                    a, n, _ = self.segments[i]
                    optim.adamw_step(params[a:a + n], grads[a:a + n],
                                     f.record_view(buf, self.record[i, 0]),
                                     f.record_view(buf, self.record[i, 1]),
                                     step, lr, b1, b2, eps, wd, grad_scale=scale)
            except BaseException:
                f.release(u, dirty=False)
                self.pending = None
                raise
            f.release(u, dirty=True)
            self.next_unit = u + 1
        if self.next_unit == len(self.unit_segments):
            self.pending = None

    # -- whole moments, in the arena's flat order (checkpoints) ------------------------------

    def flat_segments(self):
        """(segment index, flat start, floats) sorted by flat start: they tile the arena."""
        return sorted(((i, a, n) for i, (a, n, _) in enumerate(self.segments)),
                      key=lambda s: s[1])

    def moment(self, which):
        """``which`` 0 (m) or 1 (v) as a ``StreamedMoment`` for save and load."""
        return StreamedMoment(self, which)

    def read_flat(self, which):
        """One moment as a whole flat array (tests and small models)."""
        out = np.empty(self.n, np.float32)
        for piece_start, piece in self.moment(which).pieces():
            out[piece_start:piece_start + piece.size] = piece
        return out

    def stats(self):
        return dict(self.file.stats, file_bytes=self.file.file_bytes,
                    window_bytes=self.window_bytes)

    def close(self):
        self.pending = None
        self.file.close()


class StreamedMoment:
    """One AdamW moment of a ``MomentOffload``, read or written segment by segment in the
    arena's flat order (what ``gpt2.checkpoint`` streams instead of an arena)."""

    def __init__(self, offload, which):
        self.offload = offload
        self.which = which
        self.nbytes = 4 * offload.n

    def pieces(self):
        """(flat start, float32 array) in flat order, each read from disk and checked."""
        off = self.offload
        off.finish()
        off.file.flush()
        for i, a, n in off.flat_segments():
            yield a, off.file.read_record(off.record[i, self.which])

    def load(self, read_into):
        """Fill this moment from ``read_into(array)`` called with consecutive pieces of the
        flat order (a checkpoint section read sequentially)."""
        off = self.offload
        off.finish()
        off.file.flush()
        buf = np.empty(max(n for _, n, _ in off.segments), np.float32)
        for i, a, n in off.flat_segments():
            piece = buf[:n]
            read_into(piece)
            off.file.write_record(off.record[i, self.which], piece)
