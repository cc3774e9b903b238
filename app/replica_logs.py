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
    handlers when it reconfigures a replica's logging): a record below that logger's level (the
    deployment's ``logging_config.log_level``) is dropped, the rest go through its filters and handlers."""

    def emit(self, record: logging.LogRecord) -> None:
        serve = logging.getLogger(SERVE_LOGGER)
        if serve.isEnabledFor(record.levelno):
            serve.handle(record)


def to_serve_log(level: int = logging.WARNING) -> None:
    """Send the ``prefix_serve`` loggers' records of ``level`` and above (the root logger's default,
    as before) to this replica's Serve log (call in a replica's constructor; idempotent). They no
    longer reach the root logger. Under Serve's throughput profile its handlers buffer records below
    ERROR in memory until an ERROR record or a full buffer flushes them."""
    logger = logging.getLogger(APP_LOGGER)
    if not any(isinstance(h, ToServeLog) for h in logger.handlers):
        logger.addHandler(ToServeLog())
    logger.setLevel(level)
    logger.propagate = False
