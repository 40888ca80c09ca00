"""Test setup: the PyTorch oracle bench/torch_gpt2.py is importable as ``torch_gpt2``.

It is loaded by file path: nothing goes on sys.path, so neither the repo root nor
bench/ (whose scripts, e.g. bench/kernels.py, would shadow packages) can hide the
installed adtape, kernels and gpt2 packages the tests are about.
"""
import importlib.util
import pathlib
import sys

_ORACLE = pathlib.Path(__file__).resolve().parent.parent / "bench" / "torch_gpt2.py"

if "torch_gpt2" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("torch_gpt2", _ORACLE)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["torch_gpt2"] = _module
    _spec.loader.exec_module(_module)
