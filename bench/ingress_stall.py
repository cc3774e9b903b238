"""How long the ingress's serving loop stalls while it prepares large token-id completion bodies.

The ingress prepares a request (parse, validate, render, tokenize: ``app.prepare``) on a
worker loop of its own thread when the body is over 64 KiB (``app.offload``), so its
serving loop keeps answering other streams. A thread helps only between calls that hold
the GIL: ``json.loads`` and pydantic's validation of a list of 256 prompts of 3,800 token
ids (3.7 MiB) are one call each, which held the serving loop 135-607 ms (issue 38, fault 5).
Such bodies are now decoded and validated a prompt at a time
(``app.prepare.token_prompts_request``).

This benchmark runs the ingress's own preparation (``OpenAIServing._prepare``: the worker
loop, vLLM's renderer on the tiny model of ``serve_config.yaml``; no engine is asked) and,
on the serving loop, a ticker that sleeps ``TICK_S`` and records how late each wake-up is:
the stall another stream's next token would see. Three modes, in one run:

* ``idle``: the ticker alone;
* ``piecewise``: ``BODIES`` bodies prepared one after another, the ingress's way;
* ``whole``: the same bodies with the piecewise path off (``PIECEWISE_BODY_BYTES`` raised
  past them): the path before the fix.

Target: ``piecewise`` p99 stall <= 40 ms (``TARGET_P99_MS``, the stall ``docs/reliability.md``
treats as worth refusing for). Run: ``python -m bench.ingress_stall [--json OUT]`` (``make bench``
runs it; OUT's ``.png`` is the stall CDF of the three modes). Needs the tiny model (``make model``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

import yaml

from bench.stats import percentile

TICK_S = 0.002
BODIES = 8
PROMPTS = 256
PROMPT_TOKENS = 3800
IDLE_S = 1.0
TARGET_P99_MS = 40.0
REPO = Path(__file__).resolve().parent.parent


def body(seed: int) -> bytes:
    """A completion of ``PROMPTS`` token-id prompts of ``PROMPT_TOKENS`` ids each, compact JSON (3.7 MiB):
    ids 100-999, inside the tiny model's vocabulary, so vLLM's renderer accepts them."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 1000) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]
    return json.dumps({"model": "tiny-qwen2", "prompt": prompts, "max_tokens": 1},
                      separators=(",", ":")).encode()


async def _measure(serving: Any, bodies: list[bytes] | None) -> dict[str, Any]:
    """Ticker lateness (ms) while ``bodies`` are prepared one after another (or ``IDLE_S`` alone)."""
    from app.prepare import COMPLETION
    from app.protocol import EngineRequest

    late: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(TICK_S)
            late.append((time.perf_counter() - t - TICK_S) * 1e3)

    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0.05)
    prepare_s: list[float] = []
    if bodies is None:
        await asyncio.sleep(IDLE_S)
    else:
        for raw in bodies:
            t0 = time.perf_counter()
            prepared = await serving._prepare(COMPLETION, raw, False)
            prepare_s.append(time.perf_counter() - t0)
            assert isinstance(prepared, EngineRequest), prepared  # the body was accepted, rendered, tokenized
            assert len(prepared.prompt_token_ids) == PROMPT_TOKENS and len(prepared.more_prompts) == PROMPTS - 1
    done.set()
    await ticker
    late.sort()
    return {"ticks": len(late), "p50_ms": round(percentile(late, 50), 2), "p99_ms": round(percentile(late, 99), 2),
            "max_ms": round(late[-1], 2), "prepare_s": [round(x, 3) for x in prepare_s], "late_ms": late}


def run(n_bodies: int = BODIES) -> dict[str, Any]:
    """The three modes; returns ``{"idle": {...}, "piecewise": {...}, "whole": {...}, "target_met": bool}``."""
    import app.prepare as prepare
    from app.config import AppArgs
    from app.frontend import Renderer
    from app.serving import OpenAIServing

    with open(REPO / "serve_config.yaml", encoding="utf-8") as f:
        args = AppArgs.model_validate(yaml.safe_load(f)["applications"][0]["args"])
    os.chdir(REPO)  # the config's model path is relative to the repository
    print("ingress stall: building vLLM's renderer on the tiny model ...", flush=True)
    serving = OpenAIServing(args, engine=None, renderer=Renderer(args))  # type: ignore[arg-type]  # no engine asked
    bodies = [body(i) for i in range(n_bodies)]
    out: dict[str, Any] = {"bodies": n_bodies, "prompts": PROMPTS, "prompt_tokens": PROMPT_TOKENS,
                           "body_mib": round(len(bodies[0]) / 2**20, 2), "tick_s": TICK_S,
                           "target_p99_ms": TARGET_P99_MS,
                           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
    piecewise_bytes = prepare.PIECEWISE_BODY_BYTES
    try:
        for mode in ("idle", "piecewise", "whole"):
            prepare.PIECEWISE_BODY_BYTES = 2**62 if mode == "whole" else piecewise_bytes
            what = "the ticker alone" if mode == "idle" else f"{n_bodies} bodies of {out['body_mib']} MiB"
            print(f"ingress stall, {mode}: {what} ...", flush=True)
            r = out[mode] = asyncio.run(_measure(serving, None if mode == "idle" else bodies))
            took = r["prepare_s"]
            prep = f"; preparing a body took {min(took):.2f}-{max(took):.2f} s" if took else ""
            print(f"ingress stall, {mode}: {r['ticks']} ticks, stall p50 {r['p50_ms']:.1f} ms  p99 {r['p99_ms']:.1f} ms"
                  f"  max {r['max_ms']:.1f} ms{prep}", flush=True)
    finally:
        prepare.PIECEWISE_BODY_BYTES = piecewise_bytes
        serving.close()
    out["target_met"] = out["piecewise"]["p99_ms"] <= TARGET_P99_MS
    return out


def plot(result: dict[str, Any], path: str) -> None:
    """Stall CDF of the three modes (log x), the target marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, label in (("idle", "no body"), ("piecewise", "a prompt at a time (the ingress's way)"),
                        ("whole", "whole body in one call (before)")):
        ms = [max(x, 0.01) for x in result[mode]["late_ms"]]
        ax.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))],
                label=f"{label}: p99 {result[mode]['p99_ms']:.1f} ms, max {result[mode]['max_ms']:.1f} ms")
    ax.axvline(TARGET_P99_MS, color="grey", linestyle="--", linewidth=1, label=f"target p99 {TARGET_P99_MS:g} ms")
    ax.set_xscale("log")
    ax.set_xlabel(f"serving loop stall: lateness of a {TICK_S * 1e3:g} ms sleep (ms)")
    ax.set_ylabel("fraction of wake-ups")
    ax.set_title(f"The ingress's serving loop while it prepares {result['bodies']} completion bodies of "
                 f"{result['prompts']} x {result['prompt_tokens']:,} token ids ({result['body_mib']} MiB)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bodies", type=int, default=BODIES, help=f"bodies prepared per mode ({BODIES})")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON here (and the figure beside it)")
    args = ap.parse_args(argv)
    result = run(args.bodies)
    print(f"target piecewise p99 <= {TARGET_P99_MS:g} ms: {'met' if result['target_met'] else 'NOT met'}")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        plot(result, str(out.with_suffix(".png")))
        kept = {k: ({kk: vv for kk, vv in v.items() if kk != "late_ms"} if isinstance(v, dict) else v)
                for k, v in result.items()}
        out.write_text(json.dumps(kept, indent=2) + "\n")
        print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
