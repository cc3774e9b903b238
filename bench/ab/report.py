"""The A/B harness's results: each router's summary, the acceptance checks, the plots, the table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.ab.deploy import OURS_CLASS, ROUTERS, RSL_ROUTERS
from bench.ab.load import read_locust_stats, read_samples
from bench.ab.measure import INGRESS_CACHED, INGRESS_PROMPT, VLLM_HITS, VLLM_QUERIES
from bench.stats import percentile


def _delta(before: dict[str, float] | None, after: dict[str, float] | None, key: str) -> float | None:
    if before is None or after is None:
        return None
    return after[key] - before[key]


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def policy_summary(router: str, out_dir: Path, run_time_s: int, before: dict, after: dict) -> dict[str, Any]:
    """``policies.<router>`` of the summary from Locust's CSV, the samples and the counters."""
    stats = read_locust_stats(out_dir / "locust_stats.csv")
    e2e = next((row for (typ, name), row in stats.items() if name == "e2e"), None)
    aggregated = stats.get(("", "Aggregated"))
    samples = read_samples(out_dir / "samples.jsonl")
    ok = [s for s in samples if s.get("ok")]
    ttft = [s["ttft_s"] for s in ok if s.get("ttft_s") is not None]
    e2e_s = [s["e2e_s"] for s in ok]
    # Requests and failures come from the per-request samples (the same source as the
    # percentiles): Locust's final CSV is its last periodic snapshot and can miss the
    # requests of the run's last second. Failures never count fewer than Locust saw.
    csv_requests = int(e2e["Request Count"]) if e2e else None
    csv_failures = int(aggregated["Failure Count"]) if aggregated else 0
    requests = len(samples) if samples else (csv_requests or 0)
    failures = max(sum(1 for s in samples if not s.get("ok")), csv_failures)
    d_cached = _delta(before.get("ingress"), after.get("ingress"), INGRESS_CACHED)
    d_prompt = _delta(before.get("ingress"), after.get("ingress"), INGRESS_PROMPT)
    d_hits = _delta(before.get("engines"), after.get("engines"), VLLM_HITS)
    d_queries = _delta(before.get("engines"), after.get("engines"), VLLM_QUERIES)
    c_prompt = sum(s.get("prompt_tokens") or 0 for s in ok)
    c_cached = sum(s.get("cached_tokens") or 0 for s in ok)
    # The ingress's counters where the app has them (ours); Ray Serve LLM's apps have none, and there the
    # answers' own counts (usage.prompt_tokens_details.cached_tokens, the same engine numbers) stand in.
    hit_rate_ingress = _r(d_cached / d_prompt) if d_cached is not None and d_prompt else None
    hit_rate_client = _r(c_cached / c_prompt) if c_prompt else None
    return {
        "router_class": ROUTERS[router] or OURS_CLASS,
        "requests": requests,
        "failures": failures,
        "hit_rate": hit_rate_ingress if hit_rate_ingress is not None else hit_rate_client,
        "hit_rate_source": "ingress" if hit_rate_ingress is not None else "client" if c_prompt else None,
        "ttft_p50_s": _r(percentile(ttft, 50, None)),
        "ttft_p90_s": _r(percentile(ttft, 90, None)),
        "ttft_p99_s": _r(percentile(ttft, 99, None)),
        "throughput_rps": _r(len(ok) / run_time_s, 3),
        "e2e_p50_s": _r(percentile(e2e_s, 50, None)),
        "e2e_p90_s": _r(percentile(e2e_s, 90, None)),
        "completed": len(ok),
        "locust_csv_requests": csv_requests,
        "prompt_tokens": d_prompt,
        "cached_tokens": d_cached,
        "hit_rate_client": hit_rate_client,
        "hit_rate_engines": _r(d_hits / d_queries) if d_hits is not None and d_queries else None,
        "engine_targets": after.get("engine_targets") or [],
    }


def plot(summary: dict[str, Any], out: Path) -> list[str]:
    """``ttft_cdf.png`` and ``hit_rate.png`` under ``out``; returns their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pol in summary["policies"].items():
        samples = read_samples(out / name / "samples.jsonl")
        ttft = sorted(s["ttft_s"] for s in samples if s.get("ok") and s.get("ttft_s") is not None)
        if not ttft:
            continue
        ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
        ax.step(ttft, ys, where="post", label=f"{name} (p90 {pol.get('ttft_p90_s')} s)")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF per router: {summary['workload']}, {summary['users']} users, "
                 f"think {summary.get('think_time_s', 0):g} s, {summary['run_time_s']} s", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=110)
    plt.close(fig)
    files.append("ttft_cdf.png")

    names = [n for n, p in summary["policies"].items() if p.get("hit_rate") is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    values = [100 * summary["policies"][n]["hit_rate"] for n in names]
    bars = ax.bar(names, values, color=["tab:green" if n == "ours" else "tab:gray" for n in names])
    for b, v in zip(bars, values, strict=True):
        ax.text(b.get_x() + b.get_width() / 2, v + 1, f"{v:.1f} %", ha="center", fontsize=9)
    ax.set_ylim(0, 105)
    ax.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    kv = summary.get("kv_cache_tokens_per_replica")
    ax.set_title(f"Prefix-cache hit rate per router: {summary['workload']}"
                 + (f", {kv:,} KV tokens a replica" if kv else ""))
    fig.tight_layout()
    fig.savefig(out / "hit_rate.png", dpi=110)
    plt.close(fig)
    files.append("hit_rate.png")
    return files


def checks(policies: dict[str, Any]) -> dict[str, bool | None]:
    """The issue's acceptance comparisons (None where a router did not run)."""
    ours = policies.get("ours") or {}

    def cmp(other: str, key: str, better) -> bool | None:
        o = policies.get(other) or {}
        if ours.get(key) is None or o.get(key) is None:
            return None
        return bool(better(ours[key], o[key]))

    ran = [p for p in policies.values() if "error" not in p]
    out: dict[str, bool | None] = {
        "zero_failures": bool(ran) and all(p.get("failures") == 0 for p in ran) and len(ran) == len(policies),
        "ours_hit_rate_above_round_robin": cmp("round_robin", "hit_rate", lambda a, b: a > b),
        "ours_hit_rate_above_pow2": cmp("pow2", "hit_rate", lambda a, b: a > b),
        "ours_ttft_p90_below_round_robin": cmp("round_robin", "ttft_p90_s", lambda a, b: a < b),
    }
    for peer in ("ray_prefix", *RSL_ROUTERS):  # the prefix-aware peers: at least their hit rate
        if peer in policies:  # Ray Serve LLM's apps have only the answers' counts: ours by the same source
            key = "hit_rate_client" if peer in RSL_ROUTERS else "hit_rate"
            out[f"ours_hit_rate_at_least_{peer}"] = cmp(peer, key, lambda a, b: a >= b)
    p90 = {n: p.get("ttft_p90_s") for n, p in policies.items() if p.get("ttft_p90_s") is not None}
    out["ours_ttft_p90_lowest"] = (None if "ours" not in p90 or len(p90) < 2
                                   else all(p90["ours"] <= v for v in p90.values()))
    return out


def format_table(summary: dict[str, Any]) -> str:
    """One line per router (its summary, error or skip reason), then the checks."""
    cols = ("requests", "failures", "hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "throughput_rps")
    lines = [f"{'router':<12}" + "".join(f"{c:>15}" for c in cols)]
    for name, pol in summary["policies"].items():
        if "error" in pol and "requests" not in pol:
            lines.append(f"{name:<12}  error: {pol['error']}")
            continue
        lines.append(f"{name:<12}" + "".join(f"{str(pol.get(c)):>15}" for c in cols))
    for name, reason in summary.get("skipped", {}).items():
        lines.append(f"{name:<12}  skipped: {reason}")
    lines.append("checks: " + ", ".join(f"{k}={v}" for k, v in summary.get("checks", {}).items()))
    return "\n".join(lines)
