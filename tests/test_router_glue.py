"""``app.router.prefix_affinity.PrefixAffinityRouter`` built as Serve builds it, without a cluster.

The router is Ray Serve's own ``RequestRouter`` subclass, constructed with Serve's
real ``DeploymentID`` / ``RunningReplicaInfo`` / ``PendingRequest`` types; its
candidates are Serve's ``RunningReplica`` with only the actor lookup of its
constructor left out (``UnconnectedReplica``: no cluster runs here, and choosing
a replica never calls its actor). What is checked: a router whose
kwargs do not validate still answers every request (Serve would hang them if
``initialize_state`` raised) and marks them with the error; a router knows the
block size from its config before any routing stats arrive; readiness says why
it is not ready.
"""

from __future__ import annotations

import asyncio
from array import array

import pytest

from app.protocol import EngineRequest

pytest.importorskip("ray.serve")


def make_router(**kwargs):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from app.router.prefix_affinity import PrefixAffinityRouter

    router = PrefixAffinityRouter(DeploymentID(name="VLLMEngine", app_name="prefix-serve"),
                                  DeploymentHandleSource.REPLICA)
    router.initialize_state(**kwargs)
    return router


def replica(uid: str, stats: dict | None = None):
    from ray.serve._private.common import DeploymentID, ReplicaID, RunningReplicaInfo
    from ray.serve._private.request_router.replica_wrapper import RunningReplica

    class UnconnectedReplica(RunningReplica):
        def __init__(self, replica_info: RunningReplicaInfo):  # RunningReplica's, less the actor lookup
            self._replica_info = replica_info
            self._multiplexed_model_ids = set(replica_info.multiplexed_model_ids)

    info = RunningReplicaInfo(replica_id=ReplicaID(uid, DeploymentID(name="VLLMEngine", app_name="prefix-serve")),
                              node_id=None, node_ip="127.0.0.1", availability_zone=None,
                              actor_name=f"SERVE_REPLICA::prefix-serve#VLLMEngine#{uid}", max_ongoing_requests=32,
                              routing_stats=stats or {})
    return UnconnectedReplica(info)


def pending(request, internal_id: str = "i-1"):
    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest

    return PendingRequest(args=[request], kwargs={},
                          metadata=RequestMetadata(request_id="r", internal_request_id=internal_id))


def engine_request(n_tokens: int = 96) -> EngineRequest:
    return EngineRequest(request_id="cmpl-1", prompt_token_ids=array("I", range(1, n_tokens + 1)))


class ResultEnds:
    """Stands in for Serve's ``ReplicaResult`` (a real one needs a cluster): it keeps the done-callbacks
    registered on it and fires them from another thread, as Ray's core worker thread does."""

    def __init__(self):
        self.callbacks = []

    def add_done_callback(self, callback):
        self.callbacks.append(callback)

    def end(self):
        import threading

        for cb in self.callbacks:
            t = threading.Thread(target=cb, args=(None,))
            t.start()
            t.join()


def report_from_thread(fn, *args):
    """Call ``fn`` as Serve's completion callback does: from a thread that is not the router's loop."""
    import threading

    t = threading.Thread(target=fn, args=args)
    t.start()
    t.join()


@pytest.fixture
def routers():
    made = []

    def build(**kwargs):
        made.append(make_router(**kwargs))
        return made[-1]

    yield build  # on_loop closes their readers


def on_loop(test):
    """Run ``test`` (a coroutine function) on an event loop, as Serve runs its routers (the loop
    then owns their state), closing each router's relay reader on that loop at the end."""
    import functools

    @functools.wraps(test)
    def run(*args, **kwargs):
        async def body():
            try:
                return await test(*args, **kwargs)
            finally:
                from app import metrics

                for r in list(metrics.ROUTERS):
                    if r.loop is asyncio.get_running_loop():
                        await r.reader.close()

        return asyncio.run(body())

    return run


@on_loop
async def test_a_router_with_bad_kwargs_answers_every_request_with_the_error(routers):
    router = routers(load_factor=-1, not_a_knob=1)
    assert router.init_error is not None and "load_factor" in router.init_error and "not_a_knob" in router.init_error
    candidates = [replica("a"), replica("b")]
    request = engine_request()
    ranked = await router.choose_replicas(candidates, pending(request))
    assert [r.replica_id.unique_id for r in ranked[0]] in (["a", "b"], ["b", "a"])  # routed, never hung
    assert request.router_error == router.init_error  # the engine answers it as a 500 naming the setting
    router.update_replicas(candidates)
    ready, detail = router.readiness()
    assert not ready and "request router cannot start" in detail["reason"] and "load_factor" in detail["reason"]


@on_loop
async def test_a_router_knows_the_block_size_before_any_routing_stats(routers):
    router = routers(block_size=32)
    request = engine_request(96)
    ranked = await router.choose_replicas([replica("a"), replica("b")], pending(request))
    assert ranked and request.router_error is None
    record = router.state.requests["i-1"]  # scored: the prompt's 3 block keys at block size 32
    assert len(record.request.keys) == 3 and record.request.block_size == 32
    assert record.decision is not None and record.fallback is None


@on_loop
async def test_readiness_names_what_is_missing(routers):
    from app.protocol import STAT_READY

    router = routers(block_size=32)
    ready, detail = router.readiness()
    assert not ready and detail["reason"] == "no engine replica is running yet"
    router.update_replicas([replica("a", {STAT_READY: False}), replica("b", {STAT_READY: False})])
    ready, detail = router.readiness()
    assert not ready and detail["reason"] == "none of 2 engine replicas is warmed up yet"
    assert detail["not_serving"] == {"a": "not warmed up yet", "b": "not warmed up yet"}
    router.update_replicas([replica("a", {STAT_READY: True}), replica("b", {STAT_READY: False})])
    ready, detail = router.readiness()  # no relay endpoints in the stats: nothing followed, nothing synced
    assert not ready and "snapshot is applied" in detail["reason"] and detail["synced_replicas"] == 0
    assert detail["not_serving"] == {"a": "block snapshot not applied yet", "b": "not warmed up yet"}


@on_loop
async def test_a_dead_relay_delays_requests_only_within_its_wait_budget(routers, monkeypatch):
    """A followed replica whose relay never answers is waited for once, not on every request."""
    import time

    import app.router.prefix_affinity
    from app.protocol import STAT_EVENTS_ENDPOINT, STAT_SNAPSHOT_ENDPOINT

    monkeypatch.setattr(app.router.prefix_affinity, "SNAPSHOT_WAIT_S", 0.5)
    router = routers(block_size=32)
    nobody = "tcp://127.0.0.1:9"  # nothing listens: the snapshot never comes
    dead = replica("a", {STAT_EVENTS_ENDPOINT: nobody, STAT_SNAPSHOT_ENDPOINT: nobody})
    took = []
    for i in range(3):
        t0 = time.monotonic()
        ranked = await router.choose_replicas([dead, replica("b")], pending(engine_request(), f"i-{i}"))
        took.append(time.monotonic() - t0)
        assert ranked
    assert 0.4 <= took[0] < 1.5 and max(took[1:]) < 0.2, took
    assert not router.state.synced("a")


@on_loop
async def test_one_serving_replica_makes_the_router_ready(routers):
    """Readiness gates a whole ingress: one warmed-up, synced engine is enough to serve."""
    import time

    from app.protocol import STAT_EVENTS_ENDPOINT, STAT_READY, STAT_SNAPSHOT_ENDPOINT
    from routing.relay_server import RelayServer

    relay = RelayServer("tcp://127.0.0.1:9", None, 32)  # no engine events: its snapshot is empty
    try:
        router = routers(block_size=32)
        live = {STAT_READY: True, STAT_EVENTS_ENDPOINT: relay.events_endpoint,
                STAT_SNAPSHOT_ENDPOINT: relay.snapshot_endpoint}
        router.update_replicas([replica("a", live), replica("b", {STAT_READY: False})])
        deadline = time.monotonic() + 10
        while not router.state.synced("a") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        ready, detail = router.readiness()
        assert ready and "reason" not in detail, detail
        assert detail["serving_replicas"] == 1 and detail["not_serving"] == {"b": "not warmed up yet"}
    finally:
        relay.close()


@on_loop
async def test_other_threads_post_to_the_router_loop_and_never_touch_its_state(routers):
    """The ingress's first-token signal is a message: it runs on the router's loop, in order."""
    import threading

    router = routers(block_size=32)
    a, b = replica("a"), replica("b")
    router.update_replicas([a, b])
    request = engine_request(96)
    request.prefill_tokens = 96 * 3  # e.g. n=3
    ranked = await router.choose_replicas([a, b], pending(request, "i-1"))
    result = ResultEnds()
    router.on_request_routed(pending(request, "i-1"), ranked[0][0].replica_id, result)
    uid = ranked[0][0].replica_id.unique_id
    assert router.state.replicas[uid].queued_prefill_tokens == 96 * 3
    signal = threading.Thread(target=router.first_token, args=(request.route_id,))
    signal.start()
    signal.join()
    assert router.state.replicas[uid].queued_prefill_tokens == 96 * 3  # posted, not run on the caller's thread
    await asyncio.sleep(0)
    assert router.state.replicas[uid].queued_prefill_tokens == 0
    # A read from another thread's loop is answered by this loop.
    ready, detail = await asyncio.to_thread(lambda: asyncio.run(router.ask(router.readiness)))
    assert not ready and detail["replicas"] == 2
    gauges = await asyncio.to_thread(router.ask_blocking, router.snapshot)
    assert gauges["inflight"][uid] == 1 and gauges["records"] == 1
    result.end()  # the routed result's end settles the record, on the router's loop
    assert router.state.requests != {}
    await asyncio.sleep(0)
    assert router.state.requests == {} and router.state.decisions_for("cmpl-1")[0]["replica_id"] == uid


@on_loop
async def test_a_rejected_try_s_end_reported_before_the_retry_is_routed_keeps_the_record(routers):
    """Serve reports a rejected send's end from its core thread; when that report reached the loop
    between the retry's choice and its routing, the record went and the retry's decision record
    had no request id (a 404 on the debug route in CI)."""
    router = routers(block_size=32)
    a, b = replica("a"), replica("b")
    router.update_replicas([a, b])
    request = engine_request(96)
    first = await router.choose_replicas([a, b], pending(request, "i-1"))
    rejected_by = first[0][0]
    await router.choose_replicas([a, b], pending(request, "i-1"))  # Serve chooses again, under the same id
    report_from_thread(router.on_request_completed, rejected_by.replica_id, "i-1")
    await asyncio.sleep(0)  # the report runs on the loop before the retry is routed
    other = next(r for r in (a, b) if r is not rejected_by)
    result = ResultEnds()
    router.on_request_routed(pending(request, "i-1"), other.replica_id, result)
    [d] = router.state.decisions_for("cmpl-1")
    assert d["replica_id"] == other.replica_id.unique_id and d["reason"] != "unscored", d
    report_from_thread(router.on_request_completed, other.replica_id, "i-1")  # Serve's report of the routed try
    await asyncio.sleep(0)
    assert router.state.inflight(other.replica_id.unique_id) == 1
    result.end()
    await asyncio.sleep(0)
    assert router.state.requests == {} and router.state.inflight(other.replica_id.unique_id) == 0


@on_loop
async def test_at_scale_the_ranks_end_with_serves_own_list_not_one_built_per_request(routers):
    """From 32 candidates only those that could win are scored: the ranks are the chosen one,
    the other scored ones by score, then every candidate as Serve listed them (its list object,
    so no Python work per candidate); a request with an adapter few replicas hold gets those
    first, then every replica."""
    from app.protocol import STAT_LORA_ADAPTERS

    router = routers(block_size=32)
    stats = [{"num_running": i % 5, "num_waiting": 0, "kv_cache_usage": 0.1 * (i % 7),
              STAT_LORA_ADAPTERS: ["sql"] if i < 3 else []} for i in range(40)]
    candidates = [replica(f"r{i:02d}", stats[i]) for i in range(40)]
    router.update_replicas(candidates)
    ranked = await router.choose_replicas(candidates, pending(engine_request(), "i-1"))
    decision = router.state.requests["i-1"].decision
    assert len(ranked) == 3 and ranked[2] is candidates
    assert ranked[0][0].replica_id.unique_id == decision.replica_id
    scored = [r.replica_id.unique_id for r in ranked[1]]
    assert 0 < len(scored) == len(decision.scores) - 1 < 39
    assert scored == sorted(scored, key=decision.scores.__getitem__)
    request = engine_request()
    request.lora_name = "sql"
    ranked = await router.choose_replicas(candidates, pending(request, "i-2"))
    assert {r.replica_id.unique_id for r in ranked[0]} <= {"r00", "r01", "r02"}
    assert ranked[-1] is candidates and all(r.replica_id.unique_id in {"r00", "r01", "r02"}
                                            for rank in ranked[:-1] for r in rank)


class ResultDone:
    """A result already done when Serve hands it over (grpc.aio's calls back at once, on this thread)."""

    def add_done_callback(self, callback):
        callback(self)


@on_loop
async def test_a_result_already_done_settles_its_record_after_the_routing_bookkeeping(routers):
    """Found by an attack: the done-callback ran inline, dropped the record, and on_request_routed
    then raised KeyError on it (the request failed and lost its decision record)."""
    router = routers(block_size=32)
    a, b = replica("a"), replica("b")
    router.update_replicas([a, b])
    request = engine_request(96)
    pend = pending(request, "i-1")
    ranked = await router.choose_replicas([a, b], pend)
    assert pend.routing_context.should_backoff  # every replica was offered: Serve waits before asking again
    router.on_request_routed(pend, ranked[0][0].replica_id, ResultDone())
    assert router.state.decisions_for("cmpl-1")[0]["replica_id"] == ranked[0][0].replica_id.unique_id
    assert "i-1" in router.state.requests  # settled on the loop's next turn, not inside the call
    await asyncio.sleep(0)
    assert router.state.requests == {}


@on_loop
async def test_a_request_naming_a_stored_response_goes_home_while_home_runs(routers):
    """Issue 26: a request with ``home_replica`` (a stored response's replica) is ranked ``[[home]]``
    alone, even where the prompt's blocks would score another replica, and recorded as ``home``;
    once home is gone it is routed as any other (the replica it reaches answers vLLM's 404)."""
    from app import metrics

    router = routers(block_size=32)
    candidates = [replica("a"), replica("b"), replica("c")]
    request = engine_request(96)
    request.home_replica = "b"
    ranked = await router.choose_replicas(candidates, pending(request, "i-home"))
    assert [[r.replica_id.unique_id for r in rank] for rank in ranked] == [["b"]]
    record = router.state.requests["i-home"]
    assert record.fallback == "home" and record.decision is None
    routed = router.state.routed("i-home", "b", 0.0)
    assert routed.reason == "home"
    gone_before = metrics.FALLBACKS.labels(cause="home_gone")._value.get()
    request = engine_request(96)
    request.home_replica = "zz"  # not a running replica
    ranked = await router.choose_replicas(candidates, pending(request, "i-gone"))
    assert sorted(r.replica_id.unique_id for rank in ranked for r in rank) == ["a", "b", "c"]
    assert router.state.requests["i-gone"].decision is not None  # scored as any request
    assert metrics.FALLBACKS.labels(cause="home_gone")._value.get() == gone_before + 1


@on_loop
async def test_a_replica_chosen_for_one_request_goes_to_that_request_not_the_oldest(routers):
    """Issue 26 (seen live): with Serve's FIFOMixin, the replica chosen for request A was handed to the
    oldest waiting request B; B, a follow-up homed on the other replica, got vLLM's 404. Serve's own
    match by internal request id gives each request the replica chosen for it."""
    router = routers(block_size=32)
    a, b = engine_request(), engine_request()
    a.home_replica, b.home_replica = "a", "b"
    older, newer = pending(b, "i-b"), pending(a, "i-a")  # b waits longer
    for pr in (older, newer):
        router._pending_requests_to_fulfill.append(pr)
        router._add_pending_request_to_indices(pr)
    candidates = [replica("a"), replica("b")]
    ranked = await router.choose_replicas(candidates, newer)
    assert [[r.replica_id.unique_id for r in rank] for rank in ranked] == [["a"]]
    router._fulfill_next_pending_request(ranked[0][0], newer.metadata)  # what Serve does once "a" accepts
    assert newer.future.done() and newer.future.result().replica_id.unique_id == "a"
    assert not older.future.done()  # still waiting for its own home, "b"


def ranked_ids(ranked) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranked]


@on_loop
async def test_a_joining_replica_is_held_back_until_its_warm_up_releases_it(routers):
    """Issue 35: a replica that appears after the warm-up at start is left out of a client request's
    ranks but the last (Serve's whole list: it serves when every other replica is full); its own warm
    requests are pinned to it and recorded as ``warmup_join``; once released it is routed to as any."""
    router = routers(block_size=32)
    a = replica("a", {"num_running": 6, "num_waiting": 0})
    b = replica("b", {"num_running": 0, "num_waiting": 0})
    router.update_replicas([a])
    router.rewarm_watch({"a"}, 30.0, None)
    router.update_replicas([a, b])
    assert router.rewarm_take() == (["b"], [])
    ranked = await router.choose_replicas([a, b], pending(engine_request(), "i-1"))
    assert ranked_ids(ranked) == [["a"], ["a", "b"]]  # b, idle, would win on load: held back
    warm = engine_request()
    warm.warmup, warm.home_replica = "join", "b"
    assert ranked_ids(await router.choose_replicas([a, b], pending(warm, "i-w"))) == [["b"]]
    assert router.state.requests["i-w"].fallback == "warmup_join"
    assert router.rewarm_release("b")
    ranked = await router.choose_replicas([a, b], pending(engine_request(), "i-2"))
    assert ranked_ids(ranked)[0] == ["b"]  # released: the idle replica wins on load
    # A joiner's warm request whose joiner has gone is not run elsewhere: the engine answers it with the error.
    late = engine_request()
    late.warmup, late.home_replica = "join", "gone"
    await router.choose_replicas([a, b], pending(late, "i-late"))
    assert router.state.requests["i-late"].fallback == "fallback_warm_home_gone"
    assert late.router_error == "the engine replica this warm request is for (gone) left"
    # A replica reported dead that Serve's next list still names is no join.
    router.on_replica_actor_died(a.replica_id)
    router.update_replicas([a, b])
    assert router.rewarm_take() == ([], []) and router.rewarm.held_back(0.0) == set()


@on_loop
async def test_a_hit_is_recorded_and_a_leaving_replicas_own_hot_prefix_is_handed_on(routers):
    """Issue 35: a routed request's predicted hit goes into the hot-prefix records with the request's
    token ids; when the only replica holding that prefix leaves the router's set, its plan names the
    prefix, read from the index before the replica's entries went."""
    from routing.block_keys import block_keys

    router = routers(block_size=32)
    a, b = replica("a"), replica("b")
    router.update_replicas([a, b])
    router.rewarm_watch({"a", "b"}, 30.0, None)
    request = engine_request(96)
    keys = block_keys(request.prompt_token_ids, 32)
    for uid in "ab":
        router.state.index.add_replica(uid)  # followed (as their KV-event feeds make them)
    assert router.state.index.load_snapshot("a", list(keys))  # a holds the prompt's 3 blocks
    pend = pending(request, "i-1")
    ranked = await router.choose_replicas([a, b], pend)
    assert ranked[0][0].replica_id.unique_id == "a"
    router.on_request_routed(pend, a.replica_id, ResultDone())
    (hot,) = router.rewarm.hot.ranked(0.0)
    # The predicted hit of a 96-token prompt: 2 blocks (vLLM computes the last token whatever it holds).
    assert hot.tokens == 64 and hot.source[0] == request.prompt_token_ids[:64]  # the hit's ids, not the prompt
    router.update_replicas([b])  # a leaves (Serve drains it)
    assert "a" not in router.state.index.replicas()
    joins, (job,) = router.rewarm_take()
    assert joins == [] and job.replica_id == "a" and [w.keys for w in job.plan] == [tuple(keys[:2])]
    # A warm request is not recorded as a hit (it would heat the prefix it warms).
    warm = engine_request(96)
    warm.warmup = "leave"
    pend = pending(warm, "i-2")
    await router.choose_replicas([b], pend)
    router.on_request_routed(pend, b.replica_id, ResultDone())
    assert len(router.rewarm.hot) == 1


@on_loop
async def test_replication_names_a_copy_of_a_busy_holders_hot_prefix_for_the_idle_replica_within_its_bounds(routers):
    """Issue 35: four client requests share a 2-block prefix that only ``a`` holds; once ``a`` is busy (40
    running: 0.08 s of running penalty against the copy's 65-token prefill, 0.0065 s, on idle ``b``) the check
    names one copy of that prefix, pinned to ``b``, with the hit's token ids. No copy while ``a`` is idle, past
    the prefill share (4 x 32 client prefill tokens at 0.25 is 32, under the prefix's 64), for a prefix
    whose copy failed lately, or for a joining replica held back; every prefix priced is counted by its reason."""
    from app import metrics
    from routing.block_keys import block_keys

    router = routers(block_size=32)
    a, b = replica("a", {"num_running": 0, "num_waiting": 0}), replica("b", {"num_running": 0, "num_waiting": 0})
    router.update_replicas([a, b])
    for uid in "ab":
        router.state.index.add_replica(uid)
    shared = list(range(1, 65))
    assert router.state.index.load_snapshot("a", list(block_keys(array("I", shared), 32)))
    for i in range(4):
        request = EngineRequest(request_id=f"cmpl-{i}", prompt_token_ids=array("I", shared + [1000 + i] * 32))
        pend = pending(request, f"i-{i}")
        ranked = await router.choose_replicas([a, b], pend)
        assert ranked[0][0].replica_id.unique_id == "a"  # the prefix's holder, idle: a hit
        router.on_request_routed(pend, a.replica_id, ResultDone())
    await asyncio.sleep(0.01)  # the completions posted to the loop: nothing is queued on a now
    assert router.client_prefill_tokens == 4 * 32
    assert router.replication_plan(2, 1.0, 0) == []  # a idle: its queue is no bottleneck
    busy_a = replica("a", {"num_running": 40, "num_waiting": 0})
    router.update_replicas([busy_a, b])
    before = metrics.REPLICATION_CHECKS.labels(reason="replicate")._value.get()
    ((w, d),) = router.replication_plan(2, 1.0, 0)
    assert (d.target, d.holders, w.tokens, list(w.source[0])) == ("b", ("a",), 64, shared)
    assert d.holder_wait_s > d.copy_s == pytest.approx(65 * 1e-4)
    assert metrics.REPLICATION_CHECKS.labels(reason="replicate")._value.get() == before + 1
    assert router.replication_plan(2, 0.25, 0) == []  # 32 tokens of budget: the prefix is 64
    assert router.replication_plan(2, 1.0, 4 * 32 - 63) == []  # spent: 63 left
    assert router.replication_plan(2, 1.0, 0, frozenset({w.keys[-1]})) == []  # its copy failed lately: skipped
    router.rewarm_watch({"a"}, 30.0, None)  # b counts as joining: held back, no copy goes to it
    router.rewarm.known.discard("b")
    router.update_replicas([busy_a, b])
    assert router.rewarm.held_back(0.0) == {"b"}
    assert router.replication_plan(2, 1.0, 0) == []


@on_loop
async def test_a_pinned_warm_request_has_its_blocks_predicted_and_its_prefill_queued_on_its_replica(routers):
    """Issue 35: a hot prefix's copy is pinned to its target; until the target's KV events come, the router
    must see the copy there (its blocks predicted, its prefill queued), or the next check would name the same
    copy again and client requests would be routed as if the target were idle."""
    import time

    router = routers(block_size=32)
    a, b = replica("a"), replica("b")
    router.update_replicas([a, b])
    for uid in "ab":
        router.state.index.add_replica(uid)
    copy = engine_request(96)
    copy.warmup, copy.home_replica = "replicate", "b"
    pend = pending(copy, "i-copy")
    assert ranked_ids(await router.choose_replicas([a, b], pend)) == [["b"]]
    router.on_request_routed(pend, b.replica_id, ResultEnds())
    view_b = router.state.views(router._route_request(engine_request(96), 32),
                                [c for c in router._candidate_set([a, b]).candidates if c.replica_id == "b"],
                                time.time())[0]
    assert view_b.matched_blocks == 3 and view_b.queued_prefill_tokens == 96
    assert router.state.requests["i-copy"].decision.reason == "only_candidate"
