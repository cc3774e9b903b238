"""The bounded disk tier (``app.engine.disk_tier``) over vLLM's own ``fs`` tier, its files and its thread pool.

vLLM's CPU build cannot offload KV (its worker refuses the offloading connector), so no engine runs
the tier here; the test drives it as vLLM's ``TieringOffloadingManager`` does (``submit_store`` of
chunks from host memory, ``lookup`` and ``on_schedule_end`` per step, ``get_finished_jobs``), over a
host-memory buffer of its own. The offloading spec is a stand-in carrying only the fields the
``fs`` tier reads (named below): the real one needs a CUDA engine's KV-cache layout.
"""

from __future__ import annotations

import mmap
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.fs.manager")

from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

from app.engine.disk_tier import BoundedFileSystemTier  # noqa: E402

CHUNK = 4096  # bytes a chunk: the host buffer's row


def spec() -> SimpleNamespace:
    """What ``FileSystemTierManager`` and ``FileMapper.from_offloading_spec`` read of vLLM's ``OffloadingSpec``."""
    config = SimpleNamespace(
        groups=[SimpleNamespace(tokens_per_block=16, layer_names=["model.layers.0.self_attn.attn"])],
        parallel=SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0, is_parallelism_agnostic=True),
        canonical_layout=False, kv_cache_layout=None, replicated_layout=False,
        model=SimpleNamespace(name="tiny/model", dtype="float16"), cache=SimpleNamespace(tokens_per_hash=16))
    return SimpleNamespace(config=config, blocks_per_chunk=1,
                           kv_events_config=SimpleNamespace(enable_kv_cache_events=True))


def host_buffer(chunks: int = 8) -> np.ndarray:
    """Page-aligned host memory (the tier writes with ``O_DIRECT`` where the filesystem takes it), as
    vLLM's pinned host tier is."""
    return np.frombuffer(mmap.mmap(-1, chunks * CHUNK), dtype=np.uint8).reshape(chunks, CHUNK)


def tier(root, host: np.ndarray, chunks: int) -> BoundedFileSystemTier:
    return BoundedFileSystemTier(spec(), memoryview(host), "fs", root_dir=str(root), n_read_threads=2,
                                 n_write_threads=2, enable_kv_events=True, max_gib=chunks * CHUNK / 2**30)


def key(i: int):
    return make_offload_key(i.to_bytes(16, "big"), 0)


def store(t: BoundedFileSystemTier, job: int, i: int) -> None:
    t.submit_store(TransferJob(job, [key(i)], np.array([i % 8]), False, ReqContext("r")))
    t.drain_jobs()
    assert all(r.success for r in t.get_finished_jobs())


def found(t: BoundedFileSystemTier, i: int) -> LookupResult:
    """vLLM's tier lookup as the scheduler repeats it over steps until the async file check answers."""
    ctx = ReqContext(f"q{i}-{time.monotonic_ns()}")
    deadline = time.monotonic() + 10
    while (result := t.lookup(key(i), ctx)) is LookupResult.RETRY:
        t.on_schedule_end(None)  # posts the step's lookups to the tier's checker thread
        assert time.monotonic() < deadline, "the lookup never answered"
        time.sleep(0.01)
    t.on_request_finished(ctx)
    return result


def test_the_tier_keeps_its_size_evicting_the_least_recently_used_chunk_and_says_so(tmp_path) -> None:
    host = host_buffer()
    host[:] = np.arange(8 * CHUNK, dtype=np.uint64).astype(np.uint8).reshape(8, CHUNK)
    t = tier(tmp_path, host, 3)
    try:
        assert t.medium is Medium.STORAGE and t.capacity == 3
        for job, i in enumerate((0, 1, 2)):
            store(t, job, i)
        assert list(t.held) == [key(0), key(1), key(2)] and t.evicted == 0
        assert found(t, 0) is LookupResult.HIT  # read: chunk 0 is the newest now
        store(t, 3, 3)  # one over: chunk 1, the least recently used, goes
        assert list(t.held) == [key(2), key(0), key(3)] and t.evicted == 1
        assert not os.path.exists(t.file_mapper.get_file_name(key(1)))
        assert all(os.path.exists(t.file_mapper.get_file_name(key(i))) for i in (0, 2, 3))
        assert found(t, 1) is LookupResult.MISS and found(t, 3) is LookupResult.HIT
        with open(t.file_mapper.get_file_name(key(3)), "rb") as f:
            assert f.read(CHUNK) == host[3].tobytes()  # vLLM's own writer wrote the chunk's bytes
        events = list(t.take_events())
        stored = [e for e in events if not e.removed]
        removed = [e for e in events if e.removed]
        assert [k for e in stored for k in e.keys] == [key(0), key(1), key(2), key(3)]
        assert all(e.removal_expected and e.medium is Medium.STORAGE for e in stored)
        assert [e.keys for e in removed] == [[key(1)]] and removed[0].medium is Medium.STORAGE
    finally:
        t.shutdown()


def test_a_rewrite_is_one_store_a_lookup_in_flight_is_not_evicted_and_a_cut_job_keeps_its_files(tmp_path) -> None:
    """Three races a review found: vLLM writes a held chunk again whenever host memory stores it anew
    (the relay counts copies, so a second store and one removal would leave it announced for good);
    vLLM's lookup cache asserts that a verdict it waits for is not forced (evicting a chunk whose file
    check is in flight crashed the scheduler); a failed job stops at its first bad chunk after writing
    the ones before it (files nobody held or announced)."""
    host = host_buffer()
    t = tier(tmp_path, host, 1)
    try:
        store(t, 0, 0)
        store(t, 1, 0)  # written again while held: renewed, not announced again
        store(t, 2, 1)  # one over: 0 goes
        assert [(e.removed, e.keys) for e in t.take_events()] == [(False, [key(0)]), (False, [key(1)]),
                                                                   (True, [key(0)])]
        ctx = ReqContext("probe")
        assert t.lookup(key(1), ctx) is LookupResult.RETRY
        t.on_schedule_end(None)  # the file check is in flight ...
        store(t, 3, 2)  # ... so 1 stays though it is the least recent: 2, the next least recent, goes
        assert list(t.held) == [key(1)] and not os.path.exists(t.file_mapper.get_file_name(key(2)))
        deadline = time.monotonic() + 10
        while (result := t.lookup(key(1), ctx)) is LookupResult.RETRY:  # no AssertionError in vLLM's cache
            t.on_schedule_end(None)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert result is LookupResult.HIT
        t.on_request_finished(ctx)
        store(t, 4, 3)  # nothing in flight now: 1 goes
        assert list(t.held) == [key(3)]
        assert [(e.removed, e.keys) for e in t.take_events()] == [(False, [key(2)]), (True, [key(2)]),
                                                                   (False, [key(3)]), (True, [key(1)])]
        other = 5 << 120  # a chunk whose file goes in another folder ...
        folder = os.path.dirname(os.path.dirname(t.file_mapper.get_file_name(key(other))))
        open(folder, "w").close()  # ... which a plain file blocks: the job's second chunk fails
        t.submit_store(TransferJob(5, [key(4), key(other)], np.array([4, 5]), False, ReqContext("r")))
        t.drain_jobs()
        assert [r.success for r in t.get_finished_jobs()] == [False]
        assert list(t.held) == [key(4)] and os.path.exists(t.file_mapper.get_file_name(key(4)))
        assert [(e.removed, e.keys) for e in t.take_events()] == [(False, [key(4)]), (True, [key(3)])]
    finally:
        t.shutdown()


def test_files_of_an_earlier_run_are_adopted_oldest_first_and_trimmed_silently(tmp_path) -> None:
    host = host_buffer()
    first = tier(tmp_path, host, 8)
    try:
        for job, i in enumerate((5, 6, 7)):
            store(first, job, i)
            os.utime(first.file_mapper.get_file_name(key(i)), (1_000 + i, 1_000 + i))
        os.utime(first.file_mapper.get_file_name(key(5)), (2_000, 2_000))  # 5 was the last one touched
    finally:
        first.shutdown()
    again = tier(tmp_path, host, 2)  # restarted smaller: adopts 6, 7, 5 and keeps the newest two
    try:
        assert list(again.held) == [key(7), key(5)] and again.evicted == 1
        assert not os.path.exists(again.file_mapper.get_file_name(key(6)))
        assert list(again.take_events()) == []  # routers never heard of these files
    finally:
        again.shutdown()
    with pytest.raises(ValueError, match="positive"):
        BoundedFileSystemTier(spec(), memoryview(host), "fs", root_dir=str(tmp_path), max_gib=0)
