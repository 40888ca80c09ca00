"""One rank of the LoRA data-parallel test: ``mpiexec -n 2 python lora_dp_worker.py OUT``.

Rank 0 also trains one process on the whole batch (the reference) and writes what the
test checks as JSON to OUT.  Rank 1 builds its model from another seed (another base,
other adapters): the trainer must hand it rank 0's.
"""
import json
import os
import sys
import zlib

import numpy as np
from mpi4py import MPI

from gpt2 import checkpoint as ckpt
from gpt2 import distributed
from gpt2.config import LlamaConfig
from gpt2.lora import LoraConfig
from gpt2.model import Model

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
RANKS = comm.Get_size()
CONFIG = LlamaConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96,
                     vocab_size=256, block_size=64)
LORA = LoraConfig(r=2, alpha=4.0)
SEED, STEPS, B, T = 3, 4, 4, 16
LR, WEIGHT_DECAY, GRAD_CLIP = 1e-2, 0.1, 0.05
BUCKET_BYTES = 2048         # several buckets, so the sweep's hooks launch them one by one


def batches():
    rng = np.random.default_rng(SEED)
    return [(rng.integers(0, CONFIG.vocab_size, (B, T)), rng.integers(0, CONFIG.vocab_size, (B, T)))
            for _ in range(STEPS)]


def relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def base_crc(model):
    base = model.params
    arrays = [base.flat] if hasattr(base, "flat") else base.views.values()
    crc = 0
    for array in arrays:
        crc = zlib.crc32(memoryview(np.ascontiguousarray(array)).cast("B"), crc)
    return crc


def same_on_every_rank(value):
    return all(v == value for v in comm.allgather(value))


def train(out_dir):
    result = {}
    for zero, base_dtype in ((0, "fp32"), (1, "fp32"), (1, "bf16")):
        reference = None
        if rank == 0:
            reference = Model(CONFIG, seed=SEED, lora=LORA, base_dtype=base_dtype)
            # The one process runs the ranks' rows as its micro-batches, in rank order, as
            # the ranks' reduction adds them: the same float32 sums (on the whole batch
            # at once they differ in the last bits, which AdamW's division by the root of
            # near-zero second moments magnifies, and a bf16 base's rounding of the
            # gradients to bf16 can turn into whole bf16 steps).
            ref_steps = [reference.train_step(x, y, LR, weight_decay=WEIGHT_DECAY,
                                              grad_clip=GRAD_CLIP,
                                              grad_accum=RANKS)
                         for x, y in batches()]
        model = Model(CONFIG, seed=SEED + rank, lora=LORA, base_dtype=base_dtype)
        dp = distributed.DataParallelTrainer(model, comm, zero=zero, bucket_bytes=BUCKET_BYTES)
        got = {"base_equal_across_ranks": same_on_every_rank(base_crc(model))}
        steps = [dp.train_step(x, y, LR, weight_decay=WEIGHT_DECAY, grad_clip=GRAD_CLIP)
                 for x, y in batches()]
        got.update(
            adapters_equal_across_ranks=same_on_every_rank(
                zlib.crc32(memoryview(model.adapter.params.flat).cast("B"))),
            buckets=len(dp.layout.bounds),
            buckets_in_backward=dp.last_step["buckets_in_backward"],
            trainer_moments=int(dp.adam_m.size), padded=dp.layout.padded,
            adapter_parameters=model.adapter.num_parameters,
            model_moments=model.adapter.adam_m is not None)
        path = os.path.join(out_dir, f"zero{zero}-{base_dtype}.bin")
        dp.save_checkpoint(path, step=STEPS)
        if rank == 0:
            saved = ckpt.load_checkpoint(path, CONFIG, lora=True)
            got.update(
                losses=relative([s[0] for s in steps], [s[0] for s in ref_steps]),
                norms=relative([s[1] for s in steps], [s[1] for s in ref_steps]),
                clipped=min(s[1] for s in ref_steps) > GRAD_CLIP,
                adapters=relative(model.adapter.params.flat, reference.adapter.params.flat),
                adapters_equal=bool(np.array_equal(model.adapter.params.flat,
                                                   reference.adapter.params.flat)),
                saved_adapters=relative(saved.params.flat, reference.adapter.params.flat),
                saved_adam_v=relative(saved.adam_v.flat, reference.adapter.adam_v.flat),
                saved_extra=saved.extra)
            reference.close()
        model.close()
        result[f"zero{zero}/{base_dtype}"] = got
    # A LoRA trainer reads back what it wrote, and refuses another run's adapters.
    model = Model(CONFIG, seed=SEED + 1, lora=LORA)
    dp = distributed.DataParallelTrainer(model, comm, zero=1)
    state = dp.load_checkpoint(os.path.join(out_dir, "zero0-fp32.bin"))
    restored = same_on_every_rank(zlib.crc32(memoryview(model.adapter.params.flat).cast("B")))
    if rank == 0:
        saved = ckpt.load_checkpoint(os.path.join(out_dir, "zero0-fp32.bin"), CONFIG, lora=True)
        restored = restored and np.array_equal(model.adapter.params.flat, saved.params.flat)
    result["reloaded"] = {"step": state.step, "adam_step": state.adam_step,
                          "adapters_restored": bool(restored)}
    other = Model(CONFIG, seed=SEED, lora=LoraConfig(r=2, alpha=8.0))
    try:
        distributed.DataParallelTrainer(other, comm).load_checkpoint(
            os.path.join(out_dir, "zero0-fp32.bin"))
    except distributed.CollectiveError as e:
        result["other_adapters"] = str(e)
    # Dropout: every rank its own masks, rank 0 the one process's.
    dropout = LoraConfig(r=2, dropout=0.25)
    model = Model(CONFIG, seed=SEED, lora=dropout)
    distributed.DataParallelTrainer(model, comm)
    streams = comm.allgather(model.adapter.rng.bit_generator.state)
    alone = Model(CONFIG, seed=SEED, lora=dropout).adapter.rng.bit_generator.state
    result["dropout"] = {"ranks_differ": streams[0] != streams[1],
                         "rank0_is_one_process": streams[0] == alone}
    return result


def main():
    out = sys.argv[1]
    result = train(os.path.dirname(out))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
