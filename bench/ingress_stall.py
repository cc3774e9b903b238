"""How long the ingress's serving loop stalls while it prepares large request bodies.

The ingress prepares a request (parse, validate, render, tokenize: ``app.ingress.prepare``) on a
worker loop of its own thread when the body is over 64 KiB (``app.ingress.offload``), so its
serving loop keeps answering other streams. A thread helps only between calls that hold
the GIL: ``json.loads`` of a 4 MiB body and pydantic's validation of it are one call each,
which held the serving loop 135-607 ms for a list of 256 prompts of 3,800 token ids
(issue 38, fault 5). Large bodies are now decoded a piece at a time (``app.ingress.json_body``),
token-id prompt lists validated a prompt at a time (``app.ingress.prepare.token_prompts_request``),
and fields too large to validate in one short call refused by count (``check_size``).

This benchmark runs the ingress's own preparation (``OpenAIServing._prepare``: the worker
loop, vLLM's renderer on the tiny model of ``serve_config.yaml``; no engine is asked) and,
on the serving loop, a ticker that sleeps ``TICK_S`` and records how late each wake-up is:
the stall another stream's next token would see. Four body shapes (``SHAPES``), each
within the 4 MiB body limit, ``BODIES`` of each one after another, in three modes in one run:

* ``idle``: the ticker alone;
* ``pieces``: the ingress's way;
* ``whole``: the same bodies with the piecewise paths and the field bound off (the path before).

Target: ``pieces`` p99 stall <= 40 ms for every shape (``TARGET_P99_MS``, the stall
``docs/reliability.md`` treats as worth refusing for). Run: ``python -m bench.ingress_stall
[--json OUT]`` (``make bench`` runs it, about a minute; OUT's ``.png`` is the stall CDF of each
shape). Needs the tiny model (``make model``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench.stats import percentile

TICK_S = 0.002
BODIES = 3
IDLE_S = 1.0
TARGET_P99_MS = 40.0
REPO = Path(__file__).resolve().parent.parent
MODEL = "tiny-qwen2"


def token_prompts(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """256 completion prompts of 3,800 ids (100-999, inside the tiny model's vocabulary): 3.7 MiB."""
    return "completions", {"model": MODEL, "max_tokens": 1,
                           "prompt": [[rng.randrange(100, 1000) for _ in range(3800)] for _ in range(256)]}


def string_ids(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """256 completion prompts of 2,900 ids written as JSON strings (``"512"``), which vLLM's model
    coerces to ints: 3.7 MiB."""
    return "completions", {"model": MODEL, "max_tokens": 1,
                           "prompt": [[str(rng.randrange(100, 1000)) for _ in range(2900)] for _ in range(256)]}


def logit_bias(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A completion with 300,000 ``logit_bias`` entries: 3.8 MiB."""
    return "completions", {"model": MODEL, "max_tokens": 1, "prompt": "hi",
                           "logit_bias": {str(i): round(rng.uniform(-1, 1), 2) for i in range(300_000)}}


def chat_messages(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A chat of 130,000 one-word messages: 3.7 MiB (refused by count before and after; decoded first)."""
    return "chat", {"model": MODEL, "max_tokens": 1,
                    "messages": [{"role": "user", "content": rng.choice("abc")} for _ in range(130_000)]}


SHAPES: dict[str, Callable[[random.Random], tuple[str, dict[str, Any]]]] = {
    "token_prompts": token_prompts, "string_ids": string_ids, "logit_bias": logit_bias,
    "chat_messages": chat_messages}
"""Each shape's (kind, body); what the ingress answers is recorded, not assumed."""


async def _measure(serving: Any, bodies: list[tuple[str, bytes]] | None) -> dict[str, Any]:
    """Ticker lateness (ms) while ``bodies`` are prepared one after another (or ``IDLE_S`` alone)."""
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
    answers: list[str] = []
    if bodies is None:
        await asyncio.sleep(IDLE_S)
    else:
        for kind, raw in bodies:
            t0 = time.perf_counter()
            prepared = await serving._prepare(kind, raw, False)
            prepare_s.append(time.perf_counter() - t0)
            answers.append("accepted" if isinstance(prepared, EngineRequest) else
                           f"{prepared.status} {prepared.body().get('error', {}).get('param')}")
    done.set()
    await ticker
    late.sort()
    return {"ticks": len(late), "p50_ms": round(percentile(late, 50), 2), "p99_ms": round(percentile(late, 99), 2),
            "max_ms": round(late[-1], 2), "prepare_s": [round(x, 3) for x in prepare_s],
            "answers": sorted(set(answers)), "late_ms": late}


def run(n_bodies: int = BODIES) -> dict[str, Any]:
    """Every shape in the three modes; returns ``{"idle": {...}, "pieces": {shape: {...}}, "whole": {...},
    "target_met": bool}``."""
    import app.ingress.prepare as prepare
    from app.config import AppArgs
    from app.frontend import Renderer
    from app.ingress.serving import OpenAIServing

    with open(REPO / "serve_config.yaml", encoding="utf-8") as f:
        args = AppArgs.model_validate(yaml.safe_load(f)["applications"][0]["args"])
    os.chdir(REPO)  # the config's model path is relative to the repository
    print("ingress stall: building vLLM's renderer on the tiny model ...", flush=True)
    serving = OpenAIServing(args, engine=None, renderer=Renderer(args))  # type: ignore[arg-type]  # no engine asked
    rng = random.Random(0)
    bodies: dict[str, list[tuple[str, bytes]]] = {}
    for name, make in SHAPES.items():
        bodies[name] = []
        for _ in range(n_bodies):
            kind, body = make(rng)
            bodies[name].append((kind, json.dumps(body, separators=(",", ":")).encode()))
    out: dict[str, Any] = {"bodies_per_shape": n_bodies, "tick_s": TICK_S, "target_p99_ms": TARGET_P99_MS,
                           "body_mib": {n: round(len(b[0][1]) / 2**20, 2) for n, b in bodies.items()},
                           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
    print("ingress stall: one body of each shape first, unmeasured (imports and caches of first use) ...", flush=True)
    asyncio.run(_measure(serving, [shaped[0] for shaped in bodies.values()]))
    print("ingress stall, idle: the ticker alone ...", flush=True)
    out["idle"] = asyncio.run(_measure(serving, None))
    _print("idle", "", out["idle"])
    saved = (prepare.PIECEWISE_BODY_BYTES, prepare.PIECEWISE_PROMPT_IDS, prepare.MAX_FIELD_ITEMS)
    try:
        for mode in ("pieces", "whole"):
            off = 2**62 if mode == "whole" else None
            prepare.PIECEWISE_BODY_BYTES, prepare.PIECEWISE_PROMPT_IDS, prepare.MAX_FIELD_ITEMS = (
                (off, off, off) if off else saved)
            out[mode] = {}
            for name, shaped in bodies.items():
                size = out["body_mib"][name]
                print(f"ingress stall, {mode}, {name}: {n_bodies} bodies of {size} MiB ...", flush=True)
                out[mode][name] = asyncio.run(_measure(serving, shaped))
                _print(mode, name, out[mode][name])
    finally:
        prepare.PIECEWISE_BODY_BYTES, prepare.PIECEWISE_PROMPT_IDS, prepare.MAX_FIELD_ITEMS = saved
        serving.close()
    out["target_met"] = all(r["p99_ms"] <= TARGET_P99_MS for r in out["pieces"].values())
    return out


def _print(mode: str, name: str, r: dict[str, Any]) -> None:
    took = r["prepare_s"]
    prep = f"; a body prepared in {min(took):.2f}-{max(took):.2f} s, answered {', '.join(r['answers'])}" if took else ""
    print(f"ingress stall, {mode}{', ' + name if name else ''}: {r['ticks']} ticks, stall p50 {r['p50_ms']:.1f} ms"
          f"  p99 {r['p99_ms']:.1f} ms  max {r['max_ms']:.1f} ms{prep}", flush=True)


def plot(result: dict[str, Any], path: str) -> None:
    """Stall CDF per shape (log x): idle, the ingress's way and whole; the target marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(result["pieces"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), sharey=True)
    for ax, name in zip(axes, shapes, strict=True):
        for label, r in (("no body", result["idle"]), ("a piece at a time (now)", result["pieces"][name]),
                         ("whole body (before)", result["whole"][name])):
            ms = [max(x, 0.01) for x in r["late_ms"]]
            answered = f", {'/'.join(r['answers'])}" if r.get("answers") else ""
            ax.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))],
                    label=f"{label}: p99 {r['p99_ms']:.1f}, max {r['max_ms']:.1f} ms{answered}")
        ax.axvline(TARGET_P99_MS, color="grey", linestyle="--", linewidth=1, label=f"target p99 {TARGET_P99_MS:g} ms")
        ax.set_xscale("log")
        ax.set_xlabel(f"serving-loop stall: lateness of a {TICK_S * 1e3:g} ms sleep (ms)")
        ax.set_title(f"{name} ({result['body_mib'][name]} MiB)", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("fraction of wake-ups")
    fig.suptitle(f"The ingress's serving loop while it prepares {result['bodies_per_shape']} large bodies of each "
                 "shape, one after another", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bodies", type=int, default=BODIES, help=f"bodies of each shape per mode ({BODIES})")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON here (and the figure beside it)")
    args = ap.parse_args(argv)
    result = run(args.bodies)
    print(f"target: a piece at a time, p99 <= {TARGET_P99_MS:g} ms for every shape: "
          f"{'met' if result['target_met'] else 'NOT met'}")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        plot(result, str(out.with_suffix(".png")))

        def kept(r: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in r.items() if k != "late_ms"}

        summary = {k: (kept(v) if k == "idle" else {n: kept(r) for n, r in v.items()} if k in ("pieces", "whole")
                       else v) for k, v in result.items()}
        out.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
