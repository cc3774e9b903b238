"""The workload of the router benchmark: toy vLLM engines and their event streams, the prompts
looked up, and the key batches of the scale index (see the package docstring)."""

from __future__ import annotations

import random
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from routing.block_keys import ROOT_SEED, chain_keys
from routing.events import BlockRemoved, BlockStored, EngineBlockHash, encode_batch
from routing.key_events import KeysStored, keys_to_bytes

NUM_REPLICAS = 16
VOCAB = 151_000
PREFILL_CHUNK_TOKENS = 2048
DECODE_EVENTS_PER_BATCH = 4
STEADY_CAPACITY_BLOCKS = 5_000  # per toy engine: its cache stays full
ENGINE_SEED = 0x5EED  # the toy engine's hashes differ from the router's keys
DOC_LENGTHS = (1024, 2048, 4096, 6144, 8192, 12288, 16384, 24576)

SCALE_ENTRIES = 10_000_000
SCALE_REPLICAS = 64
SCALE_BASE_REPLICAS = 16
SCALE_WIDE_REPLICAS = 1024  # eight groups of the index's 128-replica masks
SCALE_WIDE_ENTRIES = 10_000_000  # as many entries as at 64 replicas (1/16 the load a replica), not 160 M
SCALE_SYSTEM_PROMPTS = 8
SCALE_SYSTEM_PROMPT_TOKENS = 1024
SCALE_COPIES = ((1, 0.55), (2, 0.25), (3, 0.10), (4, 0.06), (8, 0.04))
SCALE_LOOKUP_DOCS = 256  # documents kept as tokens for the scale lookups


class ToyEngine:
    """An LRU prefix cache that publishes vLLM-shaped KV event payloads.

    Blocks are touched as vLLM's block pool frees them: at a request's end, its
    blocks from the last to the first, so the least recently used block is a
    leaf (a block's children are evicted before it).
    """

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self.cache: OrderedDict[EngineBlockHash, int] = OrderedDict()  # engine hash -> physical copies
        self.payloads: list[bytes] = []
        self.stored_blocks = 0
        self.removed_blocks = 0
        self._ts = 0.0
        self._pending: list = []  # decode-phase events waiting for a batch

    def serve(self, prompt: list[int], output_tokens: int, rng: random.Random) -> None:
        """Prefill ``prompt`` in chunks, decode ``output_tokens``; emit the events."""
        bs = self.block_size
        seq = prompt + [rng.randrange(VOCAB) for _ in range(output_tokens)]
        data = array("I", seq).tobytes()
        hashes: list[EngineBlockHash] = []
        h = ENGINE_SEED
        for i in range(len(seq) // bs):
            h = xxhash.xxh64_intdigest(data[4 * bs * i : 4 * bs * (i + 1)], h)
            hashes.append(h)
        n_prompt = len(prompt) // bs
        hit = 0
        while hit < n_prompt and hashes[hit] in self.cache:
            self.cache.move_to_end(hashes[hit])
            hit += 1
        chunk = PREFILL_CHUNK_TOKENS // bs
        self.flush()  # events leave in the order they happen, as vLLM publishes them
        for start in range(hit, n_prompt, chunk):
            self._publish(self._store(hashes, seq, start, min(start + chunk, n_prompt)))
        for start in range(max(hit, n_prompt), len(hashes)):
            self._pending.extend(self._store(hashes, seq, start, start + 1))
            if len(self._pending) >= DECODE_EVENTS_PER_BATCH:
                self._publish(self._pending)
                self._pending = []
        for eh in reversed(hashes):  # the request ends: its blocks are freed tail first
            if eh in self.cache:
                self.cache.move_to_end(eh)

    def _store(self, hashes: list[EngineBlockHash], seq: list[int], start: int, end: int) -> list:
        bs = self.block_size
        events: list = [
            BlockStored(
                block_hashes=hashes[start:end],
                parent_block_hash=hashes[start - 1] if start else None,
                token_ids=seq[start * bs : end * bs],
                block_size=bs,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
            )
        ]
        for eh in hashes[start:end]:
            self.cache[eh] = self.cache.pop(eh, 0) + 1
        self.stored_blocks += end - start
        while len(self.cache) > self.capacity:
            old, copies = self.cache.popitem(last=False)
            self.removed_blocks += copies
            events.extend(BlockRemoved(block_hashes=[old], medium="GPU", group_idx=0) for _ in range(copies))
        return events

    def flush(self) -> None:
        """Publish decode-phase events still waiting for a batch."""
        if self._pending:
            self._publish(self._pending)
            self._pending = []

    def _publish(self, events: list) -> None:
        self._ts += 0.01
        self.payloads.append(encode_batch(events, self._ts))


@dataclass
class Stream:
    """The toy engines' vLLM event stream and what they hold at its end."""

    block_size: int
    vllm: list[tuple[str, bytes]]
    """``(replica id, msgpack KVEventBatch payload)``, replicas interleaved, each one's in order."""
    stored_blocks: int
    removed_blocks: int
    engine_blocks: dict[str, int]
    """Distinct blocks each engine holds at the end."""
    docs: list[list[int]]

    @property
    def replica_ids(self) -> tuple[str, ...]:
        return tuple(self.engine_blocks)


def build_stream(block_size: int, requests: int, seed: int, capacity: int) -> Stream:
    """The event payloads of ``NUM_REPLICAS`` toy engines of ``capacity`` blocks each."""
    rng = random.Random(seed)
    docs = [[rng.randrange(VOCAB) for _ in range(rng.choice(DOC_LENGTHS))] for _ in range(48)]
    engines = [ToyEngine(block_size, capacity) for _ in range(NUM_REPLICAS)]
    for _ in range(requests):
        # Popular documents are asked about more; each lives on two home replicas.
        d = rng.randrange(len(docs)) if rng.random() < 0.3 else min(int(rng.paretovariate(1.2)) - 1, len(docs) - 1)
        replica = rng.choice((d % NUM_REPLICAS, (7 * d + 3) % NUM_REPLICAS))
        question = [rng.randrange(VOCAB) for _ in range(rng.randrange(64, 512))]
        engines[replica].serve(docs[d] + question, rng.randrange(32, 256), rng)
    for engine in engines:
        engine.flush()
    order = [r for r, e in enumerate(engines) for _ in e.payloads]
    rng.shuffle(order)
    cursors = [iter(e.payloads) for e in engines]
    return Stream(
        block_size=block_size,
        vllm=[(f"replica-{r}", next(cursors[r])) for r in order],
        stored_blocks=sum(e.stored_blocks for e in engines),
        removed_blocks=sum(e.removed_blocks for e in engines),
        engine_blocks={f"replica-{r}": len(e.cache) for r, e in enumerate(engines)},
        docs=docs,
    )


def prompts(docs: Sequence[Sequence[int]], prompt_len: int, count: int, seed: int) -> Iterator[array]:
    """``count`` prompts of ``prompt_len`` tokens: a stored document that fits, then fresh tokens.

    The same ``seed`` gives the same prompts (ours and Dynamo's lookups use it
    so); an ``array('I')`` each, copied into a new one by the caller.  Arrays,
    not lists: the garbage collector does not traverse them, so prompts waiting
    their turn do not make every collection inside a timed lookup walk 8k-element
    lists (the ingress hands the router an ``array('I')`` too).
    """
    rng = random.Random(seed)
    draw = np.random.default_rng(seed)
    fitting = [d for d in docs if len(d) <= prompt_len]
    if not fitting:
        raise ValueError(f"no document fits in {prompt_len} tokens")
    for _ in range(count):
        doc = rng.choice(fitting)
        prompt = array("I", doc)
        prompt.frombytes(draw.integers(0, VOCAB, prompt_len - len(doc), dtype=np.uint32).tobytes())
        yield prompt


def scale_workload(replicas: int, entries: int, block_size: int = 16, seed: int = 11
                   ) -> tuple[list[tuple[str, list]], list[list[int]], int]:
    """Key-event batches for ``entries`` (replica, block) entries over ``replicas`` replicas.

    See the package docstring ("Scale").  Returns ``(batches [(replica id,
    events)], documents kept as tokens for lookups (system prompt + document),
    distinct keys)``.
    """
    rng = random.Random(seed)
    draw = np.random.default_rng(seed)
    ids = [f"replica-{r}" for r in range(replicas)]
    chunk = PREFILL_CHUNK_TOKENS // block_size

    def tokens(n: int) -> array:
        a = array("I")
        a.frombytes(draw.integers(0, VOCAB, n, dtype=np.uint32).tobytes())
        return a

    def stored(keys: Sequence[int], parent: int | None) -> list:
        events = []
        for s in range(0, len(keys), chunk):
            events.append(KeysStored(parent if s == 0 else keys[s - 1], keys_to_bytes(keys[s : s + chunk])))
        return events

    systems = [tokens(SCALE_SYSTEM_PROMPT_TOKENS) for _ in range(SCALE_SYSTEM_PROMPTS)]
    system_keys = [chain_keys(t, block_size, ROOT_SEED) for t in systems]
    batches: list[tuple[str, list]] = [(rid, stored(k, None)) for k in system_keys for rid in ids]
    total = len(system_keys[0]) * len(system_keys) * replicas
    distinct = len(system_keys[0]) * len(system_keys)
    copies = [c for c, _ in SCALE_COPIES]
    weights = [w for _, w in SCALE_COPIES]
    docs: list[list[int]] = []
    while total < entries:
        s = rng.randrange(SCALE_SYSTEM_PROMPTS)
        body = tokens(rng.choice(DOC_LENGTHS))
        keys = chain_keys(body, block_size, system_keys[s][-1])
        holders = rng.sample(ids, min(replicas, rng.choices(copies, weights)[0]))
        for rid in holders:
            take = keys[: entries - total]
            if not take:
                break
            batches.append((rid, stored(take, system_keys[s][-1])))
            total += len(take)
        distinct += len(keys)
        if len(docs) < SCALE_LOOKUP_DOCS and len(systems[s]) + len(body) <= 8192:
            docs.append(systems[s].tolist() + body.tolist())
    rng.shuffle(batches)  # replicas interleaved; a replica's system prompts may come after its documents
    return batches, docs, distinct
