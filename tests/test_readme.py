"""The README as a user reads it: its commands are the real ones, its examples run, and it
points to the notes beside the code instead of keeping a log of tuning rounds."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def code_blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_ci_runs_the_readmes_test_command():
    # .ci/run must run exactly what the README tells a user to run.
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    commands = [line.strip() for block in code_blocks("") for line in block.splitlines()]
    assert "pip install . && gpt2-train" in commands
    assert ci in commands and "pytest" in ci


@pytest.mark.parametrize("index", range(len(code_blocks("python"))))
def test_python_examples_run(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code_blocks("python")[index], f"README.md python block {index}", "exec"), {})


def test_links_resolve_and_no_tuning_log():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target
    assert (ROOT / "bench" / "README.md").exists() and (ROOT / "kernels" / "README.md").exists()
    # History belongs to git log: no "this round" / "the round before" narrative.
    assert not re.search(r"\b(this|last|previous) round\b|\bround before\b", README, re.I)
    assert len(README.encode()) < 16 << 10


# The console scripts as modules of the package the tests import (installed, or on
# PYTHONPATH), in a fresh directory.
COMMANDS = {"gpt2-train": "gpt2.train", "gpt2-generate": "gpt2.generate_cli",
            "gpt2-eval": "gpt2.evaluate"}


def test_using_a_trained_model_commands_run(tmp_path):
    import shlex
    import subprocess
    import sys
    section = README.split("## Using a trained model", 1)[1]
    block = re.search(r"```\n(.*?)```", section, flags=re.S).group(1)
    (tmp_path / "my.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    lines = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    assert [shlex.split(line)[0] for line in lines] == [
        "gpt2-train", "gpt2-generate", "gpt2-generate", "gpt2-eval", "gpt2-train"]
    outputs = []
    for line in lines:
        argv = shlex.split(line)
        res = subprocess.run([sys.executable, "-m", COMMANDS[argv[0]], *argv[1:]],
                             cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, (line, res.stderr[-2000:])
        outputs.append(res.stdout + res.stderr)
    assert (tmp_path / "tiny_hf" / "model.safetensors").exists()
    assert "tokens/s" in outputs[1] and "perplexity" in outputs[3]
    assert (tmp_path / "out" / "model.safetensors").exists()
