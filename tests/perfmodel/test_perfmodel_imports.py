"""The performance model is pure Python: it imports without the compiled extensions
(adtape's and kernels' modules), and takes sizes and the offload's constants from
gpt2.units rather than from the training command or the offload itself."""
import ast
import os
import pathlib
import subprocess
import sys

import gpt2

PERFMODEL = pathlib.Path(gpt2.__file__).parent / "perfmodel"
ROOT = os.path.dirname(os.path.dirname(gpt2.__file__))

BLOCKED = """
import importlib.abc, sys
class NoExtensions(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("adtape", "kernels"):
            raise ImportError("compiled extensions blocked: " + name)
sys.meta_path.insert(0, NoExtensions())
import gpt2.perfmodel, gpt2.perfmodel.plan, gpt2.perfmodel.cli, gpt2.perfmodel.calibrate
from gpt2.perfmodel.plan import format_size
from gpt2.units import parse_size
assert format_size(parse_size("1.5G")) == "1.5 GiB"
print(sorted(m for m in sys.modules if m.startswith(("adtape", "kernels", "gpt2.train",
                                                    "gpt2.offload"))))
"""


def test_the_perfmodel_imports_without_the_compiled_extensions(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_no_perfmodel_module_imports_the_command_or_the_offload():
    for path in PERFMODEL.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                assert not name.startswith(("gpt2.train", "gpt2.offload")), (path.name, name)
