"""``relaygr serve --prefill-replicas 2 --rank-replicas 1 --ratio-control`` in its own process, over HTTP.

The disaggregated app answers HTTP (a pre-infer shipped to the ranking pool is a hit there, exact), and the live
ratio policy, fed by the replicas' own measurements through Serve's autoscaling metrics, moves a replica from the
pre-infer pool to the ranking pool when every ranking misses the SLO and rankings queue; every ranking stays exact
while Serve moves it."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from relaygr_engine.serving import wire

from ray_local import serve_process, server_port
from test_ray_disaggregated import CFG, SEED, candidates, history
from serve_helpers import _exact, _post

HAS_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None
pytestmark = [pytest.mark.ray,
              pytest.mark.skipif(not HAS_RAY, reason="ray[serve] is not installed (pip install 'relaygr-engine[ray]')")]

MOVE = "ratio: pre-infer:ranking 2:1 -> 1:2"


@pytest.fixture
def served():
    """``relaygr serve`` in a subprocess (its own local Ray, logs under a short temp dir); SIGTERM on exit."""
    import relaygr_engine as rg

    port = server_port()
    tmp = tempfile.mkdtemp(prefix="rgr", dir="/tmp")  # Ray's socket paths must stay short
    model = json.dumps({k: (v.value if hasattr(v, "value") else v) for k, v in CFG.__dict__.items()})
    args = ["--prefill-replicas", "2", "--rank-replicas", "1",
            "--ratio-control", json.dumps({"window_s": 2.0, "patience": 2}), "--slo-ms", "0.001",
            "--num-cpus", "2", "--replica-cpus", "0.25", "--app-name", "pd_http",
            "--model", model, "--seed", str(SEED), "--num-pages", "256", "--lease-ttl-s", "600"]
    try:
        with serve_process(args, port, Path(tmp) / "serve.out",
                           env={"RAY_TMPDIR": tmp, "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0"}):
            yield {"port": port, "tmp": tmp, "model": rg.build_ranker(CFG, seed=SEED)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _controller_log(tmp: str) -> str:
    return "".join(open(p, errors="replace").read()
                   for p in glob.glob(os.path.join(tmp, "**", "logs", "serve", "controller_*.log"), recursive=True))


def test_serve_cli_disaggregated_http_and_live_ratio_control_move_a_replica(served):
    port, model = served["port"], served["model"]
    # HTTP through the ingress: the pre-infer pool computes and ships, the ranking replica it names hits
    for u in (3, 4):
        h, c = history(u, 60), candidates(u)
        status, pre = _post(port, "/prefill", {"user_id": u, **wire.behaviors_to_json(h.prefix(48))},
                            f"{u};prefill")
        assert status == 200 and pre["admitted"] and pre["rank_replica"] == pre["ticket"]["replica"], pre
        body = {"user_id": u, **wire.behaviors_to_json(h), "candidates": c.tolist(), "ticket": pre["ticket"]}
        status, res = _post(port, "/rank", body, pre["route_key"])
        assert status == 200 and res["source"] == "hbm" and res["cached_tokens"] == 48, res
        assert _exact(model, h, c, torch.tensor(res["scores"])) <= 1e-4
    status, err = _post(port, "/rank", {"user_id": 1, "item_ids": [1]}, "1")
    assert status == 400 and "candidates" in err["error"]

    # every ranking misses the 1 us SLO and four streams queue on the one ranking replica: the policy moves one
    # pre-infer replica to the ranking pool; rankings stay exact throughout
    def rank(u: int):
        h, c = history(u, 40), candidates(u)
        status, res = _post(port, "/rank", {"user_id": u, **wire.behaviors_to_json(h), "candidates": c.tolist()},
                            str(u))
        assert status == 200, res
        return res["replica"], _exact(model, h, c, torch.tensor(res["scores"]))

    replicas, worst, end = set(), 0.0, time.monotonic() + 240
    with ThreadPoolExecutor(4) as pool:
        while time.monotonic() < end and not (len(replicas) >= 2 and MOVE in _controller_log(served["tmp"])):
            for replica, diff in pool.map(rank, range(100, 140)):
                replicas.add(replica)
                worst = max(worst, diff)
    assert MOVE in _controller_log(served["tmp"]), "the ratio policy never moved a replica"
    assert len(replicas) == 2, f"rankings were served by {sorted(replicas)}, not by a grown ranking pool of 2"
    assert worst <= 1e-4
