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
import threading
import time

import ray
from ray.actor import ActorHandle

logger = logging.getLogger("prefix_serve.ingress_targets")

ANNOUNCE_S = 5.0
TTL_S = 3 * ANNOUNCE_S
BOOK_PREFIX = "prefix-serve-ingress-targets:"
BOOK_NAMESPACE = "serve"  # Serve's own namespace: every replica's job finds the same book


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


def book(app_name: str) -> ActorHandle:
    """The application's ``TargetBook`` (created if missing): an actor handle.

    A book lives while its creator holds a handle to it (Ray ends an actor that no
    handle refers to), so callers keep the handle."""
    # @ray.remote made TargetBook an ActorClass; mypy keeps a decorated class's own type.
    return TargetBook.options(name=BOOK_PREFIX + app_name, namespace=BOOK_NAMESPACE, get_if_exists=True).remote()  # type: ignore[attr-defined]


class Announcer:
    """Keeps one ingress replica's entry in its application's book, from a daemon thread
    (a replica's constructor may run outside its event loop, so no task is used).

    ``targets()`` reads the book; ``stop()`` removes the entry (Serve's shutdown hook).
    """

    def __init__(self, app_name: str, replica_id: str, hostport: str):
        self.app_name = app_name
        self.replica_id = replica_id
        self.hostport = hostport
        self._book: ActorHandle | None = None  # held: the replica that created the book keeps it alive
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ingress-target-announcer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                if self._book is None:
                    self._book = book(self.app_name)
                ray.get(self._book.put.remote(self.replica_id, self.hostport), timeout=10)
                wait = ANNOUNCE_S
            except Exception as e:  # noqa: BLE001 - a slow book, or its owner stopped
                logger.info("ingress target book unavailable (%s); announcing again", type(e).__name__)
                if isinstance(e, ray.exceptions.RayActorError):  # gone: the next call makes a new one
                    self._book = None
                wait = 0.5
            self._stopped.wait(wait)

    async def targets(self) -> dict[str, str]:
        """``replica_id -> host:port`` of the live ingress replicas (this one at least)."""
        try:
            found = await (self._book or ray.get_actor(BOOK_PREFIX + self.app_name,
                                                        namespace=BOOK_NAMESPACE)).targets.remote()
        except Exception:  # noqa: BLE001 - a book being replaced: this replica still answers for itself
            found = {}
        return {**found, self.replica_id: self.hostport}

    async def stop(self) -> None:
        """Stop announcing (after any announcement in flight) and remove the entry."""
        self._stopped.set()
        await asyncio.to_thread(self._thread.join, 11.0)
        try:
            existing = self._book
            if existing is None:
                existing = await asyncio.to_thread(ray.get_actor, BOOK_PREFIX + self.app_name, BOOK_NAMESPACE)
            await asyncio.wait_for(existing.remove.remote(self.replica_id), 5.0)
        except Exception:  # noqa: BLE001 - no book, or at shutdown: the entry expires on its own
            pass
