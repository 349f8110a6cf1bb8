"""A local Ray instance for the tests that start Ray Serve apps (loopback, 2 CPUs, no dashboard)."""
from __future__ import annotations

import contextlib
import os
import socket

ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
