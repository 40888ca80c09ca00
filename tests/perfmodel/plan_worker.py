"""Train a preset for a few steps under a memory plan's engine arguments, in a fresh
process, sampling its RSS: ``python tests/perfmodel/plan_worker.py NAME KWARGS_JSON`` prints the
losses (hex), the peak RSS and the fastest step's ms as JSON.  ``train`` runs it (the
planner tests of both families).  ``harness()`` gives bench/harness.py, whose
``RssSampler`` samples a worker's RSS (here and in tests/gpt2/test_gpt2_memory.py's worker)."""
import importlib.util
import json
import os
import subprocess
import sys
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


def harness():
    """bench/harness.py (its ``RssSampler``), loaded by its path in this worker process
    as conftest.py loads it in the tests': bench/ never goes on sys.path, whose scripts
    would shadow the packages."""
    if "harness" not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                            "bench", "harness.py")
        spec = importlib.util.spec_from_file_location("harness", path)
        sys.modules["harness"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["harness"])
    return sys.modules["harness"]


def main(name, kwargs):
    import numpy as np
    from gpt2.config import preset
    from gpt2.model import GPT2
    config = preset(name)
    with harness().RssSampler(interval=0.0005) as rss:      # from before the model is built
        model = GPT2(config, seed=0, engine="tape", **kwargs)
        rng = np.random.default_rng(0)
        x = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
        y = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
        losses, times = [], []
        for _ in range(STEPS):
            t0 = time.perf_counter()
            losses.append(model.train_step(x, y, lr=1e-3, weight_decay=0.1)[0])
            times.append(time.perf_counter() - t0)
    print(json.dumps({"losses": [float(v).hex() for v in losses], "peak": rss.peak,
                      "ms": 1e3 * min(times)}))


if __name__ == "__main__":
    # This file's directory is sys.path[0]: the package comes from PYTHONPATH.
    sys.path.pop(0)
    main(sys.argv[1], json.loads(sys.argv[2]))
