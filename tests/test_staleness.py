"""Stalled KV-event streams: when the router stops trusting a replica's index entries."""

import pytest

from routing.staleness import EventStaleness


def test_owed_event_that_never_comes_is_a_stall():
    s = EventStaleness(stale_s=30)
    s.note_sent("r", now=100.0, last_event_at=90.0)
    assert not s.stalled("r", now=129.0, last_event_at=90.0)
    assert s.stalled("r", now=131.0, last_event_at=90.0)
    # Continuous traffic must not hide the stall: the first unanswered send counts.
    s.note_sent("r", now=125.0, last_event_at=90.0)
    assert s.stalled("r", now=131.0, last_event_at=90.0)


def test_an_event_after_the_send_clears_the_debt():
    s = EventStaleness(stale_s=30)
    s.note_sent("r", now=100.0, last_event_at=None)
    assert not s.stalled("r", now=200.0, last_event_at=101.0)
    s.note_sent("r", now=150.0, last_event_at=101.0)  # a new debt starts at 150
    assert not s.stalled("r", now=179.0, last_event_at=101.0)
    assert s.stalled("r", now=181.0, last_event_at=101.0)


def test_never_sent_or_forgotten_replicas_are_not_stalled():
    s = EventStaleness(stale_s=1)
    assert not s.stalled("r", now=1e9, last_event_at=None)
    s.note_sent("r", now=0.0, last_event_at=None)
    assert s.stalled("r", now=5.0, last_event_at=None)
    s.forget("r")
    assert not s.stalled("r", now=5.0, last_event_at=None)
    with pytest.raises(ValueError):
        EventStaleness(0)
