"""Pure tests of the A/B harness (``bench/ab/``) and its baseline routers.

No engines: the config each router is deployed with, the round-robin order, the
text Ray's router is given, and the summary computed from Locust's CSV, the
per-request samples and the counters.
"""

from __future__ import annotations

import asyncio
import csv
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench import ab

REPO = Path(__file__).resolve().parent.parent


def test_each_router_is_deployed_with_its_class_and_the_same_engines():
    import copy

    from app.builder import build_app
    from tests.test_config import _engine_router_config

    cfg, base = ab.load_app_entry(REPO / "serve_config.yaml")
    before = copy.deepcopy(base)
    ours_rc = _engine_router_config(build_app(base["args"]))  # the builder's: our class, args.router, stats period
    entries = {r: ab.app_entry_for(base, f"ab-{r}", r) for r in ab.ROUTERS}
    for router, entry in entries.items():
        assert entry["name"] == f"ab-{router}"
        if router in ab.RSL_ROUTERS:  # Ray Serve LLM's own app on the same args, its router named in them
            from ray.serve.llm import LLMConfig

            from bench import serve_rsl

            assert entry["import_path"] == "bench.serve_rsl:build" and "deployments" not in entry
            assert {k: v for k, v in entry["args"].items() if k != "rsl"} == base["args"]
            llm = LLMConfig(**serve_rsl.llm_config(entry["args"]))
            rc = llm.deployment_config["request_router_config"]
            assert rc["request_router_class"] == ab.ROUTERS[router]
            assert llm.deployment_config["num_replicas"] == base["args"]["engine_replicas"]["num_replicas"]
            assert llm.engine_kwargs["num_gpu_blocks_override"] == base["args"]["engine"]["num_gpu_blocks_override"]
            assert llm.placement_group_config["bundles"] == [{"CPU": base["args"]["engine_replicas"]["num_cpus"]}]
            assert ab.ready_paths(router) == ("/v1/models",)
            assert llm.runtime_env["env_vars"]["PYTHONPATH"] == f"{REPO / 'bench' / 'rsl_compat'}:${{PYTHONPATH}}"
            if router == "rsl_kv":  # direct streaming
                assert entry["runtime_env"] == {"env_vars": {"RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1"}}
            else:
                assert "runtime_env" not in entry
            continue
        assert entry["args"] == base["args"]  # the same engines for every router
        assert entry["import_path"] == base["import_path"]
        assert ab.ready_paths(router) == ("/health", "/v1/models")
        if router == "ours":
            assert "deployments" not in entry  # no override: the builder's router config stands
            assert ours_rc.request_router_class == ab.OURS_CLASS
        else:
            rc = entry["deployments"][0]["request_router_config"]
            assert rc["request_router_class"] == ab.ROUTERS[router]
            assert rc["request_router_kwargs"] == {}
            assert rc["request_routing_stats_period_s"] == ours_rc.request_routing_stats_period_s
            assert rc["request_routing_stats_timeout_s"] == ours_rc.request_routing_stats_timeout_s
    assert base == before  # not mutated

    from ray.serve.schema import ServeDeploySchema

    for entry in entries.values():
        ServeDeploySchema.model_validate({"proxy_location": "HeadOnly",
                                          "http_options": {"host": "127.0.0.1", "port": 18500},
                                          "applications": [entry]})


@pytest.mark.parametrize("router", [r for r in ab.ROUTERS if r != "ours"])
def test_router_class_paths_import(router):
    from ray._common.utils import import_attr
    from ray.serve._private.request_router.request_router import RequestRouter

    cls = import_attr(ab.ROUTERS[router])
    assert issubclass(cls, RequestRouter)


@dataclass(frozen=True)
class _Id:
    unique_id: str


@dataclass(frozen=True)
class _Replica:
    replica_id: _Id


def test_round_robin_cycles_in_replica_id_order_and_keeps_the_rest_as_fallback():
    from bench.ab_routers import RoundRobinRouter

    router = RoundRobinRouter.__new__(RoundRobinRouter)
    router.initialize_state()
    a, b, c = (_Replica(_Id(x)) for x in "abc")
    picks = [asyncio.run(router.choose_replicas([c, a, b])) for _ in range(4)]
    assert [p[0][0].replica_id.unique_id for p in picks] == ["a", "b", "c", "a"]
    assert picks[0][1] == [b, c]
    assert asyncio.run(router.choose_replicas([a])) == [[a]]


def test_ray_router_sees_token_ids_as_text_with_the_salt():
    from app.protocol import EngineRequest
    from bench.ab_ray_router import token_text

    assert token_text(EngineRequest("r", [11, 12, 13], None)) == "11 12 13"
    assert token_text(EngineRequest("r", [11, 12], None, cache_salt="t1")) == "[t1] 11 12"
    assert token_text(object()) is None
    # equal token prefixes are equal text prefixes
    assert token_text(EngineRequest("r", [5, 6, 7, 8], None)).startswith(token_text(EngineRequest("r", [5, 6], None)))


def _write_stats(path: Path, rows: list[dict]) -> None:
    cols = ["Type", "Name", "Request Count", "Failure Count", "Requests/s"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow(r)


def test_policy_summary_from_csv_samples_and_counters(tmp_path):
    _write_stats(tmp_path / "locust_stats.csv", [
        {"Type": "shared_prefix", "Name": "e2e", "Request Count": 4, "Failure Count": 0, "Requests/s": 0.4},
        {"Type": "shared_prefix", "Name": "ttft", "Request Count": 4, "Failure Count": 0, "Requests/s": 0.4},
        {"Type": "", "Name": "Aggregated", "Request Count": 40, "Failure Count": 0, "Requests/s": 4},
    ])
    samples = [{"ok": True, "ttft_s": t, "e2e_s": t + 1, "prompt_tokens": 100, "cached_tokens": c}
               for t, c in ((0.1, 0), (0.2, 96), (0.3, 96), (0.4, 96))]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples) + '{"cut')
    before = {"ingress": {ab.INGRESS_CACHED: 10.0, ab.INGRESS_PROMPT: 20.0}, "engines": None}
    after = {"ingress": {ab.INGRESS_CACHED: 298.0, ab.INGRESS_PROMPT: 420.0},
             "engines": None, "engine_targets": []}
    pol = ab.policy_summary("round_robin", tmp_path, 10, before, after)
    assert pol["requests"] == 4 and pol["failures"] == 0 and pol["completed"] == 4
    assert pol["hit_rate"] == round(288 / 400, 4)
    assert pol["hit_rate_client"] == round(288 / 400, 4)
    assert pol["hit_rate_engines"] is None
    assert pol["ttft_p50_s"] == 0.25 and pol["ttft_p90_s"] == 0.37
    assert pol["throughput_rps"] == 0.4
    assert pol["router_class"] == ab.ROUTERS["round_robin"]
    # a failure Locust saw (e.g. GET /v1/models) is never hidden by the samples
    _write_stats(tmp_path / "locust_stats.csv", [
        {"Type": "shared_prefix", "Name": "e2e", "Request Count": 4, "Failure Count": 0, "Requests/s": 0.4},
        {"Type": "", "Name": "Aggregated", "Request Count": 41, "Failure Count": 1, "Requests/s": 4},
    ])
    assert ab.policy_summary("round_robin", tmp_path, 10, before, after)["failures"] == 1


def test_working_set_is_sized_from_the_pinned_kv_cache():
    _, base = ab.load_app_entry(REPO / "serve_config.yaml")
    engine = base["args"]["engine"]
    capacity = engine["num_gpu_blocks_override"] * engine["block_size"]
    sp = Path("locustfiles/shared_prefix.py")
    (arg,) = ab.size_workload(base, sp, [], 1.5)
    groups = int(arg.split("=")[1])
    from locustfiles.workloads import SharedPrefixConfig

    tokens = SharedPrefixConfig().system_tokens
    assert abs(groups * tokens - 1.5 * capacity) <= tokens / 2
    assert ab.size_workload(base, sp, ["--sp-groups=5"], 1.5) == []
    assert ab.size_workload(base, sp, [], 0) == []
    assert ab.size_workload(base, Path("locustfiles/rag.py"), [], 1.5) == []
    assert ab.size_workload(base, sp, ["--sp-system-tokens", "1000"], 1.0) == [f"--sp-groups={round(capacity / 1000)}"]
    # Text prompts: a system prompt of 1,000 words at 1.5 tokens a word is 1,500 tokens.
    assert ab.size_workload(base, sp, ["--sp-system-tokens", "1000"], 1.0, tokens_per_word=1.5) == [
        f"--sp-groups={round(capacity / 1500)}"]


def test_tokens_per_word_of_text_prompts_under_the_models_tokenizer(tmp_path):
    """A tokenizer with every word of the text prompts in its vocabulary: one token a word; one that
    spells each word out letter by letter: the mean length of the words drawn."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers

    from bench.ab.load import text_tokens_per_word
    from locustfiles import workloads as W

    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(("[UNK]", *W.WORDS))}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "words").mkdir()
    words.save(str(tmp_path / "words" / "tokenizer.json"))
    assert text_tokens_per_word(tmp_path / "words", n=500) == 1.0

    letters = Tokenizer(models.WordLevel({c: i for i, c in enumerate("?abcdefghijklmnopqrstuvwxyz")}, unk_token="?"))
    letters.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                     pre_tokenizers.Split("", behavior="isolated")])
    (tmp_path / "letters").mkdir()
    letters.save(str(tmp_path / "letters" / "tokenizer.json"))
    drawn = W.token_ids(random.Random("words:3"), 500)
    expected = sum(len(W.WORDS[t % len(W.WORDS)]) for t in drawn) / 500
    assert text_tokens_per_word(tmp_path / "letters", seed=3, n=500) == pytest.approx(expected)


def test_checks_compare_ours_with_the_baselines():
    pols = {
        "ours": {"failures": 0, "hit_rate": 0.9, "ttft_p90_s": 0.2},
        "pow2": {"failures": 0, "hit_rate": 0.7, "ttft_p90_s": 0.3},
        "round_robin": {"failures": 0, "hit_rate": 0.6, "ttft_p90_s": 0.4},
    }
    c = ab.checks(pols)
    assert c == {"zero_failures": True, "ours_hit_rate_above_round_robin": True,
                 "ours_hit_rate_above_pow2": True, "ours_ttft_p90_below_round_robin": True,
                 "ours_ttft_p90_lowest": True}
    # The prefix-aware peers: a tie in hit rate passes, a lower p90 anywhere fails "lowest". Ray Serve
    # LLM's apps are compared by the answers' counts (hit_rate_client), ours too.
    peers = {**pols, "rsl_prefix": {"failures": 0, "hit_rate": 0.9, "hit_rate_client": 0.89, "ttft_p90_s": 0.25},
             "rsl_kv": {"failures": 0, "hit_rate": 0.88, "hit_rate_client": 0.88, "ttft_p90_s": 0.15}}
    peers["ours"] = {**pols["ours"], "hit_rate_client": 0.89}
    c = ab.checks(peers)
    assert c["ours_hit_rate_at_least_rsl_prefix"] is True and c["ours_hit_rate_at_least_rsl_kv"] is True
    peers["rsl_kv"]["hit_rate_client"] = 0.895  # ours' ingress 0.9 is higher, its client 0.89 is not
    assert ab.checks(peers)["ours_hit_rate_at_least_rsl_kv"] is False
    assert c["ours_ttft_p90_lowest"] is False and "ours_hit_rate_at_least_ray_prefix" not in c
    pols["pow2"]["failures"] = 2
    pols["round_robin"] = {"error": "deploy failed"}
    c = ab.checks(pols)
    assert c["zero_failures"] is False and c["ours_hit_rate_above_round_robin"] is None


def test_counter_sums_parse_prometheus_text():
    text = (
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 4.0\n'
        "# TYPE prefix_serve_prompt_tokens counter\n"
        "prefix_serve_prompt_tokens_total 400.0\n"
    )
    from bench.ab.measure import _sum_samples

    got = _sum_samples(text, {ab.VLLM_HITS, ab.INGRESS_PROMPT, ab.INGRESS_CACHED})
    assert got == {ab.VLLM_HITS: 100.0, ab.INGRESS_PROMPT: 400.0, ab.INGRESS_CACHED: 0.0}


def test_cli_rejects_unknown_routers():
    with pytest.raises(SystemExit):
        ab.parse_args(["--routers", "ours,fastest"])
    assert ab.parse_args([]).routers == list(ab.ROUTERS)


def test_locust_gets_the_think_time_unless_given():
    assert ab.parse_args([]).think_time == 0.8
    assert ab.arg_value(["--think-time=0.5"], "--think-time") == "0.5"
    assert ab.arg_value(["--think-time", "0"], "--think-time") == "0"
    assert ab.arg_value(["--sp-zipf=1"], "--think-time") is None


def test_text_prompts_are_as_long_in_tokens_as_the_token_id_prompts():
    """``--prompts text`` (the default): shared_prefix sends text, its lengths given in words so that its
    prompts come to the config's tokens under the model's tokenizer; ``--prompts ids``: token ids."""
    from bench.ab.cli import _workload_args
    from bench.ab.load import text_tokens_per_word
    from locustfiles import workloads as W

    _, base = ab.load_app_entry(REPO / "serve_config.yaml")
    sp = Path("locustfiles/shared_prefix.py")
    text = _workload_args(ab.parse_args([]), base, sp)
    per_word = text_tokens_per_word(REPO / base["args"]["model"], 0)
    system_words = int(ab.arg_value(text, "--sp-system-tokens"))
    assert ab.arg_value(text, "--sp-text") == "true" and per_word > 1.0
    assert 3072 - per_word < system_words * per_word <= 3072  # W.SharedPrefixConfig().system_tokens
    low, high = W.parse_range(ab.arg_value(text, "--sp-question-tokens"))
    assert (low, high) == (int(16 / per_word), int(64 / per_word))
    assert ab.arg_value(_workload_args(ab.parse_args(["--prompts", "ids"]), base, sp), "--sp-text") is None
    given = _workload_args(ab.parse_args(["--locust-arg=--sp-system-tokens=100"]), base, sp)
    assert ab.arg_value(given, "--sp-system-tokens") is None  # the caller's stands (it is in --locust-arg)
