"""The table rows and the RESULT line of ``relaygr bench kernels``, from its result rows: printed as a run goes,
or recomputed from the JSON of runs that split the shapes between them (``--summarize``, e.g. one call per head
dim where a machine's time per call is limited)."""
from __future__ import annotations

import json
import math
from typing import Optional

__all__ = ["header", "load_rows", "result_line", "row_line", "summarize"]

NOTE = ("vs_gath: time of the same attention on gathered contiguous K/V (softmax: SDPA; hstu: dense torch) over the "
        "paged kernel's; vs_recomp: no-cache kernel time over cached; paged_ovh: scattered vs consecutive pages; "
        "plan_ms: building the tile schedule (once per forward, not included in ms); S: programs per tile and head "
        "over the cached prefix (split-prefix); V: programs per tile over its value columns (a: autotuned); cc: "
        "history and candidate tiles launched on two streams at once (y) or one after the other (n); SD: the split "
        "partials' dtype; hk: tiles' full cached blocks on the sm_90 kernel (y) or the portable one (n). On CUDA "
        "every time is GPU time: a CUDA-graph replay after an L2 flush.")


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def _geo(xs: list) -> Optional[float]:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def header(cuda: bool) -> str:
    head = (f"{'shape':<62} {'BM':>4} {'S':>3} {'keys/S':>6} {'V':>2} {'cc':>2} {'SD':>4} {'hk':>2} {'ms':>8} "
            f"{'TFLOP/s':>8} "
            f"{'GB/s':>8} {'vs_gath':>8} {'vs_recomp':>9} {'paged_ovh':>9} {'plan_ms':>8} {'err':>8}")
    return head + (f" {'%matmul':>8} {'vs_flashinfer':>13}" if cuda else "")


def row_line(r: dict) -> str:
    """One shape's line of the table (``%matmul`` and FlashInfer where the row has them: CUDA runs; ``keys/S``, the
    keys each split takes, ``cc``, whether the two kinds of tile ran concurrently, and ``SD``, the split partials'
    dtype, where the row has them)."""
    v = r.get("value_splits")
    line = (f"{r['shape']:<62} {r['block_m']:>4} {_fmt(r.get('splits'), 'd'):>3} "
            f"{_fmt(r.get('split_keys'), 'd'):>6} "
            f"{'a' if v is None else v:>2} {'-' if 'concurrent' not in r else 'yn'[not r['concurrent']]:>2} "
            f"{r.get('split_dtype') or '-':>4} "
            f"{_hopper_cell(r):>2} "
            f"{r['time_ms']:>8.3f} "
            f"{r['tflops']:>8.3g} {r['gbps']:>8.4g} "
            f"{_cell(r, 'speedup_vs_gathered', '.2f', 'x'):>8} {_cell(r, 'speedup_vs_recompute', '.2f', 'x'):>9} "
            f"{_cell(r, 'paged_overhead', '.1%'):>9} {_cell(r, 'plan_ms', '.3f'):>8} {r['max_abs_err']:>8.1e}")
    if "matmul_fraction" in r:
        fi = r["speedup_vs_flashinfer"]
        line += (f" {100 * r['matmul_fraction']:>7.1f}% "
                 f"{(_fmt(fi) + 'x') if fi is not None else r['flashinfer_note'][:13]:>13}")
    return line


def _cell(r: dict, key: str, spec: str, unit: str = "") -> str:
    """A baseline's cell of the table: ``-`` where the row has none."""
    value = r.get(key)
    return _fmt(value, spec) + (unit if value is not None else "")


def _hopper_cell(r: dict) -> str:
    """The ``hk`` column: n (the portable kernel), y (the sm_90 kernel), - (not said)."""
    return "ny"[bool(r["hopper_kernel"])] if "hopper_kernel" in r else "-"


def summarize(rows: list[dict], *, device: str, dtype: str, kv_dtype: str = "model") -> dict:
    """The RESULT fields of ``rows`` (one run's, or several runs' of one device and dtype)."""
    cpu = device.startswith("cpu")
    modes = sorted({r["mode"] for r in rows})
    block_ms = sorted({r["block_m"] for r in rows})
    sm = [r["speedup_vs_gathered"] for r in rows if r["mode"] == "softmax"]
    summary = dict(device=device, interpreter=int(cpu), dtype=dtype, shapes=len(rows),
                   max_abs_err=max(r["max_abs_err"] for r in rows),
                   min_speedup_vs_sdpa=min(sm) if sm else None, geomean_speedup_vs_sdpa=_geo(sm),
                   geomean_speedup_vs_recompute=_geo([r["speedup_vs_recompute"] for r in rows]),
                   max_paged_overhead=max(r["paged_overhead"] for r in rows))
    if kv_dtype != "model":
        # kv8_time_ratio: the 8-bit pages' time over the model dtype's, the largest over the long shapes (below; all
        # shapes where none is long); kv8_read: the path that read the 8-bit pages.
        long8 = [r for r in rows if _long(r)] or rows
        summary.update(kv_dtype=kv_dtype, geomean_kv8_speedup=_geo([r["kv8_speedup"] for r in rows]),
                       max_kv8_err=max(r["kv8_err"] for r in rows),
                       kv8_time_ratio=max(1 / r["kv8_speedup"] for r in long8),
                       kv8_read=",".join(sorted({r.get("kv8_read", "kernel") for r in rows})))
    if any("tma_gain" in r for r in rows):
        summary["geomean_tma_gain"] = _geo([r["tma_gain"] for r in rows if "tma_gain" in r])
    if len(block_ms) > 1:  # one geomean per tile height, to compare them in one run
        for bm in block_ms:
            summary[f"geomean_speedup_vs_sdpa_bm{bm}"] = _geo(
                [r["speedup_vs_gathered"] for r in rows if r["block_m"] == bm and r["mode"] == "softmax"])
            summary[f"geomean_ms_bm{bm}"] = _geo([r["time_ms"] for r in rows if r["block_m"] == bm])
    # One geomean per value of a compared setting, to compare them in one run: split counts, value splits (auto:
    # the autotuner's choice), two streams vs one, the split partials in 16 bits vs fp32.
    summary.update(_geomean_by(rows, "splits", lambda n: f"s{n}"))
    summary.update(_geomean_by(rows, "value_splits", lambda n: f"v{n or 'auto'}", keep_none=True))
    summary.update(_geomean_by(rows, "concurrent", lambda c: f"cc{'yn'[not c]}"))
    summary.update(_geomean_by(rows, "split_dtype", lambda sd: f"sd_{sd}"))
    summary.update(_geomean_by(rows, "hopper_kernel", lambda hk: f"hopper_{'yes' if hk else 'no'}"))
    if all("matmul_fraction" in r for r in rows) and not cpu:
        summary["min_matmul_fraction"] = min(r["matmul_fraction"] for r in rows)
        # The long shapes: prefix >= 4096, >= 256 query rows per user, batch >= 4 (each beside the matmul rate
        # measured in its run for its own FLOPs).
        # (The rows on the sm_90 kernel, where a run compares it, in their own fields: ..._<mode>_hopper.)
        long = [r for r in rows if r["prefix"] >= 4096 and r["new"] + r["cands"] >= 256 and r["users"] >= 4]
        for m in modes:
            for hk in (False, True):
                picked = [r["matmul_fraction"] for r in long if r["mode"] == m and bool(r.get("hopper_kernel")) == hk]
                if picked or not hk:
                    summary[f"matmul_fraction_long_{m}{'_hopper' if hk else ''}"] = _geo(picked)
    return summary


def _long(row: dict) -> bool:
    """A long shape: prefix >= 4096, >= 256 query rows per user, batch >= 4."""
    return row["prefix"] >= 4096 and row["new"] + row["cands"] >= 256 and row["users"] >= 4


def _geomean_by(rows: list[dict], field: str, name, keep_none: bool = False) -> dict:
    """``geomean_ms_<name(value)>`` for each value of ``field`` over ``rows`` (rows without it, or with None unless
    ``keep_none``, left out; None sorts first), where the rows hold more than one value; else nothing."""
    rows = [r for r in rows if field in r]
    values = {r[field] for r in rows if keep_none or r[field] is not None}
    if len(values) < 2:
        return {}
    return {f"geomean_ms_{name(v)}": _geo([r["time_ms"] for r in rows if r[field] == v])
            for v in sorted(values, key=lambda v: (v is not None, v or 0))}


def result_line(summary: dict) -> str:
    fields = " ".join(f"{k}={_fmt(v, '.4g') if isinstance(v, float) else v}" for k, v in summary.items())
    return f"RESULT {fields}"


def load_rows(paths: list[str]) -> tuple[list[dict], dict]:
    """The rows of several ``--json`` outputs and their common ``device``/``dtype``/``kv_dtype``; ValueError when
    a file is not one or the runs differ in those."""
    rows, seen = [], {}
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
            part, s = data["rows"], data["summary"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path} is not the JSON of a bench kernels run: {exc}") from None
        meta = dict(device=s["device"], dtype=s["dtype"], kv_dtype=s.get("kv_dtype", "model"))
        if seen and meta != seen:
            raise ValueError(f"{path} ran with {meta}, the first file with {seen}: summarise runs of one setting")
        seen = meta
        rows += part
    if not rows:
        raise ValueError("no rows in " + ", ".join(paths))
    return rows, seen
