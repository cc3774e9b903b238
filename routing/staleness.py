"""Detect a replica whose KV-event stream has stalled.

A replica owes the router a ``BlockStored`` once it has been sent a request
with full blocks it does not hold (it will compute and store them). If the
first such request went out more than ``stale_s`` ago and no event batch has
arrived since, the replica's events are stalled: the router must not trust its
index entries (they may be arbitrarily old) and routes it by load only.

Pure functions of times passed in (the router state keeps ``owed_since`` in
its replica table, ``routing.router_state.ReplicaEntry``); no clock, no I/O.
"""

from __future__ import annotations

__all__ = ["owed_after_send", "stalled"]


def owed_after_send(owed_since: float | None, now: float, last_event_at: float | None) -> float:
    """``owed_since`` after a request with new full blocks went out at ``now``: unchanged
    while an earlier debt is still unpaid, ``now`` if none was owed or an event paid it."""
    if owed_since is None or (last_event_at is not None and last_event_at >= owed_since):
        return now
    return owed_since


def stalled(owed_since: float | None, now: float, last_event_at: float | None, stale_s: float) -> bool:
    """True if an event has been owed for over ``stale_s`` seconds and none arrived since."""
    if owed_since is None:
        return False
    return (last_event_at is None or last_event_at < owed_since) and now - owed_since > stale_s
