"""Request limits on the serving path, and what ``relaygr serve`` listens on.

Without Ray: the JSON depth scan, body parsing and the replica's HTTP handler (a real Starlette request). With Ray:
``relaygr serve`` in its own process, hostile bodies over HTTP on 127.0.0.1 (oversized, chunked, deeply nested,
wrongly typed) answered 4xx while the replica keeps serving exact scores, and every listening socket of the started
processes bound to loopback. A port already in use is a one-line usage error, whether ``relaygr serve`` finds it
taken before starting Ray or Serve's proxy fails to bind it afterwards.
"""
from __future__ import annotations

import asyncio
import http.client
import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import relaygr_engine as rg
from relaygr_engine.serving import wire
from relaygr_engine.serving.ray_serve import RelayReplica, ReplicaSpec

from ray_local import ENV, kill_session, serve_process, server_port, session_processes

HAS_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None
CFG = dict(attention="hstu", num_layers=1, hidden_dim=32, num_heads=2, head_dim=16, num_items=500, num_actions=4,
           max_seq_len=128, num_tasks=2)
SEED = 5
LIMITS = dict(max_body_bytes=256 * 1024, max_json_depth=8, max_candidates=64)


def request_body(user: int, length: int = 40, num_candidates: int = 6) -> dict:
    g = torch.Generator().manual_seed(user)
    return {"user_id": user, "item_ids": torch.randint(0, 500, (length,), generator=g).tolist(),
            "timestamps": (1_700_000_000 + 60 * torch.arange(length)).tolist(),
            "action_ids": torch.randint(0, 4, (length,), generator=g).tolist(),
            "candidates": torch.randint(0, 500, (num_candidates,), generator=g).tolist()}


def exact(model, body: dict, scores) -> float:
    h = rg.Behaviors(item_ids=torch.tensor(body["item_ids"]), action_ids=torch.tensor(body["action_ids"]),
                     timestamps=torch.tensor(body["timestamps"]))
    return float((torch.tensor(scores) - model.rank_full(h, torch.tensor(body["candidates"]))).abs().max())


def hostile_bodies() -> list[tuple[str, bytes, int, str]]:
    """``(case, raw body, expected status, expected words in the error)``."""
    ok = request_body(1)
    big = json.dumps(dict(ok, candidates=[0] * 300_000)).encode()
    cases = [
        ("oversized", big, 413, "max_body_bytes=262144"),
        ("nested_lists", b'{"user_id": 1, "item_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
         "max_json_depth=8"),
        ("nested_objects", b'{"a": ' * 9 + b"1" + b"}" * 9, 400, "max_json_depth=8 deep, got 9"),
        ("too_many_candidates", json.dumps(dict(ok, candidates=[1] * 65)).encode(), 400, "max_candidates=64"),
        ("history_too_long", json.dumps(dict(ok, item_ids=[1] * 129)).encode(), 400, "max_history=128"),
        ("not_json", b"{user_id: 1", 400, "must be JSON"),
        ("huge_integer", b'{"user_id": ' + b"9" * 5000 + b"}", 400, "must be JSON"),
        ("body_is_a_list", b"[1, 2]", 400, "must be a JSON object"),
        ("item_ids_string", json.dumps(dict(ok, item_ids="1,2,3")).encode(), 400, "item_ids must be a list"),
        ("candidate_floats", json.dumps(dict(ok, candidates=[1.5])).encode(), 400, "candidates must be a list"),
        ("candidates_object", json.dumps(dict(ok, candidates={"a": 1})).encode(), 400, "candidates must be a list"),
        ("user_id_list", json.dumps(dict(ok, user_id=[1])).encode(), 400, "user_id"),
        ("request_time_text", json.dumps(dict(ok, request_time="soon")).encode(), 400, "request_time"),
        ("negative_time", json.dumps(dict(ok, timestamps=[-5] * 40)).encode(), 400, "timestamps must be times"),
        ("ticket_list", json.dumps(dict(ok, ticket=[1])).encode(), 400, "ticket must be a JSON object"),
        ("ticket_fields", json.dumps(dict(ok, ticket={"admitted": True, "reason": "admitted", "user_id": 1,
                                                      "fingerprint": "x", "num_tokens": 4})).encode(), 400,
         "ticket is malformed"),
    ]
    return cases


# ----------------------------------------------------------------------------------------------- without Ray
def test_json_depth_counts_brackets_outside_strings():
    assert wire.json_depth(b"1") == 0 and wire.json_depth(b"[]") == 1
    assert wire.json_depth(b'{"a": [1, [2, "[[[["], {"b": "\\"]]"}]}') == 3
    assert wire.json_depth(b"[" * 100_000 + b"]" * 100_000) == 100_000


def test_limits_are_validated_and_parse_body_checks_before_json():
    for kw, match in [(dict(max_body_bytes=0), "max_body_bytes"), (dict(max_json_depth=257), "max_json_depth"),
                      (dict(max_candidates=True), "max_candidates"), (dict(max_history=0), "max_history")]:
        with pytest.raises(ValueError, match=match):
            wire.RequestLimits(**kw)
    lim = wire.RequestLimits(max_body_bytes=100, max_json_depth=2)
    with pytest.raises(wire.RequestTooLarge, match="max_body_bytes=100"):
        wire.parse_body(b" " * 101, lim)
    with pytest.raises(ValueError, match="max_json_depth=2 deep, got 3"):
        wire.parse_body(b"[[[1]]]", lim)
    assert wire.parse_body(b'{"a": [1]}', lim) == {"a": [1]}
    with pytest.raises(ValueError, match="max_candidates=3 entries, got 4"):
        wire.candidates_from_json({"candidates": [1, 2, 3, 4]}, max_candidates=3)
    with pytest.raises(ValueError, match="timestamps must hold at most max_history=2"):
        wire.behaviors_from_json({"item_ids": [1, 2], "timestamps": [1, 2, 3]}, max_history=2)


def test_serve_cli_checks_limits_before_starting_ray(capsys):
    from relaygr_engine.serving.cli import main

    for argv, message in ((["--max-json-depth", "300"], "--max-json-depth must be in [1, 256], got 300"),
                          (["--max-candidates", "0"], "--max-candidates: expected an integer >= 1, got 0"),
                          (["--max-pinned-fraction", "2"], "--max-pinned-fraction must be")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err  # one line naming the flag


class _Request:
    """An ASGI request for the replica's handler (Starlette's own Request over a scope and a receive channel)."""

    def __init__(self, path: str, body: bytes, chunked: bool = False, method: str = "POST") -> None:
        from starlette.requests import Request

        headers = [(b"content-type", b"application/json")]
        if not chunked:
            headers.append((b"content-length", str(len(body)).encode()))
        pieces = [body[i:i + 4096] for i in range(0, len(body), 4096)] or [b""]
        self.sent = 0
        messages = [{"type": "http.request", "body": p, "more_body": i + 1 < len(pieces)}
                    for i, p in enumerate(pieces)]

        async def receive():
            self.sent += 1
            return messages[self.sent - 1]

        scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b"",
                 "root_path": "", "scheme": "http", "server": ("127.0.0.1", 8000)}
        self.request, self.num_pieces = Request(scope, receive), len(pieces)


@pytest.fixture(scope="module")
def replica():
    pytest.importorskip("starlette", reason="starlette (installed with ray[serve]) builds the handler's requests")
    threads = torch.get_num_threads()
    try:
        rep = RelayReplica(ReplicaSpec(model=CFG, seed=SEED, cache=dict(num_pages=64), limits=LIMITS))
    finally:
        torch.set_num_threads(threads)
    return rep, rg.build_ranker(rg.GRModelConfig(**CFG), seed=SEED)


def _call(rep, req: _Request):
    resp = asyncio.run(rep(req.request))
    return resp.status_code, json.loads(resp.body)


@pytest.mark.parametrize("case, raw, status, words", hostile_bodies(), ids=[c[0] for c in hostile_bodies()])
def test_replica_handler_answers_bad_bodies_with_4xx(replica, case, raw, status, words):
    rep, model = replica
    before = rep.engine.stats()
    got, reply = _call(rep, _Request("/rank", raw))
    assert got == status and words in reply["error"], reply
    after = rep.engine.stats()
    assert after["rank_requests"] == before["rank_requests"] and after["pool_inserts"] == before["pool_inserts"]
    body = request_body(2)
    got, reply = _call(rep, _Request("/rank", json.dumps(body).encode()))
    assert got == 200 and exact(model, body, reply["scores"]) <= 1e-4


def test_replica_stops_reading_a_chunked_body_at_the_limit(replica):
    rep, _ = replica
    big = json.dumps(dict(request_body(1), candidates=[0] * 300_000)).encode()
    req = _Request("/rank", big, chunked=True)
    got, reply = _call(rep, req)
    assert got == 413 and "max_body_bytes=262144" in reply["error"]
    assert req.sent <= LIMITS["max_body_bytes"] // 4096 + 1 < req.num_pieces  # the rest was never read


# ----------------------------------------------------------------------------------------------- relaygr serve
def _descendants(root: int) -> list[int]:
    children: dict = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _listening_sockets() -> dict[str, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket (/proc/net/tcp, tcp6)."""
    out = {}
    for family, path in ((socket.AF_INET, "/proc/net/tcp"), (socket.AF_INET6, "/proc/net/tcp6")):
        with open(path) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] != "0A":  # TCP_LISTEN
                    continue
                host, port = fields[1].split(":")
                raw = bytes.fromhex(host)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # per-word host order
                out[fields[9]] = (socket.inet_ntop(family, raw), int(port, 16))
    return out


def listening_of(root: int) -> list[tuple[int, str, str, int]]:
    """``(pid, name, address, port)`` of every socket listened on by ``root`` and its descendants."""
    table, found = _listening_sockets(), []
    for pid in _descendants(root):
        try:
            name = open(f"/proc/{pid}/comm").read().strip()
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue  # exited meanwhile
        for link in links:
            inode = link[8:-1] if link.startswith("socket:[") else None
            if inode in table:
                found.append((pid, name) + table[inode])
    return found


def _loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("::1", "::ffff:127.0.0.1")


def _post(port: int, path: str, data, timeout: float = 60.0):
    """POST ``data`` (bytes, or an iterable of chunks sent chunked); the reply's status and JSON. A server may answer
    a body past its limit before reading all of it and close: the reply is read after the broken send."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)  # the bound on a bad body's answer
    try:
        headers = {"content-type": "application/json", "x-session-id": "1"}
        try:
            conn.request("POST", path, body=data, headers=headers, encode_chunked=not isinstance(data, bytes))
        except (BrokenPipeError, ConnectionResetError):
            pass
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _serve_args(*extra: str) -> list[str]:
    """``relaygr serve`` arguments for a 1-replica app of ``CFG`` with ``LIMITS`` (no ``--port``)."""
    return ["--replicas", "1", "--num-cpus", "2", "--replica-cpus", "0.5", "--model", json.dumps(CFG), "--seed",
            str(SEED), "--num-pages", "64", "--max-body-bytes", str(LIMITS["max_body_bytes"]), "--max-json-depth",
            str(LIMITS["max_json_depth"]), "--max-candidates", str(LIMITS["max_candidates"]), *extra]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``relaygr serve`` (local mode, 1 replica) in its own process on a port Ray does not pick; stopped with
    SIGTERM."""
    if not HAS_RAY:
        pytest.skip("ray[serve] is not installed (pip install 'relaygr-engine[ray]')")
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("listing listening sockets needs Linux /proc")
    port = server_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve_process(_serve_args("--duration", "900"), port, log, timeout_s=240) as proc:
        yield {"proc": proc, "port": port, "model": rg.build_ranker(rg.GRModelConfig(**CFG), seed=SEED)}


@pytest.mark.ray
@pytest.mark.slow
def test_serve_listens_on_loopback_only(served):
    socks = listening_of(served["proc"].pid)
    names = {name for _, name, _, _ in socks}
    assert {"gcs_server", "raylet"} <= names, socks  # Ray's own processes were seen
    assert any(port == served["port"] and _loopback(addr) for _, _, addr, port in socks), socks
    # Ray Serve 2.60 binds each replica's inter-deployment gRPC server to [::]:0 with no option to change it: the one
    # known wildcard listener (README, "Limits and guarantees"); anything else off loopback fails.
    wild = [s for s in socks if not _loopback(s[2])]
    assert all(name.startswith("ray::ServeRepli") and addr == "::" for _, name, addr, _ in wild), wild
    assert len(wild) <= 1, wild


@pytest.mark.ray
@pytest.mark.slow
def test_http_bad_bodies_get_4xx_and_the_replica_keeps_serving_exact_scores(served):
    port, model = served["port"], served["model"]
    for case, raw, status, words in hostile_bodies():
        got, reply = _post(port, "/rank", raw)  # the timeout bounds how long a bad body may hold the replica
        assert got == status and words in reply["error"], (case, got, reply)
    big = json.dumps(dict(request_body(1), candidates=[0] * 300_000)).encode()
    got, reply = _post(port, "/rank", iter([big[i:i + 65536] for i in range(0, len(big), 65536)]))  # chunked
    assert got == 413 and "max_body_bytes" in reply["error"]
    body = request_body(3, length=60)
    got, pre = _post(port, "/prefill", json.dumps(dict(body, item_ids=body["item_ids"][:50],
                                                       timestamps=body["timestamps"][:50],
                                                       action_ids=body["action_ids"][:50])).encode())
    assert got == 200 and pre["admitted"], pre
    got, res = _post(port, "/rank", json.dumps(dict(body, ticket=pre["ticket"])).encode())
    assert got == 200 and res["source"] == "hbm" and res["cached_tokens"] == 50
    assert exact(model, body, res["scores"]) <= 1e-4


# ----------------------------------------------------------------------------------------------- a port in use
def _in_use(flag: str, port: int, why: str) -> str:
    return f"relaygr serve: error: argument {flag}: expected a free port, got {port}: {why} (see relaygr serve --help)"


@pytest.mark.skipif(not HAS_RAY, reason="ray[serve] is not installed (pip install 'relaygr-engine[ray]')")
def test_serve_refuses_a_port_in_use_in_one_line_before_starting_ray():
    with socket.socket() as held:
        held.bind(("127.0.0.1", server_port()))
        held.listen()
        port = held.getsockname()[1]
        for flag, extra in (("--port", ()), ("--metrics-port", ("--port", str(server_port())))):
            proc = subprocess.Popen([sys.executable, "-m", "relaygr_engine.cli", "serve", *_serve_args(*extra), flag,
                                     str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, **ENV}, start_new_session=True)
            try:
                out, err = proc.communicate(timeout=120)
            finally:
                kill_session(proc.pid)
            assert proc.returncode == 2 and out == "", (out, err)
            assert err.splitlines() == [_in_use(flag, port, f"127.0.0.1:{port} is already in use")], err
            assert session_processes(proc.pid) == []  # no Ray process was started


# ``relaygr serve`` whose port check, once passed, takes the port: Serve's proxy then fails to bind it
TAKE_AFTER_CHECK = """
import socket, sys
from relaygr_engine.serving import cli
check, held = cli._check_listen, []
def check_then_take(parser, flag, host, port):
    check(parser, flag, host, port)
    if flag == "--port":
        held.append(socket.create_server((host, port)))
cli._check_listen = check_then_take
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(not HAS_RAY, reason="ray[serve] is not installed (pip install 'relaygr-engine[ray]')")
def test_serve_reports_the_proxy_failing_to_bind_in_one_line_after_shutting_ray_down():
    port = server_port()
    proc = subprocess.Popen([sys.executable, "-c", TAKE_AFTER_CHECK, *_serve_args("--duration", "60"), "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **ENV}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
        left = session_processes(proc.pid)  # Ray's processes, had the server not shut Ray down
    finally:
        kill_session(proc.pid)
    lines = err.splitlines()
    assert proc.returncode == 2, err[-4000:]
    assert lines[-1] == _in_use("--port", port, f"Serve's HTTP proxy could not bind 127.0.0.1:{port} (in use by "
                                                "another process?)"), err[-4000:]
    assert not any(line.startswith("Traceback") for line in lines), err[-4000:]  # none of the server's own
    assert "HTTP http://" not in out and left == [], (out, left)
