"""Serve HSTU layers trained with Meta's generative-recommenders (its production ``STULayer``) from their checkpoint.

The STU layer differs from ``GRRanker``'s default HSTU layer in several terms (SiLU on u only, an output projection
reading ``concat(u, a, u * norm(a))``, per-head group norm, eps 1e-6, value heads wider than q/k), so the ranker is
built with the options that reproduce it (``meta_stu_options``) and the STU tensors are mapped onto its layers by
``from_meta_stu``, which checks every shape. The ranker's embeddings and task heads are the team's own (here: fresh).

Run it: ``python examples/stu_checkpoint.py`` (makes an STU-layout checkpoint in memory, loads it, serves 4 users).
"""
from __future__ import annotations

import torch

import relaygr_engine as rg
from relaygr_engine.models.convert import from_meta_stu, meta_stu_options

# The STU stack's config (STULayerConfig fields) and the ranker around it.
EMBEDDING_DIM, NUM_HEADS, ATTENTION_DIM, HIDDEN_DIM, NUM_LAYERS = 48, 2, 16, 24, 2
MAX_SEQ_LEN, NUM_ITEMS = 256, 2000
PREFIX = "_hstu_transducer._stu_module._stu_layers"


def stu_checkpoint(seed: int = 0) -> dict:
    """A state dict in the STU stack's layout (what ``torch.load`` of a trained model gives), random weights."""
    g = torch.Generator().manual_seed(seed)
    uvqk = (2 * HIDDEN_DIM + 2 * ATTENTION_DIM) * NUM_HEADS
    sd = {}
    for layer in range(NUM_LAYERS):
        p = f"{PREFIX}.{layer}."
        sd[p + "_uvqk_weight"] = torch.randn(EMBEDDING_DIM, uvqk, generator=g) * EMBEDDING_DIM ** -0.5
        sd[p + "_uvqk_beta"] = torch.randn(uvqk, generator=g) * 0.1
        sd[p + "_input_norm_weight"] = 1 + 0.1 * torch.randn(EMBEDDING_DIM, generator=g)
        sd[p + "_input_norm_bias"] = 0.1 * torch.randn(EMBEDDING_DIM, generator=g)
        sd[p + "_output_weight"] = torch.randn(3 * HIDDEN_DIM * NUM_HEADS, EMBEDDING_DIM, generator=g) * 0.1
        sd[p + "_output_norm_weight"] = 1 + 0.1 * torch.randn(NUM_HEADS, generator=g)  # use_group_norm: [H]
        sd[p + "_output_norm_bias"] = 0.1 * torch.randn(NUM_HEADS, generator=g)
    return sd


def split_layers(state_dict: dict, prefix: str, num_layers: int) -> list[dict]:
    """One dict per layer, keyed by the layer's own parameter names."""
    return [{k[len(f"{prefix}.{layer}."):]: v for k, v in state_dict.items() if k.startswith(f"{prefix}.{layer}.")}
            for layer in range(num_layers)]


def build_from_stu(state_dict: dict) -> rg.GRRanker:
    options = meta_stu_options(NUM_HEADS, ATTENTION_DIM, HIDDEN_DIM, use_group_norm=True,
                               hstu_norm=float(MAX_SEQ_LEN))  # one constant N, the longest history served
    config = rg.GRModelConfig(num_layers=NUM_LAYERS, hidden_dim=EMBEDDING_DIM, num_items=NUM_ITEMS, num_actions=4,
                              max_seq_len=MAX_SEQ_LEN, num_tasks=2, **options)
    model = rg.build_ranker(config, seed=0)  # embeddings and heads: load the team's own beside the layers
    loaded = model.load_state_dict(from_meta_stu(split_layers(state_dict, PREFIX, NUM_LAYERS), config), strict=False)
    assert not any(k.startswith("layers.") for k in loaded.missing_keys)
    return model


def synthetic_history(length: int, seed: int) -> rg.Behaviors:
    g = torch.Generator().manual_seed(seed)
    return rg.Behaviors(item_ids=torch.randint(0, NUM_ITEMS, (length,), generator=g),
                        action_ids=torch.randint(0, 4, (length,), generator=g),
                        timestamps=1_700_000_000 + torch.cumsum(torch.randint(1, 4000, (length,), generator=g), 0))


def main() -> dict:
    model = build_from_stu(stu_checkpoint())
    engine = rg.RelayEngine(model, rg.CacheConfig(page_size=16, num_pages=512, attention_backend="torch"))
    worst, sources = 0.0, []
    for user in range(4):
        history = synthetic_history(100 + 20 * user, seed=user)
        candidates = torch.randint(0, NUM_ITEMS, (32,), generator=torch.Generator().manual_seed(user))
        ticket = engine.prefill_prefix(user, history.prefix(len(history) - 8))      # at retrieval
        result = engine.rank_with_prefix(user, history, candidates, ticket=ticket)  # at ranking
        worst = max(worst, float((result.scores - model.rank_full(history, candidates)).abs().max()))
        sources.append(result.source)
    print(f"stu example: {NUM_LAYERS} STU layers loaded, served 4 users from {sorted(set(sources))}, "
          f"max |relay - no-cache| = {worst:.2e}")
    return dict(max_abs_diff=worst, sources=sources)


if __name__ == "__main__":
    main()
