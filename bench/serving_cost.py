"""CPU cost of the serving path per request, by process, under a fixed streamed load.

With the app running on this machine (``make serve``)::

    python -m bench.serving_cost --url http://127.0.0.1:8000 --duration-s 30

sends ``--concurrency`` streams back to back for ``--duration-s`` seconds (token-id
completions: a shared 512-token prefix plus a distinct 40-token suffix, 8 output
tokens, ``ignore_eos``), then prints the requests served, TTFT and end-to-end
percentiles, and the CPU seconds (user + system, from ``/proc``) each kind of
process spent per request: the Serve proxy, the ingress replica, the engine
replicas' Serve processes, vLLM's engine cores and workers, and Ray's own.
Loopback only; Linux only (``/proc``). Absolute numbers drift with the machine:
compare two versions in alternating runs on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import httpx

from app.config import AppArgs
from bench.stats import percentile

KINDS = ("ProxyActor", "OpenAIIngress", "VLLMEngine", "VLLM::EngineCore", "VLLM::Worker", "ServeController",
         "raylet", "gcs_server")


def cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far by every process of each kind in ``KINDS`` (matched on its command line)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        for kind in KINDS:
            if kind in cmd:
                out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
                break
    return out


def prompt(i: int) -> list[int]:
    return [(7 * k + 3) % 900 + 10 for k in range(512)] + [(11 * i + 5 * k) % 900 + 10 for k in range(40)]


def one(client: httpx.Client, url: str, model: str, i: int) -> tuple[float, float]:
    """(TTFT, end-to-end) seconds of one streamed completion; TTFT at the first non-empty text."""
    body = {"model": model, "prompt": prompt(i), "max_tokens": 8, "stream": True, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft = None
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: {") and json.loads(line[6:]).get("choices", [{}])[0].get("text"):
                ttft = time.perf_counter() - t0
    e2e = time.perf_counter() - t0
    return (ttft if ttft is not None else e2e), e2e


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=AppArgs.model_fields["served_model_name"].default,
                    help="served model name (default: the app's default)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0, help="offsets the suffixes, so runs do not reuse each other's cache")
    args = ap.parse_args(argv)

    with httpx.Client() as c:  # warm-up, not counted
        for i in range(4):
            one(c, args.url, args.model, 10_000_000 + i)
    results: list[tuple[float, float]] = []
    end = time.monotonic() + args.duration_s

    def worker(k: int) -> None:
        with httpx.Client() as c:
            i = 0
            while time.monotonic() < end:
                results.append(one(c, args.url, args.model, args.seed * 1_000_000 + k * 10_000 + i))
                i += 1

    print(f"{args.concurrency} streams for {args.duration_s:.0f} s against {args.url} ...", flush=True)
    before = cpu_seconds()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = cpu_seconds()
    n = len(results)
    out = {
        "requests": n, "duration_s": args.duration_s, "concurrency": args.concurrency,
        "ttft_ms": {q: round(percentile([r[0] for r in results], p) * 1e3, 1) for q, p in (("p50", 50), ("p90", 90))},
        "e2e_ms": {q: round(percentile([r[1] for r in results], p) * 1e3, 1) for q, p in (("p50", 50), ("p90", 90))},
        "cpu_ms_per_request": {k: round((after[k] - before.get(k, 0.0)) * 1e3 / max(n, 1), 1) for k in after},
    }
    out["cpu_ms_per_request_total"] = round(sum(out["cpu_ms_per_request"].values()), 1)
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
