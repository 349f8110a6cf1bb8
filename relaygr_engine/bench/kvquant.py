"""``relaygr bench kvquant``: what an 8-bit prefix KV cache costs in accuracy, on rankers trained on a real log.

The bundled ranker (``GRRanker``, HSTU and softmax attention; small sizes that train in minutes on a CPU) is trained
with a next-item objective on an interaction log (``--data``: a CSV such as MovieLens' ``ratings.csv.gz``): each
sample is a user's history up to an event, the event's item among ``--candidates - 1`` random items, and a
cross-entropy over the candidates. 20% of the users are held out. On ``--requests`` held-out requests (a history
ending at an event, the event's item and random candidates, the event's time as the request time) the prefix is
pre-inferred without the last ``--new`` tokens and the request ranked against it, once per cache format: the model
dtype (equal to full inference) and each 8-bit format (``CacheConfig(kv_dtype=...)``).

Per model and 8-bit format, against the model-dtype cache: the largest and the 99th-percentile absolute score
difference over all candidate scores, the mean top-10 overlap of the two rankings of each request's candidates, the
mean Kendall tau between them, and each format's hit rate at 10 (the held-out item among the top 10).

    relaygr bench kvquant --data ratings.csv.gz [--steps 300] [--requests 1000] [--json PATH]
"""
from __future__ import annotations

import math
import time
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from ..cli_args import ArgumentParser, POSITIVE_INT
from ..config import CacheConfig, KVDtype
from ..engine import RelayEngine
from ..models import Behaviors, GRModelConfig, build_ranker
from ..batch import RelayBatch
from .common import emit_result, environment, percentile
from ..workload.logs import read_interactions

__all__ = ["Sequences", "agreement", "main", "train"]

FORMATS = (KVDtype.INT8, KVDtype.FP8_E4M3)
NUM_ACTIONS = 6  # ratings 0..5 (MovieLens: 0.5..5 rounded)


class Sequences:
    """A log's per-user event sequences with dense item ids ``1..num_items`` (0 is never an item)."""

    def __init__(self, path) -> None:
        log = read_interactions(path)
        _, items = np.unique(log.item_ids, return_inverse=True)
        acts = np.zeros(len(log), np.int64) if log.action_values is None else np.clip(
            np.floor(log.action_values + 0.5), 0, NUM_ACTIONS - 1).astype(np.int64)
        starts = np.flatnonzero(np.r_[True, log.user_ids[1:] != log.user_ids[:-1]])
        ends = np.r_[starts[1:], len(log)]
        self.users = [(items[a:b] + 1, acts[a:b], log.timestamps[a:b]) for a, b in zip(starts, ends)]
        self.num_items = int(items.max()) + 2
        self.source = log.source

    def sample(self, user: int, g: np.random.Generator, min_history: int, max_history: int, num_candidates: int):
        """A request ending at a random event of ``user``: (history, candidates with the event's item first,
        request time)."""
        items, acts, times = self.users[user]
        t = int(g.integers(min_history, len(items)))
        lo = max(0, t - max_history)
        hist = Behaviors(item_ids=torch.from_numpy(items[lo:t].copy()), action_ids=torch.from_numpy(acts[lo:t].copy()),
                         timestamps=torch.from_numpy(times[lo:t].copy()))
        negatives = g.integers(1, self.num_items, num_candidates - 1)
        cands = torch.from_numpy(np.r_[items[t], negatives].astype(np.int64))
        return hist, cands, int(times[t])


def train(model, seqs: Sequences, users: list[int], *, steps: int, batch: int, args, seed: int) -> float:
    """``steps`` Adam steps of the next-item cross-entropy over candidates (dense forward); the last loss."""
    g = np.random.default_rng(seed)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    model.train()
    loss = torch.zeros(())
    for _ in range(steps):
        parts = []
        for u in g.choice(users, batch):
            hist, cands, t = seqs.sample(int(u), g, 8, args.max_history, args.candidates)
            parts.append((hist, 0, cands, t))
        logits = model(RelayBatch.from_requests(parts))[:, 0].view(batch, args.candidates)
        loss = F.cross_entropy(logits, torch.zeros(batch, dtype=torch.long))  # the event's item is candidate 0
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def agreement(a: torch.Tensor, b: torch.Tensor, k: int = 10) -> tuple[float, float]:
    """Top-``k`` overlap (share of ``a``'s top ``k`` in ``b``'s) and Kendall's tau-a between two score vectors
    ``[C]`` of the same candidates."""
    k = min(k, a.numel())
    top = len(set(a.topk(k).indices.tolist()) & set(b.topk(k).indices.tolist())) / k
    da, db = a[:, None] - a[None, :], b[:, None] - b[None, :]
    pairs = a.numel() * (a.numel() - 1)
    tau = float((torch.sign(da) * torch.sign(db)).sum()) / pairs if pairs else 1.0
    return top, tau


def _evaluate(model, seqs: Sequences, users: list[int], args, page_size: int) -> dict:
    """Rank the held-out requests through one engine per cache format; the metrics of each 8-bit format."""
    g = np.random.default_rng(args.seed + 1)
    requests = [seqs.sample(int(u), g, args.new + 4, args.max_history, args.candidates)
                for u in g.choice(users, args.requests)]
    engines = {kd: RelayEngine(model, CacheConfig(page_size=page_size, num_pages=1 << 12, attention_backend="torch",
                                                  kv_dtype=kd)) for kd in (KVDtype.MODEL, *FORMATS)}
    scores = {kd: [] for kd in engines}
    worst_exact = 0.0
    for i, (hist, cands, t) in enumerate(requests):
        for kd, e in engines.items():
            ticket = e.prefill_prefix(i, hist.prefix(len(hist) - args.new))
            res = e.rank_with_prefix(i, hist, cands, ticket=ticket, request_time=t)
            assert res.source == "hbm" and res.kv_dtype == kd.value, (res.source, res.kv_dtype)
            scores[kd].append(res.scores[:, 0])
        if i < 8:  # the model-dtype cache is full inference
            with torch.no_grad():
                full = model(RelayBatch.full(hist, cands, t))[:, 0]
            worst_exact = max(worst_exact, float((scores[KVDtype.MODEL][-1] - full).abs().max()))
    ref = scores[KVDtype.MODEL]
    out = {"exact_max_abs": worst_exact, "hr10_model": _hit_rate(ref)}
    for kd in FORMATS:
        diffs = torch.cat([(a - b).abs() for a, b in zip(scores[kd], ref)]).numpy()
        agree = np.asarray([agreement(b, a) for a, b in zip(scores[kd], ref)])
        name = "fp8" if kd is KVDtype.FP8_E4M3 else "int8"
        out.update({f"{name}_max_abs": float(diffs.max()), f"{name}_p99_abs": float(percentile(diffs, 99)),
                    f"{name}_top10": float(agree[:, 0].mean()), f"{name}_tau": float(agree[:, 1].mean()),
                    f"{name}_tau_min": float(agree[:, 1].min()), f"hr10_{name}": _hit_rate(scores[kd])})
    return out


def _hit_rate(scores: list[torch.Tensor], k: int = 10) -> float:
    """Share of requests whose held-out item (candidate 0) is among the top ``k``."""
    return float(np.mean([0 in s.topk(min(k, s.numel())).indices.tolist() for s in scores]))


def main(argv: Optional[list[str]] = None) -> int:
    ap = ArgumentParser(prog="relaygr bench kvquant", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="interaction CSV (.csv or .csv.gz): user, item, timestamp[, rating]")
    ap.add_argument("--models", default="hstu,softmax", help="comma-separated attention kinds (hstu,softmax)")
    ap.add_argument("--steps", type=POSITIVE_INT, default=300, help="training steps per model (300)")
    ap.add_argument("--batch", type=POSITIVE_INT, default=16, help="requests per training step (16)")
    ap.add_argument("--requests", type=POSITIVE_INT, default=1000, help="held-out requests evaluated (1000)")
    ap.add_argument("--candidates", type=POSITIVE_INT, default=50, help="candidates per request (50)")
    ap.add_argument("--max-history", type=POSITIVE_INT, default=256, help="history tokens kept per request (256)")
    ap.add_argument("--new", type=POSITIVE_INT, default=4, help="history tokens after the pre-inferred prefix (4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in ("hstu", "softmax") for m in models):
        ap.error(f"--models must name 'hstu' and/or 'softmax', got {args.models!r}")
    if args.candidates < 2:
        ap.error(f"--candidates must be >= 2 (the held-out item and at least one other), got {args.candidates}")
    try:
        seqs = Sequences(args.data)
    except (OSError, ValueError) as exc:
        ap.error(f"--data: {exc}")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    eligible = [u for u, (items, _, _) in enumerate(seqs.users) if len(items) > args.new + 8]
    held = set(rng.choice(eligible, max(1, len(eligible) // 5), replace=False).tolist())
    train_users = [u for u in eligible if u not in held]
    print(f"data={seqs.source} users={len(seqs.users)} items={seqs.num_items - 2} train_users={len(train_users)} "
          f"held_out_users={len(held)} requests={args.requests} candidates={args.candidates}")
    result: dict = {}
    for kind in models:
        cfg = GRModelConfig(attention=kind, num_layers=2, hidden_dim=64, num_heads=2, head_dim=32,
                            num_items=seqs.num_items, num_actions=NUM_ACTIONS, max_seq_len=args.max_history + 8,
                            num_tasks=1)
        model = build_ranker(cfg, seed=args.seed)
        t0 = time.perf_counter()
        loss = train(model, seqs, train_users, steps=args.steps, batch=args.batch, args=args, seed=args.seed)
        trained = time.perf_counter() - t0
        metrics = _evaluate(model, seqs, sorted(held), args, page_size=16)
        print(f"{kind}: trained {args.steps} steps in {trained:.0f} s (loss {loss:.3f} vs chance "
              f"{math.log(args.candidates):.3f}); " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        result.update({f"{kind}_loss": loss, **{f"{kind}_{k}": v for k, v in metrics.items()}})
    result.update(requests=args.requests, steps=args.steps, candidates=args.candidates, device="cpu")
    emit_result(result, args.json, extra=dict(environment("cpu"), args=vars(args)))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
