"""The ``relaygr`` command line: :func:`main` dispatches to the command modules (:data:`HELP` lists them)."""
from __future__ import annotations

import importlib
import sys
from typing import NoReturn, Optional

HELP = """\
relaygr: relay-race inference for generative-recommendation rankers

usage: relaygr COMMAND [options]

commands:
  info                devices, extension status, versions
  bench NAME [...]    a benchmark: {benchmarks}
  calibrate [...]     measure the latency profile the trigger uses
  demo [...]          the main job: relay-race vs full inference under a P99 SLO on a real-log workload
  explain [...]       what a ranking's attention runs for a model shape, and why (here or on a named GPU)
  serve [...]         Ray Serve replicas with relay engines
  workload [...]      fit a workload profile from a log, or describe one

relaygr COMMAND --help (relaygr bench NAME --help) lists a command's options."""

# command word -> module whose main(argv) runs it
_COMMANDS = {
    "calibrate": "relaygr_engine.policy.calibration",
    "demo": "relaygr_engine.bench.demo",
    "explain": "relaygr_engine.attention.explain",
    "serve": "relaygr_engine.serving.cli",
    "workload": "relaygr_engine.workload.build",
}

# ``relaygr bench NAME`` -> the module whose main(argv) runs it: the benchmarks a user runs.
BENCHMARKS = {
    "host": "relaygr_engine.bench.host",
    "kernels": "relaygr_engine.bench.kernels",
    "kvquant": "relaygr_engine.bench.kvquant",
    "loadgen": "relaygr_engine.bench.loadgen",
    "overhead": "relaygr_engine.bench.overhead",
    "pool": "relaygr_engine.bench.pool",
    "rank": "relaygr_engine.bench.rank",
    "ray": "relaygr_engine.bench.ray",
    "seeds": "relaygr_engine.bench.seeds",
    "slo": "relaygr_engine.bench.slo",
    "tiers": "relaygr_engine.bench.tiers",
    "transfer": "relaygr_engine.bench.transfer",
}

# Kernel-developer tools, run from a checkout (they are not in the wheel).
_TOOLS = {"ptxas": "benchmarks.tools.ptxas", "sass": "benchmarks.tools.sass"}


def _benchmarks() -> list[str]:
    """The ``relaygr bench`` names."""
    return sorted(BENCHMARKS)


def info() -> int:
    """Print devices, extension status and versions."""
    import platform

    import numpy
    import torch

    from . import __version__
    from ._ext import EXTENSION_ERROR, EXTENSION_LOADED

    print(f"relaygr-engine {__version__}")
    print(f"python         {platform.python_version()} ({platform.machine()})")
    print(f"torch          {torch.__version__}")
    print(f"numpy          {numpy.__version__}")
    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = "not installed"
    print(f"triton         {triton_v}")
    print(f"block pool     {'C++ extension (relaygr_engine._C)' if EXTENSION_LOADED else 'pure Python'}"
          + ("" if EXTENSION_LOADED else f"  [{EXTENSION_ERROR}]"))
    cuda = torch.cuda.is_available()
    print(f"cuda           {torch.cuda.get_device_name(0) if cuda else 'not available'}")
    npu = importlib.util.find_spec("torch_npu") is not None
    print(f"npu            {'torch_npu installed' if npu else 'not available'}")
    print(f"cpu threads    {torch.get_num_threads()}")
    print(f"RESULT extension_loaded={int(EXTENSION_LOADED)} cuda={int(cuda)} torch={torch.__version__}")
    return 0


def _usage_error(prog: str, message: str) -> NoReturn:
    """A one-line usage error on stderr; exit status 2 (the commands' own parsers end the same way)."""
    from .cli_args import ArgumentParser

    ArgumentParser(prog=prog).error(message)


# When the command now running started (time.monotonic()) and whether it is a process of its own (a command
# line: from the process's start; a call from Python: from the call); what `bench slo --budget-s` counts from
# (it takes and clears it).
CALL_STARTED: Optional[tuple] = None


def main(argv: Optional[list[str]] = None) -> int:
    global CALL_STARTED
    if argv is None:
        from .bench.slo_budget import process_started

        CALL_STARTED = (process_started(), True)
    else:
        import time

        CALL_STARTED = (time.monotonic(), False)
    argv = list(sys.argv[1:] if argv is None else argv)
    names = _benchmarks()
    if not argv or argv[0] in ("-h", "--help"):
        print(HELP.format(benchmarks=", ".join(names)))
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "info":
        return info()
    if cmd == "bench":
        if rest and rest[0] in ("-h", "--help"):
            print(f"usage: relaygr bench NAME [options]\n\nNAME: {', '.join(names)}\n\n"
                  "relaygr bench NAME --help lists a benchmark's options.")
            return 0
        if not rest:
            _usage_error("relaygr bench", f"NAME is missing: one of {', '.join(names)}")
        if rest[0] in _TOOLS:
            _usage_error("relaygr bench", f"{rest[0]} is a kernel-developer tool, not in the installed package: run "
                                          f"`python -m {_TOOLS[rest[0]]}` from a checkout of relaygr-engine")
        if rest[0] not in names:
            _usage_error("relaygr bench", f"NAME must be one of {', '.join(names)}, got {rest[0]!r}")
        module = importlib.import_module(BENCHMARKS[rest[0]])
        return int(module.main(rest[1:]) or 0)
    if cmd in _COMMANDS:
        return int(importlib.import_module(_COMMANDS[cmd]).main(rest) or 0)
    _usage_error("relaygr", f"unknown command {cmd!r}; valid: info, bench, {', '.join(_COMMANDS)}")


if __name__ == "__main__":
    sys.exit(main())
