"""Training beyond RAM, end to end on the tiny model: every memory policy gives the
in-memory run's losses bit for bit over 100 steps, with a bounded spill file and RSS
that does not grow from step to step."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import adtape
import gpt2

STEPS = 100
B, T = 4, 32
# Far below the tiny model's saved activations at (4, 32) (about 0.54 MiB a step).
BUDGET = 64 << 10
# The tape's defaults (slabs smaller than the spill unit, prefetch on) at two budgets,
# and small sizes that cross every boundary.
TAPES = {"defaults": {"memory_budget": BUDGET},
         "defaults-half": {"memory_budget": 4 * BUDGET},
         "small": {"memory_budget": BUDGET, "slab_size": 8 << 10, "spill_unit": 16 << 10,
                   "prefetch_depth": 2}}

RUN = r"""
import json, sys
import numpy as np, psutil
from gpt2.config import GPT2Config
from gpt2.model import GPT2
policy = json.loads(sys.argv[1])
model = GPT2(GPT2Config.preset("tiny"), seed=0, engine="tape", **policy)
rng = np.random.default_rng(0)
proc = psutil.Process()
losses, rss, spill_file, spills, saved, peaks = [], [], [], 0, 0, {{}}
for step in range({steps}):
    x = rng.integers(0, 256, ({B}, {T})).astype(np.int32)
    y = rng.integers(0, 256, ({B}, {T})).astype(np.int32)
    losses.append(model.train_step(x, y, lr=1e-3, weight_decay=0.1, grad_clip=1.0)[0])
    stats = model._tape_engine.optape.tape.stats
    rss.append(proc.memory_info().rss)
    spill_file.append(stats["spill_file_bytes"] - stats["spilled_bytes"])
    spills = stats["spills"]
    saved = max(saved, model._tape_engine.last_forward_bytes)
    peaks = {{k: stats.get(k, 0) for k in ("peak_spilled_bytes", "peak_spill_file_bytes")}}
print(json.dumps({{"losses": losses, "rss": rss, "spill_file": spill_file, "spills": spills,
                  "saved": saved, **peaks}}))
"""


def train(policy, tmp_path):
    roots = {os.path.dirname(os.path.dirname(m.__file__)) for m in (adtape, gpt2)}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(roots))
    out = subprocess.run([sys.executable, "-c", RUN.format(steps=STEPS, B=B, T=T), json.dumps(policy)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def in_memory(tmp_path_factory):
    return train({}, tmp_path_factory.mktemp("memory"))


POLICIES = {
    "budget": {"tape_kwargs": TAPES["defaults"]},
    "budget-half": {"tape_kwargs": TAPES["defaults-half"]},
    "budget-small-slabs": {"tape_kwargs": TAPES["small"]},
    "layer": {"checkpointing": "layer"},
    "binomial": {"checkpointing": "binomial", "snapshots": 1},
    "layer+budget": {"checkpointing": "layer", "tape_kwargs": TAPES["small"]},
    "binomial+budget": {"checkpointing": "binomial", "snapshots": 1, "tape_kwargs": TAPES["small"]},
}


@pytest.mark.parametrize("name", POLICIES)
def test_policy_trains_like_memory_within_bounds(name, in_memory, tmp_path):
    policy = dict(POLICIES[name])
    if "tape_kwargs" in policy:
        policy["tape_kwargs"] = {**policy["tape_kwargs"], "spill_dir": str(tmp_path)}
    run = train(policy, tmp_path)
    np.testing.assert_array_equal(run["losses"], in_memory["losses"])
    if "tape_kwargs" in policy:
        assert in_memory["saved"] > 2 * policy["tape_kwargs"]["memory_budget"]
        assert run["spills"] > STEPS                  # and spilled in every step
        # The spill file holds at most one spill unit beyond the bytes spilled, and so
        # does not grow from step to step.
        unit = policy["tape_kwargs"].get("spill_unit", 1 << 20)
        assert max(run["spill_file"]) <= unit, run["spill_file"]
        # And at its largest, mid-step: the most bytes on disk plus one unit and each
        # page-aligned slab's padding to the O_DIRECT block.
        slab = policy["tape_kwargs"].get("slab_size", 2 << 20)
        padding = 4096 * (run["peak_spilled_bytes"] // slab + 1)
        assert 0 < run["peak_spilled_bytes"] < in_memory["saved"]
        assert run["peak_spill_file_bytes"] <= run["peak_spilled_bytes"] + unit + padding, run
    # No growth once warm: the last 90 steps stay within 4 MiB of step 10's RSS.
    rss = np.array(run["rss"])
    assert rss[10:].max() - rss[9] <= 4 << 20, (rss[9], rss[10:].max())
