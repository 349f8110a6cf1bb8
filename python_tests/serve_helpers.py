"""Shared by the Ray Serve tests: the small ranker they serve, its users' histories and candidates, the Ray marker."""
from __future__ import annotations

import importlib.util
import json
import urllib.error
import urllib.request

import pytest
import torch

import relaygr_engine as rg

HAS_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="ray[serve] is not installed (pip install 'relaygr-engine[ray]')")

CFG = rg.GRModelConfig(attention="hstu", num_layers=1, hidden_dim=32, num_heads=2, head_dim=16, num_items=500,
                       num_actions=4, max_seq_len=256, num_tasks=2)
SEED = 3


def history(user: int, length: int) -> rg.Behaviors:
    g = torch.Generator().manual_seed(1000 + user)
    return rg.Behaviors(item_ids=torch.randint(0, CFG.num_items, (length,), generator=g),
                        action_ids=torch.randint(0, CFG.num_actions, (length,), generator=g),
                        timestamps=1_700_000_000 + torch.arange(length) * 60)


def candidates(user: int, n: int = 6) -> torch.Tensor:
    return torch.randint(0, CFG.num_items, (n,), generator=torch.Generator().manual_seed(5000 + user))


def _exact(model, h, c, scores) -> float:
    return (scores - model.rank_full(h, c)).abs().max().item()


def _post(port: int, path: str, body: dict, key: str):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", "x-session-id": key}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
