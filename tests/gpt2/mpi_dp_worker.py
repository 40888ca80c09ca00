"""One rank of the data-parallel tests: ``mpiexec -n 2 python tests/gpt2/mpi_dp_worker.py SCENARIO OUT``.

Rank 0 writes what the test checks as JSON to OUT.  The batches and hyperparameters
come from ``dp_reference`` so the test can replay them in one process.
"""
import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import dp_reference as ref     # beside this script, which Python puts first on sys.path
from gpt2 import distributed
from gpt2.model import GPT2

comm = MPI.COMM_WORLD
rank = comm.Get_rank()


def trainer(engine="tape", zero=0, seed=ref.SEED, config=None, settings=None, **kwargs):
    model = GPT2(config or ref.CONFIG, seed=seed, engine=engine)
    return distributed.DataParallelTrainer(
        model, comm, zero=zero, settings={"seed": seed, **(settings or {})}, **kwargs)


def train(dp, batches):
    out = []
    for x, y in batches:
        loss, norm = dp.train_step(x, y, ref.LR, weight_decay=ref.WEIGHT_DECAY,
                                   grad_clip=ref.GRAD_CLIP)
        out.append((loss, norm))
    return out


def losses():
    result = {}
    batches = ref.batches(ref.STEPS)
    for engine in ("tape", "manual"):
        for zero in (0, 1):
            # Small buckets: several per step, so the hooks launch them one by one.
            dp = trainer(engine, zero, bucket_bytes=ref.BUCKET_BYTES)
            steps = train(dp, batches)
            result[f"{engine}/{zero}"] = {
                "losses": [s[0] for s in steps], "norms": [s[1] for s in steps],
                "buckets": len(dp.layout.bounds), "params_padded": dp.layout.padded,
                "adam_m": int(dp.adam_m.size), "adam_v": int(dp.adam_v.size),
                "model_moments": dp.model.adam_m is not None,
                "buckets_in_backward": dp.last_step["buckets_in_backward"],
                "wte_rows_apart": dp._wte_scratch is not None,
                "params_equal_across_ranks": bool(all(
                    np.array_equal(p, dp.model.params.flat)
                    for p in comm.allgather(dp.model.params.flat)))}
            dp.model.close()
    return result


def checkpoints(directory):
    batches = ref.batches(ref.STEPS)
    half = ref.STEPS // 2
    written = os.path.join(directory, "two_ranks.bin")
    dp = trainer("tape", 1, bucket_bytes=ref.BUCKET_BYTES)
    first = train(dp, batches[:half])
    dp.save_checkpoint(written, step=half, data_state={"position": half})
    result = {"first": [s[0] for s in first]}
    for name, path, zero in (("resume_zero0", written, 0),
                             ("resume_single_zero1", os.path.join(directory, "single.bin"), 1)):
        dp = trainer("tape", zero, seed=ref.SEED + 1, bucket_bytes=ref.BUCKET_BYTES)
        state = dp.load_checkpoint(path)
        result[name] = {"step": state.step, "data_state": state.data_state,
                        "losses": [s[0] for s in train(dp, batches[state.step:])]}
    try:
        dp.load_checkpoint(os.path.join(directory, "missing.bin"))
    except distributed.CollectiveError as e:
        result["missing"] = str(e)
    return result


def sweep_order():
    """One step of a 4-block model with small buckets: each bucket's launch, in launch
    order, as (start, stop, leaves the sweep had made final before it), and the arena
    ranges of the leaves the sweep finishes last (wte, wpe, block 0)."""
    from dataclasses import replace
    dp = trainer(config=replace(ref.CONFIG, n_layer=4), bucket_bytes=ref.BUCKET_BYTES)
    engine = dp.model._tape_engine
    final, launches = [0], []

    def count(leaf, remaining):
        final[0] += remaining == 0

    # Registered after the trainer's hooks: a leaf's own final call counts after the
    # launch it triggers.
    for leaf in engine.leaves():
        leaf.register_grad_hook(count)
    launch = dp._launch

    def recording(b):
        launches.append((*dp.layout.bounds[b], final[0]))
        launch(b)

    dp._launch = recording
    x, y = ref.batches(1)[0]
    dp.train_step(x, y, ref.LR)
    base = dp.grads_padded.ctypes.data

    def extent(leaf):
        start = (leaf.grad.ctypes.data - base) // 4
        return start, start + leaf.grad.size

    wte, wpe = engine.globals["wte"], engine.globals["wpe"]
    last = [wte, wpe, *engine.layers[0].values()]
    return {"launches": launches, "leaves": len(engine.leaves()),
            "last_leaves": [extent(leaf) for leaf in last], "wte": extent(wte)}


def fail(how, out):
    """Rank 1 raises (``raise``, ``raise-debug``: with the traceback) or is killed
    (``kill``) at step 3 while rank 0 waits in the step's collectives.  Each rank
    first writes its process id to OUT.rankR.pid, for the test to check that it ended."""
    with open(f"{out}.rank{rank}.pid", "w") as f:
        f.write(str(os.getpid()))
    batches = ref.batches(6)
    dp = trainer()
    with distributed.abort_on_error(comm, debug=how == "raise-debug"):
        for step, (x, y) in enumerate(batches):
            if step == 3 and rank == 1:
                print(f"failing at {time.time()!r}", file=sys.stderr, flush=True)
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise ValueError("a deliberate failure in the test")
            dp.train_step(x, y, ref.LR)
    return {}


def mismatch(what):
    distributed.install_abort_hook(comm)
    if what == "seq_len":
        trainer(settings={"T": 16 if rank == 0 else 32})
    elif what == "model":
        from dataclasses import replace
        trainer(config=replace(ref.CONFIG, n_layer=ref.CONFIG.n_layer + rank))
    elif what == "batch":
        x, y = ref.batches(1, batch_size=3)[0]
        trainer().train_step(x, y, ref.LR)
    return {}


def main():
    scenario, out = sys.argv[1], sys.argv[2]
    if scenario == "losses":
        result = losses()
    elif scenario == "sweep_order":
        result = sweep_order()
    elif scenario == "checkpoints":
        result = checkpoints(sys.argv[3])
    elif scenario in ("raise", "raise-debug", "kill"):
        result = fail(scenario, out)
    else:
        result = mismatch(scenario)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


main()
