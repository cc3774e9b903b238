"""Stalled KV-event streams: when the router stops trusting a replica's index entries."""

from routing.staleness import owed_after_send, stalled


def test_owed_event_that_never_comes_is_a_stall():
    owed = owed_after_send(None, now=100.0, last_event_at=90.0)
    assert not stalled(owed, now=129.0, last_event_at=90.0, stale_s=30)
    assert stalled(owed, now=131.0, last_event_at=90.0, stale_s=30)
    # Continuous traffic must not hide the stall: the first unanswered send counts.
    owed = owed_after_send(owed, now=125.0, last_event_at=90.0)
    assert owed == 100.0 and stalled(owed, now=131.0, last_event_at=90.0, stale_s=30)


def test_an_event_after_the_send_clears_the_debt():
    owed = owed_after_send(None, now=100.0, last_event_at=None)
    assert not stalled(owed, now=200.0, last_event_at=101.0, stale_s=30)
    owed = owed_after_send(owed, now=150.0, last_event_at=101.0)  # a new debt starts at 150
    assert owed == 150.0
    assert not stalled(owed, now=179.0, last_event_at=101.0, stale_s=30)
    assert stalled(owed, now=181.0, last_event_at=101.0, stale_s=30)


def test_nothing_owed_is_never_stalled():
    assert not stalled(None, now=1e9, last_event_at=None, stale_s=1)
    assert stalled(owed_after_send(None, 0.0, None), now=5.0, last_event_at=None, stale_s=1)
