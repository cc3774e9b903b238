"""Bounded soak of the live app: ``python -m bench.soak`` (``make soak``).

Starts ``serve run serve_config.yaml`` (the default CPU config, loopback only)
unless ``--url`` points at a running app, then keeps ``--concurrency`` streamed
requests in flight for ``--duration-s`` seconds, mixing the four workload shapes
of ``locustfiles/shapes.py`` (shared system prompts, multi-turn chats, RAG
documents × questions, tenants with a ``cache_salt``). It prints a line every
30 s and, at the end:

* requests, errors (non-200 status or an error event in the stream), TTFT p50/p99;
* the router's index size against its cap (``max_indexed_blocks``) and memory;
* the router's decision time p99 in the first and in the last minute
  (``/debug/routing`` → ``decision_us_last_60s``), and whether it stayed within
  2× (stable).

Exits 1 if there was any error, the index exceeded its cap, or the routing
overhead was not stable. Everything is bounded: the load stops at the deadline,
every request has a timeout, and the app it started is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from app.config import AppArgs
from bench.stats import percentile
from locustfiles import shapes
from locustfiles.workloads import MultiTenant, SharedPrefix, make_rng, token_ids

REPO = Path(__file__).resolve().parent.parent


class Workloads:
    """Deterministic request bodies mixing the four shapes of ``locustfiles/shapes.py`` as token-id prompts.

    The ``CPU_TINY`` preset fits the default tiny model (ids in ``[10, 1000)``, prompt and output within its
    4,096-token context). Shared system prompts and tenants (with their ``cache_salt``) are Locust's requests
    (``locustfiles/workloads.py``); RAG and chat, text there, are token ids here: instruction + document +
    question, and sessions whose every turn adds a user message and an answer to the last prompt (the answer
    synthesized, as in the simulator).
    """

    SESSIONS = 12
    """Chat sessions in flight; each chat request continues one of them at random."""

    def __init__(self, seed: int, model: str, preset: shapes.Preset = shapes.CPU_TINY):
        self.rng = make_rng(seed, "soak")
        self.draws = shapes.PyDraws(self.rng)
        self.model = model
        self.shared = SharedPrefix(preset.shared_prefix, seed)
        self.tenants = MultiTenant(preset.multi_tenant, seed)
        self.rag, self.chat = preset.rag, preset.multi_turn
        self.docs = self.rag.prefixes(shapes.PyDraws(make_rng(seed, "soak", "rag")))
        instruction = token_ids(make_rng(seed, "soak", "instruction"), self.rag.instruction_len)
        self.documents = [instruction + token_ids(make_rng(seed, "soak", "doc", d), n)
                          for d, n in enumerate(self.docs.lengths)]
        lengths = self.chat.system_lengths(shapes.PyDraws(make_rng(seed, "soak", "chat")))
        self.systems = [token_ids(make_rng(seed, "soak", "system", i), n) for i, n in enumerate(lengths)]
        self.sessions: dict[int, tuple[list[int], int, int]] = {}  # slot -> (history, turns done, turns)

    def _rag(self) -> dict:
        drawn = self.rag.sample(self.draws, self.docs, 1)
        return {"prompt": self.documents[drawn.prefix[0]] + token_ids(self.rng, drawn.fresh[0]),
                "max_tokens": drawn.output_tokens[0]}

    def _chat(self) -> dict:
        slot = self.rng.randrange(self.SESSIONS)
        history, turn, turns = self.sessions.get(slot, ([], 0, 0))
        if turn == turns:  # the session is over (or never began): start another
            system, turns = self.chat.session(self.draws)
            history, turn = self.systems[system], 0
        user_len, max_tokens = self.chat.turn(self.draws, turn)
        prompt = history + token_ids(self.rng, user_len)
        self.sessions[slot] = (prompt + token_ids(self.rng, max_tokens), turn + 1, turns)
        return {"prompt": prompt, "max_tokens": max_tokens}

    def next_body(self) -> dict:
        kind = self.rng.randrange(4)
        if kind == 0:
            body = self.shared.sample(self.rng).body
        elif kind == 1:
            body = self._chat()
        elif kind == 2:
            body = self._rag()
        else:
            body = self.tenants.sample(self.rng).body
        return {"model": self.model, **body, "stream": True, "stream_options": {"include_usage": True}}


async def _one(client: httpx.AsyncClient, url: str, body: dict, headers: dict, out: dict) -> None:
    started = time.perf_counter()
    ttft = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120) as r:
            if r.status_code != 200:
                out["errors"].append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    out["errors"].append(f"error event: {obj['error']}")
                    return
                if ttft is None and obj.get("choices"):
                    ttft = time.perf_counter() - started
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out["errors"].append(repr(e))
        return
    out["requests"] += 1
    if ttft is not None:
        out["ttft"].append(ttft)


async def _routing(client: httpx.AsyncClient, url: str, headers: dict) -> dict:
    r = await client.get(f"{url}/debug/routing", headers=headers, timeout=30)
    routers = r.json()["routers"]
    return routers[0] if routers else {}


async def soak(url: str, duration_s: float, concurrency: int, seed: int, model: str, cap_blocks: int) -> int:
    key = os.environ.get("PREFIX_SERVE_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    work = Workloads(seed, model)
    out: dict = {"requests": 0, "errors": [], "ttft": []}
    deadline = time.monotonic() + duration_s
    started = time.monotonic()
    first_minute: dict = {}
    last_minute: dict = {}
    max_blocks = 0
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as client:

        async def worker():
            while time.monotonic() < deadline:
                await _one(client, url, work.next_body(), headers, out)

        async def monitor():
            nonlocal first_minute, last_minute, max_blocks
            next_report = started + 30
            while time.monotonic() < deadline:
                await asyncio.sleep(1)
                snap = await _routing(client, url, headers)
                max_blocks = max(max_blocks, snap.get("indexed_blocks", 0))
                elapsed = time.monotonic() - started
                if not first_minute and elapsed >= 60:
                    first_minute = snap.get("decision_us_last_60s", {})
                if elapsed >= duration_s - 2:
                    last_minute = snap.get("decision_us_last_60s", {})
                if time.monotonic() >= next_report:
                    next_report += 30
                    print(f"[{elapsed:5.0f} s] requests {out['requests']}  errors {len(out['errors'])}  "
                          f"indexed blocks {snap.get('indexed_blocks')}  "
                          f"routing p99 (60 s) {snap.get('decision_us_last_60s', {}).get('p99')} us", flush=True)

        await asyncio.gather(monitor(), *(worker() for _ in range(concurrency)))
        final = await _routing(client, url, headers)
    if not last_minute:
        last_minute = final.get("decision_us_last_60s", {})
    if not first_minute:
        first_minute = last_minute
    index_bytes = final.get("index_bytes", 0)
    stable = last_minute.get("p99", 0) <= 2 * max(first_minute.get("p99", 0), 50.0)
    within_cap = max_blocks <= cap_blocks
    print("\n=== soak summary ===")
    print(f"duration            {duration_s:.0f} s, {concurrency} concurrent streams, seed {seed}")
    print(f"requests            {out['requests']}  ({out['requests'] / duration_s:.1f}/s)")
    print(f"errors              {len(out['errors'])}")
    for e in out["errors"][:5]:
        print(f"   {e}")
    ttft = out["ttft"]
    print(f"TTFT                p50 {percentile(ttft, 50) * 1e3:.0f} ms   p99 {percentile(ttft, 99) * 1e3:.0f} ms")
    print(f"index               max {max_blocks} blocks (cap {cap_blocks}), {index_bytes / 1e6:.2f} MB now"
          f"  -> {'within cap' if within_cap else 'OVER CAP'}")
    print(f"routing overhead    first minute p99 {first_minute.get('p99')} us ({first_minute.get('count')} decisions), "
          f"last minute p99 {last_minute.get('p99')} us ({last_minute.get('count')} decisions)"
          f"  -> {'stable' if stable else 'NOT STABLE'}")
    events = final.get("events", {})
    # The router's event-path counters (RouterState.stats): errors by cause as errors_<cause>.
    event_errors = {k: v for k, v in events.items() if k.startswith("errors_") and v}
    print(f"KV events           {events.get('batches', 0)} batches, {events.get('snapshots', 0)} snapshots, "
          f"gaps {events.get('errors_gap', 0)}, decode errors {events.get('errors_decode', 0)}, "
          f"errors by cause {event_errors or 'none'}")
    ok = not out["errors"] and within_cap and stable and out["requests"] > 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def _start_app(config: Path, url: str, timeout_s: float = 900) -> subprocess.Popen:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([str(Path(sys.executable).with_name("serve")), "run", str(config)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    key = os.environ.get("PREFIX_SERVE_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", headers=headers, timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    _stop_app(proc)
    raise TimeoutError("the app did not become ready")


def _stop_app(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)  # serve run shuts Serve and its Ray down on Ctrl-C
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running app (default: start serve_config.yaml on 127.0.0.1:8000)")
    parser.add_argument("--config", type=Path, default=REPO / "serve_config.yaml")
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = yaml.safe_load(args.config.read_text())
    app_cfg = cfg["applications"][0]
    model = app_cfg["args"].get("served_model_name", AppArgs.model_fields["served_model_name"].default)
    from app.config import parse_app_args

    cap = parse_app_args(app_cfg.get("args")).router.max_indexed_blocks
    url = args.url or f"http://{cfg['http_options']['host']}:{cfg['http_options']['port']}"
    proc = None if args.url else _start_app(args.config, url)
    try:
        return asyncio.run(soak(url, args.duration_s, args.concurrency, args.seed, model, cap))
    finally:
        if proc is not None:
            _stop_app(proc)


if __name__ == "__main__":
    sys.exit(main())
