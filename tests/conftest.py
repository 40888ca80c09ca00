"""Test setup: the repo's bench/ directory is importable (torch_gpt2 oracle).

Only bench/ goes on sys.path, never the repo root: the tests import the installed adtape/gpt2.
"""
import pathlib
import sys

BENCH_DIR = str(pathlib.Path(__file__).resolve().parent.parent / "bench")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)
