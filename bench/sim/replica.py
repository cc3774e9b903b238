"""One simulated vLLM engine replica: scheduler semantics of vLLM 0.32's v1 engine.

Per engine step (``vllm/v1/core/sched/scheduler.py``, FCFS policy,
``enable_chunked_prefill``, ``scheduler_reserve_full_isl`` on, watermark 0,
prefix caching on):

1. **Running requests first**, in admission order.  Each decoding request
   computes one token.  When its next token needs a new block and the pool has
   none free, the *last admitted* running request is preempted (its blocks
   freed tail first, its computed tokens dropped, back to the front of the
   waiting queue) until the block fits or the request itself was preempted.
   A request still in prefill continues with ``min(remaining, token budget)``
   tokens (chunked prefill).
2. **Then waiting requests**, FCFS, only if nothing was preempted this step,
   while the token budget (``max_num_batched_tokens``) lasts and fewer than
   ``max_num_seqs`` run: the longest cached prefix of full blocks, at most
   ``(num_tokens - 1) // block_size`` blocks (the last prompt token is always
   recomputed), is taken from the prefix cache; the request is admitted only if
   the blocks of its *whole* sequence fit in the free blocks (hit blocks that sit
   in the free queue count as used); the head of the queue blocks the rest
   when it does not fit.
3. Blocks are cached as soon as a step's scheduled tokens fill them (at
   scheduling, so a request admitted later in the same step hits them),
   including blocks filled by generated tokens; a finished request frees its
   blocks tail first (:mod:`bench.sim.block_pool`).

With a host-memory tier (:mod:`bench.sim.host_tier`, vLLM's CPU offloading
connector), an admitted request offers its GPU-hit blocks to the tier when it loads
nothing from it, as the connector's store pass does, and a waiting request whose
blocks after its GPU hit are held in host memory loads them, as vLLM's scheduler
does with ``get_num_new_matched_tokens``: it takes GPU blocks for them at once (its
whole sequence must fit, as for any admission), leaves the waiting queue without
using the step's token budget (vLLM's ``WAITING_FOR_REMOTE_KVS``), and waits for the
copy, one at a time over the replica's host link (``LatencyModel.host_load_time``).
Once the copy is done (seen at the next step's start), the loaded blocks are cached
and the request goes back to the front of the waiting queue with them computed. Its
``cached_tokens`` count both tiers, as vLLM's ``num_cached_tokens`` does;
``host_cached_tokens`` the loaded ones.

Invariant used for speed: every decoding request computes one token in every
step (the token budget is never smaller than ``max_num_seqs``, which vLLM
requires), so decoders advance in lockstep.  A decoder's state is kept as
``(base tokens, base step)`` and only its block boundaries and its last token
are events (a heap keyed by step), so a step costs O(1) plus those events, not
O(running requests).  A request in prefill is always after every decoder in
admission order (only the last admitted request can be left with a partial
chunk), so "decoders first, then prefill chunks" is vLLM's running order.

The step's duration comes from :class:`bench.sim.latency.LatencyModel`.  KV
events queued during the step's scheduling are published at its end, as vLLM's
``update_from_output`` does.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from bench.sim.block_pool import BlockPool
from bench.sim.disk_tier import DiskTier
from bench.sim.host_tier import HostTier
from bench.sim.latency import LatencyModel
from bench.sim.workload import SimRequest

__all__ = ["EngineConfig", "Replica", "ReqState"]

_ALLOC = 0
_CACHE = 1


@dataclass(frozen=True)
class EngineConfig:
    """The vLLM settings the replica model needs.

    Attributes:
        num_blocks: KV-cache blocks, null block included (``num_gpu_blocks``).
        block_size: tokens per block.
        max_num_batched_tokens: token budget per step.
        max_num_seqs: running requests at most.
        max_model_len: context length; longer requests are rejected upstream.
        host_blocks: blocks of its host-memory KV tier (0: none).
        self_describing_host_events: host-tier stores published with token ids
            and parents (vLLM's ``self_describing_kv_events``), else placeholders.
        host_store_threshold: offers a block needs before the host tier stores it
            (vLLM's ``store_threshold``; below 2: every block).
        host_eviction: the host tier's eviction policy, ``lru``, ``arc`` or ``reuse_credit``
            (vLLM's ``eviction_policy``).
        disk_blocks: blocks of its local-disk KV tier behind the host tier (0: none;
            :mod:`bench.sim.disk_tier`, vLLM's tiering ``fs`` tier); needs ``host_blocks``.
    """

    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 128
    max_model_len: int = 32768
    host_blocks: int = 0
    self_describing_host_events: bool = True
    host_store_threshold: int = 0
    host_eviction: str = "lru"
    disk_blocks: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (as vLLM requires)")
        if self.disk_blocks and not self.host_blocks:
            raise ValueError("a disk tier needs a host tier in front of it (vLLM's tiering: the CPU tier is primary)")


class ReqState:
    """A request inside one replica."""

    __slots__ = (
        "req", "keys", "tokens", "P", "N", "T", "c", "blocks", "n_cached", "outputs", "order", "gen",
        "base_c", "base_step", "chunk", "cached_tokens", "admitted", "preemptions", "arrival_s",
        "first_token_s", "last_token_s", "finish_s", "replica", "user", "host_cached_tokens", "ready_at", "loading",
        "warm", "host_offered", "disk_cached_tokens", "promoted",
    )

    def __init__(self, req: SimRequest, arrival_s: float, tokens=None, user=None, warm: bool = False) -> None:
        self.req = req
        self.warm = warm  # a warm request (bench.sim.fleet): yields to real requests, see Replica
        self.keys = req.keys
        self.tokens = tokens
        self.P = req.prompt_len
        self.N = req.output_len
        self.T = req.prompt_len  # tokens known: prompt + generated so far
        self.c = 0  # tokens whose KV is computed (valid while not decoding)
        self.blocks: list[int] = []
        self.n_cached = 0  # blocks of self.blocks cached (have a hash)
        # Prompt blocks offered to the host tier so far (vLLM's next_stored_chunk_idx: kept when preempted).
        self.host_offered = 0
        self.outputs = 0
        self.order = 0
        self.gen = 0
        self.base_c = 0
        self.base_step = 0
        self.chunk = 0
        self.cached_tokens = 0
        self.admitted = False
        self.preemptions = 0
        self.arrival_s = arrival_s
        self.first_token_s: float | None = None
        self.last_token_s = 0.0
        self.finish_s = 0.0
        self.replica = -1
        self.user = user  # the cluster's per-request record
        self.host_cached_tokens = 0
        self.ready_at = 0.0  # when its host-tier load is done
        self.loading = 0  # blocks being loaded from the host tier (0: none)
        self.disk_cached_tokens = 0  # of host_cached_tokens, those promoted from the disk tier first
        self.promoted = 0  # blocks promoted from the disk tier for its next host load, not loaded yet


class Replica:
    """A vLLM engine: waiting queue, running batch, block pool, step timing.

    Args:
        index: replica number (its id is ``f"replica-{index}"``).
        config: engine settings.
        latency: step-time model.
        enable_events: publish KV events (costs time; off when no policy reads them).
        on_step_end: ``f(replica, now)`` after each step (the cluster publishes
            events and reschedules there).
        on_first_token: ``f(state, now)``.
        on_finish: ``f(state, now)``.
    """

    def __init__(
        self,
        index: int,
        config: EngineConfig,
        latency: LatencyModel,
        *,
        enable_events: bool = False,
        on_first_token: Callable[[ReqState, float], None] | None = None,
        on_finish: Callable[[ReqState, float], None] | None = None,
    ) -> None:
        self.index = index
        self.id = f"replica-{index}"
        self.cfg = config
        self.latency = latency
        self.host = (HostTier(config.host_blocks, config.block_size, config.self_describing_host_events,
                              config.host_store_threshold, config.host_eviction)
                     if config.host_blocks else None)
        self.disk = DiskTier(config.disk_blocks, config.block_size, config.self_describing_host_events) \
            if config.disk_blocks else None
        if self.host is not None:
            self.host.disk = self.disk
        self.pool = BlockPool(config.num_blocks, config.block_size, enable_events, self.host)
        self.loading: list[ReqState] = []  # admitted with a host-tier load in flight, by ready time
        self.link_free_at = 0.0  # when the host link finishes the loads queued on it
        self.enable_events = enable_events
        self.on_first_token = on_first_token or (lambda st, now: None)
        self.on_finish = on_finish or (lambda st, now: None)
        self.waiting: deque[ReqState] = deque()
        self.running: dict[ReqState, None] = {}  # admission order
        self.prefilling: list[ReqState] = []
        self.n_decoding = 0
        self.sum_ctx = 0  # sum of decoders' computed tokens at the current step start
        self.step_no = 0
        self._sched: list[tuple[int, int, int, int, ReqState, int]] = []  # (step, order, kind, seq, st, gen)
        self._finish: list[tuple[int, int, int, ReqState, int]] = []  # (step, order, seq, st, gen)
        self._seq = 0
        self._order = 0
        self.busy = False
        self._now = 0.0
        self._step_dur = 0.0
        self.preempted_this_step = False
        # statistics
        self.busy_s = 0.0
        self.steps = 0
        self.preemptions = 0
        self.itl: list[tuple[float, int]] = []  # (inter-token gap, tokens with that gap)
        self.prefill_tokens = 0
        self.decode_tokens = 0
        # what the current step scheduled
        self._chunks: list[ReqState] = []
        self._step_decoders = 0
        # warm requests (bench.sim.fleet): their own queue, admitted only when no real request waits,
        # at most warm_share of the step's token budget while real requests run
        self.warm_queue: deque[ReqState] = deque()
        self.warm_share = 1.0
        self.warm_in_engine = 0  # warm requests queued or running here
        self.warm_prefill_tokens = 0

    # ------------------------------------------------------------------ load numbers

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Waiting requests, those waiting for a host-tier load included (as vLLM counts them)."""
        return len(self.waiting) + len(self.loading)

    @property
    def num_requests(self) -> int:
        """Requests inside the engine (Serve's queue length for this replica)."""
        return len(self.running) + len(self.waiting) + len(self.loading)

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    def fits(self, total_tokens: int) -> bool:
        """Whether a sequence of ``total_tokens`` can ever be admitted here."""
        return -(-total_tokens // self.cfg.block_size) <= self.cfg.num_blocks - 1

    # ------------------------------------------------------------------ requests

    def add(self, st: ReqState) -> None:
        """A request reaches the engine (joins the waiting queue)."""
        st.replica = self.index
        self.waiting.append(st)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.loading or self.warm_queue)

    def add_warm(self, st: ReqState) -> None:
        """A warm request reaches the engine: it waits behind every real request (vLLM's
        ``--scheduling-policy priority`` with a lower priority) and its prefill takes at most
        ``warm_share`` of a step's token budget while real requests run."""
        st.replica = self.index
        st.warm = True
        self.warm_queue.append(st)
        self.warm_in_engine += 1

    def cancel_warm(self) -> list[ReqState]:
        """Drop the warm requests not admitted yet (their replica goes); returns them."""
        out = list(self.warm_queue)
        self.warm_queue.clear()
        self.warm_in_engine -= len(out)
        return out

    def next_load_done(self) -> float | None:
        """When the first host-tier load in flight is done, None without one."""
        return self.loading[0].ready_at if self.loading else None

    def _finish_loads(self, now: float) -> None:
        """Loads done by ``now``: their blocks cached, the requests back at the front of the waiting queue."""
        done = 0
        while done < len(self.loading) and self.loading[done].ready_at <= now:
            done += 1
        if not done:
            return
        pool = self.pool
        bs = self.cfg.block_size
        for st in reversed(self.loading[:done]):
            n = st.n_cached
            pool.cache_full_blocks(st.blocks, st.keys, n, n + st.loading, st.tokens, st.req.cache_salt)
            st.n_cached = n + st.loading
            st.c = st.n_cached * bs
            st.loading = 0
            self.waiting.appendleft(st)
        del self.loading[:done]

    # ------------------------------------------------------------------ scheduling

    def _c_of_decoder(self, st: ReqState) -> int:
        """A decoder's computed tokens at the start of the step being scheduled."""
        return st.base_c + (self.step_no - st.base_step)

    def _preempt_last(self) -> ReqState:
        """Preempt the last admitted running request (vLLM FCFS victim)."""
        victim = next(reversed(self.running))
        del self.running[victim]
        if victim in self.prefilling:
            self.prefilling.remove(victim)
            victim.c = 0
        else:  # a decoder: it has computed c_s tokens and holds T = c_s + 1
            c = self._c_of_decoder(victim)
            self.n_decoding -= 1
            self.sum_ctx -= c
            victim.outputs = victim.outputs + (self.step_no - victim.base_step)
            victim.T = c + 1
            victim.c = 0
            victim.last_token_s = self._now  # its last token came at the end of the previous step
        victim.gen += 1  # its pending step events are void
        victim.chunk = 0
        self.pool.free_blocks(reversed(victim.blocks))
        victim.blocks = []
        victim.n_cached = 0
        victim.preemptions += 1
        self.preemptions += 1
        (self.warm_queue if victim.warm else self.waiting).appendleft(victim)
        self.preempted_this_step = True
        return victim

    def schedule(self, now: float) -> float | None:
        """Schedule one step starting at ``now``; returns its duration, or None if idle
        (or only waiting for host-tier loads: see :meth:`next_load_done`)."""
        if self.loading and self.loading[0].ready_at <= now:
            self._finish_loads(now)
        if not self.running and not self.waiting and not self.warm_queue:
            return None
        self.step_no += 1
        s = self.step_no
        self._now = now
        self.preempted_this_step = False
        sched = self._sched
        if not self.prefilling and not self.waiting and not self.warm_queue and (not sched or sched[0][0] != s):
            # fast path: only decoders, none at a block boundary
            n = self.n_decoding
            self._chunks = []
            self._step_decoders = n
            dur = self.latency.step_time(0, 0.0, 0, n, self.sum_ctx, n)
            self.busy_s += dur
            self.steps += 1
            self._step_dur = dur
            return dur
        pool = self.pool
        bs = self.cfg.block_size
        budget = self.cfg.max_num_batched_tokens

        # 1a. decoders with a block boundary in this step, in admission order
        while sched and sched[0][0] == s:
            _, _, kind, _, st, gen = heapq.heappop(sched)
            if gen != st.gen:
                continue
            if kind == _ALLOC:
                while pool.num_free < 1:
                    if self._preempt_last() is st:
                        break
                if st.gen != gen:
                    continue  # preempted itself
                st.blocks.extend(pool.get_new_blocks(1))
                self._push_sched(s + bs, _ALLOC, st)
            else:
                n = st.n_cached
                pool.cache_full_blocks(st.blocks, st.keys, n, n + 1, st.tokens, st.req.cache_salt)
                st.n_cached = n + 1
                self._push_sched(s + bs, _CACHE, st)
        budget -= self.n_decoding
        warm_left = 0
        if self.warm_in_engine:  # warm requests take the whole budget only on a replica without real work
            real = len(self.running) + len(self.waiting) + len(self.loading) - self.warm_in_engine \
                + len(self.warm_queue)
            warm_left = budget if real <= 0 else int(self.warm_share * self.cfg.max_num_batched_tokens)

        # 1b. requests in prefill continue (chunked prefill)
        chunks: list[ReqState] = []
        for st in list(self.prefilling):
            if budget <= 0:
                break
            if st not in self.running:
                continue  # preempted by an earlier one
            chunk = min(st.T - st.c, budget)
            if st.warm:
                chunk = min(chunk, warm_left)
                if chunk <= 0:
                    continue
                warm_left -= chunk
            need = -(-(st.c + chunk) // bs) - len(st.blocks)
            gen = st.gen
            while need > pool.num_free:
                if self._preempt_last() is st:
                    break
            if st.gen != gen:
                break  # it preempted itself: vLLM stops scheduling running requests
            if need > 0:
                st.blocks.extend(pool.get_new_blocks(need))
            full = min(st.c + chunk, st.T) // bs
            if full > st.n_cached:
                pool.cache_full_blocks(st.blocks, st.keys, st.n_cached, full, st.tokens, st.req.cache_salt)
                st.n_cached = full
                self._offer(st, full)
            st.chunk = chunk
            chunks.append(st)
            budget -= chunk

        # 2. waiting requests, FCFS, if nothing was preempted
        if not self.preempted_this_step:
            max_seqs = self.cfg.max_num_seqs
            host = self.host
            queues = (self.waiting,) if not self.warm_queue else (self.waiting, self.warm_queue)
            for waiting in queues:
                lim = budget
                if waiting is self.warm_queue:
                    if self.waiting:
                        break  # a real request waits (for blocks): warm requests wait behind it
                    lim = min(budget, warm_left)
                while lim > 0 and waiting and len(self.running) < max_seqs:
                    st = waiting[0]
                    if st.blocks:  # back from a host-tier load: its blocks hold its computed prefix
                        if -(-st.T // bs) - len(st.blocks) > pool.num_free:
                            break
                        n_hit = st.n_cached
                        hit_tokens = st.c
                        chunk = min(st.T - hit_tokens, lim)
                        new = -(-(hit_tokens + chunk) // bs) - len(st.blocks)
                        if new > 0:
                            st.blocks.extend(pool.get_new_blocks(new))
                    else:
                        limit = (st.T - 1) // bs
                        hit = pool.longest_hit(st.keys, limit)
                        n_hit = len(hit)
                        hit_tokens = n_hit * bs
                        loaded = self._lower_tier_run(st, n_hit, limit) if host is not None else 0
                        evictable = pool.evictable(hit) if hit else 0
                        full_need = -(-st.T // bs) - n_hit + evictable
                        if full_need > pool.num_free:
                            break
                        if hit:
                            pool.touch(hit)
                        if loaded:
                            self._start_load(st, hit, n_hit, loaded, now)
                            waiting.popleft()
                            continue
                        chunk = min(st.T - hit_tokens, lim)
                        new = -(-(hit_tokens + chunk) // bs) - n_hit
                        st.blocks = hit + (pool.get_new_blocks(new) if new > 0 else [])
                        st.n_cached = n_hit
                        st.c = hit_tokens
                    full = min(hit_tokens + chunk, st.T) // bs
                    if full > st.n_cached:
                        pool.cache_full_blocks(st.blocks, st.keys, st.n_cached, full, st.tokens, st.req.cache_salt)
                        st.n_cached = full
                    self._offer(st, full)  # with no host load: its GPU hits, then what it computes
                    if not st.admitted:
                        st.admitted = True
                        st.cached_tokens = hit_tokens
                    waiting.popleft()
                    self._order += 1
                    st.order = self._order
                    self.running[st] = None
                    self.prefilling.append(st)
                    st.chunk = chunk
                    chunks.append(st)
                    budget -= chunk
                    lim -= chunk
                    if st.warm:
                        warm_left -= chunk

        # 3. the step's duration
        self._chunks = chunks
        self._step_decoders = self.n_decoding
        if not chunks and not self.n_decoding:
            self.step_no -= 1
            return None
        p_tokens = 0
        pairs = 0.0
        kv_read = 0
        sampled = self.n_decoding
        for st in chunks:
            c, n = st.c, st.chunk
            p_tokens += n
            if st.warm:
                self.warm_prefill_tokens += n
            pairs += n * (c + (n + 1) / 2.0)
            kv_read += c
            if c + n == st.T:
                sampled += 1
        dur = self.latency.step_time(p_tokens, pairs, kv_read, self.n_decoding, self.sum_ctx, sampled)
        self.prefill_tokens += p_tokens
        self.busy_s += dur
        self.steps += 1
        self._step_dur = dur
        return dur

    def _offer(self, st: ReqState, full: int) -> None:
        """vLLM's store pass: offer the host tier ``st``'s full prompt blocks below ``full`` that it
        has not offered yet (``offload_prompt_only``, vLLM's default: decode blocks never are)."""
        if self.host is None:
            return
        end = min(full, st.P // self.cfg.block_size)
        if end > st.host_offered:
            self.pool.offer_to_host(st.keys, st.host_offered, end, st.tokens, st.req.cache_salt)
            st.host_offered = end

    def _lower_tier_run(self, st: ReqState, n_hit: int, limit: int) -> int:
        """Blocks of ``st`` after its ``n_hit`` GPU-hit ones, up to ``limit``, that the host tier holds
        consecutively, after promoting into it those of the run that only the disk tier holds
        (vLLM's tiering ``lookup``: the host tier first, then the disk; a promotion takes room in
        the host tier as a store does, and finds none: a miss from there)."""
        host, disk = self.host, self.disk
        assert host is not None
        if disk is None:
            return host.run(st.keys, n_hit, limit)
        keys = st.keys
        end = n_hit
        only_disk = 0
        while end < limit:
            h = keys[end]
            if h in host:
                end += 1
            elif h in disk:
                end += 1
                only_disk += 1
            else:
                break
        if only_disk:
            read = [h for h in keys[n_hit:end] if h not in host]
            disk.read(read)
            self.pool.offer_to_host(keys, n_hit, end, st.tokens, st.req.cache_salt, cascade=False)
            loaded = host.run(keys, n_hit, end)
            wanted = set(read)
            st.promoted += sum(1 for h in keys[n_hit:n_hit + loaded] if h in wanted)
            return loaded
        return end - n_hit

    def _start_load(self, st: ReqState, hit: list[int], n_hit: int, loaded: int, now: float) -> None:
        """Admit ``st`` with a host-tier load of ``loaded`` blocks after its ``n_hit`` GPU-hit blocks
        (neither is offered to the tier again: the connector's store pass starts after them)."""
        bs = self.cfg.block_size
        assert self.host is not None
        self.host.load(st.keys[n_hit:n_hit + loaded])
        st.host_offered = max(st.host_offered, n_hit + loaded)
        st.blocks = hit + self.pool.get_new_blocks(loaded)
        st.n_cached = n_hit
        st.c = n_hit * bs
        st.loading = loaded
        start = max(now, self.link_free_at)
        promoted, st.promoted = min(st.promoted, loaded), 0  # read from the disk before the host copy
        st.ready_at = self.link_free_at = (start + self.latency.disk_load_time(promoted * bs)
                                           + self.latency.host_load_time(loaded * bs))
        if not st.admitted:
            st.admitted = True
            st.cached_tokens = (n_hit + loaded) * bs
            st.host_cached_tokens = loaded * bs
            st.disk_cached_tokens = promoted * bs
        self.loading.append(st)  # ready times rise: one link, loads in order

    def _push_sched(self, step: int, kind: int, st: ReqState) -> None:
        self._seq += 1
        heapq.heappush(self._sched, (step, st.order, kind, self._seq, st, st.gen))

    def _start_decoding(self, st: ReqState, next_step: int) -> None:
        """``st`` finished its prefill in step ``next_step - 1``: decode from ``next_step``."""
        bs = self.cfg.block_size
        c = st.c
        st.base_c = c
        st.base_step = next_step
        self.n_decoding += 1
        self.sum_ctx += c
        self._push_sched(next_step + (-c) % bs, _ALLOC, st)
        self._push_sched(next_step + (bs - 1 - c % bs) % bs, _CACHE, st)
        self._seq += 1
        # outputs after step s: outputs + (s - next_step + 1); finished when it reaches N
        heapq.heappush(self._finish, (next_step + st.N - st.outputs - 1, st.order, self._seq, st, st.gen))

    def finish_step(self, now: float) -> None:
        """End of the step scheduled last: tokens out, finished requests freed."""
        s = self.step_no
        n_dec = self._step_decoders
        if n_dec:
            self.itl.append((self._step_dur, n_dec))  # each decoder waited exactly this step
            self.decode_tokens += n_dec
            self.sum_ctx += n_dec
        # finished decoders
        fin = self._finish
        if not self._chunks and (not fin or fin[0][0] > s):
            return
        while fin and fin[0][0] <= s:
            _, _, _, st, gen = heapq.heappop(fin)
            if gen != st.gen:
                continue
            c_after = st.base_c + (s + 1 - st.base_step)
            self.sum_ctx -= c_after
            self.n_decoding -= 1
            st.outputs = st.N
            st.c = c_after
            st.T = st.P + st.N
            self._release(st, now)
        # prefill chunks
        for st in self._chunks:
            st.c += st.chunk
            st.chunk = 0
            if st.c < st.T:
                continue
            self.prefilling.remove(st)
            st.outputs += 1
            st.T += 1
            if st.first_token_s is None:
                st.first_token_s = now
                self.on_first_token(st, now)
            else:  # resumed after preemption: the gap since its last token
                self.itl.append((now - st.last_token_s, 1))
            st.last_token_s = now
            if st.outputs >= st.N:
                self._release(st, now)
            else:
                self._start_decoding(st, s + 1)
        self._chunks = []

    def _release(self, st: ReqState, now: float) -> None:
        del self.running[st]
        if st.warm:
            self.warm_in_engine -= 1
        st.gen += 1
        self.pool.free_blocks(reversed(st.blocks))
        st.blocks = []
        st.finish_s = now
        st.tokens = None
        self.on_finish(st, now)
