"""What a user meets when a run is stopped or repeated: Ctrl-C and SIGTERM (real signals to a
real process, alone and under mpiexec), the default periodic checkpoints, the refusal to
overwrite another run, the resumed learning-rate schedule, the memory policy in the header
and summary, and one-line argparse errors."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import adtape
import gpt2
from gpt2 import checkpoint as ckpt
from gpt2.train import (SaveSchedule, _restore_memory_policy, build_parser, explicit_options,
                        read_log)

PACKAGE_ROOTS = os.pathsep.join({os.path.dirname(os.path.dirname(m.__file__))
                                 for m in (adtape, gpt2)})
LONG_RUN = ["--model", "tiny", "-B", "2", "-T", "16", "--steps", "1000000", "--corpus-bytes",
            "50k", "--eval-interval", "0", "--sample-tokens", "0", "--no-progress"]
SHORT_RUN = ["--model", "tiny", "-B", "2", "-T", "16", "--corpus-bytes", "50k",
             "--eval-interval", "0", "--sample-tokens", "0", "--no-progress"]


def command(*args, ranks=None):
    program = [sys.executable, "-m", "gpt2.train", *map(str, args)]
    if ranks:
        mpiexec = shutil.which("mpiexec")
        assert mpiexec, "mpiexec not found: install the mpi extra (pip install '.[mpi]')"
        program = [mpiexec, "-n", str(ranks), *program]
    return program


def start(cwd, *args, ranks=None):
    """The command started in its own session (so a signal can go to its whole group)."""
    return subprocess.Popen(command(*args, ranks=ranks), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=PACKAGE_ROOTS))


def run_cli(cwd, *args):
    return subprocess.run(command(*args), cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=PACKAGE_ROOTS))


def wait_for_step(proc, step):
    """Read the progress lines (one every 20 steps) until step ``step`` is printed."""
    for line in proc.stdout:
        if line.startswith(f"step {step}/"):
            return
    raise AssertionError(f"the run ended before step {step}: {proc.communicate()}")


def finish(proc, timeout=60):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the run did not stop within {timeout} s: {err}")
    return proc.returncode, out, err


def no_temporaries(directory):
    return [n for n in os.listdir(directory) if n.endswith(".tmp")] == []


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_finishes_the_step_saves_and_says_how_to_resume(tmp_path, signum, status):
    out = tmp_path / "run"
    proc = start(tmp_path, *LONG_RUN, "--out-dir", out, "--checkpoint-interval", "0")
    wait_for_step(proc, 41)
    proc.send_signal(signum)
    code, _, err = finish(proc)
    assert code == status, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    name = signal.Signals(signum).name
    assert f"interrupted by {name} after step" in lines[0]
    assert f"--resume {out / 'checkpoint.bin'}" in lines[0]
    step = ckpt.read_checkpoint_header(out / "checkpoint.bin").step
    assert f"after step {step} of" in lines[0] and step >= 41
    # Every step the log holds is in the checkpoint; the run resumes from it.
    assert [r["step"] for r in read_log(out / "log.csv", 10 ** 9)] == list(range(1, step + 1))
    assert no_temporaries(out)
    resumed = run_cli(tmp_path, "--resume", out / "checkpoint.bin", "--steps", step + 2)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at step {step}" in resumed.stdout


def test_a_second_signal_stops_at_once_and_keeps_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = start(tmp_path, *LONG_RUN, "--out-dir", out, "--checkpoint-interval", "10")
    wait_for_step(proc, 41)
    # Two SIGINTs sent at once merge into one; SIGINT and SIGTERM, sent while the process
    # is stopped, arrive together: the second stops at once, with its own exit status.
    # Usually SIGINT is handled first (the lower number), but the kernel may hand the two
    # to different threads of the process (OpenMP's), and then either can come first.
    proc.send_signal(signal.SIGSTOP)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    code, _, err = finish(proc)
    second, first = ("SIGTERM", "SIGINT") if "SIGTERM after SIGINT" in err else ("SIGINT", "SIGTERM")
    assert code == {"SIGTERM": 143, "SIGINT": 130}[second], err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{second} after {first}: stopped at once; the last checkpoint, at step" in err
    step = ckpt.read_checkpoint_header(out / "checkpoint.bin").step  # complete: its CRCs check
    assert f"at step {step}, is {out / 'checkpoint.bin'}" in err
    ckpt.load_checkpoint(out / "checkpoint.bin")
    assert no_temporaries(out)


def test_ctrl_c_under_mpiexec_saves_the_gathered_checkpoint_and_every_rank_exits(tmp_path):
    out = tmp_path / "run"
    proc = start(tmp_path, *LONG_RUN, "--out-dir", out, "--zero", "1",
                 "--checkpoint-interval", "0", ranks=2)
    wait_for_step(proc, 41)
    os.killpg(proc.pid, signal.SIGINT)     # as Ctrl-C in a terminal: mpiexec and the ranks
    code, _, err = finish(proc, timeout=120)
    assert code == 130, err
    assert "Traceback" not in err
    ours = [line for line in err.splitlines() if "interrupted" in line]
    assert len(ours) == 1 and "--resume" in ours[0], err   # rank 0 alone says it
    state = ckpt.load_checkpoint(out / "checkpoint.bin")
    assert state.step >= 41 and state.adam_m is not None and state.extra["ranks"] == 2
    assert no_temporaries(out)


def test_default_checkpoints_cost_half_a_percent_of_the_training_time():
    schedule = SaveSchedule(None, checkpoint_bytes=200e6)   # first save assumed to take 1 s
    assert SaveSchedule.COST_RATIO == 200
    assert not schedule.due(1, 199.0) and schedule.due(2, 1.0)
    schedule.saved(0.5)
    # From now on, every 100 s of training: 0.5 s of saving per 100 s.
    assert not schedule.due(3, 99.0) and schedule.due(4, 1.0)
    schedule.saved(0.25)
    assert not schedule.due(5, 49.0) and schedule.due(6, 1.0)
    assert schedule.summary() == {"interval": "auto", "saves": 2, "seconds": 0.75}
    every_3 = SaveSchedule(3, 1.0)
    assert [s for s in range(1, 10) if every_3.due(s, 1e-3)] == [3, 6, 9]
    assert not any(SaveSchedule(0, 1.0).due(s, 1e6) for s in range(1, 10))


def test_a_default_run_saves_along_the_way_and_reports_the_cost(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(tmp_path, *SHORT_RUN, "--steps", "2000", "--out-dir", out)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    saves = summary["checkpoints"]
    assert saves["interval"] == "auto" and saves["saves"] >= 2   # periodic ones and the last
    assert 0 < saves["seconds"] < saves["train_seconds"]


def test_a_second_run_into_the_same_directory_is_refused(tmp_path):
    out = tmp_path / "run"
    first = run_cli(tmp_path, *SHORT_RUN, "--steps", "3", "--out-dir", out)
    assert first.returncode == 0, first.stderr
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = run_cli(tmp_path, *SHORT_RUN, "--steps", "2", "--out-dir", out)
    assert again.returncode == 2
    assert len(again.stderr.strip().splitlines()) == 1, again.stderr
    assert (f"--out-dir {out} holds another run (checkpoint.bin at step 3); continue it with "
            f"--resume {out / 'checkpoint.bin'}, pass --overwrite") in again.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # Resuming in place is the same run; --overwrite replaces the old one.
    resumed = run_cli(tmp_path, "--resume", out / "checkpoint.bin", "--steps", "4")
    assert resumed.returncode == 0, resumed.stderr
    replaced = run_cli(tmp_path, *SHORT_RUN, "--steps", "2", "--out-dir", out, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert ckpt.read_checkpoint_header(out / "checkpoint.bin").step == 2
    assert [r["step"] for r in read_log(out / "log.csv", 100)] == [1, 2]
    # A run that wrote only a log (--no-checkpoint) is another run too.
    logged = tmp_path / "logged"
    assert run_cli(tmp_path, *SHORT_RUN, "--steps", "2", "--out-dir", logged,
                   "--no-checkpoint").returncode == 0
    refused = run_cli(tmp_path, *SHORT_RUN, "--steps", "2", "--out-dir", logged)
    assert refused.returncode == 2 and "holds another run (log.csv)" in refused.stderr
    assert "--resume" not in refused.stderr


def lrs(out):
    return [r["lr"] for r in read_log(out / "log.csv", 10 ** 9)]


def test_resume_continues_the_saved_schedule_unless_asked_to_extend_it(tmp_path):
    args = [*SHORT_RUN, "--warmup", "2", "--lr", "1e-3", "--min-lr", "1e-4"]
    out = tmp_path / "run"
    assert run_cli(tmp_path, *args, "--steps", "10", "--out-dir", out).returncode == 0
    whole = lrs(out)
    assert 1e-4 < whole[-1] < whole[-2] < 1e-3   # the cosine, near its end
    continued = tmp_path / "continued"
    shutil.copytree(out, continued)
    proc = run_cli(tmp_path, "--resume", continued / "checkpoint.bin", "--steps", "16")
    assert proc.returncode == 0, proc.stderr
    # No jump back up: the schedule ended at step 10, the new steps stay at --min-lr.
    assert lrs(continued)[:10] == whole and lrs(continued)[10:] == [1e-4] * 6
    extended = tmp_path / "extended"
    shutil.copytree(out, extended)
    proc = run_cli(tmp_path, "--resume", extended / "checkpoint.bin", "--steps", "16",
                   "--decay-steps", "16")
    assert proc.returncode == 0, proc.stderr
    # Asked for: the cosine is stretched to step 16 (up again, then down to --min-lr).
    new = lrs(extended)[10:]
    assert new[0] == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 8 / 14)))
    assert new == sorted(new, reverse=True) and new[0] > whole[-1]


def test_header_and_summary_state_the_memory_policy(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(tmp_path, *SHORT_RUN, "--steps", "2", "--out-dir", out, "--checkpointing",
                   "binomial", "--snapshots", "1", "--tape-budget", "1M", "--spill-dir",
                   tmp_path)
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.splitlines()[0]
    assert (f"memory: tape budget 1.0 MiB, spilling to {tmp_path} and binomial checkpointing "
            f"with 1 snapshot,") in header
    policy = json.loads((out / "summary.json").read_text())["memory_policy"]
    assert policy == {"offload": "none", "offload_dir": None,
                      "tape_budget": 1 << 20, "spill_dir": str(tmp_path),
                      "checkpointing": "binomial", "snapshots": 1, "chosen_by": "options",
                      "from_checkpoint": []}
    plain = run_cli(tmp_path, *SHORT_RUN, "--steps", "1", "--out-dir", tmp_path / "plain")
    assert "memory: activations in RAM," in plain.stdout.splitlines()[0]


def test_resume_keeps_the_memory_policy_unless_given_again(tmp_path):
    out, spill = tmp_path / "run", tmp_path / "spill"
    spill.mkdir()
    first = run_cli(tmp_path, *SHORT_RUN, "--steps", "2", "--out-dir", out, "--offload",
                    "moments", "--tape-budget", "1k", "--checkpointing", "binomial",
                    "--snapshots", "1", "--spill-dir", os.path.relpath(spill, tmp_path))
    assert first.returncode == 0, first.stderr
    policy = ("tape budget 1.0 KiB, spilling to {spill} and binomial checkpointing with 1 "
              "snapshot; AdamW moments on disk in {spill} ({given} from the checkpoint)")
    # The command a Ctrl-C prints, from elsewhere: the saved --spill-dir is absolute.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    resumed = run_cli(elsewhere, "--resume", out / "checkpoint.bin", "--steps", "3")
    assert resumed.returncode == 0, resumed.stderr
    every = "--tape-budget, --checkpointing, --snapshots, --offload, --spill-dir"
    assert policy.format(spill=spill, given=every) in resumed.stdout.splitlines()[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["memory_policy"] == {
        "offload": "moments", "offload_dir": str(spill), "tape_budget": 1024,
        "spill_dir": str(spill), "checkpointing": "binomial", "snapshots": 1,
        "chosen_by": "options", "from_checkpoint": every.split(", ")}
    # An option given again wins; the others still come from the checkpoint.
    again = run_cli(tmp_path, "--resume", out / "checkpoint.bin", "--steps", "4", "--offload",
                    "none", "--checkpointing", "layer")
    assert again.returncode == 0, again.stderr
    assert (f"memory: tape budget 1.0 KiB, spilling to {spill} and per-layer checkpointing "
            f"(--tape-budget, --spill-dir from the checkpoint),") in again.stdout.splitlines()[0]
    # A checkpoint saved before the memory policy was kept resumes as before: in RAM.
    state = ckpt.load_checkpoint(out / "checkpoint.bin")
    old_args = {k: v for k, v in state.extra["args"].items()
                if k not in ("offload", "spill_dir", "tape_budget", "checkpointing",
                             "snapshots", "max_memory")}
    ckpt.save_checkpoint(out / "checkpoint.bin", state.params, step=state.step,
                         adam_m=state.adam_m, adam_v=state.adam_v, adam_step=state.adam_step,
                         data_state=state.data_state, extra={"args": old_args})
    old = run_cli(tmp_path, "--resume", out / "checkpoint.bin", "--steps", "5")
    assert old.returncode == 0, old.stderr
    assert "memory: activations in RAM, corpus" in old.stdout.splitlines()[0]
    # A saved --spill-dir that is gone is one line naming where it came from.
    ckpt.save_checkpoint(out / "checkpoint.bin", state.params, step=state.step,
                         adam_m=state.adam_m, adam_v=state.adam_v, adam_step=state.adam_step,
                         data_state=state.data_state, extra=state.extra)
    spill.rmdir()
    gone = run_cli(tmp_path, "--resume", out / "checkpoint.bin", "--steps", "5")
    assert gone.returncode == 2
    assert gone.stderr == (f"python -m gpt2.train: error: --spill-dir {spill} (from the "
                           f"checkpoint): no such directory; pass --spill-dir to choose "
                           f"another\n")


SAVED_POLICY = {"max_memory": None, "tape_budget": None, "checkpointing": "none",
                "snapshots": 2, "offload": "none", "spill_dir": None}


@pytest.mark.parametrize("saved, argv, restored", [
    # A policy --max-memory chose is planned again, from the saved --max-memory.
    ({"max_memory": 1 << 30, "tape_budget": 1 << 20, "offload": "moments", "spill_dir": "/s"},
     [], {"max_memory": 1 << 30, "spill_dir": "/s"}),
    # The command line's own policy: no --max-memory; its choices, one by one, where not given.
    ({"max_memory": 1 << 30, "tape_budget": 1 << 20, "offload": "moments", "spill_dir": "/s"},
     ["--offload", "none"], {"tape_budget": 1 << 20, "spill_dir": "/s"}),
    # A given --max-memory plans afresh: nothing of the saved policy but --spill-dir.
    ({"tape_budget": 1 << 20, "checkpointing": "layer", "spill_dir": "/s"},
     ["--max-memory", "1G"], {"spill_dir": "/s"}),
    # --snapshots with binomial checkpointing only; --spill-dir where the disk was used.
    ({"checkpointing": "binomial", "snapshots": 1, "spill_dir": "/s"},
     [], {"checkpointing": "binomial", "snapshots": 1}),
    ({"checkpointing": "binomial", "snapshots": 1}, ["--checkpointing", "layer"], {}),
])
def test_which_memory_options_a_resume_takes(saved, argv, restored):
    argv = ["--resume", "x.bin", *argv]
    args = build_parser().parse_args(argv)
    names = _restore_memory_policy(args, explicit_options(argv), dict(SAVED_POLICY, **saved))
    assert set(names) == set(restored)
    assert {n: getattr(args, n) for n in restored} == restored


@pytest.mark.parametrize("args, expected", [
    (["--stepz", "3"], "unrecognized arguments: --stepz 3"),
    (["--engine", "fast"], "argument --engine: invalid choice: 'fast'"),
    (["--snapshots", "3"], "--snapshots applies to --checkpointing binomial only"),
    (["--checkpointing", "binomial", "--snapshots", "2"],
     "--snapshots 2: binomial checkpointing of 2 layers keeps at most 1 snapshot"),
])
def test_mistakes_are_one_line_with_a_pointer_to_help(tmp_path, args, expected):
    proc = run_cli(tmp_path, *SHORT_RUN, "--out-dir", tmp_path / "out", *args)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and expected in proc.stderr, proc.stderr
    assert proc.stderr.startswith("python -m gpt2.train: error: ")
    if "invalid choice" in expected or "unrecognized" in expected:
        assert proc.stderr.rstrip().endswith("(see python -m gpt2.train --help)")
    assert not (tmp_path / "out").exists()
