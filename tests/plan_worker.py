"""Train a preset for a few steps under a memory plan's engine arguments, in a fresh
process, sampling its RSS: ``python tests/plan_worker.py NAME KWARGS_JSON`` prints the
losses (hex), the peak RSS and the fastest step's ms as JSON.  ``train`` runs it (the
planner tests of both families)."""
import json
import os
import subprocess
import sys
import threading
import time

B, T, STEPS = 32, 64, 3


def train(name, kwargs, cwd):
    import adtape
    import gpt2
    roots = {os.path.dirname(os.path.dirname(m.__file__)) for m in (adtape, gpt2)}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(roots))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), name, json.dumps(kwargs)],
                         capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(name, kwargs):
    import numpy as np
    import psutil
    from gpt2.config import preset
    from gpt2.model import GPT2
    config = preset(name)
    proc = psutil.Process()
    peak = proc.memory_info().rss
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    model = GPT2(config, seed=0, engine="tape", **kwargs)
    rng = np.random.default_rng(0)
    x = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    losses, times = [], []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        losses.append(model.train_step(x, y, lr=1e-3, weight_decay=0.1)[0])
        times.append(time.perf_counter() - t0)
    done.set()
    sampler.join()
    peak = max(peak, proc.memory_info().rss)
    print(json.dumps({"losses": [float(v).hex() for v in losses], "peak": peak,
                      "ms": 1e3 * min(times)}))


if __name__ == "__main__":
    # This file's directory is sys.path[0]: the package comes from PYTHONPATH.
    sys.path.pop(0)
    main(sys.argv[1], json.loads(sys.argv[2]))
