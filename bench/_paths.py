"""Import order for the benchmarks, imported first by each of them.

The source tree is used when it is built in place (``pip install -e .`` or
``python setup.py build_ext --inplace``: its compiled extensions are there),
otherwise the installed packages.  bench/ itself goes last, so that a script
such as bench/kernels.py can never shadow the ``kernels`` package while helpers
like torch_gpt2 stay importable.
"""
import glob
import os
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
_rest = [p for p in sys.path if os.path.abspath(p or os.curdir) not in (BENCH, REPO)]
_built = glob.glob(os.path.join(REPO, "adtape", "_tape*.so"))
sys.path[:] = ([REPO] if _built else []) + _rest + [BENCH]
