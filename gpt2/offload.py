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

from adtape.statefile import StateFile, aligned_buffer
from gpt2.params import (ParamArena, init_params_, layer_major_offsets, num_parameters,
                         param_offsets)
from gpt2.state import FULL_OFFLOAD_SLOTS, TrainingState
from gpt2.units import FULL_WINDOW, SEGMENT_FLOATS, UNIT_BYTES, WINDOW  # noqa: F401
from kernels import optim



def _stage_runs(stages):
    """[(stage, [indices])] of the runs of equal consecutive labels in ``stages``."""
    runs = []
    for i, stage in enumerate(stages):
        if not runs or runs[-1][0] != stage:
            runs.append((stage, []))
        runs[-1][1].append(i)
    return runs


def _unit_groups(keys, floats, unit_bytes):
    """``keys`` in order, in consecutive groups of at most ``unit_bytes`` of m and v (8
    bytes a float; a key larger than that alone)."""
    groups, size = [], 0
    for key, n in zip(keys, floats):
        if groups and size + 8 * n <= unit_bytes:
            groups[-1].append(key)
            size += 8 * n
        else:
            groups.append([key])
            size = 8 * n
    return groups


class MomentOffload:
    """AdamW moments on disk.  ``segments``: (offset in the parameters, offset in the
    gradients, floats, stage, offset in the saved moment) of every piece, in update order
    (``for_model``: a model's arena, in forward order; ``for_shard``: a ZeRO-1 rank's
    share).  The saved offsets tile the moment a checkpoint holds (llm.c order)."""

    def __init__(self, segments, spill_dir=None, window=WINDOW, unit_bytes=UNIT_BYTES,
                 name="AdamW moments"):
        self.segments = segments = list(segments)
        self.n = sum(s[2] for s in segments)
        self.spill_dir = spill_dir
        # Units: consecutive segments of one stage up to unit_bytes of m and v.
        units, stage_units = [], {}
        for stage, idx in _stage_runs([seg[3] for seg in segments]):
            for group in _unit_groups(idx, [segments[i][2] for i in idx], unit_bytes):
                units.append([group[0], group[-1] + 1])
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
                    record_nbytes.append(4 * segments[i][2])
            record_units.append((first, len(record_nbytes)))
        self.file = StateFile(record_nbytes, record_units, spill_dir=spill_dir,
                              window=window, name=name)
        self.pending = None          # the deferred update's arguments
        self.next_unit = 0           # the first unit the pending update has not reached

    @classmethod
    def for_model(cls, config, spill_dir=None, layer_major=False, segment_floats=SEGMENT_FLOATS,
                  **kwargs):
        """The moments of ``config``'s arena (llm.c order, or ``layer_major``: the
        data-parallel trainer's), in forward order: embedding, block 0, ..., head."""
        lm = layer_major_offsets(config)
        segments = []
        for start, n, stage, name, layer, off in _segments(config, segment_floats):
            at = lm[name, layer][0] + off if layer_major else start
            segments.append((at, at, n, stage, start))
        return cls(segments, spill_dir=spill_dir, **kwargs)

    @classmethod
    def for_shard(cls, pieces, spill_dir=None, segment_floats=SEGMENT_FLOATS, **kwargs):
        """A ZeRO-1 rank's moments: ``pieces`` (offset in the parameters, offset in the
        shard, floats), one per gradient bucket, updated bucket by bucket (stage = the
        bucket's index); saved in shard order."""
        segment_floats = max(16, segment_floats // 16 * 16)
        segments = []
        for b, (p0, s0, n) in enumerate(pieces):
            for off in range(0, n, segment_floats):
                k = min(segment_floats, n - off)
                segments.append((p0 + off, s0 + off, k, b, s0 + off))
        return cls(segments, spill_dir=spill_dir, **kwargs)

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

    def read_ahead(self):
        """Start reading the next update's first units now (the forward pass is over and
        wrote them behind; the backward pass has time to read them back)."""
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
                    a, ga, n, _, _ = self.segments[i]
                    optim.adamw_step(params[a:a + n], grads[ga:ga + n],
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
        """(segment index, saved start, floats) sorted by saved start: they tile the
        saved moment."""
        return sorted(((i, at, n) for i, (_, _, n, _, at) in enumerate(self.segments)),
                      key=lambda s: s[1])

    def moment(self, which):
        """``which`` 0 (m) or 1 (v) as a ``StreamedState`` for save and load."""
        return StreamedState(self, which)

    def pieces(self, which):
        """(saved start, float32 array) of moment ``which`` in saved order, each read from
        disk and checked."""
        self.finish()
        self.file.flush()
        for i, a, n in self.flat_segments():
            yield a, self.file.read_record(self.record[i, which])

    def load(self, which, read_into):
        """Fill moment ``which`` from ``read_into(array)`` called with consecutive pieces
        of the saved order (a checkpoint section read sequentially)."""
        self.finish()
        self.file.flush()
        buf = np.empty(max(s[2] for s in self.segments), np.float32)
        for i, a, n in self.flat_segments():
            piece = buf[:n]
            read_into(piece)
            self.file.write_record(self.record[i, which], piece)

    def read_flat(self, which):
        """One moment as a whole flat array in saved order (tests; a ZeRO-1 shard's
        gather)."""
        out = np.empty(self.n, np.float32)
        for piece_start, piece in self.moment(which).pieces():
            out[piece_start:piece_start + piece.size] = piece
        return out

    def write_flat(self, which, flat):
        """Set one moment from a whole flat array in saved order."""
        self.moment(which).load(_reader(flat))

    def stats(self):
        return dict(self.file.stats, file_bytes=self.file.file_bytes,
                    window_bytes=self.window_bytes)

    def close(self):
        self.pending = None
        self.file.close()


class _OffloadedState(TrainingState):
    """A state whose ``offload`` runs the deferred update and holds the files."""

    def ready(self, stage):
        self.offload.ready(stage)

    def read_ahead(self):
        self.offload.read_ahead()

    def finish(self):
        self.offload.finish()

    def close(self):
        self.offload.close()


class MomentState(_OffloadedState):
    """``--offload moments``: parameters and gradients as arenas in RAM, the moments on
    disk (``offload``, a ``MomentOffload``), each update deferred into the next forward
    pass."""

    def __init__(self, params, grads, offload):
        super().__init__()
        self.params, self.grads, self.offload = params, grads, offload

    @classmethod
    def for_model(cls, config, seed=0, spill_dir=None, layer_major=False):
        params = init_params_(ParamArena(config, layer_major=layer_major), seed)
        return cls(params, ParamArena(config, layer_major=layer_major),
                   MomentOffload.for_model(config, spill_dir=spill_dir, layer_major=layer_major))

    def adamw(self, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, grad_scale=1.0,
              defer=False):
        self.step += 1
        # Deferred: the moments stream in while the next forward pass computes.
        self.offload.begin(self.params.flat, self.grads.flat, self.step, lr, beta1, beta2, eps,
                           weight_decay, grad_scale)

    def sections(self):
        self.finish()
        return self.params, self.offload.moment(0), self.offload.moment(1)

    def load_moment(self, which, flat):
        self.offload.write_flat(which, np.zeros(self.offload.n, np.float32)
                                if flat is None else flat)

    @property
    def nbytes(self):
        return self.params.nbytes + self.grads.nbytes + self.offload.window_bytes


# -- everything offloaded ------------------------------------------------------------------

def _segments(config, segment_floats):
    """Every (parameter, layer) slice in forward order, split at ``segment_floats``:
    (flat start in the arena's llm.c order, floats, stage, name, layer or None, offset
    inside the slice)."""
    # Whole cache lines: the pieces of a split parameter lie back to back in a unit
    # (records start on RECORD_ALIGN bytes), so a slot holds each parameter contiguously.
    segment_floats = max(16, segment_floats // 16 * 16)
    flat = param_offsets(config)
    per_layer = set(config.per_layer)
    segments, seen_block = [], False
    for (name, layer), (lo, hi) in layer_major_offsets(config).items():
        size = hi - lo
        if name in per_layer:
            seen_block = True
            start, stage = flat[name][0] + layer * size, layer
        else:
            start, stage, layer = flat[name][0], ("head" if seen_block else "embed"), None
        for off in range(0, size, segment_floats):
            segments.append((start + off, min(segment_floats, size - off), stage, name, layer, off))
    return segments


class NormPartials:
    """The global gradient norm of an arena whose pieces become final at different times,
    to the bit of ``kernels.optim.grad_norm`` over the whole arena: the partial sums of
    its blocks (``sum_squares_blocks``), the blocks that pieces share staged until whole."""

    def __init__(self, n):
        self.n = n
        self.block = optim.norm_block()
        self.partials = np.zeros((n + self.block - 1) // self.block)
        self.reset()

    def reset(self):
        self.done = np.zeros(len(self.partials), bool)
        self.staged = {}        # block -> [float32 buffer, floats filled]

    def _block_len(self, k):
        return min(self.block, self.n - k * self.block)

    def add(self, start, x):
        """The final gradient ``x`` (flat float32) of elements [start, start + x.size)."""
        B, end = self.block, start + x.size
        # [a, b): the whole blocks inside the piece (the arena's last block may be short);
        # [start, a) and [b, end) lie inside one block each.
        a = min(-(-start // B) * B, end)
        b = end if end == self.n else max(a, end // B * B)
        if a < b:
            k = a // B
            sums = optim.sum_squares_blocks(x[a - start:b - start])
            self.partials[k:k + len(sums)] = sums
            self.done[k:k + len(sums)] = True
        for lo, hi in ((start, a), (b, end)):
            if lo >= hi:
                continue
            k = lo // B
            entry = self.staged.setdefault(k, [np.empty(self._block_len(k), np.float32), 0])
            entry[0][lo - k * B:hi - k * B] = x[lo - start:hi - start]
            entry[1] += hi - lo
            if entry[1] == self._block_len(k):
                self.partials[k] = optim.sum_squares_blocks(entry[0])[0]
                self.done[k] = True
                del self.staged[k]

    def norm(self):
        if not self.done.all():
            raise RuntimeError(f"gradient norm: {int((~self.done).sum())} blocks of the "
                               f"gradient are not final")
        total = 0.0
        for p in self.partials.tolist():    # one by one, in order, as grad_norm adds them
            total += p
        return float(np.sqrt(total))


class FullOffload:
    """``offload="all"``: the blocks' parameters and gradients on disk too, beside every
    AdamW moment; RAM keeps the parameters outside the blocks (embedding, final norm,
    head) with their gradients, ``slots`` blocks' parameters and gradients, and the unit
    buffers.

    Block l runs in slot ``l % slots``: its leaves (``layer_arrays``) are views of the
    slot's buffers, which hold block l's parameters when its forward pass runs (the
    deferred AdamW update reads them, updates them in the slot and writes them behind)
    and again when its backward pass runs (read back as the sweep reaches the block's
    output, ``backward_begin``); its gradients are written once final
    (``backward_done``), and read back by the next update.  The I/O thread reads the
    next block's parameters into the other slot while a block computes.
    """

    def __init__(self, config, spill_dir=None, slots=FULL_OFFLOAD_SLOTS, window=FULL_WINDOW,
                 unit_bytes=UNIT_BYTES, segment_floats=SEGMENT_FLOATS):
        if slots < 2:
            raise ValueError(f"slots must be >= 2, got {slots}")
        self.config = config
        self.n = num_parameters(config)
        self.n_layer = config.n_layer
        self.slots = slots
        shapes = config.param_shapes()
        self.segments = segs = _segments(config, segment_floats)
        self.global_params = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()
                              if name not in config.per_layer}
        self.global_grads = {name: np.zeros_like(p) for name, p in self.global_params.items()}
        # Records and units.  Block l: P (its parameters: read into and written from its
        # slot), G (its gradients: written from the slot, read by the update), then units
        # of m|v records; the globals: m|v units only.
        record_nbytes, units, self.record = [], [], {}
        self.p_unit, self.g_unit, self.mv_units, self._mv_segments = {}, {}, {}, {}
        stages = _stage_runs([seg[2] for seg in segs])

        def add_unit(kind_records):
            first = len(record_nbytes)
            for key, nbytes in kind_records:
                self.record[key] = len(record_nbytes)
                record_nbytes.append(nbytes)
            units.append((first, len(record_nbytes)))
            return len(units) - 1

        for stage, idx in stages:
            if stage not in ("embed", "head"):
                self.p_unit[stage] = add_unit([((i, "p"), 4 * segs[i][1]) for i in idx])
                self.g_unit[stage] = add_unit([((i, "g"), 4 * segs[i][1]) for i in idx])
            self.mv_units[stage] = []
            for g in _unit_groups(idx, [segs[i][1] for i in idx], unit_bytes):
                u = add_unit([((i, "m"), 4 * segs[i][1]) for i in g]
                             + [((i, "v"), 4 * segs[i][1]) for i in g])
                self.mv_units[stage].append(u)
                self._mv_segments[u] = g
        self.stages = [stage for stage, _ in stages]
        self.stage_segments = {stage: idx for stage, idx in stages}
        pooled = [u for us in self.mv_units.values() for u in us] + list(self.g_unit.values())
        self.file = StateFile(record_nbytes, units, spill_dir=spill_dir, window=window,
                              name="model state", pooled=pooled)
        # The slots: one block's P and G units each, in the units' own layout.
        f = self.file
        p0, g0 = self.p_unit[0], self.g_unit[0]
        self.slot_p = [aligned_buffer(f.unit_nbytes[p0]) for _ in range(slots)]
        self.slot_g = [aligned_buffer(f.unit_nbytes[g0]) for _ in range(slots)]
        self.slot_layer = [None] * slots     # whose parameters the slot holds (or is reading)
        self.slot_g_unit = [None] * slots    # the G unit last written from the slot
        self._arrays = [self._slot_arrays(s) for s in range(slots)]
        self.norm_partials = NormPartials(self.n)
        self.pending = None
        self.next_stage = 0

    # -- the slots ---------------------------------------------------------------------

    def _slot_arrays(self, s):
        """name -> (parameter view, gradient view) of block-shaped arrays in slot s."""
        f, shapes, out = self.file, self.config.param_shapes(), {}
        for i in self.stage_segments[0]:
            _, n, _, name, _, off = self.segments[i]
            if off:
                continue        # a later piece of a parameter split into segments
            size = int(np.prod(shapes[name][1:]))
            p0 = f.record_offset[self.record[i, "p"]]
            last = max(j for j in self.stage_segments[0] if self.segments[j][3] == name)
            assert f.record_offset[self.record[last, "p"]] + 4 * self.segments[last][1] == p0 + 4 * size
            g0 = f.record_offset[self.record[i, "g"]]
            out[name] = (self.slot_p[s][p0:p0 + 4 * size].view(np.float32).reshape(shapes[name][1:]),
                         self.slot_g[s][g0:g0 + 4 * size].view(np.float32).reshape(shapes[name][1:]))
        return out

    def layer_arrays(self, l):
        """Block l's (parameter, gradient) arrays by name: views of its slot."""
        return self._arrays[l % self.slots]

    def _unit_of_layer(self, kind, l):
        return (self.p_unit if kind == "p" else self.g_unit)[l]

    def _load_params(self, l, wait=True):
        """Queue the read of block l's parameters into its slot (unless it holds them)."""
        s = l % self.slots
        if self.slot_layer[s] != l:
            self.file.read_into(self.p_unit[l], self.slot_p[s])
            self.slot_layer[s] = l
        if wait:
            # Read in; the write behind of an update that just ran in the slot may still
            # be going (the forward pass only reads the parameters, and the slot's next
            # read is queued behind that write).
            self.file.wait(self.p_unit[l], writes=False)

    def _prefetch_params(self, l):
        if 0 <= l < self.n_layer:
            self._load_params(l, wait=False)

    def ensure_params(self, l):
        """Block l's parameters in its slot (a forward pass with no update pending)."""
        self._load_params(l)
        self._prefetch_params(l + 1)

    def backward_begin(self, l):
        """The sweep reached block l's output: its parameters back into its slot, and the
        slot's gradients free to be written over."""
        s = l % self.slots
        if self.slot_g_unit[s] is not None:
            self.file.wait(self.slot_g_unit[s])
        self._load_params(l)
        self._prefetch_params(l - 1)

    def backward_done(self, l):
        """Block l's gradients are final: into the norm, then written behind."""
        s = l % self.slots
        for i in self.stage_segments[l]:
            start, n, _, name, _, off = self.segments[i]
            g = self._arrays[s][name][1].reshape(-1)
            self.norm_partials.add(start, g[off:off + n])
        self.file.write_from(self.g_unit[l], self.slot_g[s])
        self.slot_g_unit[s] = self.g_unit[l]

    def grad_norm(self):
        """The global norm of this step's gradients (every block's final by now)."""
        flat = param_offsets(self.config)
        for name, g in self.global_grads.items():
            self.norm_partials.add(flat[name][0], g.reshape(-1))
        return self.norm_partials.norm()

    def reset_norm(self):
        self.norm_partials.reset()

    # -- the deferred update -------------------------------------------------------------

    def begin(self, step, lr, beta1, beta2, eps, weight_decay, grad_scale):
        self.finish()
        self.file.flush()      # the gradients written behind are on disk
        self.pending = (step, lr, beta1, beta2, eps, weight_decay, grad_scale)
        self.next_stage = 0
        order = []
        for stage in self.stages:
            if stage in self.g_unit:
                order.append(self.g_unit[stage])
            order += self.mv_units[stage]
        self.file.prefetch(order)
        self._prefetch_params(0)

    def read_ahead(self):
        """Start reading the next update's moments now (written behind during the forward
        pass); not the gradients, which the backward pass is about to write."""
        self.file.prefetch([u for stage in self.stages for u in self.mv_units[stage]])

    def ready(self, stage):
        """Before the forward pass runs ``stage``: its update if one is pending (and every
        earlier stage's), else its parameters loaded."""
        if self.pending is not None:
            self._update_through(self.stages.index(stage))
        if stage not in ("embed", "head"):
            self.ensure_params(stage)

    def finish(self):
        if self.pending is not None:
            self._update_through(len(self.stages) - 1)

    def _update_through(self, last):
        step, lr, b1, b2, eps, wd, scale = self.pending
        f = self.file
        while self.next_stage <= last:
            stage = self.stages[self.next_stage]
            block = stage not in ("embed", "head")
            try:
                if block:
                    self._load_params(stage)
                    self._prefetch_params(stage + 1)
                    gbuf = f.acquire(self.g_unit[stage])
                    arrays = self._arrays[stage % self.slots]
                for u in self.mv_units[stage]:
                    buf = f.acquire(u)
                    try:
                        for i in self._mv_segments[u]:
                            _, n, _, name, _, off = self.segments[i]
                            if block:
                                p = arrays[name][0].reshape(-1)[off:off + n]
                                g = f.record_view(gbuf, self.record[i, "g"])
                            else:
                                p = self.global_params[name].reshape(-1)[off:off + n]
                                g = self.global_grads[name].reshape(-1)[off:off + n]
                            optim.adamw_step(p, g, f.record_view(buf, self.record[i, "m"]),
                                             f.record_view(buf, self.record[i, "v"]),
                                             step, lr, b1, b2, eps, wd, grad_scale=scale)
                    except BaseException:
                        f.release(u, dirty=False)
                        raise
                    f.release(u, dirty=True)
                if block:
                    f.release(self.g_unit[stage], dirty=False)
                    f.write_from(self.p_unit[stage], self.slot_p[stage % self.slots])
            except BaseException:
                self.pending = None
                raise
            self.next_stage += 1
        if self.next_stage == len(self.stages):
            self.pending = None

    # -- whole arenas in llm.c order (checkpoints, sampling, exports) ---------------------

    def flat_segments(self):
        return sorted(range(len(self.segments)), key=lambda i: self.segments[i][0])

    def pieces(self, kind):
        """(flat start, float32 array) in llm.c order of "p" (parameters), "m" or "v"."""
        self.finish()
        self.file.flush()
        for i in self.flat_segments():
            start, n, _, name, layer, off = self.segments[i]
            if kind == "p" and layer is None:
                yield start, self.global_params[name].reshape(-1)[off:off + n]
            else:
                yield start, self.file.read_record(self.record[i, kind])

    def load(self, kind, read_into):
        """Fill "p", "m" or "v" from ``read_into(array)`` called in llm.c order."""
        self.finish()
        self.file.flush()
        buf = np.empty(max(s[1] for s in self.segments), np.float32)
        for i in self.flat_segments():
            start, n, _, name, layer, off = self.segments[i]
            if kind == "p" and layer is None:
                read_into(self.global_params[name].reshape(-1)[off:off + n])
            else:
                piece = buf[:n]
                read_into(piece)
                self.file.write_record(self.record[i, kind], piece)
        if kind == "p":
            self.slot_layer = [None] * self.slots      # the slots hold stale parameters

    def stats(self):
        return dict(self.file.stats, file_bytes=self.file.file_bytes,
                    window_bytes=self.file.window * self.file._pool_bytes
                    + sum(b.nbytes for b in self.slot_p + self.slot_g))

    def close(self):
        self.pending = None
        self.file.close()


class StreamedState:
    """One piece of offloaded state as a checkpoint section, streamed in its saved order
    (``pieces()`` and ``load(read_into)``, as an arena's): a ``MomentOffload``'s moment 0
    or 1, or a ``FullOffload``'s "p" (parameters), "m" or "v"."""

    def __init__(self, offload, kind):
        self.offload = offload
        self.kind = kind
        self.config = getattr(offload, "config", None)
        self.nbytes = 4 * offload.n

    def pieces(self):
        return self.offload.pieces(self.kind)

    def load(self, read_into):
        self.offload.load(self.kind, read_into)


class FullOffloadState(_OffloadedState):
    """``--offload all``: parameters, gradients and moments in a ``FullOffload``
    (``offload``); RAM holds the parameters outside the blocks, two blocks' slots and
    the unit buffers.  Each backward pass writes the gradients anew (no accumulation),
    and their norm is summed as the sweep finishes each block."""

    accumulates = False
    streams_blocks = True

    def __init__(self, offload):
        super().__init__()
        self.offload = offload

    @classmethod
    def for_model(cls, config, seed=0, spill_dir=None):
        state = cls(FullOffload(config, spill_dir=spill_dir))
        state.set_params(init_params_(ParamArena(config), seed))
        return state

    def zero_grad(self):
        """Nothing to zero: each backward pass writes the gradients anew."""

    def begin_step(self):
        self.offload.reset_norm()

    def grad_norm(self):
        return self.offload.grad_norm()

    def clip_grad_norm(self, max_norm):
        raise NotImplementedError("with offload='all' the gradients are on disk: clip "
                                  "through train_step(..., grad_clip=)")

    def adamw(self, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, grad_scale=1.0,
              defer=False):
        self.step += 1
        self.offload.begin(self.step, lr, beta1, beta2, eps, weight_decay, grad_scale)

    def backward_begin(self, l):
        self.offload.backward_begin(l)

    def backward_done(self, l):
        self.offload.backward_done(l)

    def layer_arrays(self, l):
        return self.offload.layer_arrays(l)

    def sections(self):
        self.finish()
        return tuple(StreamedState(self.offload, kind) for kind in "pmv")

    def param_arena(self):
        arena = ParamArena(self.offload.config)
        for start, piece in self.offload.pieces("p"):
            arena.flat[start:start + piece.size] = piece
        return arena

    def set_params(self, arena):
        self.offload.load("p", _reader(arena.in_llmc_order().flat))

    def load_moment(self, which, flat):
        self.offload.load("mv"[which], _reader(np.zeros(self.offload.n, np.float32)
                                               if flat is None else flat))

    @property
    def nbytes(self):
        return (sum(2 * p.nbytes for p in self.offload.global_params.values())
                + self.offload.stats()["window_bytes"])


def _reader(flat):
    """A ``read_into(piece)`` that fills consecutive pieces from ``flat``."""
    position = [0]

    def read_into(piece):
        piece[...] = flat[position[0]:position[0] + piece.size]
        position[0] += piece.size
    return read_into
