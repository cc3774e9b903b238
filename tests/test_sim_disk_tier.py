"""The simulator's local-disk KV tier behind the host tier: vLLM's tiering ``fs`` tier in the replica
model (write-through, promotion through host memory), its events on the routers' event paths, the
peers' disk weights and the command line."""

from __future__ import annotations

import json
import random

import pytest

from bench.sim.cli import main
from bench.sim.disk_tier import DiskTier
from bench.sim.policies import DynamoPolicy, RouterContext
from bench.sim.replica import EngineConfig, Replica
from routing.block_keys import block_keys
from routing.events import BlockRemoved, BlockStored
from routing.index import BlockIndex
from tests.test_sim_host_tier import BS, LAT, delivered, pushed_off_the_gpu, routed_prompt, run, state, toks

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # ray.serve import noise


def disk_replica(num_blocks: int, host_blocks: int, disk_blocks: int, events: bool = False) -> Replica:
    return Replica(0, EngineConfig(num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=2048, max_num_seqs=8,
                                   max_model_len=16_384, host_blocks=host_blocks, disk_blocks=disk_blocks), LAT,
                   enable_events=events)


def test_disk_tier_is_an_lru_of_what_the_host_tier_wrote_with_storage_events() -> None:
    disk = DiskTier(3, BS)
    events: list = []
    disk.write([1, 2, 3], [0, 2], None, list(range(3 * BS)), None, events)  # the host tier stored 1 and 3
    assert list(disk.held) == [1, 3] and disk.stores == 2
    disk.write([4, 5], [0, 1], 3, list(range(2 * BS)), None, events)  # room for one: 1, the least recent, goes
    assert list(disk.held) == [3, 4, 5] and disk.evictions == 1
    disk.read([3])
    disk.write([5, 6], [0, 1], 4, list(range(2 * BS)), None, events)  # 5 rewritten (newest), 6 evicts 4, not 3
    assert list(disk.held) == [3, 5, 6] and disk.reads == 1
    assert [(type(e).__name__, e.block_hashes, getattr(e, "parent_block_hash", None), e.medium) for e in events] == [
        ("BlockStored", [1], None, "STORAGE"), ("BlockStored", [3], 2, "STORAGE"),
        ("BlockRemoved", [1], None, "STORAGE"), ("BlockStored", [4, 5], 3, "STORAGE"),
        ("BlockRemoved", [4], None, "STORAGE"), ("BlockStored", [6], 5, "STORAGE")]
    assert [len(e.token_ids) for e in events if isinstance(e, BlockStored)] == [BS, BS, 2 * BS, BS]
    with pytest.raises(ValueError, match="positive"):
        DiskTier(0, BS)
    with pytest.raises(ValueError, match="host tier"):
        EngineConfig(num_blocks=10, disk_blocks=100)


def test_a_prompt_gone_from_gpu_and_host_memory_is_read_from_disk_through_host_memory() -> None:
    """GPU of 20 usable blocks, host of 16, disk of 200. A (8 blocks) is computed and written through;
    B and C (12 blocks each) push it out of the GPU and out of host memory. A again reads its 8 blocks
    from the disk into host memory and loads them from there: all count as cached, the first token
    waits for the disk read and the host copy, and host memory holds A again (announced as stored)."""
    rep = disk_replica(21, 16, 200, events=True)
    a = toks(1, 8 * BS + 3)
    keys = block_keys(a, BS)
    run(rep, state(0, a))
    assert rep.disk.stores == 8 and all(k in rep.disk for k in keys[:8])
    run(rep, state(1, toks(2, 12 * BS + 1)))
    run(rep, state(2, toks(3, 12 * BS + 1)))
    assert rep.pool.longest_hit(keys, 8) == [] and rep.host.run(keys, 0, 8) == 0  # neither GPU nor host memory
    rep.pool.take_events()
    again = state(3, a)
    start = 10.0
    run(rep, again, start)
    assert again.cached_tokens == again.host_cached_tokens == again.disk_cached_tokens == 8 * BS
    wait = LAT.disk_load_time(8 * BS) + LAT.host_load_time(8 * BS)
    assert LAT.disk_load_time(8 * BS) == pytest.approx(8 * BS * 57_344 / 6.0e9)
    assert wait <= again.first_token_s - start < wait + 0.1
    assert rep.disk.reads == 8 and rep.host.run(keys, 0, 8) == 8
    events = rep.pool.take_events()
    promoted = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [h for e in promoted for h in e.block_hashes] == list(keys[:8])
    assert not any(isinstance(e, BlockStored) and e.medium == "STORAGE" for e in events)  # not written back


def test_with_half_on_host_only_the_rest_is_read_from_disk() -> None:
    """A's first 4 blocks still in host memory, its last 4 only on disk: the load counts 8 host
    tokens' blocks, 4 of them read from disk."""
    rep = disk_replica(21, 200, 200)
    a = toks(4, 8 * BS + 3)
    keys = block_keys(a, BS)
    run(rep, state(0, a))
    run(rep, state(1, toks(5, 12 * BS + 1)))
    run(rep, state(2, toks(6, 12 * BS + 1)))
    for h in keys[4:8]:  # host memory evicted A's last four blocks
        rep.host._policy.evict(h)
    again = state(3, a)
    run(rep, again, 10.0)
    assert (again.cached_tokens, again.host_cached_tokens, again.disk_cached_tokens) == (8 * BS, 8 * BS, 4 * BS)


def test_disk_events_reach_our_index_as_host_and_dynamos_third_tree() -> None:
    """Ours (through the relay): a block on disk only is on the host tier. Dynamo: its own disk tree,
    credited at 0.25 beyond the device and host matches."""
    rep = disk_replica(21, 16, 200, events=True)
    events, keys = pushed_off_the_gpu(rep, 7)
    assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in events)
    ours = BlockIndex()
    path = delivered(ours, rep, events)
    assert ours.match_tiers(keys, (rep.id,), 0.0) == {rep.id: (0, 8)}
    assert path.relays[rep.id].stats.ignored_media == 0
    dyn = DynamoPolicy()
    dyn.setup(RouterContext(replicas=[rep], block_size=BS, max_ongoing_requests=128, rng=random.Random(0)))
    delivered(dyn.index, rep, events)
    assert (dyn.index.match(keys, (rep.id,), 0.0), dyn.index.match_host(keys, (rep.id,)),
            dyn.index.match_disk(keys, (rep.id,))) == ({rep.id: 0}, {rep.id: 0}, {rep.id: 8})


def test_dynamo_credits_disk_blocks_beyond_host_at_a_quarter() -> None:
    reps = [Replica(i, EngineConfig(num_blocks=1000, block_size=BS, host_blocks=1000, disk_blocks=1000), LAT)
            for i in range(2)]
    req, stored = routed_prompt(8)
    dyn = DynamoPolicy()
    dyn.setup(RouterContext(replicas=reps, block_size=BS, max_ongoing_requests=128, rng=random.Random(0)))
    # replica-0: 10 blocks in host memory (credit 7.5); replica-1: 4 in host memory and 32 on disk
    # (3 + 0.25 * 28 = 10).
    for rid, evs in (("replica-0", [stored(10, "CPU")]), ("replica-1", [stored(4, "CPU"), stored(32, "STORAGE")])):
        delivered(dyn.index, rid, evs)
    assert dyn.choose(req, [0, 1], 1.0) == 1
    dyn.prefill_tokens[1] += 3 * BS  # 3 blocks of queued prefill outweigh its 2.5 blocks more credit
    assert dyn.choose(req, [0, 1], 1.0) == 0


def test_cli_disk_tier_option_report_and_bounds(tmp_path) -> None:
    out = tmp_path / "r.json"
    assert main(["--workload", "chat", "--num-requests", "150", "--replicas", "2", "--num-blocks", "300",
                 "--kv-offloading-size", "0.1", "--kv-disk-size", "1", "--policies", "prefix_affinity,dynamo",
                 "--seed", "2", "--no-progress", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    per_block = BS * PRESET_KV_BYTES
    assert rep["config"]["disk_blocks_per_replica"] == 2**30 // per_block
    assert rep["config"]["disk_read_bytes_per_s"] == 6_000_000_000
    for p in rep["policies"].values():
        assert 0 <= p["disk_hit_rate"] <= p["host_hit_rate"] <= p["hit_rate"]
        assert p["extra"]["disk_stored_blocks"] > 0
    host = rep["config"]["host_blocks_per_replica"]
    assert rep["bounds"]["pooled_inclusive_hit_rate"] <= rep["bounds"]["unbounded_cache_hit_rate"]
    assert host < rep["config"]["disk_blocks_per_replica"]
    with pytest.raises(SystemExit, match="needs --kv-offloading-size"):
        main(["--workload", "chat", "--num-requests", "10", "--kv-disk-size", "1", "--no-progress"])
    with pytest.raises(SystemExit, match="must be > 0"):
        main(["--workload", "chat", "--num-requests", "10", "--kv-offloading-size", "1", "--kv-disk-size", "1",
              "--disk-read-gb-per-s", "0", "--no-progress"])


PRESET_KV_BYTES = 57_344  # the default preset's model (Qwen2.5-7B AWQ, fp16 KV): 28 x 2 x 4 x 128 x 2 bytes
