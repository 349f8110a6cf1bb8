"""The API reference builds from the docstrings with Sphinx (autodoc + napoleon), every warning an error."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _sphinx_runs() -> bool:
    """Sphinx is importable as ``python -m sphinx`` (some images ship a partial ``sphinx`` package)."""
    try:
        return importlib.util.find_spec("sphinx.__main__") is not None
    except ImportError:
        return False


@pytest.mark.skipif(not _sphinx_runs(), reason="Sphinx is not installed (pip install 'relaygr-engine[docs]')")
def test_api_reference_builds_without_warnings(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html",
                          str(DOCS), str(tmp_path / "html")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    api = (tmp_path / "html" / "api.html").read_text(encoding="utf-8")
    for name in ("RelayEngine", "CacheConfig", "PrefixAttention", "check_relay_exact", "EngineMetrics",
                 "percentile"):
        assert name in api, name
