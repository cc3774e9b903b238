"""Where every ingress replica's own Prometheus endpoint is, for service discovery.

Engine replicas are found through the request routers (their routing stats carry
the endpoint); ingress replicas know nothing of each other, so each announces its
endpoint (``app.metrics_server``) to a small named Ray actor of the application,
``TargetBook``, and any ingress replica answers ``GET /metrics/ingresses`` from it.

- An entry lives ``TTL_S`` seconds unless announced again (``Announcer`` repeats
  every ``ANNOUNCE_S``); a replica that stops removes its own entry.
- The book is a plain (not detached) actor created by the first replica that
  announces, so it goes with the application; when its owner replica stops, the
  book goes too and the next announcement of any other replica makes a new one,
  which is full again within ``ANNOUNCE_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

logger = logging.getLogger("prefix_serve.ingress_targets")

ANNOUNCE_S = 5.0
TTL_S = 3 * ANNOUNCE_S
BOOK_PREFIX = "prefix-serve-ingress-targets:"


@ray.remote(num_cpus=0, max_restarts=0)
class TargetBook:
    """``replica_id -> host:port`` of every live ingress replica of one application."""

    def __init__(self) -> None:
        self._targets: dict[str, tuple[str, float]] = {}

    def put(self, replica_id: str, hostport: str, ttl_s: float = TTL_S) -> None:
        self._targets[replica_id] = (hostport, time.monotonic() + ttl_s)

    def remove(self, replica_id: str) -> None:
        self._targets.pop(replica_id, None)

    def targets(self) -> dict[str, str]:
        """The entries not expired, by replica id."""
        now = time.monotonic()
        self._targets = {k: v for k, v in self._targets.items() if v[1] > now}
        return {k: hostport for k, (hostport, _) in sorted(self._targets.items())}


def book(app_name: str):
    """The application's ``TargetBook`` (created if missing): an actor handle."""
    return TargetBook.options(name=BOOK_PREFIX + app_name, get_if_exists=True).remote()


class Announcer:
    """Keeps one ingress replica's entry in its application's book.

    ``start()`` on the replica's event loop; ``targets()`` reads the book;
    ``stop()`` removes the entry (Serve's shutdown hook).
    """

    def __init__(self, app_name: str, replica_id: str, hostport: str):
        self.app_name = app_name
        self.replica_id = replica_id
        self.hostport = hostport
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start announcing on the running event loop (idempotent); raises
        ``RuntimeError`` outside one."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await book(self.app_name).put.remote(self.replica_id, self.hostport)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the book's owner stopped: a new book next time
                logger.info("ingress target book unavailable (%s); announcing again", type(e).__name__)
                await asyncio.sleep(0.5)
                continue
            await asyncio.sleep(ANNOUNCE_S)

    async def targets(self) -> dict[str, str]:
        """``replica_id -> host:port`` of the live ingress replicas (this one at least)."""
        try:
            found = await book(self.app_name).targets.remote()
        except Exception:  # noqa: BLE001 - a book being replaced: this replica still answers for itself
            found = {}
        return {**found, self.replica_id: self.hostport}

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        try:
            existing = ray.get_actor(BOOK_PREFIX + self.app_name)
            await asyncio.wait_for(existing.remove.remote(self.replica_id), 5.0)
        except Exception:  # noqa: BLE001 - no book, or at shutdown: the entry expires on its own
            pass
