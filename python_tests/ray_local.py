"""What the tests that start Ray Serve apps share: a local Ray instance (loopback, 2 CPUs, no dashboard), ports for
servers that Ray will not take, and ``relaygr serve`` in its own process, waited for until it answers HTTP.

Ports. Ray picks its own ports (GCS, raylet, object manager, agents, the replicas' gRPC servers) by binding port 0
and then a random port between that one and 65535, and ``ray start`` gives workers 10002-19999: a port a test took
by binding port 0 and releasing it can be taken by Ray before the test's server binds it (the server's client then
talks to a Ray gRPC server). :func:`server_port` picks ports below the kernel's ephemeral range instead, above Ray's
worker ports, checked free, never the same twice in a process.
"""
from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest

ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0", "OMP_NUM_THREADS": "1"}
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
DEFAULT_EPHEMERAL_RANGE = (32768, 65535)  # below both Linux's (32768-60999) and IANA's (49152-65535) defaults
RAY_WORKER_PORTS = (10002, 19999)  # `ray start`'s default --min-worker-port .. --max-worker-port
_port_counter: Optional[Iterator[int]] = None


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (where ``bind(0)`` and Ray's own port choices start).

    Parameters
    ----------
    path : str
        The file holding ``LOW HIGH`` (Linux's ``ip_local_port_range``).

    Returns
    -------
    tuple of int
        ``(low, high)``; :data:`DEFAULT_EPHEMERAL_RANGE` when the file is missing or unreadable.
    """
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    return (low, high) if 1 <= low <= high <= 65535 else DEFAULT_EPHEMERAL_RANGE


def server_port_window(ephemeral: Optional[tuple[int, int]] = None) -> tuple[int, int]:
    """The ports :func:`server_port` picks from: above Ray's worker ports, below the ephemeral range.

    Ray's random choices reach from the ephemeral range's low end to 65535, so only ports below it are safe. When
    the range starts too low to leave 256 ports there, the window is the one below the default range.

    Parameters
    ----------
    ephemeral : tuple of int, optional
        ``(low, high)`` ephemeral range (default: :func:`ephemeral_range`).

    Returns
    -------
    tuple of int
        ``(first, last)`` port, both included.
    """
    low = (ephemeral or ephemeral_range())[0]
    first = RAY_WORKER_PORTS[1] + 1
    if low - first < 256:
        low = DEFAULT_EPHEMERAL_RANGE[0]
    return first, low - 1


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``host:port`` can be bound now (without ``SO_REUSEADDR``, as Serve's proxy binds it)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def server_port() -> int:
    """A TCP port on 127.0.0.1 for a server a test starts (Serve's HTTP port, Ray's metrics export port).

    The port lies in :func:`server_port_window`, where Ray picks none of its own, and is free now. Successive calls
    in a process walk the window from a start that depends on the process id, so two tests of a run never get the
    same port and two concurrent runs on one machine start far apart.

    Returns
    -------
    int
        The port.

    Raises
    ------
    RuntimeError
        When every port of the window is taken.
    """
    global _port_counter
    first, last = server_port_window()
    size = last - first + 1
    if _port_counter is None:
        _port_counter = itertools.count(os.getpid() * 7919 % size)
    for _ in range(size):
        port = first + next(_port_counter) % size
        if port_is_free(port):
            return port
    raise RuntimeError(f"no free port in {first}-{last} (below the ephemeral range {ephemeral_range()})")


@contextlib.contextmanager
def local_ray(env=None, **init_kwargs):
    """``ray.init`` on 127.0.0.1 with ``ENV`` (and ``env``) set; Serve and Ray shut down and the environment
    restored on exit. Yields the ``ray`` module."""
    env = {**ENV, **(env or {})}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import ray
    from ray import serve

    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False, object_store_memory=80 * 2 ** 20, **init_kwargs)
        yield ray
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def http_get(url: str, timeout: float = 10.0) -> tuple[Optional[int], bytes]:
    """GET ``url``.

    Returns
    -------
    tuple
        ``(status, body)``; ``(None, b"")`` when no HTTP/1.1 server answered: refused, reset, timed out, or a reply
        that is not HTTP (any ``http.client.HTTPException``, such as another protocol's bytes on that port).
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (OSError, http.client.HTTPException):  # URLError, ConnectionError and TimeoutError are OSErrors
        return None, b""


def wait_for_http(url: str, alive: Callable[[], bool], log: Callable[[], str], timeout_s: float = 300.0) -> dict:
    """Poll ``url`` until it answers 200 with JSON; fail with the server's log when it stopped or the time ran out.

    Parameters
    ----------
    url : str
        What a ready server answers (a ``stats`` endpoint).
    alive : callable
        Whether the server is still running (a process's ``poll() is None``, a thread's ``is_alive``).
    log : callable
        The server's output so far, shown when it fails.
    timeout_s : float
        How long it may take to answer.

    Returns
    -------
    dict
        The first JSON reply.
    """
    end = time.monotonic() + timeout_s
    while True:
        status, raw = http_get(url)
        if status == 200:
            with contextlib.suppress(ValueError):
                return json.loads(raw)
        if not alive():
            pytest.fail(f"the server stopped before {url} answered:\n{log()[-4000:]}")
        if time.monotonic() > end:
            pytest.fail(f"{url} did not answer within {timeout_s:g} s (last status {status}):\n{log()[-4000:]}")
        time.sleep(0.25)  # poll interval


def session_processes(sid: int) -> list[int]:
    """Ids of the live processes (zombies excepted) of session ``sid`` (Linux ``/proc``; empty elsewhere)."""
    found = []
    for d in (os.listdir("/proc") if os.path.isdir("/proc") else ()):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z" and int(fields[3]) == sid:
                found.append(int(d))
    return found


@contextlib.contextmanager
def serve_process(args: list[str], port: int, log: Path, env: Optional[dict] = None,
                  timeout_s: float = 300.0) -> Iterator[subprocess.Popen]:
    """``relaygr serve ARGS --port PORT`` in its own process and session, output to ``log``; yields it once
    ``GET /stats`` answers. On exit: SIGTERM (the server shuts Serve and its Ray down), then SIGKILL to what is
    left of its session (all of it if the server has not exited within 120 s), so that no Ray process outlives it.

    Parameters
    ----------
    args : list of str
        ``relaygr serve`` arguments other than ``--port`` (the app on route prefix ``/``).
    port : int
        The HTTP port (from :func:`server_port`).
    log : pathlib.Path
        Where its stdout and stderr go.
    env : dict, optional
        Environment on top of this process's and :data:`ENV`.
    timeout_s : float
        How long it may take to answer.
    """
    argv = [sys.executable, "-m", "relaygr_engine.cli", "serve", *args, "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **ENV, **(env or {})},
                                start_new_session=True)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/stats", lambda: proc.poll() is None,
                      lambda: log.read_text(errors="replace"), timeout_s)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
        kill_session(proc.pid)
        proc.wait()


def kill_session(sid: int) -> None:
    """SIGKILL every live process of session ``sid`` (a server started with ``start_new_session`` and its Ray)."""
    for pid in session_processes(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
