"""``python -m benchmarks.tools.kv8_probe`` (:mod:`benchmarks.tools.kv8_probe`) without a GPU: its table and verdicts
from stand-in probe processes, and a probe's launch and comparison in Triton's interpreter on a small batch."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import torch

from benchmarks.tools import kv8_probe
from interpreter_process import interpreter_env

REPO = pathlib.Path(__file__).resolve().parents[1]  # (the checkout: benchmarks.tools imports from it)


def test_the_table_and_verdicts_of_the_probes_processes(monkeypatch, capsys):
    """Each probe's rows as its process returned them; a fault (a launch that raised, a process that died) and a
    mismatch are the verdicts ``fault`` and ``wrong``."""
    def child(name, timeout, ptxas):
        if name == "int8-s3":
            return [dict(probe=name, mode="softmax", fault=1, error="RuntimeError: an illegal memory access")]
        return [dict(probe=name, mode=m, fault=0, max_abs_err=0.01, mismatched=0.02 if name == "fp8" else 0.0)
                for m in ("softmax", "hstu")]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kv8_probe, "_child", child)
    assert kv8_probe.main(["--probes", "bf16,fp8,int8-s3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:3] == ["probe", "pages", "config"] and len(lines) == 1 + 2 + 2 + 1 + 1
    assert "64/8w/3s/128" in lines[5] and lines[5].split()[7] == "yes" and "illegal memory access" in lines[5]
    assert lines[-1].startswith("RESULT probe_bf16=ok probe_fp8=wrong probe_int8_s3=fault faults=1 wrong=1 ptxas=")


PROBE_IN_THE_INTERPRETER = r"""
import json, torch
from relaygr_engine import quant
from relaygr_engine.config import KVDtype
from benchmarks.tools import kv8_probe

def small(kv_dtype, short_user=True):  # two users, the second's prefix shorter than a key block
    g = torch.Generator().manual_seed(0)
    ps, H, D = 16, 1, 16
    dense = torch.randn(8, 2, ps, H, D, generator=g)
    pages = dense if kv_dtype == "model" else quant.quantize_pages(dense, KVDtype(kv_dtype))
    q, k, v = (torch.randn(20, H, D, generator=g) for _ in range(3))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    tables = dict(kv_indptr=i32([0, 5, 6]), kv_indices=torch.randperm(8, generator=g)[:6].int(),
                  kv_last_page_len=i32([8, 10]), cu_seqlens_q=i32([0, 12, 20]), num_candidates=i32([6, 5]))
    return q, k, v, pages, tables

kv8_probe._batch = small
print(json.dumps([row for name in ("int8", "int8-s3") for row in kv8_probe.run_probe(name)]))
"""


def test_a_probe_launches_and_compares_in_the_interpreter():
    """``run_probe`` (what each probe's process runs) on int8 pages, with the launcher's config and with a fixed
    one, in the interpreter: no fault, both modes, exact against the torch reference."""
    proc = subprocess.run([sys.executable, "-c", PROBE_IN_THE_INTERPRETER], env=interpreter_env(),
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(r["probe"], r["mode"]) for r in rows] == [(p, m) for p in ("int8", "int8-s3")
                                                      for m in ("softmax", "hstu")]
    assert all(r["fault"] == 0 and r["mismatched"] == 0 and r["max_abs_err"] < 1e-4 for r in rows), rows
