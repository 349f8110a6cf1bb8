"""Build script for relaygr-engine: the Python package and its C++ core ``relaygr_engine._C`` (built with CMake).

``pip install .`` / ``pip install -e .`` configure and build ``CMakeLists.txt`` with the cmake, ninja and pybind11
packages of the build environment (see ``[build-system]`` in pyproject.toml); nothing else is downloaded and torch is
not needed to build. Environment knobs:

* ``RELAYGR_BUILD_TYPE``: CMake build type (default ``Release``; ``--debug`` on build_ext gives ``Debug``).
* ``CMAKE_BUILD_PARALLEL_LEVEL``: parallel compile jobs (default: all CPUs).
* ``RELAYGR_CMAKE_ARGS``: extra arguments for the CMake configure step (whitespace separated).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _rel(paths) -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in paths)


class CMakeExtension(Extension):
    """An extension module built by the CMake project in the repository root.

    ``sources`` lists every file the CMake build reads so that an sdist carries them; setuptools never compiles
    them itself (``CMakeBuild`` replaces the compile step).
    """

    def __init__(self, name: str) -> None:
        files = [ROOT / "CMakeLists.txt", *(ROOT / "cmake").glob("*.cmake"), *(ROOT / "csrc").rglob("*.cpp"),
                 *(ROOT / "csrc").rglob("*.h")]
        super().__init__(name, sources=_rel(f for f in files if f.is_file()))


def _tool(module: str, attr: str, exe: str) -> str | None:
    """An executable from a Python package of the build env (cmake, ninja), else from PATH."""
    try:
        bin_dir = getattr(__import__(module), attr)
        path = Path(bin_dir) / (exe + (".exe" if os.name == "nt" else ""))
        if path.is_file():
            return str(path)
    except (ImportError, AttributeError):
        pass
    return shutil.which(exe)


def _drop_stale_cache(build_dir: Path, cmake: str, generator: str | None) -> None:
    """Forget a CMake cache made by another cmake binary or generator (e.g. a previous isolated build env)."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return
    entries = dict(line.split("=", 1) for line in cache.read_text(errors="replace").splitlines()
                   if "=" in line and not line.startswith(("#", "//")))
    same_cmake = Path(entries.get("CMAKE_COMMAND:INTERNAL", "")).resolve() == Path(cmake).resolve()
    cached = entries.get("CMAKE_GENERATOR:INTERNAL")
    same_generator = cached == generator if generator is not None else cached != "Ninja"
    if not (same_cmake and same_generator):
        cache.unlink()
        shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        import pybind11  # a build requirement

        cmake = _tool("cmake", "CMAKE_BIN_DIR", "cmake")
        if cmake is None:
            raise RuntimeError("building relaygr_engine._C needs CMake >= 3.18 (pip install cmake)")
        build_type = "Debug" if self.debug else os.environ.get("RELAYGR_BUILD_TYPE", "Release")
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = Path(self.build_temp).resolve() / "cmake"
        out_dir = build_dir / "out"
        configure = [
            cmake, "-S", str(ROOT), "-B", str(build_dir),
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DRELAYGR_EXT_OUTPUT_DIR={out_dir}",
        ]
        ninja = _tool("ninja", "BIN_DIR", "ninja")
        generator = "Ninja" if ninja is not None else None
        _drop_stale_cache(build_dir, cmake, generator)
        if generator is not None:
            configure += ["-G", generator, f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        configure += os.environ.get("RELAYGR_CMAKE_ARGS", "").split()
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        build = [cmake, "--build", str(build_dir), "--config", build_type, "--target", "_C", "--parallel", jobs]

        build_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(configure, check=True)
        subprocess.run(build, check=True)

        built = sorted(p for p in out_dir.glob("_C*") if p.suffix in (".so", ".pyd", ".dylib"))
        if len(built) != 1:
            raise RuntimeError(f"expected one built module _C* in {out_dir}, found {[p.name for p in built]}")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        shutil.copyfile(built[0], tmp)
        os.replace(tmp, target)  # the exact path setuptools expects; never rewrites a module a process has mapped


# Every subpackage of relaygr_engine, found, so a new one cannot be left out of wheels while editable installs, which
# read the source tree, still work.
PACKAGES = find_packages(include=["relaygr_engine", "relaygr_engine.*"])
assert {"relaygr_engine", "relaygr_engine.attention", "relaygr_engine.kernels", "relaygr_engine.models",
        "relaygr_engine.policy", "relaygr_engine.serving", "relaygr_engine.bench", "relaygr_engine.bench.sim",
        "relaygr_engine.workload", "relaygr_engine.workload.data", "relaygr_engine.data"} <= set(PACKAGES), PACKAGES

setup(
    packages=PACKAGES,
    # Data read with importlib.resources, and the PEP 561 marker of the type hints.
    package_data={"relaygr_engine": ["py.typed"], "relaygr_engine.data": ["*.json"],
                  "relaygr_engine.workload.data": ["*.json", "*.md"]},
    ext_modules=[CMakeExtension("relaygr_engine._C")],
    cmdclass={"build_ext": CMakeBuild},
)
