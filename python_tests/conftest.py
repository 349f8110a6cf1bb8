"""Shared fixtures: every pool test runs against each pool implementation available."""
from __future__ import annotations

import os

import torch

# Triton reads TRITON_INTERPRET when it is first imported: without a GPU, kernels run in the CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (pyproject's addopts: a worker per core) each worker computes on one thread: two workers of two
# intra-op threads each on a 2-core machine would oversubscribe it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

import pytest  # noqa: E402

from relaygr_engine._ext import EXTENSION_ERROR, pool_implementations  # noqa: E402

IMPLS = pool_implementations()


@pytest.fixture(params=sorted(IMPLS), ids=lambda name: f"pool={name}")
def pool_cls(request):
    """The pool class of each implementation ("cpp" when the extension is built, and "python")."""
    return IMPLS[request.param]


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module with one intra-op thread: its tensors are tiny, and OpenMP oversubscription on shared CI
    machines made such tests many times slower. Use with ``pytestmark = pytest.mark.usefixtures(...)``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_report_header(config):
    return f"relaygr pool implementations: {sorted(IMPLS)}" + (f" (extension: {EXTENSION_ERROR})"
                                                               if EXTENSION_ERROR else "")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # The tests that start Ray (mark ``ray``) run in one xdist worker, one after the other: two local Ray
    # instances at once would share the machine's two CPUs and Ray's default ports.
    for item in items:
        if item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.xdist_group("ray"))
    if os.environ.get("RELAYGR_REQUIRE_EXT") == "1" and "cpp" not in IMPLS:
        raise pytest.UsageError(f"RELAYGR_REQUIRE_EXT=1 but relaygr_engine._C did not load: {EXTENSION_ERROR}")

