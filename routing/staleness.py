"""Detect a replica whose KV-event stream has stalled.

A replica owes the router a ``BlockStored`` once it has been sent a request
with full blocks it does not hold (it will compute and store them). If the
first such request went out more than ``stale_s`` ago and no event batch has
arrived since, the replica's events are stalled: the router must not trust its
index entries (they may be arbitrarily old) and routes it by load only. Pure
bookkeeping on times passed in; no clock, no I/O.
"""

from __future__ import annotations


class EventStaleness:
    """Per replica: when the first request still owed an event went out."""

    def __init__(self, stale_s: float):
        if stale_s <= 0:
            raise ValueError(f"stale_s must be positive, got {stale_s}")
        self.stale_s = stale_s
        self._owed_since: dict[str, float] = {}

    def note_sent(self, replica_id: str, now: float, last_event_at: float | None) -> None:
        """A request with new full blocks went to ``replica_id`` at ``now``."""
        since = self._owed_since.get(replica_id)
        if since is None or (last_event_at is not None and last_event_at >= since):
            self._owed_since[replica_id] = now

    def stalled(self, replica_id: str, now: float, last_event_at: float | None) -> bool:
        """True if an event has been owed for over ``stale_s`` and none arrived since."""
        since = self._owed_since.get(replica_id)
        if since is None:
            return False
        return (last_event_at is None or last_event_at < since) and now - since > self.stale_s

    def forget(self, replica_id: str) -> None:
        self._owed_since.pop(replica_id, None)
