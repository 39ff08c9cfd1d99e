"""The process a worker runs in: the settings every worker process applies first
(`tune_process`), and where it runs (`node_ip`, `node_id`, `in_ray_actor`, `serving_host`).

Ray is imported inside the functions: the same code runs in-process (tests, `tandem serve`
without Ray), where each answers for the local host.
"""

from __future__ import annotations

import logging
import os
import socket
import sys

log = logging.getLogger(__name__)

# Quiet the transfer libraries' logging (NIXL prints INFO lines to stdout otherwise) and fold
# repeated Ray log lines. (Which interface UCX listens on is set per endpoint: kvtransfer/bind.py.)
QUIET_ENV = {"MC_LOG_LEVEL": "WARNING", "NIXL_LOG_LEVEL": "WARN", "RAY_DEDUP_LOGS": "1"}

# A worker process runs two Python threads that both want the GIL: the loop thread, which holds
# it for long stretches while it steps (and spins while a transfer is pending), and the actor's
# event loop (Ray calls, stream items). CPython hands the GIL over only once per switch interval,
# 5 ms by default -- a Ray call or a first token could wait that long. Workers use 0.5 ms unless
# TANDEM_GIL_SWITCH_S says otherwise (seconds; Python's default is 0.005).
GIL_SWITCH_INTERVAL_S = 0.0005
GIL_SWITCH_ENV = "TANDEM_GIL_SWITCH_S"


def tune_process() -> None:
    """Process settings every worker process applies first (quiet logs, GIL hand-over)."""
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    raw = os.environ.get(GIL_SWITCH_ENV, "")
    try:
        interval = float(raw) if raw else GIL_SWITCH_INTERVAL_S
    except ValueError:
        log.warning("%s=%r is not a number of seconds: using %g", GIL_SWITCH_ENV, raw,
                    GIL_SWITCH_INTERVAL_S)
        interval = GIL_SWITCH_INTERVAL_S
    sys.setswitchinterval(interval if interval > 0 else GIL_SWITCH_INTERVAL_S)


def in_ray_actor() -> bool:
    """Whether this process is a Ray actor (a worker that may exit for Ray to restart it)."""
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 -- no Ray, or no actor context
        return False


def node_id() -> str:
    """The Ray node this process runs on (hostname outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    return os.uname().nodename


def serving_host() -> str:
    """Where a server in a Ray actor (the bench's router, the colocated server) listens and what
    it reports: the address the node's KV endpoints advertise -- `$TANDEM_KV_HOST` (init_ray
    sets 127.0.0.1 for the workers of a local Ray instance) else this node's IP; never the
    wildcard, so nothing listens on an interface nobody named."""
    from tandem.kvtransfer.bind import KV_HOST_ENV

    return os.environ.get(KV_HOST_ENV, "").strip() or node_ip()


def node_ip() -> str:
    """This node's IP address: what a server bound to the wildcard address tells its clients."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())
