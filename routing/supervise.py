"""Keep a background loop running: restart it after any exception, with backoff.

The KV-event relay (``routing.relay_server``) runs its socket loop under ``supervise`` (the
router's relay reader, ``routing.relay_reader``, an asyncio task, keeps its backoff): the event path
must outlive any one failure.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

__all__ = ["supervise"]

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0


def supervise(loop: Callable[[], None], stop: threading.Event, stats: Counter, logger: logging.Logger,
              message: str, on_failure: Callable[[], None] = lambda: None) -> None:
    """Run ``loop`` until it returns or ``stop`` is set.

    After each exception it raises: ``stats["loop_restarts"]`` += 1, ``message`` is
    logged with the traceback, ``on_failure()`` cleans up, and the loop runs again
    after a backoff of ``FIRST_BACKOFF_S`` seconds doubling up to ``MAX_BACKOFF_S``
    (cut short when ``stop`` is set). Exceptions of ``on_failure`` propagate.
    """
    backoff = FIRST_BACKOFF_S
    while not stop.is_set():
        try:
            loop()
            return
        except Exception:  # noqa: BLE001 - keep the loop alive whatever happened
            stats["loop_restarts"] += 1
            logger.exception(message)
            on_failure()
            stop.wait(backoff)
            backoff = min(MAX_BACKOFF_S, backoff * 2)
