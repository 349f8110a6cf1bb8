"""benchmarks/run_gpu.sh's driver, run on the CPU with a stand-in GPU and Python: steps run in the order STEPS names
them, a deadline skips or shortens them, every step's seconds and exit status are listed, unknown names stop it
before anything runs, and the outputs are packed into one archive (a device call returns few files)."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tarfile

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "run_gpu.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def _run(tmp_path, steps, **env):
    """Run the script with a fake ``nvidia-smi`` and a fake Python that logs its arguments (and fails for ``tiers``);
    returns the completed process and the logged calls, one per line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'Stand-in GPU, 1.0, 1 MiB'\n")
    (bin_dir / "fakepy").write_text("#!/bin/sh\ncase \"$*\" in '-c import xdist') exit 1;; esac\n"  # no xdist
                                    f"echo \"$*\" >> '{log}'\n"
                                    "case \"$*\" in *'bench tiers'*) exit 3;; esac\necho ran\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    full_env = dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin", PYTHON=str(bin_dir / "fakepy"), STEPS=steps,
                    RELAYGR_COMMIT="abc1234", **env)
    for name in ("DEADLINE_S", "ARCHIVE", "MIN_STEP_S"):
        if name not in env:
            full_env.pop(name, None)
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env=full_env, capture_output=True, text=True,
                          timeout=120)
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls


def _table(tmp_path):
    return [line.split("\t") for line in (tmp_path / "out" / "steps.tsv").read_text().splitlines()]


def test_steps_run_in_the_order_named_with_their_times_and_an_archive(tmp_path):
    archive = tmp_path / "gpu.tgz"
    (tmp_path / "bin").mkdir()  # a stand-in ncu (the machine's own, if any, is never reached) logging its arguments
    log = tmp_path / "ncu.log"
    (tmp_path / "bin" / "ncu").write_text(f"#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; done > '{log}'\n")
    proc, calls = _run(tmp_path, "rank env ncu", ARCHIVE=str(archive))
    assert proc.returncode == 0, proc.stderr
    assert calls[0].startswith("-m pip install")
    assert "bench rank" in calls[1] and "--model nvidia-hstu" in calls[1]   # rank first, as STEPS named it
    assert "relaygr_engine.cli info" in calls[2]
    assert [row[0] for row in _table(tmp_path)] == ["rank", "env", "ncu"]
    assert all(row[1].isdigit() and row[2] == "0" for row in _table(tmp_path))
    rank = (tmp_path / "out" / "rank.txt").read_text()
    assert "device: Stand-in GPU" in rank.splitlines()[0] and "commit: abc1234" in rank.splitlines()[0]
    assert rank.splitlines()[-1].startswith("# rank: ") and rank.rstrip().endswith("exit 0")
    # a quoted `bash -c` step survives being stored and run again: each of ncu's arguments arrives whole
    args = log.read_text().splitlines()
    assert "regex:prefix_attention|bias_table|reduce_kernel" in args and "--cuda-profiler-window" in args
    assert args[-3:] == [str(tmp_path / "bin" / "fakepy"), "benchmarks/tools/profile_rank.py", "--cuda-profiler-window"]
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {"out/steps.tsv", "out/rank.txt", "out/env.txt", "out/ncu.txt"} <= names


def test_a_deadline_skips_steps_and_cuts_their_limits(tmp_path):
    proc, calls = _run(tmp_path, "env rank", DEADLINE_S="0")
    assert proc.returncode == 0, proc.stderr
    assert len(calls) == 1 and calls[0].startswith("-m pip install")     # installed, then nothing ran
    assert _table(tmp_path) == [["env", "-", "not run"], ["rank", "-", "not run"]]
    assert "not run (deadline): env rank" in proc.stdout

    proc, calls = _run(tmp_path, "rank", DEADLINE_S="100")
    assert proc.returncode == 0
    line = next(x for x in proc.stdout.splitlines() if x.startswith("== rank"))
    limit = int(line.split("limit ", 1)[1].split(" ", 1)[0])
    assert limit <= 100 and "cut to the deadline" in line                # rank's own limit is 300 s


def test_failures_are_listed_and_unknown_steps_stop_it_first(tmp_path):
    proc, _ = _run(tmp_path, "env tiers-8k")
    assert proc.returncode == 1
    assert "failed: tiers-8k (exit 3)" in proc.stdout
    assert _table(tmp_path)[1] == ["tiers-8k", _table(tmp_path)[1][1], "3"]

    (tmp_path / "calls.log").unlink()
    proc, calls = _run(tmp_path, "rank tiers-9k")
    assert proc.returncode == 2 and "unknown step 'tiers-9k'" in proc.stderr
    assert calls == []                                                  # not even the install ran


def test_the_join_step_takes_the_parts_that_finished(tmp_path):
    """``kernels`` joins the head-dim parts' JSON found in OUT_DIR (a part cut by a call's deadline wrote none), and
    nothing of another step's. (The former split rule's steps, ``kernels-rule*``, are gone.)"""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("kernels-hopper", "kernels-d64", "kernels-d256"):
        (out / f"{name}.json").write_text("{}")
    proc, calls = _run(tmp_path, "kernels")
    assert proc.returncode == 0, proc.stderr
    plain, = [c for c in calls if "--summarize" in c]
    assert f"{out}/kernels-d64.json" in plain and f"{out}/kernels-d256.json" in plain
    assert "hopper" not in plain and "d128" not in plain and plain.endswith(f"--json {out}/kernels.json")
    proc, _ = _run(tmp_path, "kernels-rule")
    assert proc.returncode == 2 and "unknown step 'kernels-rule'" in proc.stderr
