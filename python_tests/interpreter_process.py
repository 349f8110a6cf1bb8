"""For the tests that run the kernels in Triton's CPU interpreter in a fresh process (``TRITON_INTERPRET=1`` set for
that process, so they run on a CUDA machine too): the process's environment, or a skip saying why the installed
Triton's interpreter cannot run the kernels (:func:`relaygr_engine.kernels._common.interpreter_problem`)."""
from __future__ import annotations

import os

import pytest


def interpreter_env() -> dict:
    """This process's environment with ``TRITON_INTERPRET=1``; skips the calling test where Triton is missing or its
    interpreter cannot run the kernels with the installed numpy."""
    pytest.importorskip("triton", reason="triton is not installed")
    from relaygr_engine.kernels._common import interpreter_problem

    why = interpreter_problem()
    if why is not None:
        pytest.skip(why)
    return dict(os.environ, TRITON_INTERPRET="1")
