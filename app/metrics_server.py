"""Each replica's own Prometheus endpoint, on an ephemeral port of its node.

Scraping replicas through Serve's HTTP proxy reaches a different replica on each
scrape, so with more than one replica the counters Prometheus stores jump between
replicas and ``increase()`` reads resets that never happened. Every engine and
ingress replica therefore serves its process's registry on a port of its own;
Prometheus finds them through HTTP service discovery (``/metrics/engines``,
``/metrics/ingresses``), one target per replica, labelled ``replica``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def start(host: str, before_scrape: Callable[[], None] | None = None) -> str:
    """Serve this process's Prometheus registry at ``http://host:<port>/metrics`` on
    a daemon thread; returns ``host:port`` (the port is picked by the OS).
    ``before_scrape`` runs before each answer (to refresh gauges); an exception in
    it is logged and the registry served as it is.

    Always the classic text format (``generate_latest``), as vLLM's own API server
    does: prometheus-client's negotiated OpenMetrics output would rename ``vllm:x``
    to ``vllm_x`` for Prometheus 2.x scrapers. Any path other than ``/metrics...``
    gets 404 (with the same body, for a human with curl).
    """
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server API
            if before_scrape is not None:
                try:
                    before_scrape()
                except Exception:  # noqa: BLE001 - a scrape must still answer
                    logging.getLogger("prefix_serve.metrics").exception("refreshing gauges before a scrape failed")
            body = generate_latest()
            self.send_response(200 if self.path.startswith("/metrics") else 404)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, 0), Handler)
    threading.Thread(target=server.serve_forever, name="replica-metrics", daemon=True).start()
    return f"{host}:{server.server_address[1]}"
