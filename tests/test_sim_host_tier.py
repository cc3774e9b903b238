"""The simulator's host-memory KV tier: vLLM's CPU offloading in the replica model, its events, the peers' tier
weights, the two-tier bound and the command line."""

from __future__ import annotations

import json
import random
from array import array

import numpy as np
import pytest

from bench.sim.bounds import cache_hit_rates
from bench.sim.cli import main
from bench.sim.event_path import EventPath
from bench.sim.host_tier import HostTier
from bench.sim.latency import GIB, PRESETS
from bench.sim.policies import POLICIES, DynamoPolicy, LlmDPolicy, RouterContext, make_policy
from bench.sim.replica import EngineConfig, Replica, ReqState
from bench.sim.workload import SimRequest
from routing.block_keys import block_keys
from routing.events import BlockStored

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # ray.serve import noise

LAT = PRESETS["4090-qwen2.5-7b-fp16"].latency
BS = 16


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


def state(i: int, prompt: list[int], max_tokens: int = 1) -> ReqState:
    out = [900_000 + i] * max_tokens
    req = SimRequest(i, 0.0, ((i, len(prompt)),), i, len(prompt), max_tokens)
    req.keys = array("Q", block_keys(prompt + out, BS))
    return ReqState(req, 0.0, tokens=np.array(prompt + out, dtype=np.uint32))


def replica(num_blocks: int, host_blocks: int, events: bool = False) -> Replica:
    return Replica(0, EngineConfig(num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=2048, max_num_seqs=8,
                                   max_model_len=16_384, host_blocks=host_blocks), LAT, enable_events=events)


def run(rep: Replica, st: ReqState, now: float = 0.0) -> float:
    """Serve one request to its end as the cluster loop would (idle while a load is in flight); the end time."""
    rep.add(st)
    while rep.has_work():
        d = rep.schedule(now)
        if d is None:
            nxt = rep.next_load_done()
            assert nxt is not None and nxt > now, "replica stalled with work"
            now = nxt
            continue
        now += d
        rep.finish_step(now)
    return now


def pushed_off_the_gpu(rep: Replica, seed: int) -> tuple[list, list[int]]:
    """A prompt of 8 blocks served, then two of 12 that push it off a 20-block GPU: the replica's
    events since its start, and the prompt's 8 block keys."""
    a = toks(seed, 8 * BS + 3)
    run(rep, state(0, a))
    for i in (1, 2):
        run(rep, state(i, toks(10 * seed + i, 12 * BS + 1)))
    return rep.pool.take_events(), list(block_keys(a, BS))[:8]


def delivered(index, rep: Replica | str, events: list) -> EventPath:
    """``events`` of ``rep`` (a replica or its id) through the simulator's event path into ``index``,
    at once; the path."""
    rid = rep if isinstance(rep, str) else rep.id
    path = EventPath(index, 0.0)
    path.deliver(rid, path.publish(rid, events, 0.0)[1], 0.0)
    return path


def routed_prompt(seed: int, blocks: int = 40):
    """A request for a prompt of ``blocks`` full blocks, and ``stored(n, medium)``: the ``BlockStored``
    of its first ``n`` blocks on ``medium`` (a tier's event for a replica that holds them)."""
    prompt = toks(seed, blocks * BS)
    keys = block_keys(prompt, BS)
    req = SimRequest(0, 0.0, ((0, len(prompt)),), 0, len(prompt), 4)
    req.keys = block_keys(prompt + [0] * 4, BS)

    def stored(n: int, medium: str) -> BlockStored:
        return BlockStored(block_hashes=keys[:n].tolist(), parent_block_hash=None, token_ids=prompt[: n * BS],
                           block_size=BS, lora_id=None, medium=medium, lora_name=None, group_idx=0)

    return req, stored


def test_host_tier_is_an_lru_of_the_blocks_offered_first_blocks_most_recent() -> None:
    """vLLM's LRU policy, with a request's accesses applied tail first (``on_request_finished``)."""
    host = HostTier(4, BS)
    events: list = []
    host.store([1, 2, 3], None, list(range(3 * BS)), None, events)
    assert host.blocks == [3, 2, 1]  # the first block ends most recent
    # 3 again (reused) and 4, 5 new: one must go, not one of this offer's (3): 2, the least recent.
    host.store([3, 4, 5], 2, list(range(3 * BS)), None, events)
    assert host.blocks == [1, 5, 4, 3] and host.evictions == 1 and host.stores == 5
    assert host.run([3, 4, 5, 9], 0, 4) == 3 and host.run([1, 2], 0, 2) == 1
    host.load([4, 5])
    assert host.blocks == [1, 3, 5, 4] and host.loads == 2
    # Evictions are published before the stores that needed the room, as vLLM's manager does.
    assert [(type(e).__name__, e.block_hashes, getattr(e, "parent_block_hash", None), e.medium) for e in events] == [
        ("BlockStored", [1, 2, 3], None, "CPU"), ("BlockRemoved", [2], None, "CPU"),
        ("BlockStored", [4, 5], 3, "CPU")]
    assert [len(e.token_ids) for e in events if isinstance(e, BlockStored)] == [3 * BS, 2 * BS]
    placeholders: list = []
    HostTier(4, BS, self_describing=False).store([1, 2], None, None, None, placeholders)
    assert [(e.block_hashes, e.token_ids, e.block_size, e.parent_block_hash) for e in placeholders] == [
        ([1, 2], [], 0, None)]
    # An offer larger than the tier stores nothing (vLLM's prepare_store cannot make room).
    small = HostTier(2, BS)
    small.store([7, 8, 9], None, list(range(3 * BS)), None, None)
    assert len(small) == 0 and small.stores == 0


def test_store_threshold_stores_a_block_on_its_nth_offer_counted_in_a_bounded_table(monkeypatch) -> None:
    host = HostTier(10, BS, store_threshold=2)
    events: list = []
    host.store([1, 2], None, list(range(2 * BS)), None, events)
    assert len(host) == 0 and host.skipped == 2 and events == []
    host.store([1, 2, 3], None, list(range(3 * BS)), None, events)  # 1, 2 offered twice; 3 once
    assert host.blocks == [2, 1] and host.skipped == 3 and host.stores == 2
    assert [(e.block_hashes, e.parent_block_hash) for e in events] == [([1, 2], None)]
    host.store([3], 2, list(range(BS)), None, events)
    assert host.blocks == [2, 1, 3] and [e.parent_block_hash for e in events] == [None, 2]
    # The table keeps the most recently offered blocks; the current offer's are never dropped.
    monkeypatch.setattr("bench.sim.host_tier.MAX_TRACKER_SIZE", 3)
    t = HostTier(10, BS, store_threshold=2)
    t.store([10, 11], None, None, None, None)
    t.store([12, 13], None, None, None, None)  # 10 dropped (least recent), 11, 12, 13 counted once
    assert dict(t.counts) == {11: 1, 12: 1, 13: 1}
    t.store([10, 11], None, None, None, None)  # 11 counted twice, stored; 10 again from 1, in 12's place
    assert dict(t.counts) == {13: 1, 11: 2, 10: 1} and t.blocks == [11]
    with pytest.raises(ValueError, match="store_threshold"):
        HostTier(10, BS, store_threshold=-1)
    with pytest.raises(ValueError, match="eviction"):
        HostTier(10, BS, eviction="fifo")


def test_arc_keeps_a_reused_block_that_lru_evicts_and_learns_from_its_ghosts() -> None:
    """vLLM's ARC: new blocks enter T1, a reused one moves to T2; T1 gives up blocks first
    while it is at least its target; a store of a block T1 evicted (a B1 ghost) raises the target."""
    lru, arc = HostTier(3, BS), HostTier(3, BS, eviction="arc")
    for host in (lru, arc):
        host.store([1, 2, 3], None, None, None, None)
        host.load([1])
        for h in (4, 5, 6):
            host.store([h], None, None, None, None)
    assert lru.blocks == [4, 5, 6]
    assert arc.blocks == [5, 6, 1]  # T1 [5, 6], T2 [1]: the reused block stays
    assert list(arc._policy.b1) == [3, 2, 4] and arc._policy.target_t1 == 0
    arc.store([2], None, None, None, None)  # a B1 ghost: T1's target grows by max(1, |B2| / |B1|) = 1
    assert arc._policy.target_t1 == 1 and 2 in arc and arc.blocks == [6, 2, 1]
    # B1 took 5 and was cut to the capacity (3: [4, 2, 5]) before the store removed 2's ghost.
    assert list(arc._policy.b1) == [4, 5]


def test_only_full_prompt_blocks_are_offered() -> None:
    """vLLM's ``offload_prompt_only`` (on by default): a 3-block-and-5-token prompt that decodes
    40 tokens fills 5 blocks on the GPU; the host tier gets its 3 full prompt blocks only."""
    rep = replica(61, 100)
    a = toks(1, 3 * BS + 5)
    st = state(0, a, max_tokens=40)
    run(rep, st)
    assert rep.pool.longest_hit(list(st.keys), len(st.keys)) and len(st.keys) >= 5
    assert rep.host.stores == 3 and sorted(rep.host.blocks) == sorted(block_keys(a, BS)[:3])


def test_a_gpu_hit_renews_its_host_copy() -> None:
    """The connector offers a request's GPU hits when it loads nothing: a prefix kept hot on
    the GPU stays in the host tier while colder blocks pass through it.  GPU of 60 usable
    blocks, host of 20. A (8 blocks) is computed, then each of B1..B4 (5 blocks, so the host
    tier turns over) follows a repeat of A, which hits on the GPU: A's blocks stay in the host
    tier.  Without the repeats the four B's (20 blocks) push A out."""
    a = toks(1, 8 * BS + 3)
    keys = block_keys(a, BS)
    for repeat in (True, False):
        rep = replica(61, 20)
        run(rep, state(0, a))
        for i in range(4):
            if repeat:
                st = state(10 + i, a)
                run(rep, st)
                assert st.cached_tokens == 8 * BS and st.host_cached_tokens == 0  # a GPU hit
            run(rep, state(20 + i, toks(30 + i, 5 * BS + 1)))
        assert rep.host.run(keys, 0, 8) == (8 if repeat else 0), repeat


def test_a_prompt_evicted_from_gpu_loads_from_host_memory_over_the_link() -> None:
    """GPU of 20 usable blocks, host of 100. A (8 blocks) is computed, B (12) and C (12) push it out
    of the GPU; A again loads its 8 blocks from the host tier: they count as cached, and its first
    token waits for the copy (8 * 16 tokens of 57,344 bytes at 80 % of PCIe 4.0 x16)."""
    rep = replica(21, 100)
    a = toks(1, 8 * BS + 3)
    run(rep, state(0, a))
    run(rep, state(1, toks(2, 12 * BS + 1)))
    run(rep, state(2, toks(3, 12 * BS + 1)))
    assert rep.pool.longest_hit(block_keys(a, BS), 8) == []  # gone from the GPU ...
    assert rep.host.run(block_keys(a, BS), 0, 8) == 8  # ... kept in host memory
    again = state(3, a)
    start = 10.0
    stores = rep.host.stores
    end = run(rep, again, start)
    assert rep.host.stores == stores  # loaded blocks are not offered again (the store pass starts after them)
    assert again.cached_tokens == again.host_cached_tokens == 8 * BS
    load = 8 * BS * 57_344 / (16 * 16e9 * 128 / 130 / 8 * 0.8)
    assert LAT.host_load_time(8 * BS) == pytest.approx(load)
    assert again.first_token_s - start >= load and again.first_token_s - start < load + 0.1
    assert rep.host.loads == 8 and end >= again.first_token_s
    # Loaded blocks are cached on GPU again: a fourth turn hits them there.
    fourth = state(4, a)
    run(rep, fourth, end)
    assert fourth.cached_tokens == 8 * BS and fourth.host_cached_tokens == 0


def test_without_a_host_tier_the_evicted_prompt_is_recomputed() -> None:
    rep = replica(21, 0)
    a = toks(1, 8 * BS + 3)
    for i, p in enumerate((a, toks(2, 12 * BS + 1), toks(3, 12 * BS + 1))):
        run(rep, state(i, p))
    again = state(3, a)
    run(rep, again)
    assert again.cached_tokens == 0 and rep.host is None


def test_host_events_reach_our_index_and_dynamos_second_tree() -> None:
    from routing.index import BlockIndex

    rep = replica(21, 100, events=True)
    events, keys = pushed_off_the_gpu(rep, 4)
    assert any(isinstance(e, BlockStored) and e.medium == "CPU" for e in events)
    ours = BlockIndex()
    delivered(ours, rep, events)
    assert ours.match_tiers(keys, (rep.id,), 0.0) == {rep.id: (0, 8)}
    dyn = DynamoPolicy()
    dyn.setup(RouterContext(replicas=[rep], block_size=BS, max_ongoing_requests=128, rng=random.Random(0)))
    delivered(dyn.index, rep, events)
    assert dyn.index.match(keys, (rep.id,), 0.0) == {rep.id: 0}
    assert dyn.index.match_host(keys, (rep.id,)) == {rep.id: 8}


def test_peers_weigh_host_blocks_as_published() -> None:
    """llm-d: gpu 1.0, cpu 0.8 a block; Dynamo: host blocks beyond the device match at 0.75."""
    reps = [Replica(i, EngineConfig(num_blocks=1000, block_size=BS, host_blocks=1000), LAT) for i in range(3)]
    req, stored = routed_prompt(5)
    # replica-0: 10 blocks on GPU; replica-1: 12 in host memory only; replica-2: nothing.
    llm = LlmDPolicy()
    llm.setup(RouterContext(replicas=reps, block_size=BS, max_ongoing_requests=128, rng=random.Random(0)))
    dyn = DynamoPolicy()
    dyn.setup(RouterContext(replicas=reps, block_size=BS, max_ongoing_requests=128, rng=random.Random(0)))
    for policy in (llm, dyn):
        for rid, ev in (("replica-0", stored(10, "GPU")), ("replica-1", stored(12, "CPU"))):
            delivered(policy.index, rid, [ev])
    # llm-d: 12 * 0.8 = 9.6 < 10: the GPU holder wins on prefix score (all else equal).
    assert llm.choose(req, [0, 1, 2], 1.0) == 0
    # Dynamo: credits 10 against 0.75 * 12 = 9: the GPU holder has the lower cost.
    assert dyn.choose(req, [0, 1, 2], 1.0) == 0
    dyn.prefill_tokens[0] += 1000  # its queue outweighs the difference
    assert dyn.choose(req, [0, 1, 2], 1.0) == 1


def test_pooled_bound_covers_both_tiers() -> None:
    from bench.sim.generators import generate

    wl = generate("chat", 300, seed=3)
    small = cache_hit_rates(wl, BS, 3 * 200, None)
    both = cache_hit_rates(wl, BS, 3 * (200 + 600), None, inclusive_blocks=3 * 600)
    assert small["pooled_cache_hit_rate"] < both["pooled_cache_hit_rate"] <= both["unbounded_cache_hit_rate"]
    assert small["pooled_cache_hit_rate"] < both["pooled_inclusive_hit_rate"] < both["pooled_cache_hit_rate"]
    assert both["pooled_inclusive_hit_rate"] == cache_hit_rates(wl, BS, 3 * 600, None)["pooled_cache_hit_rate"]


def test_cli_host_tier_option_and_report(tmp_path) -> None:
    common = ["--workload", "chat", "--num-requests", "120", "--replicas", "3", "--rate-scale", "2",
              "--preset", "4090-qwen2.5-7b-fp16", "--num-blocks", "300", "--no-progress", "--seed", "2",
              "--policies", "round_robin,prefix_affinity_tier_blind,prefix_affinity"]
    assert main([*common, "--json", str(tmp_path / "none.json")]) == 0
    assert main([*common, "--kv-offloading-size", "0.5", "--json", str(tmp_path / "host.json")]) == 0
    none, host = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("none", "host"))
    blocks = int(0.5 * GIB) // (BS * LAT.model.kv_bytes_per_token)
    assert host["config"]["host_blocks_per_replica"] == blocks == 585
    assert host["config"]["kv_offloading_size_gib"] == 0.5 and none["config"]["host_blocks_per_replica"] == 0
    assert host["bounds"]["pooled_cache_hit_rate"] >= none["bounds"]["pooled_cache_hit_rate"]
    # vLLM's tiers are inclusive: 585 host blocks hold the 299 GPU ones too, 585 distinct a replica.
    assert "pooled_inclusive_hit_rate" not in none["bounds"]
    assert (none["bounds"]["pooled_cache_hit_rate"] <= host["bounds"]["pooled_inclusive_hit_rate"]
            <= host["bounds"]["pooled_cache_hit_rate"])
    for name in ("round_robin", "prefix_affinity"):
        assert none["policies"][name]["host_hit_rate"] == 0.0
        p = host["policies"][name]
        assert 0.0 <= p["host_hit_rate"] <= p["hit_rate"]
        assert p["extra"]["host_loaded_blocks"] * BS >= p["host_cached_tokens"]
    # Without a tier, pricing tiers changes nothing: the variant and ours make the same decisions.
    blind, ours = (dict(none["policies"][n]) for n in ("prefix_affinity_tier_blind", "prefix_affinity"))
    for d in (blind, ours):
        d.pop("sim_wall_s")
    assert blind == ours
    # Round-robin routes alike with and without the tier: the bigger cache can only add hits.
    assert host["policies"]["round_robin"]["hit_rate"] >= none["policies"]["round_robin"]["hit_rate"]
    assert host["policies"]["prefix_affinity"]["host_hit_rate"] > 0
    with pytest.raises(SystemExit, match="kv-offloading-size"):
        main([*common, "--kv-offloading-size", "-1"])


def test_fp8_kv_doubles_both_tiers_and_halves_a_host_load(tmp_path) -> None:
    """``--kv-cache-dtype fp8``: one byte an element (vLLM's fp8 cache), so the memory of
    ``--num-blocks`` fp16 blocks holds twice as many, the host tier too, and a host load or a
    decode step's KV read moves half the bytes."""
    from bench.sim.cli import _cluster, build_parser

    common = ["--workload", "chat", "--preset", "4090-qwen2.5-7b-fp16", "--num-blocks", "300",
              "--kv-offloading-size", "0.5"]
    fp16, _ = _cluster(build_parser().parse_args(common))
    fp8, info = _cluster(build_parser().parse_args([*common, "--kv-cache-dtype", "fp8"]))
    assert (fp16.engine.num_blocks, fp8.engine.num_blocks) == (300, 600)
    assert fp16.engine.host_blocks == int(0.5 * GIB) // (BS * 2 * 28 * 4 * 128 * 2) == 585
    assert fp8.engine.host_blocks == int(0.5 * GIB) // (BS * 2 * 28 * 4 * 128 * 1) == 1170
    assert info["kv_cache_dtype"] == "fp8" and info["num_blocks_per_replica"] == 600
    assert fp8.latency.host_load_time(1000) == pytest.approx(fp16.latency.host_load_time(1000) / 2)
    # Calibration is the preset's (fp16) and stays: only the KV bytes a decode step reads change.
    assert fp8.latency.bandwidth_efficiency == fp16.latency.bandwidth_efficiency
    assert fp8.latency.decode_step_time(1, 4000) < fp16.latency.decode_step_time(1, 4000)


def test_tier_blind_variant_is_ours_with_pricing_off() -> None:
    assert list(POLICIES)[-2:] == ["prefix_affinity_tier_blind", "prefix_affinity"]
    reps = [Replica(i, EngineConfig(num_blocks=100, block_size=BS), LAT) for i in range(2)]
    c = RouterContext(replicas=reps, block_size=BS, max_ongoing_requests=128, rng=random.Random(0))
    blind, ours = make_policy("prefix_affinity_tier_blind"), make_policy("prefix_affinity")
    blind.setup(c)
    ours.setup(c)
    assert blind.router.policy.price_tiers is False and ours.router.policy.price_tiers is True

