"""K disjoint copies of a Mooncake-format trace, merged in time: a cluster K times larger at the same load.

Scaling a trace's rate by K on K times the replicas keeps each replica's
arrival rate, but not its working set: the same prefixes are spread over K
times the cache, so the cluster hits more for a reason that has nothing to do
with routing.  Tiling keeps both: copy ``k`` (0-based) is the trace with every
hash id moved past the previous copies' (``hash_id + k * (max_id + 1)``: no
block is shared between copies) and every timestamp moved ``k * stagger_ms``
later.  Each copy keeps its own arrival times and multi-turn order, so K
copies on ``K * N`` replicas are K independent ``N``-replica problems; a router
that scales gives the hit rate of one copy on ``N`` replicas::

    python -m bench.sim.tile_trace ../shared/workloads/mooncake_synthetic_trace.jsonl --copies 8 \\
        --out /tmp/mooncake_x8copies.jsonl
    python -m bench.sim --trace /tmp/mooncake_x8copies.jsonl --replicas 64 --rate-scale 1 ...

The default stagger is the trace's mean gap between arrivals divided by K
(rounded to a millisecond), so the copies' requests interleave instead of
arriving K at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from locustfiles.shapes import MOONCAKE_BLOCK_TOKENS, read_mooncake

__all__ = ["tile"]


def tile(src: str | os.PathLike, out: str | os.PathLike, copies: int, stagger_ms: float | None = None,
         block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> dict:
    """Write ``copies`` disjoint copies of trace ``src`` to ``out``, sorted by timestamp (stable).

    Args:
        src: a Mooncake-format ``.jsonl`` trace.
        out: the tiled trace (overwritten).
        copies: K >= 1.
        stagger_ms: copy ``k`` arrives ``k * stagger_ms`` ms later; None = the
            mean inter-arrival gap of ``src`` over K, rounded to 1 ms.
        block_tokens: tokens per hash id.

    Returns:
        ``{"records", "copies", "stagger_ms", "hash_id_offset"}`` of what was written.

    Raises:
        ValueError: ``copies`` < 1, a negative stagger, an empty or malformed trace.
    """
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    if stagger_ms is not None and stagger_ms < 0:
        raise ValueError(f"stagger_ms must be >= 0, got {stagger_ms}")
    recs = read_mooncake(src, block_tokens=block_tokens)
    if not recs:
        raise ValueError(f"{src}: no trace records")
    offset = max(max(r.hash_ids) for r in recs) + 1
    if stagger_ms is None:
        span = max(r.timestamp_ms for r in recs) - min(r.timestamp_ms for r in recs)
        stagger_ms = float(round(span / len(recs) / copies))
    rows = []
    for k in range(copies):
        for i, r in enumerate(recs):
            ts = r.timestamp_ms + k * stagger_ms
            rows.append((ts, k, i, {"timestamp": int(ts) if float(ts).is_integer() else ts,
                                    "input_length": r.input_length, "output_length": r.output_length,
                                    "hash_ids": [h + k * offset for h in r.hash_ids]}))
    rows.sort(key=lambda x: (x[0], x[1], x[2]))
    with open(out, "w", encoding="utf-8") as f:
        for *_, row in rows:
            f.write(json.dumps(row) + "\n")
    return {"records": len(rows), "copies": copies, "stagger_ms": stagger_ms, "hash_id_offset": offset}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="Mooncake-format JSONL trace")
    ap.add_argument("--copies", type=int, required=True, help="K disjoint copies")
    ap.add_argument("--out", required=True, help="the tiled trace (.jsonl)")
    ap.add_argument("--stagger-ms", type=float, default=None,
                    help="copy k arrives k * this later (default: the mean arrival gap / K)")
    args = ap.parse_args(argv)
    try:
        info = tile(args.trace, args.out, args.copies, args.stagger_ms)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {info}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
