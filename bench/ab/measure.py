"""What the A/B harness measures around the load: the prefix-cache counters (Prometheus), the CPU
seconds by role, the ingress's metrics, and our router's routing decisions."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.ab.common import LOOPBACK
from bench.ab.load import read_samples

INGRESS_CACHED = "prefix_serve_cached_tokens_total"
INGRESS_PROMPT = "prefix_serve_prompt_tokens_total"
VLLM_HITS = "vllm:prefix_cache_hits_total"
VLLM_QUERIES = "vllm:prefix_cache_queries_total"
ROLES: dict[str, tuple[str, ...]] = {
    # Serve deployment names by role: ours (app.builder), then Ray Serve LLM's (bench.serve_rsl:
    # its ingress, the request-router peer HAProxy asks, and its LLMServer:<model> engines).
    "ingress": ("OpenAIIngress", "OpenAiIngress", "LLMRouter"),
    "engines": ("VLLMEngine", "LLMServer"),
}


def _sum_samples(text: str, names: set[str]) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {n: 0.0 for n in names}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                out[sample.name] += float(sample.value)
    return out


def read_counters(base_url: str, loopback_only: bool = True) -> dict[str, Any]:
    """Prefix-cache counters of the ingress and (where listed) of every engine replica."""
    import httpx

    out: dict[str, Any] = {"ingress": None, "engines": None, "engine_targets": []}
    try:
        r = httpx.get(f"{base_url}/metrics", timeout=15)
        r.raise_for_status()
        out["ingress"] = _sum_samples(r.text, {INGRESS_CACHED, INGRESS_PROMPT})
    except Exception as e:  # noqa: BLE001 - recorded in the summary
        out["ingress_error"] = f"{type(e).__name__}: {e}"
    try:
        r = httpx.get(f"{base_url}/metrics/engines", timeout=15)
        r.raise_for_status()
        targets = [t for group in r.json() for t in group.get("targets", [])]
    except Exception as e:  # noqa: BLE001
        out["engines_error"] = f"{type(e).__name__}: {e}"
        targets = []
    if loopback_only:
        skipped = [t for t in targets if urlsplit(f"//{t}").hostname not in (LOOPBACK, "localhost", "::1")]
        targets = [t for t in targets if t not in skipped]
        if skipped:
            out["engine_targets_skipped"] = skipped
    if targets:
        total = {VLLM_HITS: 0.0, VLLM_QUERIES: 0.0}
        for t in targets:
            try:
                r = httpx.get(f"http://{t}/metrics", timeout=15)
                r.raise_for_status()
                for k, v in _sum_samples(r.text, set(total)).items():
                    total[k] += v
            except Exception as e:  # noqa: BLE001
                out.setdefault("engine_errors", []).append(f"{t}: {type(e).__name__}: {e}")
        out["engines"] = total
        out["engine_targets"] = targets
    return out


def save_routing_debug(base_url: str, out_dir: Path, max_decisions: int = 5000) -> dict[str, Any]:
    """Our router's state (``GET /debug/routing``) and, per sampled request, where it
    went and why (``GET /debug/routing/decisions/{id}``), into ``out_dir``. Other
    routers have no such state: returns ``{"routers": 0}`` for them."""
    import httpx

    try:
        r = httpx.get(f"{base_url}/debug/routing", timeout=15)
        routers = r.json().get("routers") if r.status_code == 200 else None
    except Exception:  # noqa: BLE001
        routers = None
    if not routers:
        return {"routers": 0}
    (out_dir / "debug_routing.json").write_text(json.dumps(routers, indent=1))
    reasons: dict[str, int] = {}
    per_replica: dict[str, int] = {}
    n = 0
    with httpx.Client(timeout=10) as client, open(out_dir / "decisions.jsonl", "w", encoding="utf-8") as f:
        for s in read_samples(out_dir / "samples.jsonl")[:max_decisions]:
            if not s.get("id"):
                continue
            r = client.get(f"{base_url}/debug/routing/decisions/{s['id']}")
            if r.status_code != 200:
                continue
            d = r.json()
            f.write(json.dumps({"id": s["id"], "tag": s.get("tag"), "cached_tokens": s.get("cached_tokens"),
                                "prompt_tokens": s.get("prompt_tokens"), **d}) + "\n")
            reasons[d.get("reason", "?")] = reasons.get(d.get("reason", "?"), 0) + 1
            per_replica[d.get("replica_id", "?")] = per_replica.get(d.get("replica_id", "?"), 0) + 1
            n += 1
    return {"routers": len(routers), "decisions": n, "reasons": reasons, "requests_per_replica": per_replica}


def cpu_snapshot(app_name: str) -> dict[str, float]:
    """CPU seconds (user + system) used so far by this run's processes, by role, and by
    the whole machine: ``ingress`` (``ROLES``: ours, or Ray Serve LLM's ingress and its
    request-router peer), ``engines`` (replica actors with their vLLM EngineCore/Worker
    children), ``cluster`` (every process this harness started: Ray,
    Serve, engines, Locust) and ``machine`` (all CPUs, from /proc/stat). The difference
    ``machine - cluster`` over a run is CPU taken by other work on the host."""
    import psutil

    def cpu(p) -> float:
        try:
            t = p.cpu_times()
            return t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return 0.0

    out = {"ingress": 0.0, "engines": 0.0, "cluster": 0.0}
    me = psutil.Process()
    family = [me] + me.children(recursive=True)
    roles: dict[int, str] = {}
    for p in family:
        try:
            cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        role = next((r for r, names in ROLES.items() if any(f"ServeReplica:{app_name}:{n}" in cmd for n in names)),
                    None)
        if role:
            try:
                for q in [p] + p.children(recursive=True):
                    roles[q.pid] = role
            except psutil.NoSuchProcess:
                pass
    for p in family:
        c = cpu(p)
        out["cluster"] += c
        if p.pid in roles:
            out[roles[p.pid]] += c
    t = psutil.cpu_times()
    out["machine"] = (t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
                      + getattr(t, "steal", 0.0))
    out["loadavg_1m"] = os.getloadavg()[0]
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float | None]:
    cpu = {f"{k}_cpu_s": round(after[k] - before[k], 1) for k in ("ingress", "engines", "cluster", "machine")}
    d: dict[str, float | None] = {**cpu, "other_cpu_s": round(cpu["machine_cpu_s"] - cpu["cluster_cpu_s"], 1)}
    d["cpus"] = os.cpu_count()  # None where the OS cannot tell
    d["seconds"] = round(seconds, 1)
    d["loadavg_1m_before"], d["loadavg_1m_after"] = round(before["loadavg_1m"], 2), round(after["loadavg_1m"], 2)
    return d


def save_ingress_metrics(base_url: str, out_dir: Path) -> None:
    """The ingress's Prometheus text after the run (router, event-path and latency metrics)."""
    import httpx

    try:
        r = httpx.get(f"{base_url}/metrics", timeout=15)
        if r.status_code == 200:
            (out_dir / "ingress_metrics.txt").write_text(r.text)
    except Exception:  # noqa: BLE001
        pass
