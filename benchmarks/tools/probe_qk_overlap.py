"""Does Triton overlap the next key block's QK product with this block's SiLU? A static probe, no GPU needed.

Two small HSTU-style attention loops (head dim 256, 128 rows, 32-key blocks, 8 warps, 3 stages, bf16) are compiled
for sm_90 offline: ``plain`` (each block: QK product, SiLU, P.V product, as the portable kernel does) and ``piped``
(the next block's QK product issued before this block's SiLU, FlashAttention-3's order, written by hand). The probe
prints their registers and each loop's wgmma issues (``HGMMA``) and waits (``WARPGROUP.DEPBAR``) in SASS order: where
the wait for the next block's scores comes right after its last ``HGMMA``, before the SiLU's arithmetic, nothing
overlaps.

    python benchmarks/tools/probe_qk_overlap.py
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _silu_pv(acc, s, v, bias):
    h = s * 0.5 + bias[None, :]
    p = h + h * h  # (elementwise work standing in for the SiLU)
    return acc + tl.dot(p.to(v.dtype), v)


@triton.jit
def plain(q_ptr, k_ptr, v_ptr, b_ptr, o_ptr, n_keys, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    om, on, od = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, D)
    q = tl.load(q_ptr + om[:, None] * D + od[None, :])
    acc = tl.zeros([BM, D], dtype=tl.float32)
    for start in range(0, n_keys, BN):
        k = tl.load(k_ptr + (start + on)[:, None] * D + od[None, :])
        v = tl.load(v_ptr + (start + on)[:, None] * D + od[None, :])
        acc = _silu_pv(acc, tl.dot(q, tl.trans(k)), v, tl.load(b_ptr + start + on))
    tl.store(o_ptr + om[:, None] * D + od[None, :], acc.to(o_ptr.dtype.element_ty))


@triton.jit
def piped(q_ptr, k_ptr, v_ptr, b_ptr, o_ptr, n_keys, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    om, on, od = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, D)
    q = tl.load(q_ptr + om[:, None] * D + od[None, :])
    acc = tl.zeros([BM, D], dtype=tl.float32)
    s = tl.dot(q, tl.trans(tl.load(k_ptr + on[:, None] * D + od[None, :])))
    for start in range(0, n_keys - BN, BN):
        s_next = tl.dot(q, tl.trans(tl.load(k_ptr + (start + BN + on)[:, None] * D + od[None, :])))
        v = tl.load(v_ptr + (start + on)[:, None] * D + od[None, :])
        acc = _silu_pv(acc, s, v, tl.load(b_ptr + start + on))
        s = s_next
    last = n_keys - BN
    v = tl.load(v_ptr + (last + on)[:, None] * D + od[None, :])
    acc = _silu_pv(acc, s, v, tl.load(b_ptr + last + on))
    tl.store(o_ptr + om[:, None] * D + od[None, :], acc.to(o_ptr.dtype.element_ty))


def main() -> None:
    from benchmarks.tools.ptxas import compile_kernel, ptxas_report
    from benchmarks.tools.sass import disassemble

    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "b_ptr": "*fp32", "o_ptr": "*bf16"}
    print(f"triton {triton.__version__}, sm_90, D=256 BM=128 BN=32, 8 warps, 3 stages")
    for fn in (plain, piped):
        kernel = compile_kernel(fn, types, dict(BM=128, BN=32, D=256), arch=90, num_warps=8, num_stages=3)
        regs, spill, _ = ptxas_report(kernel.asm["ptx"], 90)
        code = disassemble(kernel.asm["cubin"])
        print(f"\n{fn.__name__}: {regs} registers, {spill} spill bytes, {len(code)} instructions")
        run, kind = 0, None
        for _, text, _, _ in code:  # runs of consecutive HGMMAs, waits and arithmetic between them
            now = ("HGMMA " + text.split()[0].split(".")[1] if text.startswith("HGMMA") else
                   "wait" if text.startswith("WARPGROUP.DEPBAR") else
                   "arith" if text.split()[0].split(".")[0] in ("FMUL", "FFMA", "FADD") else None)
            if now is None:
                continue
            if now != kind and kind is not None:
                print(f"  {kind} x{run}")
                run = 0
            kind, run = now, run + 1
        print(f"  {kind} x{run}")


if __name__ == "__main__":
    main()
