"""The app's own log records (``prefix_serve.*`` loggers) in Serve's replica log files.

Serve writes a replica's log (``logs/serve/replica_<app>_<deployment>_<id>.log`` in the Ray
session directory) through the handlers of its ``ray.serve`` logger. The app logs under
``prefix_serve.*``, whose parent is the root logger, which has no handler in a replica: a record
went to Python's last-resort handler, ``sys.stderr``. Under Serve's throughput profile
(``RAY_SERVE_THROUGHPUT_OPTIMIZED``, ``infra.ray_env``) Serve points ``sys.stderr`` at its own
logger at INFO, into a memory buffer that is flushed only when full or on an ERROR record: the
ingress's "engine call failed" and its traceback sat in that buffer and were lost with the replica.
"""

from __future__ import annotations

import logging

from app.errors import SERVE_LOGGER

APP_LOGGER = "prefix_serve"


class ToServeLog(logging.Handler):
    """Hands each record to the ``ray.serve`` logger as it is then (Serve replaces that logger's
    handlers when it reconfigures a replica's logging): its filters, handlers and level rules."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(SERVE_LOGGER).handle(record)


def to_serve_log(level: int = logging.INFO) -> None:
    """Send the ``prefix_serve`` loggers' records of ``level`` and above to this replica's Serve log
    (call in a replica's constructor; idempotent). They no longer reach the root logger."""
    logger = logging.getLogger(APP_LOGGER)
    if not any(isinstance(h, ToServeLog) for h in logger.handlers):
        logger.addHandler(ToServeLog())
    logger.setLevel(level)
    logger.propagate = False
