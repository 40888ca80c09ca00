"""Which hardware profile is used: this machine's, from the user's cache and keyed by its CPU
and thread count, calibrated once on first use and said so; the profiles measured on our
machines by their own names; approximate profiles and other thread counts named where used."""
import io
import json
import os
import subprocess
import sys

import pytest

import adtape
import gpt2
from gpt2.config import GPT2Config
from gpt2.perfmodel import calibrate as calibrate_module
from gpt2.perfmodel import cli
from gpt2.perfmodel.hardware import (available_profiles, cpu_identity, load_profile, profile_cache_dir, save_profile,
                                     this_machine_name, this_machine_path, this_machine_profile)
from gpt2.perfmodel.plan import plan_memory

TINY = GPT2Config.preset("tiny")
HUGE = 1 << 50
EPYC = {"model_name": "AMD EPYC 9R14 96-Core Processor", "family": "25", "model": "17",
        "flags_sha256": "0123456789abcdef", "machine": "Linux x86_64"}


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """A fresh, empty user cache: this machine has no profile yet."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "adtape" / "profiles"


@pytest.fixture
def calibrations(monkeypatch):
    """The quick calibration's child process replaced by a fake that reports its phases and
    writes the committed Zen 4 figures as this machine's; the thread counts it was run for."""
    calls = []

    def fake(threads, path, progress):
        calls.append(threads)
        for phase in ("matmuls", "kernels", "disk"):
            progress(phase)
        measured = load_profile("zen4-2core-vm")
        save_profile(measured.with_changes(name=this_machine_name(threads), threads=threads,
                                           calibration=dict(measured.calibration, cpu=cpu_identity(), quick=True)),
                     path)
    monkeypatch.setattr(calibrate_module, "run_quick_calibration", fake)
    return calls


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert profile_cache_dir() == str(tmp_path / "adtape" / "profiles")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in ("", "relative/dir"):
        monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert profile_cache_dir() == str(tmp_path / "home" / ".cache" / "adtape" / "profiles")


def test_profile_name_says_the_cpu_and_threads_and_keys_every_field():
    assert this_machine_name(2, EPYC).startswith("amd-epyc-9r14-f25m17-")
    assert this_machine_name(2, EPYC).endswith("-2t") and this_machine_name(16, EPYC).endswith("-16t")
    digest = this_machine_name(2, EPYC).split("-")[-2]
    assert len(digest) == 8
    for field in EPYC:
        other = dict(EPYC, **{field: EPYC[field] + "x"})
        assert this_machine_name(2, other).split("-")[-2] != digest, field
    arm = {"model_name": "aarch64", "family": "", "model": "", "flags_sha256": "0", "machine": "Darwin arm64"}
    assert this_machine_name(1, arm).startswith("aarch64-") and this_machine_name(1, arm).endswith("-1t")
    identity = cpu_identity()
    assert set(identity) == set(EPYC) and identity["model_name"]
    assert os.path.basename(this_machine_path(3)) == this_machine_name(3) + ".json"


def test_committed_profiles_keep_their_names_and_this_machine_is_not_one():
    names = available_profiles()
    assert "this-machine" not in names
    for name in ("zen4-2core-vm", "a100-40gb-sxm", "a100-80gb-sxm", "h100-sxm", "generic-cpu"):
        assert name in names
    zen4 = load_profile("zen4-2core-vm")
    assert zen4.name == "zen4-2core-vm" and zen4.threads == 2 and not zen4.approximate
    assert zen4.calibration["cpu"]["family"] == "25" and zen4.calibration["cpu"]["model"] == "17"
    assert "Zen 4" in zen4.describe()
    generic = load_profile("generic-cpu")
    assert generic.approximate and "approximate" in generic.describe()


def test_first_use_calibrates_once_says_so_and_keeps_it(cache, calibrations):
    progress = io.StringIO()
    profile = this_machine_profile(threads=1, progress=progress)
    assert calibrations == [1]
    line = progress.getvalue()
    assert line.startswith("calibrating this machine for the performance model (once")
    assert "matmuls... kernels... disk... done in" in line and line.count("\n") == 1
    assert str(cache) in line
    path = cache / f"{this_machine_name(1)}.json"
    assert path.exists() and profile.threads == 1 and profile.calibration["cpu"] == cpu_identity()
    # Read back, not measured again: by this_machine_profile and by the name this-machine.
    again = io.StringIO()
    assert this_machine_profile(threads=1, progress=again) == profile
    assert load_profile("this-machine", threads=1) == profile
    assert calibrations == [1] and again.getvalue() == ""
    # Another thread count is another profile.
    with pytest.raises(FileNotFoundError, match="calibrate --threads 3"):
        this_machine_profile(threads=3, calibrate_if_missing=False)
    this_machine_profile(threads=3, progress=io.StringIO())
    assert calibrations == [1, 3]
    assert sorted(os.listdir(cache)) == sorted(f"{this_machine_name(t)}.json" for t in (1, 3))


def test_a_cached_profile_of_another_cpu_is_refused(cache, calibrations):
    path = this_machine_path(2)
    os.makedirs(os.path.dirname(path))
    zen4 = load_profile("zen4-2core-vm")
    save_profile(zen4.with_changes(calibration=dict(zen4.calibration, cpu=EPYC)), path)
    with pytest.raises(ValueError, match="measured on .*AMD EPYC 9R14.*remove it"):
        this_machine_profile(threads=2)
    assert calibrations == []


def test_a_failed_calibration_says_so_and_keeps_nothing(cache):
    progress = io.StringIO()
    with pytest.raises(RuntimeError, match="exit status 1: --threads must be >= 1, got 0"):
        calibrate_module.calibrate_once(0, progress, str(cache / "none.json"))
    assert progress.getvalue().endswith("): failed\n") and not os.path.exists(cache / "none.json")


def test_planner_calibrates_this_machine_on_first_use(cache, calibrations, capsys):
    first = plan_memory(TINY, 4, 64, HUGE, threads=1)
    assert calibrations == [1]
    assert "calibrating this machine" in capsys.readouterr().err
    second = plan_memory(TINY, 4, 64, HUGE, threads=1)
    assert calibrations == [1] and capsys.readouterr().err == ""
    assert first.predicted_ms == second.predicted_ms


def test_approximate_profiles_and_other_thread_counts_are_named(capsys):
    plan = plan_memory(TINY, 4, 64, HUGE, hardware="generic-cpu")
    assert any("approximate" in note for note in plan.notes)
    plan = plan_memory(TINY, 4, 64, HUGE, hardware="zen4-2core-vm", threads=1)
    assert any("scaled from the profile's 2 threads to 1" in note for note in plan.notes)
    assert not any("approximate" in note for note in plan.notes)
    args = ["--model", "gpt2", "--batch", "4", "--seq", "64"]
    assert cli.main(args) == 0
    assert "hardware: generic-cpu-16c-avx2 (approximate" in capsys.readouterr().out
    assert cli.main(args + ["--hardware", "zen4-2core-vm", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert "hardware: zen4-2core-vm (measured on AMD EPYC" in captured.out
    assert captured.err == "note: profile zen4-2core-vm was measured with 2 threads, not the 1 of --threads; " \
                           "its rates are for 2\n"


def test_calibrate_disk_only_updates_this_machines_profile(cache, calibrations, monkeypatch, capsys):
    with pytest.raises(SystemExit, match="no profile of this machine for 1 threads"):
        calibrate_module.main(["--disk-only", "--threads", "1"])
    this_machine_profile(threads=1, progress=io.StringIO())
    monkeypatch.setattr(calibrate_module, "measure_disk", lambda path, nbytes: (3e9, 4e9, "O_DIRECT"))
    monkeypatch.setattr(calibrate_module, "measure_baseline_rss", lambda threads: 99e6)
    assert calibrate_module.main(["--disk-only", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.endswith(f"wrote {this_machine_path(1)}\n")
    assert captured.err.startswith("calibrate [") and "disk and baseline RSS (1 threads)..." in captured.err
    profile = this_machine_profile(threads=1, calibrate_if_missing=False)
    assert (profile.disk_write_bandwidth, profile.disk_read_bandwidth, profile.baseline_rss) == (3e9, 4e9, 99e6)


def _perfmodel(args, cache_home):
    roots = {os.path.dirname(os.path.dirname(m.__file__)) for m in (adtape, gpt2)}
    env = dict(os.environ, XDG_CACHE_HOME=str(cache_home), PYTHONPATH=os.pathsep.join(roots))
    out = subprocess.run([sys.executable, "-m", "gpt2.perfmodel", *args], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    return out


def test_plan_on_a_fresh_machine_runs_the_real_quick_calibration_once(tmp_path):
    args = ["--plan", "--max-memory", "8G", "--model", "gpt2", "--batch", "4", "--seq", "64"]
    first = _perfmodel(args, tmp_path)
    line = first.stderr.strip()
    assert line.startswith("calibrating this machine for the performance model (once, ~30 s"), first.stderr
    assert "): peak... matmuls... memory... overheads... kernels... disk... baseline RSS... done in " in line
    (name,) = os.listdir(tmp_path / "adtape" / "profiles")
    with open(tmp_path / "adtape" / "profiles" / name) as f:
        profile = json.load(f)
    assert profile["calibration"]["cpu"] == cpu_identity() and profile["calibration"]["quick"]
    assert name == f"{profile['name']}.json" and name.endswith(f"-{profile['threads']}t.json")
    assert "chose in-memory" in first.stdout
    second = _perfmodel(args, tmp_path)
    assert second.stderr == "" and second.stdout == first.stdout
    assert os.listdir(tmp_path / "adtape" / "profiles") == [name]
