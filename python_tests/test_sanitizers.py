"""The C++ core and its own test (csrc/tests/test_block_pool.cpp, threads included) built with CMake's
``RELAYGR_SANITIZE`` and run: AddressSanitizer + UndefinedBehaviorSanitizer (any report aborts), and
ThreadSanitizer. Skipped, with the reason, where CMake, a compiler or the sanitizer runtime is missing."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Every report is fatal; leaks are reports too.
RUNTIME_ENV = {"ASAN_OPTIONS": "halt_on_error=1:detect_leaks=1:abort_on_error=0",
               "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1", "TSAN_OPTIONS": "halt_on_error=1"}
BANNER = {"address,undefined": ("ASAN_OPTIONS", "AddressSanitizer"), "thread": ("TSAN_OPTIONS", "ThreadSanitizer")}
PROBE = """#include <atomic>
#include <thread>
int main() { std::atomic<int> n{0}; std::thread t([&] { ++n; }); t.join(); return n.load() - 1; }
"""


def _tool(module: str, attr: str, exe: str):
    """An executable from a Python package (cmake, ninja), else from PATH."""
    try:
        path = Path(getattr(__import__(module), attr)) / exe
        if path.is_file():
            return str(path)
    except (ImportError, AttributeError):
        pass
    return shutil.which(exe)


def _run(cmd, cwd=None, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=None if env is None else {**os.environ, **env}, capture_output=True,
                          text=True, timeout=timeout)


def _probe(kind: str, cxx: str, tmp: Path):
    """None when ``cxx`` builds and runs a threaded program with ``-fsanitize=kind``, else why not."""
    src, exe = tmp / "probe.cpp", tmp / "probe"
    src.write_text(PROBE)
    built = _run([cxx, "-std=c++17", f"-fsanitize={kind}", "-pthread", str(src), "-o", str(exe)], timeout=120)
    if built.returncode != 0:
        return f"{cxx} cannot build with -fsanitize={kind}: {built.stderr.strip()[-300:]}"
    ran = _run([str(exe)], env=RUNTIME_ENV, timeout=60)
    if ran.returncode != 0:
        return f"the -fsanitize={kind} runtime does not run here: {(ran.stderr or ran.stdout).strip()[-300:]}"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(BANNER), ids=["asan-ubsan", "tsan"])
def test_core_and_its_test_are_clean_under_sanitizer(kind, tmp_path):
    cmake = _tool("cmake", "CMAKE_BIN_DIR", "cmake")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cmake is None or cxx is None:
        pytest.skip(f"needs CMake and a C++ compiler (cmake={cmake}, compiler={cxx})")
    why = _probe(kind, cxx, tmp_path)
    if why is not None:
        pytest.skip(why)
    build = tmp_path / "build"
    configure = [cmake, "-S", str(ROOT), "-B", str(build), f"-DRELAYGR_SANITIZE={kind}", "-DRELAYGR_BUILD_PYTHON=OFF",
                 "-DRELAYGR_BUILD_TESTS=ON", "-DCMAKE_BUILD_TYPE=Debug", f"-DCMAKE_CXX_COMPILER={cxx}"]
    ninja = _tool("ninja", "BIN_DIR", "ninja")
    if ninja is not None:
        configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    for step in (configure, [cmake, "--build", str(build), "--parallel", "2"]):
        done = _run(step)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    exe = build / "test_block_pool"
    var, name = BANNER[kind]
    banner = _run([str(exe)], env={var: "help=1"}, timeout=60)
    assert f"Available flags for {name}" in banner.stdout + banner.stderr, "the test binary is not instrumented"
    ran = _run([str(exe)], env=RUNTIME_ENV)
    out = ran.stdout + ran.stderr
    assert ran.returncode == 0 and "all checks passed" in out, out[-4000:]
    assert "runtime error" not in out and "Sanitizer" not in out, out[-4000:]
