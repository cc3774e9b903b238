"""The Mooncake trace format (FAST'25 trace release), read into a :class:`Workload`.

One JSON object a line::

    {"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1, ...]}

* ``timestamp``: arrival in milliseconds from the start;
* ``input_length`` / ``output_length``: prompt and completion tokens;
* ``hash_ids``: one id per 512-token block of the prompt; equal ids at the same
  position are a shared prefix.

Tokens are synthesized per hash id (``segment_tokens``: the same id always
gives the same 512 tokens) and the last block is cut to ``input_length``.  Each
request's output tokens are its own segment (the trace does not say whether a
later turn contains them, so they never match another prompt).

Requests whose ``input_length + output_length`` exceeds the engines'
``max_model_len`` are rejected by vLLM; they are dropped here and counted in
``Workload.rejected``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.sim.workload import SimRequest, Workload, renumber

__all__ = ["MOONCAKE_BLOCK_TOKENS", "TRACE_NAMESPACE", "load_mooncake"]

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in the Mooncake trace."""

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
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(reqs) + rejected >= limit:
                break
            try:
                rec = json.loads(line)
                ts = float(rec["timestamp"]) / 1000.0
                n_in = int(rec["input_length"])
                n_out = max(1, int(rec["output_length"]))
                ids = [int(h) for h in rec["hash_ids"]]
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record: {exc}") from exc
            if n_in <= 0 or len(ids) != -(-n_in // block_tokens):
                raise ValueError(
                    f"{path}:{lineno}: {len(ids)} hash_ids do not cover input_length {n_in} "
                    f"at {block_tokens} tokens per id"
                )
            if max_model_len is not None and n_in + n_out > max_model_len:
                rejected += 1
                continue
            segs = [(h, block_tokens) for h in ids]
            last = n_in - block_tokens * (len(ids) - 1)
            segs[-1] = (ids[-1], last)
            reqs.append(
                SimRequest(
                    rid=0,
                    arrival_s=ts,
                    segments=tuple(segs),
                    output_segment=_OUTPUT_SEGMENT_BASE + lineno,
                    prompt_len=n_in,
                    output_len=n_out,
                )
            )
    return Workload(
        name=Path(path).stem,
        requests=renumber(reqs),
        namespace=TRACE_NAMESPACE,
        params={"trace": str(path), "max_model_len": max_model_len, "block_tokens": block_tokens},
        rejected=rejected,
    )
