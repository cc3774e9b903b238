"""The app's loggers write into Serve's replica log (``app.replica_logs``), through whatever handlers
the ``ray.serve`` logger has when a record comes, and no longer into the root logger."""

from __future__ import annotations

import logging

from app import replica_logs
from app.errors import SERVE_LOGGER


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_app_records_reach_the_serve_loggers_current_handlers_only():
    app_logger, serve_logger, root = (logging.getLogger(n) for n in (replica_logs.APP_LOGGER, SERVE_LOGGER, ""))
    saved = (app_logger.handlers[:], app_logger.level, app_logger.propagate, serve_logger.handlers[:],
             serve_logger.level)
    first, second, at_root = _Keep(), _Keep(), _Keep()
    root.addHandler(at_root)
    try:
        serve_logger.handlers = [first]
        serve_logger.setLevel(logging.INFO)
        replica_logs.to_serve_log()
        replica_logs.to_serve_log()  # idempotent: one forwarding handler
        assert sum(isinstance(h, replica_logs.ToServeLog) for h in app_logger.handlers) == 1
        logging.getLogger("prefix_serve.ingress").error("engine call failed")
        logging.getLogger("prefix_serve.engine").info("below the app's level")
        serve_logger.handlers = [second]  # Serve reconfigured the replica's logging
        logging.getLogger("prefix_serve.router").warning("routed elsewhere")
        serve_logger.setLevel(logging.ERROR)  # the deployment's log_level
        logging.getLogger("prefix_serve.router").warning("below Serve's level")
        assert [(r.name, r.getMessage()) for r in first.records] == [("prefix_serve.ingress", "engine call failed")]
        assert [(r.name, r.getMessage()) for r in second.records] == [("prefix_serve.router", "routed elsewhere")]
        assert at_root.records == []
    finally:
        root.removeHandler(at_root)
        app_logger.handlers, app_logger.level, app_logger.propagate = saved[0], saved[1], saved[2]
        serve_logger.handlers = saved[3]
        serve_logger.setLevel(saved[4])
