"""Requests of a simulated workload, and their tokens, synthesized deterministically.

A request's prompt is a sequence of *segments*: ``(segment id, length)`` pairs,
where a segment id names a fixed run of token ids (a Mooncake hash id, a system
prompt, a document, a chat turn).  Equal segment ids at equal positions are
shared prefixes.  Token ids are synthesized from the segment id alone
(:func:`segment_tokens`): the same id always gives the same tokens, cut to the
length asked for, so the same text reaches the same block keys in every policy,
replica and run.

The tokens a request *generates* are a segment too (``output_segment``): in a
chat session the next turn's prompt contains the previous answer, so the
engine's decode-phase blocks can serve later prompts, as they do in vLLM.

:meth:`Workload.prepare` computes, once per block size, every request's block
keys (``routing.block_keys.block_keys`` over prompt + output, with its
``cache_salt``); the simulated engines use them as their block hashes and the
policies as the router's keys, so each policy run shares that work.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from routing.block_keys import block_keys

__all__ = ["SimRequest", "Workload", "segment_tokens", "DEFAULT_VOCAB"]

DEFAULT_VOCAB = 150_000
"""Synthesized token ids are in ``[0, DEFAULT_VOCAB)`` (Qwen2.5 has 151,643 text tokens)."""


@functools.lru_cache(maxsize=16384)
def _segment_array(namespace: int, segment: int, length: int, vocab: int) -> np.ndarray:
    rng = np.random.Generator(np.random.Philox(key=[namespace & 0xFFFFFFFFFFFFFFFF, segment & 0xFFFFFFFFFFFFFFFF]))
    out = rng.integers(0, vocab, size=length, dtype=np.uint32)
    out.setflags(write=False)
    return out


def segment_tokens(segment: int, length: int, *, namespace: int = 0, vocab: int = DEFAULT_VOCAB) -> np.ndarray:
    """The first ``length`` token ids of ``segment`` (uint32, read-only).

    Deterministic in ``(namespace, segment)``: a longer cut starts with the
    shorter one's tokens.  ``namespace`` keeps the ids of different workloads
    apart.
    """
    if length <= 0:
        return np.zeros(0, dtype=np.uint32)
    # Generate whole 512-token pages so that every cut of a segment shares its tokens.
    page = 512
    n_pages = -(-length // page)
    full = _segment_array(namespace, segment, n_pages * page, vocab)
    return full[:length]


@dataclass(slots=True)
class SimRequest:
    """One request of a workload.

    Attributes:
        rid: index in the workload, 0-based, in arrival order.
        arrival_s: arrival time at the router, seconds from the start.
        segments: the prompt, as ``(segment id, length)`` pairs.
        output_segment: segment id of the tokens the engine generates.
        prompt_len: prompt tokens (sum of the segment lengths).
        output_len: tokens to generate (>= 1; ``ignore_eos`` semantics).
        cache_salt: tenant salt (vLLM ``cache_salt``), or None.
        session: session / group id, for reporting only.
        keys: block keys of the full blocks of prompt + output, set by
            :meth:`Workload.prepare`.
        tail_key: fingerprint of the prompt's partial last block (0 when the
            prompt is a whole number of blocks), chained on the last key.
    """

    rid: int
    arrival_s: float
    segments: tuple[tuple[int, int], ...]
    output_segment: int
    prompt_len: int
    output_len: int
    cache_salt: str | None = None
    session: int = -1
    keys: array = field(default_factory=lambda: array("Q"))
    tail_key: int = 0

    def prompt_blocks(self, block_size: int) -> int:
        """Full blocks of the prompt."""
        return self.prompt_len // block_size


@dataclass
class Workload:
    """A named, arrival-ordered list of requests and its token namespace.

    Attributes:
        name: workload name (``--workload`` or the trace's file name).
        requests: requests in arrival order (``rid`` = index).
        namespace: token namespace of its segments (see :func:`segment_tokens`).
        params: the generator's parameters, for the report.
        rejected: requests dropped before the run (e.g. longer than the context).
    """

    name: str
    requests: list[SimRequest]
    namespace: int = 0
    params: dict = field(default_factory=dict)
    rejected: int = 0
    vocab: int = DEFAULT_VOCAB
    _prepared_for: int | None = None

    # ------------------------------------------------------------------ tokens

    def tokens(self, req: SimRequest) -> np.ndarray:
        """Prompt + output token ids of ``req`` (uint32)."""
        parts = [segment_tokens(s, n, namespace=self.namespace, vocab=self.vocab) for s, n in req.segments]
        parts.append(segment_tokens(req.output_segment, req.output_len, namespace=self.namespace, vocab=self.vocab))
        return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()

    def prompt_tokens(self, req: SimRequest) -> np.ndarray:
        return self.tokens(req)[: req.prompt_len]

    def prepare(self, block_size: int, progress: bool = False) -> None:
        """Compute every request's block keys and tail key at ``block_size`` (once)."""
        if self._prepared_for == block_size:
            return
        it: Iterable[SimRequest] = self.requests
        if progress:
            from tqdm import tqdm

            it = tqdm(self.requests, desc=f"block keys ({self.name})", unit="req", leave=False)
        for req in it:
            toks = self.tokens(req)
            raw = toks.astype("<u4", copy=False).tobytes()
            req.keys = block_keys(raw, block_size, cache_salt=req.cache_salt)
            n_full = req.prompt_len // block_size
            tail = req.prompt_len - n_full * block_size
            if tail:
                seed = req.keys[n_full - 1] if n_full else 0
                req.tail_key = xxhash.xxh3_64_intdigest(raw[n_full * block_size * 4 : req.prompt_len * 4], seed)
            else:
                req.tail_key = 0
        self._prepared_for = block_size

    # ------------------------------------------------------------------ views

    def scaled(self, rate_scale: float) -> Workload:
        """The same requests arriving ``rate_scale`` times faster (keys are shared)."""
        if rate_scale <= 0:
            raise ValueError(f"rate_scale must be positive, got {rate_scale}")
        reqs = [
            SimRequest(
                r.rid, r.arrival_s / rate_scale, r.segments, r.output_segment, r.prompt_len, r.output_len,
                r.cache_salt, r.session, r.keys, r.tail_key,
            )
            for r in self.requests
        ]
        out = Workload(self.name, reqs, self.namespace, dict(self.params, rate_scale=rate_scale), self.rejected,
                       self.vocab)
        out._prepared_for = self._prepared_for
        return out

    def head(self, n: int) -> Workload:
        """The first ``n`` requests."""
        out = Workload(self.name, self.requests[:n], self.namespace, dict(self.params), self.rejected, self.vocab)
        out._prepared_for = self._prepared_for
        return out

    def __iter__(self) -> Iterator[SimRequest]:
        return iter(self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    def stats(self) -> dict:
        """Request count, mean / max prompt and output lengths, duration, offered rates."""
        reqs = self.requests
        if not reqs:
            return {"requests": 0}
        prompt = np.array([r.prompt_len for r in reqs], dtype=np.int64)
        out = np.array([r.output_len for r in reqs], dtype=np.int64)
        span = max(reqs[-1].arrival_s - reqs[0].arrival_s, 1e-9)
        return {
            "requests": len(reqs),
            "rejected": self.rejected,
            "prompt_tokens_mean": float(prompt.mean()),
            "prompt_tokens_max": int(prompt.max()),
            "output_tokens_mean": float(out.mean()),
            "duration_s": float(span),
            "request_rate_per_s": float(len(reqs) / span),
            "prompt_tokens_per_s": float(prompt.sum() / span),
        }


def renumber(requests: Sequence[SimRequest]) -> list[SimRequest]:
    """Sort by arrival (stable) and set ``rid`` to the index."""
    out = sorted(requests, key=lambda r: r.arrival_s)
    for i, r in enumerate(out):
        r.rid = i
    return out
