"""The tape core does not depend on the kernels package (issue 24): kernels are
leaves that adtape.nn uses, so the tape keeps its own parallel copy."""
import subprocess
import sys


def test_tape_core_imports_nothing_from_kernels():
    code = ("import sys, numpy as np\n"
            "import adtape._tape as core\n"
            "t = core.Tape()\n"
            "t.push_array(np.arange(1 << 18, dtype=np.float64))\n"
            "assert t.pop_array()[-1] == (1 << 18) - 1\n"
            "print(sorted(m for m in sys.modules if m == 'kernels' or m.startswith('kernels.')))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
