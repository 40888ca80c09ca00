"""Test setup: the PyTorch oracle bench/torch_gpt2.py, the measuring harness
bench/harness.py and the small Hugging Face models of tests/hf_models.py are importable
as ``torch_gpt2``, ``harness`` and ``hf_models``.

They are loaded by file path: nothing goes on sys.path, so neither the repo root nor
bench/ (whose scripts, e.g. bench/kernels.py, would shadow packages) can hide the
installed adtape, kernels and gpt2 packages the tests are about.
"""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

# The tests compare float32 numbers: --precision auto would pick bf16 products on a CPU
# with AVX512_BF16. The precision tests ask for auto and bf16 themselves.
os.environ.setdefault("ADTAPE_PRECISION", "fp32")

_BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"

for _path in (_BENCH / "torch_gpt2.py", _BENCH / "harness.py",
              pathlib.Path(__file__).resolve().parent / "hf_models.py"):
    _name = _path.stem
    if _name not in sys.modules:
        _spec = importlib.util.spec_from_file_location(_name, _path)
        _module = importlib.util.module_from_spec(_spec)
        sys.modules[_name] = _module
        _spec.loader.exec_module(_module)


# Opt-in markers: marker -> (the variable that selects its tests, what they are).
OPT_IN = {"large": ("ADTAPE_LARGE", "real model sizes, minutes each"),
          "llamacpp": ("ADTAPE_LLAMACPP", "runs GGUF files in llama.cpp (llama-cpp-python)")}


def pytest_configure(config):
    for marker, (variable, what) in OPT_IN.items():
        config.addinivalue_line("markers", f"{marker}: {what}; run with {variable}=1 "
                                           f"(deselected otherwise)")


def pytest_collection_modifyitems(config, items):
    """Deselect (not skip: CI runs skip nothing) each opt-in marker's tests unless its
    variable is 1."""
    for marker, (variable, _) in OPT_IN.items():
        if os.environ.get(variable) == "1":
            continue
        chosen = [item for item in items if item.get_closest_marker(marker)]
        if chosen:
            config.hook.pytest_deselected(items=chosen)
            items[:] = [item for item in items if not item.get_closest_marker(marker)]


@pytest.fixture(autouse=True, scope="session")
def _outside_the_source_tree(tmp_path_factory):
    """Run every test from an empty directory: the child processes that tests start
    (``python -c``, ``python -m gpt2.train``, ``mpiexec``) put their working directory
    first on sys.path, and from the repository root they would import the unbuilt
    sources instead of the installed package."""
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(old)


@pytest.fixture
def tmpfs():
    """``tmpfs(path, options)`` mounts a small tmpfs at ``path`` (a real full or read-only
    disk: e.g. ``"size=2m"``, ``"ro,size=1m"``) and returns it; every mount is undone at
    teardown.  Where mounting is refused (not root), the test is skipped (CI runs as root)."""
    mounted = []

    def mount(path, options):
        path.mkdir(exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", str(path)], check=True)


def _lane_widths():
    from kernels import layers
    return [8, 16] if layers.vector_lanes() == 16 else [8]


@pytest.fixture(params=_lane_widths(), ids=lambda lanes: f"{lanes}lanes")
def vector_lanes(request):
    """Runs a test with the layers, loss and attention kernels in eight lanes and, where
    the CPU has AVX-512, again in sixteen (kernels.set_vector_lanes)."""
    import kernels
    old = kernels.set_vector_lanes(request.param)
    yield request.param
    kernels.set_vector_lanes(old)
