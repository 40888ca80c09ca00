"""GPT-2 under a tape memory budget: the same losses, with far less memory."""
import json
import os
import subprocess
import sys

import numpy as np

import adtape
import gpt2

RUN = """
import json, sys
import numpy as np
from plan_worker import harness
from gpt2.config import GPT2Config
from gpt2.model import GPT2
budget = None if sys.argv[1] == "none" else int(sys.argv[1])
kwargs = {{}} if budget is None else {{"memory_budget": budget, "spill_dir": {spill_dir!r}}}
config = GPT2Config.preset("small")
model = GPT2(config, seed=0, engine="tape", tape_kwargs=kwargs)
rng = np.random.default_rng(0)
x = rng.integers(0, 256, (8, 128)).astype(np.int32)
y = rng.integers(0, 256, (8, 128)).astype(np.int32)
with harness().RssSampler(interval=0.001) as rss:
    losses = [model.train_step(x, y, lr=1e-3, weight_decay=0.1)[0] for _ in range(3)]
engine = model._tape_engine
print(json.dumps({{"losses": losses, "tape_bytes": engine.last_forward_bytes,
                  "spills": engine.optape.tape.stats["spills"], "growth": rss.growth}}))
"""


def run(budget, spill_dir):
    # The package roots, and tests/perfmodel/ for the worker's harness (plan_worker.py).
    roots = {os.path.dirname(os.path.dirname(m.__file__)) for m in (adtape, gpt2)}
    roots.add(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perfmodel"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sorted(roots)))
    out = subprocess.run([sys.executable, "-c", RUN.format(spill_dir=str(spill_dir)), str(budget)],
                         capture_output=True, text=True, env=env, check=True, cwd=spill_dir,
                         timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_budget_far_below_activations_gives_the_same_losses(tmp_path):
    budget = 3 << 20
    free = run("none", tmp_path)
    bounded = run(budget, tmp_path)
    assert free["tape_bytes"] > 8 * budget          # the activations dwarf the budget
    assert free["spills"] == 0 and bounded["spills"] > 0
    np.testing.assert_array_equal(bounded["losses"], free["losses"])
    # Without a budget the saved activations are resident at the end of the forward
    # pass; with one, only the budget is (plus the live tensors of one layer).
    assert bounded["growth"] < free["growth"] - free["tape_bytes"] // 2, (bounded, free)
    assert os.listdir(tmp_path) == []
