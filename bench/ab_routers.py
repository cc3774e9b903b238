"""Round-robin request router for the A/B harness (``bench/ab/``).

Serve has no round-robin router built in. :class:`RoundRobinRouter` sends the
n-th routed request to the n-th replica (sorted by replica id), cyclically.

Serve pickles a request-router module BY VALUE into every process that routes:
module-level objects are copied, not shared, so this module keeps no globals
beyond imports (no locks, no metrics).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from app.router.ranks import chosen_first, no_candidates


class RoundRobinRouter(FIFOMixin, RequestRouter):
    """Sends the n-th routed request to the n-th replica (sorted by id), cyclically.

    The chosen replica is the first rank; the others follow as a second rank, so
    a request still goes out when the chosen replica's queue is full.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        self._turn = 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return no_candidates(pending_request)
        order = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        i = self._turn % len(order)
        self._turn += 1
        return chosen_first(order[i], order[i + 1:] + order[:i])
