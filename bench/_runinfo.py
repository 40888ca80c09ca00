"""What the benchmarks that run GPT-2 workers share: the MODEL:BxT configuration lists
they take, and the CPU and commit each result file names."""
import argparse
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_configs(text, example, note=""):
    """'gpt2:4x1024,gpt2-medium:4x1024' -> (('gpt2', 4, 1024), ('gpt2-medium', 4, 1024))."""
    out = []
    for item in text.split(","):
        try:
            model, bt = item.split(":")
            b, t = (int(v) for v in bt.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"a configuration is MODEL:BxT{note}, e.g. {example}; got {item!r}") from None
        out.append((model, b, t))
    return tuple(out)


def cpu_name():
    """The CPU's model name from /proc/cpuinfo ("unknown" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def git_commit():
    """The checkout's short commit hash, or None outside a git checkout."""
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
