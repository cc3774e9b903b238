"""The app's loggers write into Serve's replica log (``app.replica_logs``), through whatever handlers
the ``ray.serve`` logger has when a record comes, and no longer into the root logger."""

from __future__ import annotations

import logging

from app import replica_logs


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_app_records_reach_the_serve_loggers_current_handlers_only():
    app_logger, serve_logger, root = (logging.getLogger(n) for n in (replica_logs.APP_LOGGER, "ray.serve", ""))
    saved = (app_logger.handlers[:], app_logger.level, app_logger.propagate, serve_logger.handlers[:])
    first, second, at_root = _Keep(), _Keep(), _Keep()
    root.addHandler(at_root)
    try:
        serve_logger.handlers = [first]
        replica_logs.to_serve_log()
        replica_logs.to_serve_log()  # idempotent: one forwarding handler
        assert sum(isinstance(h, replica_logs.ToServeLog) for h in app_logger.handlers) == 1
        logging.getLogger("prefix_serve.ingress").error("engine call failed")
        logging.getLogger("prefix_serve.engine").debug("below the level")
        serve_logger.handlers = [second]  # Serve reconfigured the replica's logging
        logging.getLogger("prefix_serve.router").info("routed")
        assert [(r.name, r.getMessage()) for r in first.records] == [("prefix_serve.ingress", "engine call failed")]
        assert [(r.name, r.getMessage()) for r in second.records] == [("prefix_serve.router", "routed")]
        assert at_root.records == []
    finally:
        root.removeHandler(at_root)
        app_logger.handlers, app_logger.level, app_logger.propagate, serve_logger.handlers = (
            saved[0], saved[1], saved[2], saved[3])
