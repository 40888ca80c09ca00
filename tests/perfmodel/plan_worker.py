"""Train a preset for a few steps under a memory plan's engine arguments, in a fresh
process, sampling its RSS: ``python tests/perfmodel/plan_worker.py NAME KWARGS_JSON`` prints the
losses (hex), the peak RSS and the fastest step's ms as JSON.  ``train`` runs it (the
planner tests of both families).  ``RssPeak`` samples a worker's RSS (here and in
tests/gpt2/test_gpt2_memory.py's worker)."""
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


class RssPeak:
    """This process's peak RSS from construction to ``stop()``: ``base`` (at the start)
    and ``peak``, sampled every ``interval`` seconds on a daemon thread and once more
    at the stop."""

    def __init__(self, interval):
        import psutil
        self._proc = psutil.Process()
        self.base = self.peak = self._proc.memory_info().rss
        self._interval = interval
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._done.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self._interval)

    def stop(self):
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def main(name, kwargs):
    import numpy as np
    from gpt2.config import preset
    from gpt2.model import GPT2
    config = preset(name)
    rss = RssPeak(0.0005)      # from before the model is built
    model = GPT2(config, seed=0, engine="tape", **kwargs)
    rng = np.random.default_rng(0)
    x = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    losses, times = [], []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        losses.append(model.train_step(x, y, lr=1e-3, weight_decay=0.1)[0])
        times.append(time.perf_counter() - t0)
    rss.stop()
    print(json.dumps({"losses": [float(v).hex() for v in losses], "peak": rss.peak,
                      "ms": 1e3 * min(times)}))


if __name__ == "__main__":
    # This file's directory is sys.path[0]: the package comes from PYTHONPATH.
    sys.path.pop(0)
    main(sys.argv[1], json.loads(sys.argv[2]))
