"""The candidate replicas of a request, and the same as columns built once per candidate list.

Ray Serve hands a request router the same list object (``RequestRouter._replicas_list``)
until a replica or its routing stats change, when it builds a new one
(``ray/serve/_private/request_router/request_router.py``, ``update_replicas`` and
``on_replica_actor_died``).  The live router keeps one :class:`CandidateSet` per such list:
the stats are read into numpy columns once, not on every request, and
``routing.router_state.RouterState.choose`` scores every candidate from them in arrays
(``routing.contenders``).  A set is a snapshot: build a new one when the stats change.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Candidate", "CandidateSet", "with_adapter"]


@dataclass(slots=True)
class Candidate:
    """A candidate replica as the request router sees it.

    Attributes:
        replica_id: the replica's id.
        routing_stats: its last reported stats (``num_running``, ``num_waiting``,
            ``kv_cache_usage``, ``num_gpu_blocks``; with a host tier
            ``num_host_blocks``, ``kv_bytes_per_token`` and
            ``host_blocks_per_chunk``), or None before the first report.
        max_ongoing_requests: the per-replica concurrency cap, or None.
    """

    replica_id: str
    routing_stats: Mapping[str, Any] | None
    max_ongoing_requests: int | None


def with_adapter(candidates: Sequence[Candidate], lora_name: str | None,
                 stats_key: str = "lora_adapters") -> list[Candidate]:
    """The candidates whose engines have ``lora_name`` loaded (listed under ``stats_key``
    in their routing stats), or all of them when none has it or the request names no
    adapter: a replica without the adapter would first load it from disk.
    """
    if lora_name is None:
        return list(candidates)
    having = [c for c in candidates if lora_name in ((c.routing_stats or {}).get(stats_key) or ())]
    return having or list(candidates)


def _column(values: list[float]) -> np.ndarray:
    return np.array(values, dtype=np.float64)


class CandidateSet(Sequence[Candidate]):
    """Candidates, in order, with their stats as columns (one entry per candidate).

    A ``Sequence[Candidate]``.  Columns (numpy float64 unless said):

    * ``running``, ``kv_usage``: ``num_running``, ``kv_cache_usage`` (NaN when unknown);
    * ``waiting``: ``num_waiting`` (0 when unknown);
    * ``max_ongoing``: ``max_ongoing_requests`` (inf when none);
    * ``capacity``: ``num_gpu_blocks - 1`` (vLLM counts the null block, which never
      caches; NaN when unknown);
    * ``kv_bytes_per_token``: with a host tier (``num_host_blocks`` and
      ``kv_bytes_per_token`` reported), its KV bytes a token; 0 without;
    * ``host_chunk``: ``host_blocks_per_chunk`` (int64, 1 when unknown).

    ``uids`` is the tuple of replica ids.  Adapter subsets (:meth:`with_adapter`) are
    built once per adapter name.
    """

    __slots__ = ("candidates", "uids", "running", "waiting", "kv_usage", "max_ongoing", "capacity",
                 "kv_bytes_per_token", "host_chunk", "has_host_tier", "_adapters", "positions")

    def __init__(self, candidates: Sequence[Candidate]) -> None:
        self.candidates = tuple(candidates)
        self.uids = tuple(c.replica_id for c in self.candidates)
        stats = [c.routing_stats or {} for c in self.candidates]
        self.running = _column([math.nan if s.get("num_running") is None else s["num_running"] for s in stats])
        self.waiting = _column([s.get("num_waiting") or 0 for s in stats])
        self.kv_usage = _column([math.nan if s.get("kv_cache_usage") is None else s["kv_cache_usage"]
                                 for s in stats])
        self.max_ongoing = _column([math.inf if c.max_ongoing_requests is None else c.max_ongoing_requests
                                    for c in self.candidates])
        self.capacity = _column([int(s["num_gpu_blocks"]) - 1 if s.get("num_gpu_blocks") else math.nan
                                 for s in stats])
        self.kv_bytes_per_token = _column([float(s["kv_bytes_per_token"])
                                           if s.get("num_host_blocks") and s.get("kv_bytes_per_token") else 0.0
                                           for s in stats])
        self.host_chunk = np.array([int(s.get("host_blocks_per_chunk") or 1) for s in stats], dtype=np.int64)
        self.has_host_tier = bool(self.kv_bytes_per_token.any())
        self._adapters: dict[tuple[str, str], CandidateSet] = {}
        self.positions: Any = None
        """The owner's cache of where each candidate's load is kept (``RouterState``'s business)."""

    def __len__(self) -> int:
        return len(self.candidates)

    def __getitem__(self, i):
        return self.candidates[i]

    def __iter__(self):
        return iter(self.candidates)

    def with_adapter(self, lora_name: str | None, stats_key: str = "lora_adapters") -> CandidateSet:
        """As the module's :func:`with_adapter`, as a set (this one when nothing is filtered out)."""
        if lora_name is None:
            return self
        sub = self._adapters.get((lora_name, stats_key))
        if sub is None:
            kept = with_adapter(self.candidates, lora_name, stats_key)
            sub = self if len(kept) == len(self.candidates) else CandidateSet(kept)
            self._adapters[(lora_name, stats_key)] = sub
        return sub

    def without(self, uids: Collection[str]) -> CandidateSet:
        """The candidates whose id is not in ``uids``; this set when that removes none or all of them."""
        kept = [c for c in self.candidates if c.replica_id not in uids]
        return self if len(kept) in (0, len(self.candidates)) else CandidateSet(kept)

    def __repr__(self) -> str:
        return f"<CandidateSet of {len(self)}: {', '.join(self.uids[:4])}{', ...' if len(self) > 4 else ''}>"
