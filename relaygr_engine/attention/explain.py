"""``relaygr explain``: what a cached ranking's attention would run for a model shape, on this device or a named GPU.

::

    relaygr explain --model nvidia-hstu --history 4096 --candidates 256             # this machine's device
    relaygr explain --model nvidia-hstu --history 4096 --candidates 256 --gpu h100  # planned for an H100

Prints the :class:`~relaygr_engine.attention.plan.AttentionPlan` of one layer of the model for a batch of
``--users`` users, each with ``--history`` tokens of which the newest ``--new-tokens`` are computed now (the rest
cached) and ``--candidates`` candidates: the backend, the path, and every kernel launch decision with its reason.
Planning is host-side arithmetic, so ``--gpu`` needs no GPU. ``--json`` writes the plan as JSON too.
"""
from __future__ import annotations

import json
import sys
from typing import Optional

from ..cli_args import COUNT, POSITIVE_INT, ArgumentParser, add_model_arguments, model_shape

__all__ = ["main"]


def _parser() -> ArgumentParser:
    from ..config import AttentionBackend, KVDtype
    from ..kernels._target import GPUS

    ap = ArgumentParser(prog="relaygr explain", description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    g = ap.add_argument_group("batch")
    g.add_argument("--history", type=POSITIVE_INT, default=4096, help="history tokens per user (default: 4096)")
    g.add_argument("--new-tokens", type=COUNT, default=128,
                   help="of them, the newest computed now (the rest cached; default: 128)")
    g.add_argument("--candidates", type=COUNT, default=256, help="candidates per user (default: 256)")
    g.add_argument("--users", type=POSITIVE_INT, default=1, help="users in the batch (default: 1)")
    g = ap.add_argument_group("cache and device")
    g.add_argument("--page-size", type=POSITIVE_INT, help="tokens per page (default: 64 on CUDA, 16 elsewhere)")
    g.add_argument("--kv-dtype", default="model", choices=[k.value for k in KVDtype], help="how pages store K/V")
    g.add_argument("--backend", default="auto", choices=[b.value for b in AttentionBackend],
                   help="CacheConfig.attention_backend (default: auto)")
    g.add_argument("--gpu", choices=sorted(GPUS), help="plan for this GPU instead of this machine's device")
    g.add_argument("--device", default=None, help="this machine's device to plan for (default: cuda if available, "
                                                  "else cpu)")
    ap.add_argument("--json", help="also write the plan as JSON here")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    import torch

    from ..kernels._target import named_gpu
    from .plan import plan_attention

    ap = _parser()
    args = ap.parse_args(argv)
    shape = model_shape(ap, args)
    if args.new_tokens > args.history:
        ap.error(f"--new-tokens ({args.new_tokens}) must be <= --history ({args.history})")
    if args.gpu:
        target = named_gpu(args.gpu)
    else:
        try:
            target = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        except RuntimeError as e:
            ap.error(f"argument --device: {e}")
    page_size = args.page_size or (64 if target.type == "cuda" else 16)
    cached = args.history - args.new_tokens
    plan = plan_attention(target, mode="hstu", num_heads=shape.num_heads, head_dim=shape.head_dim,
                          dtype=shape.dtype, page_size=page_size, cached=[cached] * args.users,
                          new=[args.new_tokens] * args.users, candidates=[args.candidates] * args.users,
                          kv_dtype=args.kv_dtype, backend=args.backend)
    print(f"model: {args.model}: {shape.describe()} (each of its {shape.num_layers} layers runs this plan)")
    print(plan.describe())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(plan.as_dict(), model=args.model, layers=shape.num_layers), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
