"""The model and device side of ``relaygr bench slo``: the model's size, the defaults that depend on the device,
how each side runs (CUDA graphs, ``torch.compile``), and what the report states about them.

On the CPU the defaults are the demo's (the ``small`` model, histories capped at 2048 tokens, 64 candidates, a
64 MiB cache). On a CUDA device the workload reaches production lengths: 256 candidates, histories capped at
16384 tokens (64 tokens per real behavior), a max-length search up to 65536 tokens, 64-token pages, 1024-token
pre-infer chunks, and an HBM budget of 16 GiB (at most a fifth of the device's memory); both sides run at their
best there: CUDA graphs and ``torch.compile`` on, unless ``--no-cuda-graphs`` / ``--no-compile``.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Optional

from ..cli_args import model_shape
from ..models.presets import ModelShape

__all__ = ["SloDefaults", "CPU_DEFAULTS", "CUDA_DEFAULTS", "MODEL_SEED", "defaults_for", "add_arguments",
           "apply_defaults", "check", "build_model", "describe", "fairness_notes"]

_MIB = 2**20


@dataclass(frozen=True)
class SloDefaults:
    """The benchmark options whose default depends on the device (``hbm_mb``/``dram_mb`` None: from the device's
    memory, see :func:`apply_defaults`)."""

    candidates: int
    length_scale: float
    max_history: int
    max_len_hi: int
    page_size: int
    chunk_tokens: int
    hbm_mb: Optional[float]
    dram_mb: Optional[float]


CPU_DEFAULTS = SloDefaults(candidates=64, length_scale=8.0, max_history=2048, max_len_hi=4096, page_size=16,
                           chunk_tokens=256, hbm_mb=64.0, dram_mb=256.0)
CUDA_DEFAULTS = SloDefaults(candidates=256, length_scale=64.0, max_history=16384, max_len_hi=65536, page_size=64,
                            chunk_tokens=1024, hbm_mb=None, dram_mb=None)
_CUDA_HBM_MB, _CUDA_HBM_SHARE = 16384.0, 0.2  # at most 16 GiB, at most a fifth of the device's memory


def defaults_for(device: str) -> SloDefaults:
    """The defaults of ``device`` (``cuda[:N]``: :data:`CUDA_DEFAULTS`, else :data:`CPU_DEFAULTS`)."""
    return CUDA_DEFAULTS if str(device).startswith("cuda") else CPU_DEFAULTS


def _help(name: str, unit: str = "") -> str:
    cpu, gpu = getattr(CPU_DEFAULTS, name), getattr(CUDA_DEFAULTS, name)
    return f"(default: {cpu:g}{unit} on the CPU, {gpu:g}{unit} on CUDA)" if gpu is not None else \
        f"(default: {cpu:g}{unit} on the CPU)"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``--page-size``, and how each side runs: ``--cuda-graphs`` and ``--compile`` (on by default on CUDA)."""
    from ..cli_args import POSITIVE_INT

    g = ap.add_argument_group("execution (both sides alike)")
    g.add_argument("--page-size", type=POSITIVE_INT, help="tokens per KV page " + _help("page_size"))
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="serve every mode's forwards through CUDA graphs (RelayEngine(cuda_graphs=True): the "
                        "rankings and the relay's pre-infer chunks; the baseline through a cache-less engine; needs "
                        "a CUDA --device and --baseline paged; default: on with a CUDA --device)")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="run the whole model compiled on both sides (RelayEngine(compile_model=True); needs "
                        "--baseline paged; default: on with a CUDA --device)")


def apply_defaults(args) -> None:
    """Fill the device-dependent options left unset (:class:`SloDefaults`), and the execution switches."""
    d = defaults_for(args.device)
    for key, value in asdict(d).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    cuda = str(args.device).startswith("cuda")
    if args.hbm_mb is None:
        args.hbm_mb = min(_CUDA_HBM_MB, _CUDA_HBM_SHARE * _device_memory_mb(args.device))
    if args.dram_mb is None:
        args.dram_mb = args.hbm_mb
    if args.cuda_graphs is None:
        args.cuda_graphs = cuda and args.baseline == "paged"
    if args.compile is None:
        args.compile = cuda and args.baseline == "paged"


def _device_memory_mb(device: str) -> float:
    import torch

    return torch.cuda.get_device_properties(torch.device(device)).total_memory / _MIB


def check(parser: argparse.ArgumentParser, args) -> ModelShape:
    """The model's shape (``args.shape``) and the checks that involve it, as usage errors naming the flags."""
    shape = model_shape(parser, args)
    args.shape = shape
    for flag, on in (("--cuda-graphs", args.cuda_graphs), ("--compile", args.compile)):
        if on and args.baseline != "paged":
            parser.error(f"{flag} needs --baseline paged (the dense oracle is not served through an engine), got "
                         f"--baseline {args.baseline}")
    if args.cuda_graphs and not str(args.device).startswith("cuda"):
        parser.error(f"--cuda-graphs needs a CUDA --device and --baseline paged, got --device {args.device} "
                     f"--baseline {args.baseline}")
    need = shape.kv_bytes_per_token * args.max_history / _MIB / 0.5   # an entry pins at most half the pool
    if args.hbm_mb < need:
        parser.error(f"--hbm-mb must hold one --max-history {args.max_history}-token history of the model "
                     f"({shape.kv_bytes_per_token} bytes of KV per token, half the pool at most): expected >= "
                     f"{need:.6g}, got {args.hbm_mb:g}")
    return shape


# The seed of the model's weights, whatever ``--seed``: the seeds of ``--seeds`` vary the workload's draw and its
# trace, and share one model (built once; a seed run alone builds the same weights).
MODEL_SEED = 0


def build_model(args, num_items: int, num_actions: int):
    """The benchmark's ranker: ``args.shape``'s size, long enough for the max-length search, its weights drawn
    with :data:`MODEL_SEED` (the same for every ``--seed``)."""
    from ..models import build_ranker

    cfg = args.shape.config(num_items=num_items, num_actions=num_actions,
                            max_seq_len=max(args.max_history, args.max_len_hi), num_tasks=2)
    return build_ranker(cfg, seed=MODEL_SEED, device=args.device, dtype=args.shape.torch_dtype)


def describe(args) -> dict:
    """The report's ``model`` additions and its ``execution`` entry: size, dtype, KV bytes per token, the HBM
    budget in bytes and tokens, how each side runs."""
    s = args.shape
    hbm = int(args.hbm_mb * _MIB)
    return {
        "model": {"preset": args.model, "dtype": s.dtype, "kv_bytes_per_token": s.kv_bytes_per_token,
                  "hbm_budget_bytes": hbm, "hbm_budget_tokens": hbm // s.kv_bytes_per_token,
                  "dram_budget_bytes": int(args.dram_mb * _MIB)},
        "execution": {"cuda_graphs": bool(args.cuda_graphs), "compile": bool(args.compile),
                      "page_size": args.page_size, "chunk_tokens": args.chunk_tokens,
                      "both_sides": "the baseline and the relay run the same model the same way (graphs and "
                                    "compilation alike)"},
    }


def fairness_notes(results: dict) -> list[str]:
    """Notes where a mode ran eagerly although it was asked to run graphed or compiled (a capture or compilation
    failure, counted by its engines), so one side ran worse than the other."""
    notes = []
    for m, r in results.items():
        es = r.get("at_ref", {}).get("engine_stats", {})
        for fail, eager, what in (("graph_failures", "graph_eager", "CUDA graphs"),
                                  ("compile_failures", "compile_eager", "torch.compile")):
            if es.get(fail, 0) or es.get(eager, 0):  # (an engine reused across runs counts its failure once)
                notes.append(f"{m}: {what} failed, and {es.get(eager, 0)} forward(s) at the reference QPS ran "
                             f"eagerly: the sides did not run alike there.")
    return notes
