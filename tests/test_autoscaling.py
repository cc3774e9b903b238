"""Engine replicas that autoscale (``engine_replicas.autoscaling``), on real Ray, Serve and vLLM CPU engines.

One Serve app for the module: engines autoscale between 1 and 2 replicas at 2
requests in flight a replica, with delays of seconds; the module takes about 4
minutes on a busy 2-core machine, most of it loading two engines. The burst is a
bounded one: client threads with the real ``openai`` client, each streaming one
completion after another (unique prompts, so no prefix holds them to the first
replica), stopped as soon as the new replica has taken
traffic. Locust (``tests/test_locust_run.py``) would need a duration fixed up front,
and the engine's load time on a loaded 2-core machine (one to three minutes) is not
known: a fixed run is either cut before the new replica serves or idles past it.

The cases run in order: the burst scales up (the new replica followed by the router,
its KV events indexed, and named by routing decisions within seconds); after it, a
long stream is pinned on each replica by prefix affinity, Serve removes one replica
(whichever it picks: docs/configuration.md), and both streams end with ``[DONE]``.
The measured times are printed (``pytest -s``).

Re-warm (issue 35, ``app.ingress.warmup``): the app warms one configured prompt at start and a
prefix is made hot (hit twice) before the burst. The replica the burst adds is held
back until it has been sent both (its join's decision records precede every client
request routed to it), and the first request for the hot prefix that reaches it is a
hit. On the scale-down, the prompt only the removed replica held (the long stream's,
hit once) is warmed on the survivor, where the next request for it is a hit.

Run alone on a shared machine with ``PREFIX_SERVE_TEST_PORT`` set to a free port: the
module starts its own local Ray (``address="local"``), never one found on the machine.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from typing import Any

import httpx
import pytest

from tests.conftest import requests_by_status, start_app, stop_all

pytestmark = pytest.mark.engine

BLOCK = 32
PROMPT_TOKENS = 3 * BLOCK  # three blocks: a replica that served one holds (96 - 1) // 32 = 2 of them for a resend
BURST_USERS = 6  # 6 in flight against a target of 2 a replica: Serve wants 3, capped at max_replicas
# max_ongoing_requests, above the burst, so replicas seldom reject; a rejected try retried under the same id
# keeps its record (docs/router-state.md, "Retried sends").
ENGINE_CAP = 8
BURST_MAX_TOKENS = 48
LONG_MAX_TOKENS = 1500  # 8-30 s of decoding (idle to loaded machine): outlasts the downscale decision (~4-6 s)
SCALE_UP_TIMEOUT_S = 300.0
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 1,
               "downscale_delay_s": 2, "metrics_interval_s": 0.5, "look_back_period_s": 2}
RUNTIME_ADAPTER = "tiny-lora-rt"
STATE: dict[str, Any] = {}  # what the scale-up case leaves for the scale-down case
HOT_TOKENS = 5 * BLOCK  # the hot prefix: 5 blocks, hit twice before the burst
PROBES = 20  # requests for the hot prefix, at most, until one reaches the new replica


@pytest.fixture(scope="module")
def app():
    import ray

    # Our own local cluster, never one `ray start` left on the machine (start_app's ray.init then reuses it).
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    started = time.monotonic()
    try:
        running = start_app({"engine_replicas": {"num_replicas": None, "max_ongoing_requests": ENGINE_CAP,
                                                 "autoscaling": AUTOSCALING},
                             "lifecycle": {"request_timeout_s": 120},
                             "warmup": {"prompts": [{"name": "system", "prompt_token_ids": tokens(1, 4 * BLOCK)}]},
                             "serving": {"allow_runtime_lora_updating": True}})
    except BaseException:
        stop_all()
        raise
    print(f"\napp ready with 1 engine replica in {time.monotonic() - started:.1f} s")
    yield running
    stop_all()


def tokens(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def routing(app) -> dict[str, Any]:
    routers = httpx.get(f"{app.base_url}/debug/routing", timeout=30).json()["routers"]
    assert len(routers) == 1, routers  # one ingress replica, one router
    return routers[0]


def decision(app, response_id: str) -> dict[str, Any]:
    r = httpx.get(f"{app.base_url}/debug/routing/decisions/{response_id}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def routed_to(app, response_id: str) -> str:
    return decision(app, response_id)["replica_id"]


def rewarm_job(app, reason: str, uid: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """The re-warm job of ``reason`` for replica ``uid`` from ``/ready``, once it has ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        recent = httpx.get(f"{app.base_url}/ready", timeout=30).json()["rewarm"]["recent"]
        jobs = [j for j in recent if j["reason"] == reason and j["replica_id"] == uid]
        if jobs and jobs[-1]["state"] != "running":
            return jobs[-1]
        assert time.monotonic() < deadline, f"no {reason} job for {uid} ended: {recent}"
        time.sleep(0.5)


def complete(app, prompt: list[int]) -> tuple[str, int]:
    """One completion of ``prompt`` (``max_tokens`` 1): its response id and cached prompt tokens."""
    r = app.openai().completions.create(model=app.model, prompt=prompt, max_tokens=1)
    return r.id, r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0


def warm_counts(app) -> dict[tuple[str, str], float]:
    """``prefix_serve_warmup_requests_total`` by ``(reason, outcome)``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{app.base_url}/metrics", timeout=30).text
    return {(s.labels["reason"], s.labels["outcome"]): s.value
            for f in text_string_to_metric_families(text) if f.name == "prefix_serve_warmup_requests"
            for s in f.samples if s.name.endswith("_total")}


def engine_states() -> dict[str, int]:
    """Serve's count of engine replicas by state (``RUNNING``, ``STARTING``, ``STOPPING``, ...)."""
    from ray import serve

    dep = serve.status().applications["prefix-serve"].deployments["VLLMEngine"]
    return {str(k).rsplit(".", 1)[-1]: v for k, v in dep.replica_states.items() if v}


class Burst:
    """``BURST_USERS`` threads, each streaming one completion after another with the ``openai`` client
    until ``stop``; every request is recorded as ``(prompt seed, response id, status, when its first chunk came)``."""

    def __init__(self, app):
        self.app, self.stop, self.lock = app, threading.Event(), threading.Lock()
        self.done: list[tuple[int, str | None, int | str, float]] = []
        self.threads = [threading.Thread(target=self._user, args=(u,), daemon=True) for u in range(BURST_USERS)]

    def start(self) -> Burst:
        for t in self.threads:
            t.start()
        return self

    def _user(self, user: int) -> None:
        import openai

        client = self.app.openai()
        n = 0
        while not self.stop.is_set():
            seed, n = 10_000 * (user + 1) + n, n + 1
            first, rid, status = 0.0, None, 200
            try:
                for chunk in client.completions.create(
                        model=self.app.model, prompt=tokens(seed), max_tokens=BURST_MAX_TOKENS, stream=True,
                        extra_body={"ignore_eos": True}):
                    rid, first = chunk.id, first or time.monotonic()
            except openai.APIStatusError as e:
                status = e.status_code
            except openai.APIError as e:  # an error event in the stream, or the connection lost
                status = type(e).__name__
            with self.lock:
                self.done.append((seed, rid, status, first))

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in self.threads), "a burst request hung"


def test_a_burst_scales_engines_up_and_the_router_follows_the_new_replica(app):
    snap = routing(app)
    assert engine_states() == {"RUNNING": 1}, "min_replicas is 1 and nothing has run yet"
    old = set(snap["subscribed"])
    assert len(old) == 1 and snap["synced"] == sorted(old)
    # Issue 26: an adapter loaded at run time, before the scale-up, is loaded by the replica that starts later.
    from tests.conftest import REPO

    r = httpx.post(f"{app.base_url}/v1/load_lora_adapter", timeout=120,
                   json={"lora_name": RUNTIME_ADAPTER, "lora_path": str(REPO / "models" / "tiny-qwen2-lora")})
    assert r.status_code == 200 and r.text == f"Success: LoRA adapter '{RUNTIME_ADAPTER}' added successfully."
    hot = tokens(2, HOT_TOKENS)
    for i in range(3):  # the first computes the prefix, the next two hit it: the fleet's hottest prefix
        complete(app, hot + [7 + i] * 8)
    before = requests_by_status(httpx.get(f"{app.base_url}/metrics", timeout=30).text)

    burst = Burst(app).start()
    t0 = time.monotonic()
    t_running = t_followed = None
    new: str | None = None
    placed: dict[int, tuple[str, float]] = {}  # prompt seed -> (replica that served it, its first chunk's time)
    checked = 0
    try:
        while True:
            now = time.monotonic()
            assert now - t0 < SCALE_UP_TIMEOUT_S, (f"no second replica served within {SCALE_UP_TIMEOUT_S:g} s: "
                                                   f"{engine_states()}, {routing(app)['synced']}")
            if t_running is None and engine_states().get("RUNNING", 0) == 2:
                t_running = now
            if new is None:
                fresh = set(routing(app)["synced"]) - old
                if fresh:
                    (new,), t_followed = fresh, now
            with burst.lock:
                done = burst.done[checked:]
            checked += len(done)
            for seed, rid, status, first in done:
                if status == 200 and rid is not None:
                    placed[seed] = (routed_to(app, rid), first)
            if new is not None and sum(1 for r, _ in placed.values() if r == new) >= 3:
                break
            time.sleep(0.5)
        # Re-warm: the first request for the hot prefix that reaches the new replica is a hit (with the
        # burst still running, so the two replicas' loads decide where each probe goes).
        probes = []
        for i in range(PROBES):
            rid, cached = complete(app, hot + [500 + i] * 8)
            probes.append((rid, cached, decision(app, rid)))
            if probes[-1][2]["replica_id"] == new:
                break
    finally:
        burst.finish()
    t_end = time.monotonic()
    t_first = min(first for r, first in placed.values() if r == new)  # the new replica's first output

    by_status = Counter(status for _, _, status, _ in burst.done)
    print(f"\nburst: {len(burst.done)} streams by status {dict(by_status)}; second replica RUNNING after "
          f"{(t_running or t_end) - t0:.1f} s, synced by the router after {t_followed - t0:.1f} s, first "
          f"output from it {t_first - t0:.1f} s after the burst began "
          f"({t_first - t_followed:+.1f} s from its sync), burst stopped at {t_end - t0:.1f} s")
    assert by_status == {200: len(burst.done)}, by_status
    assert t_running is not None and engine_states() == {"RUNNING": 2}
    # The new replica served within seconds of the router following it (polls are ~1 s apart), its
    # join warm-up (two short prompts) first.
    assert t_first - t_followed <= 20.0, (t_first, t_followed)
    # It was held back until its warm-up had sent it the configured prompt and the hot prefix.
    job = rewarm_job(app, "join", new)
    warm = [decision(app, rid) for rid in job["request_ids"]]
    print(f"join warm-up of the new replica: {job['planned']} prompts of {[d['prompt_tokens'] for d in warm]} "
          f"tokens in {job['ended_at'] - job['started_at']:.2f} s")
    assert (job["state"], job["failed"]) == ("done", 0) and job["requests_done"] == job["planned"] >= 2, job
    # The configured prompt first, then the hottest prefix (2 hits x 160 tokens); then any other prefix a
    # client request hit (a client's own retry, say) within the budget.
    assert [d["prompt_tokens"] for d in warm[:2]] == [4 * BLOCK, HOT_TOKENS], warm
    assert {(d["replica_id"], d["reason"], d["warmup"]) for d in warm} == {(new, "warmup_join", "join")}
    assert job["ended_at"] >= max(d["routed_at"] for d in warm)
    # Every probe saw the new replica hold the hot prefix (its engine's KV events); the first that went
    # there was a hit in its engine.
    for _, _, d in probes:
        seen = d["matched_tokens"] if d["replica_id"] == new else d["best_alternative_matched_tokens"]
        assert seen == HOT_TOKENS, d
    assert probes[-1][2]["replica_id"] == new, f"none of {PROBES} hot-prefix probes reached the new replica"
    assert probes[-1][1] == HOT_TOKENS, probes[-1]
    # ... and follows it with events: the blocks of the prompts it served are indexed under it.
    served = sum(1 for r, _ in placed.values() if r == new)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and routing(app)["replica_blocks"].get(new, 0) < PROMPT_TOKENS // BLOCK:
        time.sleep(0.2)
    snap = routing(app)
    assert snap["replica_blocks"].get(new, 0) >= PROMPT_TOKENS // BLOCK, snap
    assert set(snap["synced"]) == old | {new}
    assert snap["replica_adapters"][new] == [RUNTIME_ADAPTER], snap["replica_adapters"]  # loaded as it warmed up
    after = requests_by_status(httpx.get(f"{app.base_url}/metrics", timeout=30).text)
    counted = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    assert counted == {("/v1/completions", "200"): len(burst.done) + len(probes)}, counted
    print(f"the new replica served {served} of {len(placed)} burst requests; {snap['replica_blocks'][new]} "
          f"of its blocks indexed")
    STATE.update(old=old.pop(), new=new, placed={seed: r for seed, (r, _) in placed.items()}, burst_end=t_end,
                 join=job, burst_ids=[rid for _, rid, _, _ in burst.done if rid is not None])


class LongStream(threading.Thread):
    """One streamed completion read line by line through the ``openai`` client's raw streaming response:
    HTTP status, response id, whether ``data: [DONE]`` came, the usage chunk, and when it ended."""

    def __init__(self, app, prompt: list[int]):
        super().__init__(daemon=True)
        self.app, self.prompt = app, prompt
        self.status, self.rid, self.done, self.usage, self.errors = 0, None, False, None, []
        self.ended: float | None = None

    def run(self) -> None:
        client = self.app.openai()
        try:
            with client.completions.with_streaming_response.create(
                    model=self.app.model, prompt=self.prompt, max_tokens=LONG_MAX_TOKENS, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True}) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        obj = json.loads(line[6:])
                        if "error" in obj:
                            self.errors.append(obj["error"])
                            continue
                        self.rid = obj["id"]
                        self.usage = obj.get("usage") or self.usage
        except Exception as e:  # noqa: BLE001 - kept for the assertion message
            self.errors.append(repr(e))
        self.ended = time.monotonic()


def test_after_the_burst_serve_removes_a_replica_and_its_stream_finishes(app):
    assert STATE, "runs after the scale-up case"
    old, new = STATE["old"], STATE["new"]
    # A long stream on each replica: resending the last burst prompt it served (the early ones may be evicted:
    # the burst stores more blocks than a replica's 2048), prefix affinity sends it back there.
    seeds = {uid: [s for s, r in STATE["placed"].items() if r == uid][-1] for uid in (old, new)}
    streams = {uid: LongStream(app, tokens(seed)) for uid, seed in seeds.items()}
    for s in streams.values():
        s.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(s.rid or s.ended for s in streams.values()):
        time.sleep(0.1)
    for uid, s in streams.items():
        assert s.rid is not None, s.errors
        assert routed_to(app, s.rid) == uid, "prefix affinity did not pin the stream to its prompt's holder"

    t_stopping = t_unfollowed = t_gone = None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and t_gone is None:
        now, states, snap = time.monotonic(), engine_states(), routing(app)
        if t_stopping is None and states.get("RUNNING", 0) == 1:
            t_stopping = now
        if t_unfollowed is None and len(snap["subscribed"]) == 1:
            t_unfollowed = now
        if states == {"RUNNING": 1}:
            t_gone = now
        time.sleep(0.5)
    assert t_stopping is not None and t_unfollowed is not None and t_gone is not None, (engine_states(), snap)
    (kept,) = routing(app)["subscribed"]
    removed = new if kept == old else old
    victim = streams[removed]
    victim.join(timeout=120)
    streams[kept].join(timeout=120)
    end = STATE["burst_end"]
    print(f"\nscale-down: Serve took a replica out {t_stopping - end:.1f} s after the burst ended (router "
          f"unfollowed it at {t_unfollowed - end:.1f} s), the replica was gone at {t_gone - end:.1f} s; removed "
          f"{'the newer' if removed == new else 'the older'} replica, whose stream ended at "
          f"{victim.ended - end:.1f} s; long streams by status {dict(Counter(s.status for s in streams.values()))}, "
          f"[DONE] in {sum(s.done for s in streams.values())} of {len(streams)}")
    for s in streams.values():
        assert not s.is_alive(), "a stream hung"
        assert s.status == 200 and s.done and not s.errors, (s.status, s.done, s.errors)
        assert s.usage["completion_tokens"] == LONG_MAX_TOKENS  # ran to max_tokens (ignore_eos), not cut short
    # The stream was in flight on the replica Serve removed, and the replica waited for it.
    assert victim.ended > t_stopping, "the stream ended before the scale-down: it proves nothing; raise LONG_MAX_TOKENS"
    assert t_gone >= victim.ended - 1.0  # polls are 0.5 s apart
    # The router dropped the removed replica's index entries with it.
    assert removed not in routing(app)["replica_blocks"]
    # Re-warm: the prompt only the removed replica held (hit once, by its long stream) was warmed on the
    # survivor as the removed one left; the next request for it is a hit there.
    job = rewarm_job(app, "leave", removed)
    assert job["state"] == "done" and job["failed"] == 0 and job["requests_done"] >= 1, job
    warm = [decision(app, rid) for rid in job["request_ids"]]
    assert {(d["replica_id"], d["warmup"]) for d in warm} == {(kept, "leave")}
    rid, cached = complete(app, tokens(seeds[removed]))
    assert routed_to(app, rid) == kept and cached == (PROMPT_TOKENS - 1) // BLOCK * BLOCK, cached
    counts = warm_counts(app)
    assert counts.get(("start", "ok"), 0) >= 1 and counts.get(("join", "ok"), 0) >= 2 \
        and counts.get(("leave", "ok"), 0) >= 1, counts


def test_the_joined_replica_took_no_client_request_before_its_warm_up_ended(app):
    """Checked last, from the decision records (reading ~600 of them takes longer than the replica
    would stay after the burst): every burst request routed to the replica the burst added was routed
    after its join warm-up ended (the router released it after that)."""
    assert STATE.get("join"), "runs after the scale-up case"
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        decisions = list(pool.map(lambda rid: decision(app, rid), STATE["burst_ids"]))
    to_new = [d["routed_at"] for d in decisions if d["replica_id"] == STATE["new"]]
    assert to_new, "no burst request reached the new replica"
    print(f"\n{len(to_new)} of {len(decisions)} burst requests went to the new replica, the first "
          f"{min(to_new) - STATE['join']['ended_at']:.2f} s after its join warm-up ended")
    assert min(to_new) > STATE["join"]["ended_at"]
