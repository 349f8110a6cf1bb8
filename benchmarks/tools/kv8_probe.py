"""``python -m benchmarks.tools.kv8_probe``: the prefix kernel's 8-bit page read on CUDA against the torch reference,
probe by probe, each in a process of its own (a kernel fault loses its process's CUDA context, not the others').

A probe is one way of launching the kernel on one batch (head dim 128, 4 heads, pages of 64 tokens): the CUDA
8-bit test's two users (3000 cached tokens, 64 new history rows and 256 candidates; 1000 cached tokens and 32
candidates) and a third with 40 cached tokens (less than a key block: its programs skip the prefix loop), 8 new
history rows and 16 candidates; in softmax and HSTU mode. A probe fixes the pages' format (bf16, int8, fp8) and
either the launcher's configs (autotuned) or one config (key block, warps, stages), with the launcher's split count
or a given one. Each mode's output is compared with :func:`~relaygr_engine.attention.ops.paged_prefix_attention_torch`
over the same pages: ``max_abs_err``, ``mismatched`` (the fraction of elements outside ``atol = rtol = 0.03``, the
test's tolerance), ``fault`` (the launch raised, or the process died or ran out of time).

The probes split the hypotheses of why 8-bit pages went wrong on CUDA (``benchmarks/results/static-kv8-2026-11-28``):
``bf16*`` are controls; ``*-s3`` the 3-stage config (64-key blocks, 8 warps) whose 8-bit build ptxas 12.8
miscompiles (a candidate tile's own-key product reads its shared-memory descriptor from a register only the prefix
loop's preheader writes), split, and unsplit without the third user (``-whole``: no program skips the prefix
loop); ``int8-s2``/``-s1`` fewer stages; ``int8-mma2`` two warps (Triton's warp-level ``mma``, no ``wgmma``).

    python -m benchmarks.tools.kv8_probe                       # every probe, a table and a RESULT line
    python -m benchmarks.tools.kv8_probe --probes int8,int8-s3 --ptxas /path/to/ptxas   # another sm_90 assembler
    python -m benchmarks.tools.kv8_probe --probe int8 --json - # one probe in this process (what the table's processes
    run)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Optional

from relaygr_engine.cli_args import ArgumentParser

__all__ = ["PROBES", "Probe", "run_probe", "main"]

TOLERANCE = 3e-2  # atol and rtol, as the CUDA 8-bit test's


@dataclass(frozen=True)
class Probe:
    """One launch: pages ``kv_dtype``; ``block_n=None`` the launcher's configs (autotuned), else this key block,
    ``num_warps``, ``num_stages`` and candidate tiles of ``block_m`` rows (history tiles of 64); ``splits`` the
    split count (None: the launcher's); ``short_user``: the batch's third user (40 cached tokens) in it."""

    kv_dtype: str
    block_n: Optional[int] = None
    num_warps: int = 8
    num_stages: int = 2
    block_m: int = 128
    splits: Optional[int] = None
    short_user: bool = True


PROBES = {
    "bf16": Probe("model"),
    "int8": Probe("int8"),
    "fp8": Probe("fp8_e4m3"),
    "bf16-s3": Probe("model", 64, 8, 3),
    "int8-s3": Probe("int8", 64, 8, 3),
    "fp8-s3": Probe("fp8_e4m3", 64, 8, 3),
    "int8-s3-whole": Probe("int8", 64, 8, 3, splits=1, short_user=False),
    "int8-s2": Probe("int8", 64, 8, 2),
    "int8-s1": Probe("int8", 64, 8, 1),
    "int8-mma2": Probe("int8", 32, 2, 2, block_m=64),
}


def _batch(kv_dtype: str, short_user: bool = True):
    """The probes' batch on the GPU (the module's docstring): ``(q, k, v, pages, tables)``, pages quantised by the
    torch path."""
    import torch

    from relaygr_engine import quant
    from relaygr_engine.config import KVDtype

    dev, ps, H, D = torch.device("cuda"), 64, 4, 128
    g = torch.Generator(device=dev).manual_seed(0)
    dense = torch.randn(64, 2, ps, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    pages = dense if kv_dtype == "model" else quant.quantize_pages(dense, KVDtype(kv_dtype))
    q, k, v = (torch.randn(376, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    users = 3 if short_user else 2
    tables = dict(kv_indptr=i32([0, 47, 63, 64][:users + 1]),
                  kv_indices=torch.randperm(64, device=dev, generator=g)[:[0, 47, 63, 64][users]].int(),
                  kv_last_page_len=i32([3000 - 46 * ps, 1000 - 15 * ps, 40][:users]),
                  cu_seqlens_q=i32([0, 320, 352, 376][:users + 1]), num_candidates=i32([256, 32, 16][:users]))
    rows = [0, 320, 352, 376][users]
    q, k, v = q[:rows], k[:rows], v[:rows]
    return q, k, v, pages, tables


def run_probe(name: str) -> list[dict]:
    """Run probe ``name`` in this process (CUDA): one row per mode, ``fault`` set (and the rest absent) where its
    launch raised; a mode after a fault is not run (the context may be lost)."""
    import torch

    from relaygr_engine import quant
    from relaygr_engine.kernels import prefix_attention as pa
    from relaygr_engine.kernels._prefix_config import KernelConfig
    from relaygr_engine.attention.ops import paged_prefix_attention_torch

    probe = PROBES[name]
    os.environ[quant.KERNEL_ENV] = "1"  # (the probes exist to run the kernel's 8-bit read)
    if probe.block_n is not None:  # this process's launches: the probe's one config, both kinds of tile
        cfg = KernelConfig(probe.block_m, probe.block_n, probe.num_warps, probe.num_stages, hist_block_m=64)
        pa.pick_config = lambda *args, **kwargs: cfg
    q, k, v, pages, tables = _batch(probe.kv_dtype, probe.short_user)
    rows = []
    for mode in ("softmax", "hstu"):
        row = dict(probe=name, mode=mode, **asdict(probe))
        try:
            out = pa.prefix_attention(q, k, v, pages, **tables, mode=mode, scale=128 ** -0.5, splits=probe.splits,
                                      kv_dtype=probe.kv_dtype)
            if out.is_cuda:
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a fault is what a probe reports
            rows.append(dict(row, fault=1, error=f"{type(exc).__name__}: {exc}"[:300]))
            break
        ref = paged_prefix_attention_torch(q.float(), k.float(), v.float(), pages, **tables, mode=mode,
                                           scale=128 ** -0.5, kv_dtype=probe.kv_dtype)
        err = (out.float() - ref).abs()
        bad = err > TOLERANCE + TOLERANCE * ref.abs()
        rows.append(dict(row, fault=0, max_abs_err=float(err.max()), mismatched=float(bad.float().mean())))
    return rows


def _child(name: str, timeout: float, ptxas: Optional[str]) -> list[dict]:
    """Probe ``name`` in a process of its own; a process that dies or runs out of time is a fault."""
    env = dict(os.environ)
    if ptxas:
        env["TRITON_PTXAS_PATH"] = ptxas
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.tools.kv8_probe", "--probe", name, "--json", "-"],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [dict(probe=name, mode="-", fault=1, error=f"no result in {timeout:.0f} s")]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    rows = json.loads(lines[-1]) if lines else []
    if proc.returncode != 0 and not any(r.get("fault") for r in rows):
        rows.append(dict(probe=name, mode="-", fault=1, error=f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"))
    for r in rows:
        r["seconds"] = round(time.perf_counter() - t0, 1)
    return rows


def _verdict(rows: list[dict]) -> str:
    if any(r.get("fault") for r in rows):
        return "fault"
    return "wrong" if any(r["mismatched"] > 0 for r in rows) else "ok"


def main(argv: Optional[list[str]] = None) -> int:
    ap = ArgumentParser(prog="python -m benchmarks.tools.kv8_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--probes", default=",".join(PROBES), help=f"which, comma-separated (of {', '.join(PROBES)})")
    ap.add_argument("--probe", help="run this one probe in this process (what each of the table's processes runs)")
    ap.add_argument("--jobs", type=int, default=4, help="probes running at once, each in its own process")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a probe's process may take")
    ap.add_argument("--ptxas", help="assemble the sm_90 code with this ptxas (TRITON_PTXAS_PATH in each probe)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON ('-': stdout)")
    opts = ap.parse_args(argv)
    names = [opts.probe] if opts.probe else [n.strip() for n in opts.probes.split(",") if n.strip()]
    unknown = [n for n in names if n not in PROBES]
    if unknown:
        ap.error(f"unknown probe(s) {', '.join(unknown)}; the probes: {', '.join(PROBES)}")
    import torch

    if not torch.cuda.is_available():
        ap.error("the probes launch the kernel on CUDA; no CUDA device here")
    if opts.probe:
        rows = run_probe(opts.probe)
        print(json.dumps(rows) if opts.json == "-" else rows)
        return 0
    with ThreadPoolExecutor(max(1, opts.jobs)) as pool:
        results = list(pool.map(lambda n: _child(n, opts.timeout, opts.ptxas), names))
    print(f"{'probe':<14} {'pages':<9} {'config':<16} {'splits':>6} {'mode':<8} {'max_abs_err':>11} "
          f"{'mismatched':>10} {'fault':>5}")
    for name, rows in zip(names, results):
        p = PROBES[name]
        config = "autotuned" if p.block_n is None else f"{p.block_n}/{p.num_warps}w/{p.num_stages}s/{p.block_m}"
        for r in rows:
            err = f"{r['max_abs_err']:.4g}" if "max_abs_err" in r else "-"
            mis = f"{r['mismatched']:.4f}" if "mismatched" in r else "-"
            print(f"{name:<14} {p.kv_dtype:<9} {config:<16} {p.splits or 'auto':>6} {r['mode']:<8} {err:>11} {mis:>10} "
                  f"{'yes' if r.get('fault') else 'no':>5}" + (f"  {r['error']}" if r.get("error") else ""))
    if opts.json and opts.json != "-":
        with open(opts.json, "w") as f:
            json.dump([r for rows in results for r in rows], f, indent=1)
    verdicts = {n: _verdict(rows) for n, rows in zip(names, results)}
    from benchmarks.tools.sm90_compile import ptxas_version

    if opts.ptxas:
        os.environ["TRITON_PTXAS_PATH"] = opts.ptxas
    count = lambda verdict: sum(v == verdict for v in verdicts.values())  # noqa: E731
    print("RESULT " + " ".join(f"probe_{n.replace('-', '_')}={v}" for n, v in verdicts.items())
          + f" faults={count('fault')} wrong={count('wrong')} ptxas={ptxas_version(90)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
