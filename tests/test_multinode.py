"""The app on a multi-node Ray cluster on one machine, and the loss of a node under load.

Ray's own ``ray.cluster_utils.Cluster`` runs a head and worker nodes as separate
raylets, each on its own loopback address (head 127.0.0.2, worker A 127.0.0.3, B
127.0.0.4, and later C 127.0.0.5), so an address bound on one node is not the one of
another. Custom node resources place the replicas (``engine_replicas.resources``,
``ingress_replicas.resources``): two engines share node A, one runs on B; one
ingress runs on the head and one on B. The application sets ``VLLM_HOST_IP=127.0.0.1``
for the whole cluster in its ``runtime_env`` (the mistake of issue 25): every replica
must ignore it and bind and announce its own node's address.

The module checks, in order: each replica's announced relay and metrics addresses
are its own node's and scrapeable; each of the two routers follows every engine on
every node (events indexed, prefix hits on every engine from either router); then
node A is removed under load (``Cluster.remove_node``, processes killed) while
streams and unary requests run: streams on A end with a 503 error event and
``[DONE]``, unary requests are resent (200) or get a clear 503, every failure is
counted by status in the ingresses' own metrics, the dead replicas leave every
router, and Serve's replacements on node C (added before the loss, with room for two
engines) are followed and get prefix hits.

HAProxy (one, on the head: ``proxy_location: HeadOnly``, since proxies on every node
would share one port here) forwards each request to an ingress replica's own HTTP
server at its node's address, so the app binds ``0.0.0.0`` (traffic still goes to
loopback addresses only). Serve's Python proxy, HAProxy's fallback, would send every
request to the head's own ingress (Serve prefers a proxy's local node), so the test
turns that preference off (``RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING=0``).
The cluster keeps its files under its own ``RAY_TMPDIR``, so its address file never
points another Ray user of this machine at it; its GCS is on ``GCS_PORT``, its proxy
on ``HTTP_PORT``.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import RunningApp, deep_update, default_config, requests_by_status
from tests.test_router_cluster import Stream

pytestmark = pytest.mark.engine

HTTP_PORT = 18600
GCS_PORT = 26379
BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"
HEAD, NODE_A, NODE_B, NODE_C = "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"
BLOCK = 32
CLUSTER_WIDE_HOST_IP = "127.0.0.1"  # set for every replica in the runtime_env: reachable from no other node
ARGS = {
    "engine_replicas": {"num_replicas": 3, "num_cpus": 0.5, "max_ongoing_requests": 32,
                        "resources": {"engine_slot": 1}},
    "ingress_replicas": {"num_replicas": 2, "num_cpus": 0.25, "resources": {"ingress_slot": 1}},
    "lifecycle": {"request_timeout_s": 120},
}
NODE_SYSTEM_CONFIG = {"health_check_period_ms": 1000, "health_check_failure_threshold": 5}
"""A dead raylet is declared dead after about 5 s (Ray's default: 3 s x 5)."""


class Multi:
    """The running cluster: its nodes by address and the app."""

    def __init__(self, cluster: Any, nodes: dict[str, Any], app: RunningApp, tmp: str):
        self.cluster, self.nodes, self.app, self.tmp = cluster, nodes, app, tmp

    def add_spare_node(self) -> None:
        """Start node C with room for two engines (Serve's replacements land there). Ray adds
        nodes from the main thread only (it sets signal handlers), so this blocks a few seconds."""
        self.nodes[NODE_C] = self.cluster.add_node(node_ip_address=NODE_C, num_cpus=2, resources={"engine_slot": 2})


@pytest.fixture(scope="module")
def mn():
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    started = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="psmn", dir="/tmp")  # short: Ray's socket paths live under it
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING")}
    os.environ["RAY_TMPDIR"] = tmp  # the cluster's address file too: no `ray.init()` here joins it by accident
    os.environ["RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"] = "0"
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            node_ip_address=HEAD, gcs_server_port=GCS_PORT, include_dashboard=False,
            dashboard_agent_listen_port=None, num_cpus=2, resources={"ingress_slot": 1},
            _system_config=NODE_SYSTEM_CONFIG))
        nodes = {HEAD: cluster.head_node,
                 NODE_A: cluster.add_node(node_ip_address=NODE_A, num_cpus=2, resources={"engine_slot": 2}),
                 NODE_B: cluster.add_node(node_ip_address=NODE_B, num_cpus=2,
                                          resources={"engine_slot": 1, "ingress_slot": 1})}
        ray.init(address=cluster.address, _node_ip_address=HEAD, log_to_driver=False)
        print(f"cluster of 3 nodes up in {time.monotonic() - started:.0f} s")
        app = deploy()
        multi = Multi(cluster, nodes, app, tmp)
        wait_followed(3, timeout_s=420)
        print(f"app ready, both routers following 3 engines, {time.monotonic() - started:.0f} s in")
        yield multi
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"test_multinode wall time {time.monotonic() - started:.0f} s")


def deploy() -> RunningApp:
    """Submit the repo's config with ``ARGS`` to this cluster's Serve (proxy on ``HTTP_PORT``)."""
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    entry = default_config()
    entry["args"] = deep_update(entry["args"], ARGS)
    entry["runtime_env"] = {"env_vars": {"VLLM_HOST_IP": CLUSTER_WIDE_HOST_IP}}
    # HAProxy (infra.ray_env) forwards to each ingress replica's own HTTP server at its node's address
    # (127.0.0.x here), and a replica binds http_options.host: loopback alone would refuse node B's.
    http = {"host": "0.0.0.0", "port": HTTP_PORT}
    config = ServeDeploySchema.model_validate({"proxy_location": "HeadOnly", "http_options": http,
                                               "applications": [entry]})
    serve_api.serve_start(http_options=http, proxy_location="HeadOnly").deploy_apps(config, _blocking=False)
    app = RunningApp(entry["name"], entry["args"], entry)
    app.base_url = BASE_URL
    return app


# ------------------------------------------------------------------ helpers


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def complete(prompt: list[int], max_tokens: int = 1) -> dict:
    r = httpx.post(f"{BASE_URL}/v1/completions", timeout=120,
                   json={"model": "tiny-qwen2", "prompt": prompt, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()


def router_snapshots(want: int = 2, tries: int = 60) -> dict[str, dict]:
    """``/debug/routing`` of each ingress replica's router, by ingress replica id (the proxy
    picks an ingress per request: asked until ``want`` distinct routers answered)."""
    seen: dict[str, dict] = {}
    for _ in range(tries):
        try:
            r = httpx.get(f"{BASE_URL}/debug/routing", timeout=30)
        except httpx.HTTPError:
            continue
        if r.status_code == 200:
            for snap in r.json()["routers"]:
                seen[snap["router_replica_id"]] = snap
        if len(seen) >= want:
            break
    return seen


def find_decision(request_id: str, timeout_s: float = 30.0) -> dict:
    """The routing decision of ``request_id`` from whichever ingress's router made it, asked of each
    ingress replica in its own process: through the proxy, which prefers the ingress on its own node,
    every ask can reach the same one."""
    import ray

    def decisions_here(_replica, rid):  # runs in the ingress replica (pickled by value: a closure)
        from app import metrics

        return [d for r in list(metrics.ROUTERS) for d in r.ask_blocking(lambda r=r: r.decisions_for(rid))]

    deadline = time.monotonic() + timeout_s
    while True:
        for a in ray.util.list_named_actors(all_namespaces=True):
            if "#OpenAIIngress#" not in a["name"]:
                continue
            try:
                actor = ray.get_actor(a["name"], namespace=a["namespace"])
                found = ray.get(actor.__ray_call__.remote(decisions_here, request_id), timeout=15)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ValueError):
                continue  # gone or going
            if found:
                return found[-1]
        if time.monotonic() > deadline:
            raise AssertionError(f"no ingress replica knows {request_id}")
        time.sleep(0.5)


def wait_followed(engines: int, timeout_s: float, exclude: frozenset[str] = frozenset()) -> dict[str, dict]:
    """Wait until two routers each follow and have synced ``engines`` engine replicas (none of
    ``exclude``); returns their snapshots. ``/ready`` is asked too: it makes each ingress's router."""
    deadline = time.monotonic() + timeout_s
    snaps: dict[str, dict] = {}
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{BASE_URL}/ready", timeout=10)
        except httpx.HTTPError:
            pass
        snaps = router_snapshots(tries=8)
        if len(snaps) == 2 and all(len(s["subscribed"]) == engines and not exclude & set(s["subscribed"])
                                   and sorted(s["synced"]) == sorted(s["subscribed"]) for s in snaps.values()):
            return snaps
        time.sleep(1)
    raise AssertionError(f"two routers did not follow {engines} engines within {timeout_s:g} s: "
                         f"{ {k: (s['subscribed'], s['synced']) for k, s in snaps.items()} }")


def replica_nodes(deployment: str) -> dict[str, str]:
    """Replica id -> node address of every live replica of ``deployment``, asked of each actor."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if f"#{deployment}#" not in a["name"]:
            continue
        try:
            actor = ray.get_actor(a["name"], namespace=a["namespace"])
            out[a["name"].rsplit("#", 1)[-1]] = ray.get(
                actor.__ray_call__.remote(lambda _self: ray.util.get_node_ip_address()), timeout=15)
        except (RayActorError, GetTimeoutError, ValueError):
            pass  # gone or going
    return out


def sd_targets(path: str) -> dict[str, str]:
    """``/metrics/engines`` or ``/metrics/ingresses``: replica id -> ``host:port``."""
    r = httpx.get(f"{BASE_URL}{path}", timeout=30)
    assert r.status_code == 200, r.text
    return {e["labels"]["replica"]: e["targets"][0] for e in r.json()}


def ingress_requests() -> Counter[tuple[str, str]]:
    """``prefix_serve_requests_total`` by (route, status), summed over every ingress's own endpoint."""
    total: Counter[tuple[str, str]] = Counter()
    for hostport in sd_targets("/metrics/ingresses").values():
        total.update(requests_by_status(httpx.get(f"http://{hostport}/metrics", timeout=30).text))
    return total


STREAM_TOKENS = 1200  # outlasts the setup before the node goes (at 160, a stream on it once ended first)
WARM: dict[str, list[int]] = {}  # engine replica id -> a 512-token prompt it computed (test 2)


# ------------------------------------------------------------------ tests


def test_each_replica_binds_and_announces_its_own_node_address(mn):
    """Two engines on node A, one on B, ingresses on the head and B; each replica's relay
    and metrics endpoints are on its own node's address (never the cluster-wide
    ``VLLM_HOST_IP=127.0.0.1``), distinct, and every metrics target answers a scrape."""
    engines = replica_nodes("VLLMEngine")
    ingresses = replica_nodes("OpenAIIngress")
    assert sorted(Counter(engines.values()).items()) == [(NODE_A, 2), (NODE_B, 1)], engines
    assert sorted(ingresses.values()) == [HEAD, NODE_B], ingresses
    for router, snap in router_snapshots().items():
        assert set(snap["subscribed"]) == set(engines), (router, snap["subscribed"])
        for uid, endpoint in snap["subscribed"].items():  # tcp://host:port of the engine's relay
            assert endpoint.rsplit(":", 1)[0] == f"tcp://{engines[uid]}", (router, uid, endpoint)
    for path, where, series in (("/metrics/engines", engines, "vllm:num_requests_running"),
                                ("/metrics/ingresses", ingresses, "prefix_serve_requests_total")):
        targets = sd_targets(path)
        assert set(targets) == set(where), (path, targets, where)
        assert len(set(targets.values())) == len(targets), targets
        for uid, hostport in targets.items():
            assert hostport.rsplit(":", 1)[0] == where[uid] != CLUSTER_WIDE_HOST_IP, (path, uid, hostport)
            scrape = httpx.get(f"http://{hostport}/metrics", timeout=30)
            assert scrape.status_code == 200 and series in scrape.text, (hostport, scrape.status_code)
    # Each replica said which value it ignored (its Serve log file: with Ray's throughput settings replicas log
    # to files only, infra.ray_env; or worker stderr without them; every node's logs are under one session).
    session = Path(mn.tmp).glob("ray/session_*/logs")
    logs = "".join(p.read_text(errors="replace") for d in session
                   for p in [*d.glob("worker-*.err"), *d.glob("serve/replica_*.log")])
    assert logs.count(f"VLLM_HOST_IP={CLUSTER_WIDE_HOST_IP!r} is not this node's address") >= 5


def test_every_router_follows_every_engine_on_every_node(mn):
    """Both routers index the blocks of every engine on every node and send a warm prefix
    to its holder: each of the 3 engines serves prefix hits routed by each of the 2 routers."""
    engines = replica_nodes("VLLMEngine")
    for i in range(40):  # an idle cluster spreads new prefixes by load: until every engine holds one
        prompt = tokens(100 + i, 512)
        holder = find_decision(complete(prompt)["id"])["replica_id"]
        WARM.setdefault(holder, prompt)
        if set(WARM) == set(engines):
            break
    assert set(WARM) == set(engines), f"prefixes landed on {set(WARM)} only"
    deadline = time.monotonic() + 15
    while True:  # both routers have every engine's blocks (its events arrived from its node)
        snaps = router_snapshots()
        blocks = {r: {uid: s["replica_blocks"].get(uid, 0) for uid in engines} for r, s in snaps.items()}
        if len(snaps) == 2 and all(n >= 512 // BLOCK for b in blocks.values() for n in b.values()):
            break
        assert time.monotonic() < deadline, blocks
        time.sleep(0.25)
    full = (512 - 1) // BLOCK * BLOCK  # hits stop one token short of the prompt
    pairs = set()
    for holder, prompt in WARM.items():
        for _ in range(16):  # until both routers routed this prefix (the proxy picks the ingress)
            out = complete(prompt)
            d = find_decision(out["id"])
            assert d["replica_id"] == holder, (d, holder)
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == full, out["usage"]
            pairs.add((d["router_replica_id"], holder))
            if len({r for r, h in pairs if h == holder}) == 2:
                break
    assert len(pairs) == 2 * 3, f"(router, engine) pairs with hits: {sorted(pairs)}"


class Unary(threading.Thread):
    """Unary completions with the real ``openai`` client, one after another until ``stop``; records
    each answer's status (200, or the error's) and message."""

    def __init__(self, seed: int, stop: threading.Event):
        super().__init__(daemon=True)
        self.seed, self.stop = seed, stop
        self.results: list[tuple[int | str, str]] = []

    def run(self) -> None:
        import openai

        client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="unused", timeout=90, max_retries=0)
        i = 0
        while not self.stop.is_set():
            i += 1
            try:
                client.completions.create(model="tiny-qwen2", prompt=tokens(self.seed * 1000 + i, 96),
                                          max_tokens=24)
                self.results.append((200, ""))
            except openai.APIStatusError as e:
                self.results.append((e.status_code, str(e.message)))
            except Exception as e:  # noqa: BLE001 - a timeout or a cut connection: counted, then asserted
                self.results.append((type(e).__name__, str(e)))


def test_node_loss_under_load(mn):
    """Node A (two engines) is removed while streams and unary requests run."""
    from ray import serve

    assert WARM, "runs after the routing test, which warms a prefix on every engine"
    started = time.monotonic()
    mn.add_spare_node()
    print(f"node C added in {time.monotonic() - started:.0f} s")
    engines = replica_nodes("VLLMEngine")
    lost = {uid for uid, ip in engines.items() if ip == NODE_A}
    assert len(lost) == 2
    before = ingress_requests()

    # Two streams on each engine (a warm prefix brings each to its holder), unary requests beside.
    app = mn.app
    streams = [Stream(app, WARM[uid] + tokens(7000 + 10 * j + k, 40), max_tokens=STREAM_TOKENS)
               for j, uid in enumerate(sorted(engines)) for k in range(2)]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(s.chunks >= 2 or s.done for s in streams):
        time.sleep(0.1)
    assert all(s.chunks >= 2 for s in streams), [(s.chunks, s.error) for s in streams]
    placement = {s.request_id: find_decision(s.request_id)["replica_id"] for s in streams}
    cut = [s for s in streams if placement[s.request_id] in lost]
    assert cut and len(cut) < len(streams), placement
    stop = threading.Event()
    assert not any(s.done for s in cut), "a stream on node A ended before the loss: STREAM_TOKENS too few"
    unary = [Unary(seed, stop) for seed in range(3)]
    for u in unary:
        u.start()
    time.sleep(1.0)
    removed_at = time.monotonic()
    mn.cluster.remove_node(mn.nodes.pop(NODE_A), allow_graceful=False)
    print(f"node A removed in {time.monotonic() - removed_at:.1f} s")

    # 1. The dead replicas leave every router (polled while the streams run).
    while True:
        snaps = router_snapshots()
        held = {r: lost & (set(s["replica_blocks"]) | set(s["subscribed"])) for r, s in snaps.items()}
        if len(snaps) == 2 and not any(held.values()):
            break
        assert time.monotonic() - removed_at < 45, f"lost replicas still followed: {held}"
        time.sleep(0.5)
    gone_after = time.monotonic() - removed_at

    # 2. Every stream ends, none hangs: those on A with the 503 error event then [DONE].
    for s in streams:
        s.join(timeout=max(1.0, 240 - (time.monotonic() - removed_at)))
        assert not s.is_alive(), "a stream hung after its node was lost"
        assert s.done, s.error  # [DONE] came
        if s in cut:
            assert s.error is not None and s.error.get("code") == 503, s.error
        else:
            assert s.error is None and s.usage["completion_tokens"] == STREAM_TOKENS, (s.error, s.usage)
    cut_end = max(s.ended_at for s in cut) - removed_at

    # 3. Unary requests ran on for a while after the loss: each got 200 (resent) or a clear 503.
    time.sleep(max(0.0, 10 - (time.monotonic() - removed_at)))
    stop.set()
    for u in unary:
        u.join(timeout=100)
        assert not u.is_alive(), "a unary request hung"
    answers = [r for u in unary for r in u.results]
    statuses = Counter(status for status, _ in answers)
    assert set(statuses) <= {200, 503}, statuses
    assert all("engine error" in msg for status, msg in answers if status == 503), answers
    assert statuses[200] >= 3, statuses

    # 4. Every answer is counted by its status in the ingresses' own metrics (both replicas).
    after = ingress_requests()
    route = "/v1/completions"
    assert after[(route, "503")] - before[(route, "503")] == len(cut) + statuses[503], (after, before, statuses)
    assert after[(route, "200")] - before[(route, "200")] == len(streams) - len(cut) + statuses[200]
    assert not any(s not in ("200", "503") and after[(r, s)] != before[(r, s)] for r, s in after), after
    resent = sum(p.read_text(errors="replace").count("engine replica lost before the answer started")
                 for p in Path(mn.tmp).glob("ray/session_*/logs/worker-*.err"))
    print(f"streams cut on A: {len(cut)} of {len(streams)}, ended {cut_end:.1f} s after the loss; lost replicas "
          f"left both routers after {gone_after:.1f} s; unary answers {dict(statuses)}, {resent} attempt(s) resent")

    # 5. Serve's replacements start on node C, and both routers follow them and route hits to them.
    snaps = wait_followed(3, timeout_s=300, exclude=frozenset(lost))
    replaced_after = time.monotonic() - removed_at
    now = replica_nodes("VLLMEngine")
    new = {uid for uid, ip in now.items() if ip == NODE_C}
    assert len(new) == 2 and set(now) - new == set(engines) - lost, now
    for snap in snaps.values():
        for uid in new:
            assert snap["subscribed"][uid].rsplit(":", 1)[0] == f"tcp://{NODE_C}", snap["subscribed"]
    targets = sd_targets("/metrics/engines")
    assert set(targets) == set(now) and all(targets[uid].rsplit(":", 1)[0] == NODE_C for uid in new), targets
    fresh: dict[str, list[int]] = {}
    for i in range(40):
        prompt = tokens(9000 + i, 320)
        holder = find_decision(complete(prompt)["id"])["replica_id"]
        if holder in new:
            fresh.setdefault(holder, prompt)
        if set(fresh) == new:
            break
    assert set(fresh) == new, f"no request reached {new - set(fresh)}"
    full = (320 - 1) // BLOCK * BLOCK
    for holder, prompt in fresh.items():
        routers = set()
        for _ in range(16):
            out = complete(prompt)
            d = find_decision(out["id"])
            assert d["replica_id"] == holder and out["usage"]["prompt_tokens_details"]["cached_tokens"] == full
            routers.add(d["router_replica_id"])
            if len(routers) == 2:
                break
        assert len(routers) == 2, routers
    status = serve.status().applications[app.name]
    assert status.status == "RUNNING" and all(d.status == "HEALTHY" for d in status.deployments.values())
    print(f"replacements on node C followed by both routers {replaced_after:.0f} s after the loss")
