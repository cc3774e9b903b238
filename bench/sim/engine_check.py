"""Pin the simulated replica to a real vLLM engine: same requests, same cached tokens.

Two request sequences, each sent one request at a time (the next after the
previous finished) to a fresh prefix cache:

* ``prefix_table``: the foundation issue's table, 8 token-id prompts of one
  512-token prefix plus suffixes of 24, 40, 8, 32, 16, 48, 12 and 20 tokens at
  block size 32: 4,296 prompt tokens, 3,584 cached.
* ``evictions``: prompts over four documents on a 64-block KV cache (63 usable
  blocks, 2,016 tokens), some generating tokens (``ignore_eos``), so later
  requests find their prefix partly evicted: the counts pin the LRU order
  (tail blocks first, decode blocks cached, unhashed partial blocks reused
  first), the full-sequence admission check and the last-token rule.

:func:`simulate` runs them on :class:`bench.sim.replica.Replica`;
:func:`run_engine` on vLLM (``LLM``, no Ray), reading
``RequestOutput.num_cached_tokens``.  ``python -m bench.sim.engine_check``
prints both as JSON (the engine needs ``models/tiny-qwen2``; about 30 s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from bench.sim.latency import PRESETS
from bench.sim.replica import EngineConfig, Replica, ReqState
from bench.sim.workload import SimRequest
from routing.block_keys import block_keys

__all__ = ["CASES", "ENGINE_SETTINGS", "run_engine", "simulate"]

ENGINE_SETTINGS = {
    "block_size": 32,
    "num_gpu_blocks_override": 64,
    "max_model_len": 2016,  # = 63 usable blocks x 32: vLLM requires one sequence to fit
    "max_num_batched_tokens": 2048,
    "max_num_seqs": 8,
}
"""vLLM settings of the check (the CPU backend needs block sizes in multiples of 32)."""


def _tokens(seed: int, n: int, vocab: int = 1000) -> list[int]:
    """``n`` deterministic token ids in ``[10, vocab + 10)`` (the tiny model has 1,024)."""
    x = (seed * 2654435761 + 12345) & 0xFFFFFFFF
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        out.append(10 + (x >> 8) % vocab)
    return out


def _prefix_table() -> list[tuple[list[int], int]]:
    prefix = _tokens(1, 512)
    return [(prefix + _tokens(100 + j, n), 1) for j, n in enumerate([24, 40, 8, 32, 16, 48, 12, 20])]


def _evictions() -> list[tuple[list[int], int]]:
    d0, d1, d2, d3 = _tokens(10, 700), _tokens(11, 900), _tokens(12, 600), _tokens(13, 1200)
    q = lambda i, n: _tokens(200 + i, n)  # noqa: E731
    return [
        (d0 + q(1, 50), 1),
        (d1 + q(2, 40), 40),
        (d0 + q(3, 30), 1),
        (d2 + q(4, 70), 20),
        (d3 + q(5, 20), 1),
        (d0 + q(6, 10), 1),
        (d1 + q(7, 64), 33),
        (d3[:800] + q(8, 40), 1),
        (d2 + q(9, 5), 1),
        (d0 + d1[:900] + q(10, 16), 5),
        (d1 + q(11, 100), 1),
        (d3 + q(12, 200), 1),
        (d2[:576], 1),
        (d2[:576], 1),
    ]


CASES: dict[str, list[tuple[list[int], int]]] = {
    "prefix_table": _prefix_table(),
    "evictions": _evictions(),
}
"""Case name -> ``[(prompt token ids, max_tokens), ...]``, sent in order, one at a time."""


def simulate(
    requests: list[tuple[list[int], int]], settings: dict | None = None
) -> tuple[list[int], dict[str, int]]:
    """Cached tokens per request on the simulated replica, and pool statistics.

    Generated tokens are arbitrary here: only their count matters, since no
    later prompt contains them.
    """
    cfg = dict(ENGINE_SETTINGS, **(settings or {}))
    bs = cfg["block_size"]
    rep = Replica(
        0,
        EngineConfig(
            num_blocks=cfg["num_gpu_blocks_override"],
            block_size=bs,
            max_num_batched_tokens=cfg["max_num_batched_tokens"],
            max_num_seqs=cfg["max_num_seqs"],
            max_model_len=cfg["max_model_len"],
        ),
        PRESETS["4090-qwen2.5-7b-awq"].latency,  # timing is irrelevant here
    )
    out: list[int] = []
    now = 0.0
    for i, (prompt, max_tokens) in enumerate(requests):
        req = SimRequest(i, now, ((i, len(prompt)),), i, len(prompt), max_tokens)
        req.keys = block_keys(list(prompt) + [1] * max_tokens, bs)
        st = ReqState(req, now)
        rep.add(st)
        while rep.has_work():
            dur = rep.schedule(now)
            if dur is None:
                raise RuntimeError("simulated replica stalled")
            now += dur
            rep.finish_step(now)
        out.append(st.cached_tokens)
    return out, {"evictions": rep.pool.evictions, "preemptions": rep.preemptions}


def run_engine(cases: dict[str, list[tuple[list[int], int]]], model: str,
               settings: dict | None = None) -> dict[str, list[int]]:
    """Cached tokens per request on a real vLLM engine, one request at a time.

    The prefix cache is reset between cases (all blocks are free then, so the
    next case starts as on a fresh engine).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = dict(ENGINE_SETTINGS, **(settings or {}))
    llm = LLM(
        model=model,
        enable_prefix_caching=True,
        gpu_memory_utilization=0.1,
        enforce_eager=True,
        seed=0,
        **cfg,
    )
    results: dict[str, list[int]] = {}
    for name, requests in cases.items():
        if not llm.reset_prefix_cache():
            raise RuntimeError("could not reset the prefix cache")
        counts = []
        for prompt, max_tokens in requests:
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            (res,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
            counts.append(int(res.num_cached_tokens or 0))
        results[name] = counts
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-qwen2")
    ap.add_argument("--sim-only", action="store_true", help="skip the real engine")
    args = ap.parse_args(argv)
    report: dict = {"settings": ENGINE_SETTINGS, "simulated": {}, "prompt_tokens": {}}
    for name, reqs in CASES.items():
        counts, stats = simulate(reqs)
        report["simulated"][name] = counts
        report["prompt_tokens"][name] = sum(len(p) for p, _ in reqs)
        report.setdefault("sim_stats", {})[name] = stats
    if not args.sim_only:
        report["engine"] = run_engine(CASES, args.model)
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
