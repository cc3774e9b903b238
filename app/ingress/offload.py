"""A second event loop on its own thread, for the ingress's CPU-heavy request work.

Parsing a request body, validating it with vLLM's request models and rendering it
(chat-message parsing, the chat template; vLLM tokenizes in its own thread pool)
are Python work that grows with the body: a 2.6 MiB chat request of 40,000
content parts takes about 1.8 s of CPU. Run on the ingress's event loop, that
work stalls every other stream and ``/health`` of the replica for as long.
``WorkerLoop.run(coro)`` runs such a coroutine on the worker loop instead, so the
serving loop only waits on a future.

Bounded: one thread, so the preparations on it together compete with the serving
loop for the GIL no more than one thread does (CPython hands the GIL over every
``sys.getswitchinterval()``, 5 ms by default); they interleave at their ``await``
points, and how many there can be is bounded by the ingress replica's
``max_ongoing_requests``.

Context variables (the OpenTelemetry span) are carried over: the coroutine runs
in a copy of the caller's context (``asyncio.run_coroutine_threadsafe`` schedules
it from a handle created in the caller's context). Cancelling the caller cancels
the coroutine.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class WorkerLoop:
    """An asyncio loop running forever on a daemon thread named ``name``."""

    def __init__(self, name: str = "ingress-prepare"):
        self.loop = asyncio.new_event_loop()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` run on the worker loop; its result or its exception.

        Raises ``RuntimeError`` if the worker loop was closed.
        """
        if self._closing or self.loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the ingress's worker loop is closed")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel the work on the loop, stop it and join the thread; ``run`` refuses
        new work from here on."""
        if self._closing or self.loop.is_closed():
            return
        self._closing = True

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks(self.loop) if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.sleep(0)  # the callers' futures hear of it before the loop stops
            self.loop.stop()

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()
