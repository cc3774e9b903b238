"""The rank lists every request router of this project hands Serve, written once.

``choose_replicas`` of a Serve request router returns ranks: lists of replicas,
tried in order; Serve sends to a replica of the first rank whose queue has room,
else falls through to the next rank. ``app.router.prefix_affinity.PrefixAffinityRouter`` and the
A/B harness's ``bench.ab_routers.RoundRobinRouter`` both answer with
``chosen_first`` (or ``no_candidates``).

Serve pickles a request-router module BY VALUE into every process that routes;
this module is imported by reference from them (like ``app.metrics``), so it
keeps no state of its own: plain functions only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from ray.serve.request_router import PendingRequest

__all__ = ["chosen_first", "no_candidates"]

R = TypeVar("R")


def no_candidates(pending_request: PendingRequest | None) -> list[list[R]]:
    """The answer when Serve offers no candidate replica: ``[]``, and the request (if
    any) is marked ``routing_context.should_backoff`` so Serve waits before asking again."""
    if pending_request is not None:
        pending_request.routing_context.should_backoff = True
    return []


def chosen_first(chosen: R, rest: Sequence[R], *fallbacks: list[R]) -> list[list[R]]:
    """``[[chosen], rest, *fallbacks]``: the chosen replica, then the others in ``rest``'s
    order as a second rank, so a request still goes out when the chosen one's queue is full,
    then each of ``fallbacks`` as a rank of its own (passed as they are: a caller may hand
    Serve's own candidate list back without copying it). Empty ranks are left out (Serve
    refuses an empty rank). Within a rank Serve sends to the replica with the shortest
    queue, the first of equals; a replica may appear in several ranks."""
    ranks = [[chosen], list(rest)] if rest else [[chosen]]
    ranks.extend(rank for rank in fallbacks if rank)
    return ranks
