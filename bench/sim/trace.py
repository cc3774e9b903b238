"""A Mooncake-format trace (FAST'25 trace release) as a simulator :class:`Workload`.

The records come from :func:`locustfiles.shapes.read_mooncake` (the format and
its checks are written there, once for Locust and the simulator).  Each request's
prompt is one segment per hash id (:meth:`~locustfiles.shapes.MooncakeRecord.segments`:
512 tokens each, the last cut to ``input_length``), so equal hash ids at equal
positions are shared prefixes, and tokens are synthesized per hash id
(``segment_tokens``: the same id always gives the same tokens).  Each request's
output tokens are its own segment (the trace does not say whether a later turn
contains them, so they never match another prompt).

Requests whose ``input_length + output_length`` exceeds the engines'
``max_model_len`` are rejected by vLLM; they are dropped here and counted in
``Workload.rejected``.
"""

from __future__ import annotations

import os
from pathlib import Path

from bench.sim.workload import SimRequest, Workload, renumber
from locustfiles.shapes import MOONCAKE_BLOCK_TOKENS, read_mooncake

__all__ = ["MOONCAKE_BLOCK_TOKENS", "TRACE_NAMESPACE", "load_mooncake"]

TRACE_NAMESPACE = 1
"""Token namespace of trace segments (generated workloads use others)."""

_OUTPUT_SEGMENT_BASE = 1 << 40  # output segments: never equal to a hash id


def load_mooncake(
    path: str | os.PathLike,
    *,
    max_model_len: int | None = None,
    limit: int | None = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Workload:
    """Read a Mooncake-format JSONL trace.

    Args:
        path: the ``.jsonl`` file.
        max_model_len: drop requests longer than this (prompt + output), as
            vLLM rejects them; None keeps all.
        limit: keep only the first ``limit`` requests of the file.
        block_tokens: tokens per hash id (512 in the Mooncake release).

    Raises:
        ValueError: a line that is not a trace record, or whose ``hash_ids``
            do not cover ``input_length``.
    """
    reqs: list[SimRequest] = []
    rejected = 0
    for rec in read_mooncake(path, limit=limit, block_tokens=block_tokens):
        if max_model_len is not None and rec.input_length + rec.output_tokens > max_model_len:
            rejected += 1
            continue
        reqs.append(
            SimRequest(
                rid=0,
                arrival_s=rec.timestamp_ms / 1000.0,
                segments=rec.segments(block_tokens, block_tokens),
                output_segment=_OUTPUT_SEGMENT_BASE + rec.line,
                prompt_len=rec.input_length,
                output_len=rec.output_tokens,
            )
        )
    return Workload(
        name=Path(path).stem,
        requests=renumber(reqs),
        namespace=TRACE_NAMESPACE,
        params={"trace": str(path), "max_model_len": max_model_len, "block_tokens": block_tokens},
        rejected=rejected,
    )
