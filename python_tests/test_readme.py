"""The README's "Using it" snippet runs as a script and prints what its comments promise."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def snippet(section: str) -> str:
    """The first ```python block after the heading ``section``."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {section}\n")
    match = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    assert match is not None, section
    return match.group(1)


def test_using_it_snippet_runs_and_prints(tmp_path):
    script = tmp_path / "using_it.py"
    script.write_text(snippet("Using it"))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "torch.Size([256, 2])"
    assert lines[1] == "hbm"  # the ticket's prefix was read from the cache
    assert float(lines[2]) <= 1e-4
    assert int(lines[3]) == 1
