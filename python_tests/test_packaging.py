"""The wheel a user installs: built with ``pip wheel . --no-deps`` from a copy of the source tree, installed alone in a
fresh virtual environment, it carries its data, type marker and license, loads its C++ extension and runs
``relaygr demo``."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                              ".hypothesis", "reports", "_build", "*.so")

pytestmark = [pytest.mark.packaging, pytest.mark.slow]


def run(cmd, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)  # build from a copy: the checkout's build/ stays the editable one's
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp / "dist", src], timeout=1200)
    (whl,) = (tmp / "dist").glob("relaygr_engine-*.whl")
    return whl


def test_the_wheel_carries_data_types_and_license(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in ("relaygr_engine/py.typed", "relaygr_engine/data/latency_cpu.json",
                 "relaygr_engine/workload/data/movielens_small_profile.json",
                 "relaygr_engine/workload/data/README.md", "relaygr_engine/kernels/prefix_attention.py",
                 "relaygr_engine/bench/slo.py", "relaygr_engine/serving/metrics.py"):
        assert path in names, path
    assert any(n.startswith("relaygr_engine/_C") for n in names)
    license_text = next(zipfile.ZipFile(wheel).read(n) for n in names if n.endswith("licenses/LICENSE"))
    assert b"Apache License" in license_text and b"Version 2.0" in license_text


def test_the_installed_wheel_runs_the_demo(wheel, tmp_path):
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], timeout=300)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    # the dependencies (torch, numpy, matplotlib, tqdm) come from this environment, appended after the venv's own
    # site-packages, so nothing is downloaded; the package itself only from the wheel (installed with --no-deps)
    (site / "_deps_of_the_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel], timeout=600)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    where = run([python, "-c", "import relaygr_engine; print(relaygr_engine.__file__)"], cwd=tmp_path, env=env)
    assert Path(where.stdout.strip()).is_relative_to(venv)
    info = run([bindir / "relaygr", "info"], cwd=tmp_path, env=env, timeout=300)
    assert "RESULT extension_loaded=1" in info.stdout
    demo = run([bindir / "relaygr", "demo", "--requests", "20", "--min-duration-s", "0.5", "--repeats", "1",
                "--no-max-len", "--no-progress", "--out", tmp_path / "report"], cwd=tmp_path, env=env,
               timeout=900)
    assert demo.stdout.strip().splitlines()[-1].startswith("RESULT slo_throughput_ratio=")
    assert (tmp_path / "report" / "report.md").is_file() and (tmp_path / "report" / "latency_vs_qps.png").is_file()
