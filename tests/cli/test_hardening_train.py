"""gpt2-train at the edges, made deterministic: an offloaded state file that reads back
corrupted mid-run, Ctrl-C at points of the start-up imports, two signals that reach Python
as one handler call during a checkpoint's write, and a signal during the final save.

Each case runs the command in a child process whose first lines set up the hook (a
patched save, an import finder that sends the signal); nothing in the package is there
for the tests but ``StateFile._corrupt_for_tests``."""
import importlib.util
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from gpt2 import checkpoint as ckpt

_spec = importlib.util.spec_from_file_location(
    "gpt2_interrupt_helpers", pathlib.Path(__file__).resolve().parent / "test_gpt2_interrupt.py")
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)
PACKAGE_ROOTS, no_temporaries = _helpers.PACKAGE_ROOTS, _helpers.no_temporaries

RUN = ["--model", "tiny", "-B", "1", "-T", "16", "--corpus-bytes", "50k", "--eval-interval",
       "0", "--sample-tokens", "0", "--no-progress"]

CALL_MAIN = "from gpt2.train import main\nsys.exit(main(sys.argv[1:]))"
# The program as its entry points start it: python -m gpt2.train; the gpt2-train script.
AS_MODULE = 'import runpy\nrunpy.run_module("gpt2.train", run_name="__main__", alter_sys=True)'
AS_SCRIPT = ('sys.argv[0] = "/usr/local/bin/gpt2-train"\nfrom gpt2.train import main\n'
             'sys.exit(main())')


def run_hooked(cwd, setup, *args, start=CALL_MAIN):
    """The command in a child process (named python -m gpt2.train in its messages), after
    ``setup`` (Python source) has run."""
    code = f"import sys\n{textwrap.dedent(setup)}\n{start}\n"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=PACKAGE_ROOTS))


# -- a corrupted offload file -------------------------------------------------------------

# Flips a byte of the state file on disk: after the checkpoint at step 2 (the next update
# reads it back), or inside the save at step 3 (the checkpoint's own read of the moments).
CORRUPT = """
    from gpt2 import checkpoint
    real_save = checkpoint.save_checkpoint

    def save_checkpoint(path, params, *, step, adam_m=None, **kwargs):
        if step == 3 and {inside_save}:
            adam_m.offload.file._corrupt_for_tests(1)
        real_save(path, params, step=step, adam_m=adam_m, **kwargs)
        if step == 2 and not {inside_save}:
            adam_m.offload.file._corrupt_for_tests(1)

    checkpoint.save_checkpoint = save_checkpoint
"""


@pytest.mark.parametrize("inside_save", [False, True], ids=["next-update", "inside-save"])
@pytest.mark.parametrize("offload", ["moments", "all"])
def test_a_corrupted_offload_file_is_one_error_line_and_keeps_the_checkpoint(
        tmp_path, offload, inside_save):
    out, spill = tmp_path / "run", tmp_path / "spill"
    spill.mkdir()
    proc = run_hooked(tmp_path, CORRUPT.format(inside_save=inside_save), *RUN, "--steps", "6",
                      "--offload", offload, "--spill-dir", spill, "--out-dir", out,
                      "--checkpoint-interval", "1")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    what = "AdamW moments" if offload == "moments" else "model state"
    assert re.fullmatch(
        rf"python -m gpt2.train: error: {what} file '{re.escape(str(spill))}/adtape-{what}-\w+': "
        rf"record 1 at offset \d+ fails its checksum \(the bytes read back are not those "
        rf"written\); the last checkpoint, at step 2, is "
        rf"{re.escape(str(out / 'checkpoint.bin'))}\n",
        proc.stderr), proc.stderr
    state = ckpt.load_checkpoint(out / "checkpoint.bin")     # complete: its CRCs check
    assert state.step == 2
    assert no_temporaries(out) and os.listdir(spill) == []


# -- Ctrl-C while the program starts ------------------------------------------------------

# Sends SIGINT to this process as the import of {target} begins.
INTERRUPT_AT_IMPORT = """
    import os, signal

    class InterruptAtImport:
        def find_spec(self, name, path=None, target=None):
            if name == {target!r}:
                sys.meta_path.remove(self)
                os.kill(os.getpid(), signal.SIGINT)
            return None

    sys.meta_path.insert(0, InterruptAtImport())
"""


@pytest.mark.parametrize("target, entry", [
    ("argparse", "module"),          # gpt2/train.py's own first imports
    ("numpy", "module"),             # main()'s: the handler used to import numpy again
    ("numpy", "script"),
    ("gpt2.checkpoint", "module"),
    ("gpt2.model", "script"),
    ("matplotlib", "module"),        # the plot, after the training: the last checkpoint
])
def test_ctrl_c_at_any_import_exits_130_in_one_line(tmp_path, target, entry):
    out = tmp_path / "run"
    proc = run_hooked(tmp_path, INTERRUPT_AT_IMPORT.format(target=target), *RUN, "--steps",
                      "2", "--out-dir", out, start=AS_MODULE if entry == "module" else AS_SCRIPT)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    prog = "python -m gpt2.train" if entry == "module" else "gpt2-train"
    if target == "matplotlib":
        assert proc.stderr == (f"{prog}: interrupted by SIGINT; the last checkpoint, at step 2, "
                               f"is {out / 'checkpoint.bin'}\n")
    else:
        assert proc.stderr == (f"{prog}: interrupted by SIGINT while starting; nothing was "
                               f"written\n")
        assert not out.exists()


# -- two signals in one handler call, a signal during the final save ----------------------

# Inside the checkpoint's write at save number {at} (its temporary file open), the signals
# {signums} arrive one by one in another thread (sent to itself, so that none waits pending
# and merges with the next) while the main thread waits in one C call, as in a long write:
# Python runs its handler once for all of them.
SIGNALS_DURING_SAVE = """
    import contextlib, os, signal, threading
    from gpt2 import checkpoint
    real_writer = checkpoint.atomic_writer
    saves = []

    def deliver_while_busy(signums):
        def send():
            for s in signums:
                signal.pthread_kill(threading.get_ident(), s)
        sender = threading.Thread(target=send)
        sender.start()
        sender.join()

    @contextlib.contextmanager
    def atomic_writer(path):
        with real_writer(path) as f:
            if os.path.basename(path) == "checkpoint.bin":
                saves.append(path)
                if len(saves) == {at}:
                    deliver_while_busy({signums})
            yield f

    checkpoint.atomic_writer = atomic_writer
"""


def test_two_signals_during_a_save_stop_at_once(tmp_path):
    out = tmp_path / "run"
    setup = SIGNALS_DURING_SAVE.format(at=3, signums="[signal.SIGINT, signal.SIGINT]")
    proc = run_hooked(tmp_path, setup, *RUN, "--steps", "50", "--out-dir", out,
                      "--checkpoint-interval", "1")
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == (f"python -m gpt2.train: SIGINT again: stopped at once; the last "
                           f"checkpoint, at step 2, is {out / 'checkpoint.bin'}\n")
    assert ckpt.load_checkpoint(out / "checkpoint.bin").step == 2
    assert no_temporaries(out)


def test_a_signal_during_the_final_save_finishes_it_and_exits_130(tmp_path):
    out = tmp_path / "run"
    setup = SIGNALS_DURING_SAVE.format(at=1, signums="[signal.SIGINT]")
    proc = run_hooked(tmp_path, setup, *RUN, "--steps", "3", "--sample-tokens", "5",
                      "--out-dir", out, "--checkpoint-interval", "0")
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == (f"python -m gpt2.train: interrupted by SIGINT at the end of the run "
                           f"(step 3 of 3): saved {out / 'checkpoint.bin'}; skipped the "
                           f"summary, the plot and the sample\n")
    assert "sample" not in proc.stdout
    state = ckpt.load_checkpoint(out / "checkpoint.bin")
    assert state.step == 3
    assert no_temporaries(out) and not (out / "summary.json").exists()
    # The run is complete: a resume has nothing left to do.
    again = run_hooked(tmp_path, "", "--resume", out / "checkpoint.bin")
    assert again.returncode == 0 and "nothing left to do" in again.stdout, again.stderr
