"""The data-parallel tests' model, batches and hyperparameters, shared by the MPI worker
(tests/gpt2/mpi_dp_worker.py) and the one-process reference in tests/gpt2/test_distributed.py."""
import numpy as np

from gpt2.config import GPT2Config
from gpt2.model import GPT2

CONFIG = GPT2Config.preset("tiny")
SEED = 3
STEPS = 10
GLOBAL_B, T = 4, 16
LR, WEIGHT_DECAY = 3e-3, 0.1
# Below the gradient's norm in every step, so the clipping is exercised throughout.
GRAD_CLIP = 0.5
# Many buckets for the tiny model (140 KB of gradients), launched one by one.
BUCKET_BYTES = 8 << 10


def batches(n, batch_size=GLOBAL_B):
    rng = np.random.default_rng(11)
    return [tuple(rng.integers(0, CONFIG.vocab_size, (batch_size, T)).astype(np.int32)
                  for _ in range(2)) for _ in range(n)]


def single_process(engine, steps=STEPS, model=None):
    """(losses, norms, model) of one process on the whole global batches."""
    model = model or GPT2(CONFIG, seed=SEED, engine=engine)
    losses, norms = [], []
    for x, y in batches(STEPS)[model.adam_step:steps]:
        loss, norm = model.train_step(x, y, LR, weight_decay=WEIGHT_DECAY, grad_clip=GRAD_CLIP)
        losses.append(loss)
        norms.append(norm)
    return losses, norms, model
