"""``routing.rewarm.RewarmBook``: joins held back until released or timed out, leave plans read from
the index before a replica's entries go, join plans (configured prompts first, then the hottest
prefixes within the budget). Pure: no Ray, times passed in; the index is a dict here (the
router reads ``BlockIndex.match_tiers``: ``tests/test_router_glue.py`` runs that path)."""

from __future__ import annotations

from routing.hot_prefixes import HotPrefixes, WarmPrompt
from routing.rewarm import RewarmBook

BS = 16


def book(timeout_s: float = 30.0) -> RewarmBook:
    return RewarmBook(HotPrefixes(half_life_s=100.0), hot_candidates=8)


def held_from(table: dict[str, list[int]]):
    """``held(keys, replicas)`` over a table of the keys each replica holds: leading blocks held."""
    def held(keys, replicas):
        out = {}
        for r in replicas:
            n = 0
            while n < len(keys) and keys[n] in table.get(r, ()):
                n += 1
            out[r] = n
        return out
    return held


def test_replicas_before_the_watch_are_no_joins_and_those_after_are_held_until_released():
    b = book()
    b.changed({"a", "b"}, 0.0, held_from({}), 10_000)
    assert b.take() == ([], []) and not b.joining  # the warm-up at start covers them
    b.watch(known={"a"}, live={"a", "b"}, join_timeout_s=30.0, now=1.0)  # b came after the start's list
    b.changed({"a", "b", "c"}, 2.0, held_from({}), 10_000)
    assert b.held_back(2.5) == {"b", "c"}
    joins, leaves = b.take()
    assert joins == ["b", "c"] and leaves == []
    assert b.take() == ([], [])  # taken once
    assert b.release("c") and not b.release("c")
    assert b.held_back(3.0) == {"b"}
    assert b.held_back(31.0) == set()  # b's hold-back ended at 1 + 30 s: it serves, warm or not


def test_a_joiner_that_goes_before_its_join_is_taken_is_dropped():
    b = book()
    b.watch(set(), set(), 30.0, 0.0)
    b.changed({"a"}, 1.0, held_from({}), 10_000)
    b.changed({"b"}, 2.0, held_from({}), 10_000)  # a went, b came
    joins, _ = b.take()
    assert joins == ["b"] and set(b.joining) == {"b"}


def test_a_leave_queues_the_hot_prefixes_only_the_leaving_replica_held_hottest_first_within_budget():
    b = book()
    hot_a = tuple(range(100, 104))  # 4 blocks, only on a
    shared = tuple(range(200, 203))  # 3 blocks, on a and b
    cold_a = tuple(range(300, 302))  # 2 blocks, only on a, one hit
    for t in range(3):
        b.hot.record(hot_a, 4, BS, float(t), source=("ids-hot-a",))
        b.hot.record(shared, 3, BS, float(t), source=("ids-shared",))
    b.hot.record(cold_a, 2, BS, 2.0, source=("ids-cold-a",))
    table = {"a": [*hot_a, *shared, *cold_a], "b": list(shared)}
    b.changed({"a", "b"}, 3.0, held_from(table), 10_000)
    b.watch({"a", "b"}, {"a", "b"}, 30.0, 3.0)
    b.changed({"b"}, 4.0, held_from(table), 10_000)
    joins, (job,) = b.take()
    assert joins == [] and job.replica_id == "a" and job.at_s == 4.0
    assert [w.keys for w in job.plan] == [hot_a, cold_a]  # shared is held by b: not handed on
    assert [w.source for w in job.plan] == [("ids-hot-a",), ("ids-cold-a",)]
    # Within a budget of 4 blocks' tokens only the hottest fits.
    b2 = book()
    for t in range(3):
        b2.hot.record(hot_a, 4, BS, float(t), source=None)
    b2.hot.record(cold_a, 2, BS, 2.0, source=None)
    b2.changed({"a", "b"}, 3.0, held_from(table), 4 * BS)
    b2.watch({"a", "b"}, {"a", "b"}, 30.0, 3.0)
    b2.changed({"b"}, 4.0, held_from(table), 4 * BS)
    _, (job2,) = b2.take()
    assert [w.keys for w in job2.plan] == [hot_a]


def test_no_leave_plan_without_survivors_or_before_the_watch():
    b = book()
    b.hot.record((1, 2), 2, BS, 0.0, source=None)
    table = {"a": [1, 2]}
    b.changed({"a", "b"}, 0.0, held_from(table), 10_000)
    b.changed({"b"}, 1.0, held_from(table), 10_000)  # not watching yet
    assert b.take() == ([], [])
    b.watch({"b"}, {"b"}, 30.0, 1.0)
    b.changed(set(), 2.0, held_from(table), 10_000)  # the last replica went: nobody to hand on to
    assert b.take() == ([], [])


def test_a_join_plan_is_the_configured_prompts_then_the_hottest_prefixes_not_covered():
    b = book()
    configured = [WarmPrompt((1, 2, 3), 3 * BS, ("sys",), configured=True)]
    b.hot.record((1, 2), 2, BS, 0.0, source=("covered",))  # a prefix of the configured prompt
    for t in range(2):
        b.hot.record((7, 8, 9, 10), 4, BS, float(t), source=("hot",))
    b.hot.record((20,), 1, BS, 1.0, source=("cool",))
    plan = b.join_plan(configured, 2.0, token_budget=8 * BS)
    assert [w.source for w in plan] == [("sys",), ("hot",), ("cool",)]
    assert plan[0].configured and not plan[1].configured
    plan = b.join_plan(configured, 2.0, token_budget=7 * BS)  # 3 + 4 blocks: the cool one does not fit
    assert [w.source for w in plan] == [("sys",), ("hot",)]


def test_a_second_watch_changes_nothing_and_a_join_is_listed_once():
    b = book()
    b.watch({"a"}, {"a"}, 30.0, 0.0)
    b.changed({"a", "b"}, 1.0, held_from({}), 10_000)
    b.watch(set(), {"a", "b"}, 30.0, 2.0)  # a router's watch asked again (its first answer timed out)
    assert b.take() == (["b"], [])
    assert b.take() == ([], [])


def test_a_join_whose_hold_back_ended_before_it_was_taken_is_still_warmed():
    b = book()
    b.watch(set(), set(), 1.0, 0.0)
    b.changed({"a"}, 1.0, held_from({}), 10_000)
    assert b.held_back(5.0) == set()  # client traffic found its hold-back over
    assert b.take() == (["a"], [])  # warmed all the same (it serves meanwhile)
    assert not b.release("a")


def test_a_dead_replica_still_listed_is_no_join_and_no_second_leave():
    b = book()
    b.hot.record((1, 2), 2, BS, 0.0, source=None)
    table = {"a": [1, 2]}
    b.changed({"a", "b"}, 0.0, held_from(table), 10_000)
    b.watch({"a", "b"}, {"a", "b"}, 30.0, 0.0)
    b.changed({"b"}, 1.0, held_from(table), 10_000)  # a died: its leave
    b.died("a")
    b.changed({"a", "b"}, 2.0, held_from(table), 10_000)  # Serve's next list still names it
    b.changed({"b"}, 3.0, held_from(table), 10_000)
    joins, leaves = b.take()
    assert joins == [] and [j.replica_id for j in leaves] == ["a"] and b.joining == {}


def test_without_covered_matches_the_pairwise_rule_on_random_chains():
    """The linear ``without_covered`` against the rule written pairwise: covered when a longer prompt
    has the prompt's last key at the same position; a repeat (same length, same last key) kept once."""
    import random

    from routing.hot_prefixes import without_covered

    def pairwise(prompts):
        out = []
        for i, w in enumerate(prompts):
            n = len(w.keys)
            if not n:
                continue
            covered = any(j != i and len(o.keys) > n and o.keys[n - 1] == w.keys[-1] for j, o in enumerate(prompts))
            if not covered and not any(len(o.keys) == n and o.keys[-1] == w.keys[-1] for o in out):
                out.append(w)
        return out

    rng = random.Random(7)
    for _ in range(300):
        roots = [tuple(rng.randrange(1 << 40) for _ in range(8)) for _ in range(3)]  # shared chains
        prompts = [WarmPrompt(r[:rng.randrange(0, 9)], 0, i) for i, r in enumerate(rng.choice(roots)
                                                                                for _ in range(rng.randrange(1, 12)))]
        assert without_covered(prompts) == pairwise(prompts)
