"""An fp8 KV cache (``engine.kv_cache_dtype: fp8``): twice the blocks in the same memory, and
the app still answers as vLLM's own server does and still predicts the engine's hits.

Beside the app (one engine replica, fp8, ``kv_cache_memory_bytes`` pinned) run two vLLM
servers with the same bytes: one fp8 (the reference for answers) and one with the model's
own dtype (the reference for the block count). vLLM's CPU build stores fp8 KV only on x86 with
AVX-512 or AMX (``vllm/v1/attention/backends/cpu_attn.py``, which asks torch); on a CPU with
neither (an AMD EPYC with AVX2 only, as this project's machine was on 2026-12-07) every engine
here fails to start, so the module is skipped, saying so.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench import vllm_server
from tests.conftest import REPO, deep_update, default_config, start_app, stop_all
from tests.test_api_parity import CASES, CHAT, CMPL, _post, assert_same_answer

pytestmark = pytest.mark.engine

KV_BYTES = 64 << 20  # the same KV-cache memory for every engine here
PORT = int(os.environ.get("PREFIX_SERVE_TEST_VLLM_PORT", "18100")) + 20
MODEL = "tiny-qwen2"
OVERRIDES = {"engine_replicas": {"num_replicas": 1},
             "engine": {"kv_cache_dtype": "fp8", "num_gpu_blocks_override": None, "kv_cache_memory_bytes": KV_BYTES}}
# The parity cases for chat and completions that need no adapter and are valid requests.
FP8_CASES = [c for c in CASES if c[1] in (CHAT, CMPL) and not c[0].startswith(("lora_", "bad_"))]


def _num_gpu_blocks(metrics_text: str) -> int:
    """``num_gpu_blocks`` of vLLM's ``vllm:cache_config_info`` gauge in a Prometheus text page."""
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                return int(sample.labels["num_gpu_blocks"])
    raise AssertionError("no vllm:cache_config_info in the page")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    import torch

    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):  # vLLM's own test
        pytest.skip("vLLM's CPU build stores fp8 KV only on x86 with AVX-512 or AMX; this CPU has neither")
    logs = tmp_path_factory.mktemp("vllm")
    procs: dict[str, tuple[subprocess.Popen, Any, str]] = {}
    try:
        for i, dtype in enumerate(("fp8", "auto")):
            args = deep_update(default_config()["args"], {**OVERRIDES, "engine": {**OVERRIDES["engine"],
                                                                                 "kv_cache_dtype": dtype}})
            log = open(logs / f"{dtype}.log", "w")
            proc = subprocess.Popen(vllm_server.command(args, PORT + i), stdout=log, stderr=subprocess.STDOUT,
                                    env=vllm_server.env(), cwd=REPO)
            procs[dtype] = (proc, log, f"http://127.0.0.1:{PORT + i}")
        for proc, log, url in procs.values():
            vllm_server.wait_ready(proc, url, MODEL, log.name)
        # The app starts once vLLM's servers are up: on two loaded cores their start-up beside Serve's
        # made Serve's proxy miss its 5 s readiness checks, and the controller killed it mid-start.
        app = start_app(OVERRIDES, name="prefix-serve")
        yield app.base_url, procs["fp8"][2], procs["auto"][2]
    finally:
        for proc, log, _ in procs.values():
            vllm_server.stop(proc)
            log.close()
        stop_all()


def test_fp8_holds_twice_the_blocks_of_the_models_dtype_in_the_same_memory(servers):
    app_url, fp8_url, auto_url = servers
    targets = httpx.get(f"{app_url}/metrics/engines", timeout=30).json()
    assert len(targets) == 1, targets
    ours = _num_gpu_blocks(httpx.get(f"http://{targets[0]['targets'][0]}/metrics", timeout=30).text)
    fp8 = _num_gpu_blocks(httpx.get(f"{fp8_url}/metrics", timeout=30).text)
    auto = _num_gpu_blocks(httpx.get(f"{auto_url}/metrics", timeout=30).text)
    print(f"KV blocks in {KV_BYTES >> 20} MiB: app fp8 {ours}, vLLM fp8 {fp8}, vLLM auto (bf16) {auto}")
    assert ours == fp8 == 2 * auto


def test_a_repeat_reports_its_full_blocks_cached_as_the_router_predicted(servers):
    """The router's keys match the fp8 engine's events: a repeated 1,000-token prompt is routed
    as a hit of its full blocks, and the engine reports exactly those tokens cached."""
    app_url = servers[0]
    ids = [11 + (7 * i) % 900 for i in range(1000)]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "cache_salt": "fp8-repeat"}
    seen = []
    for _ in range(2):
        status, out = _post(app_url, CMPL, body)
        assert status == 200, out
        d = httpx.get(f"{app_url}/debug/routing/decisions/{out['id']}", timeout=30).json()
        seen.append((d["matched_tokens"], out["usage"]["prompt_tokens_details"]["cached_tokens"]))
        time.sleep(0.3)  # the engine's BlockStored reaches the index before the repeat
    assert seen == [(0, 0), (len(ids) // 32 * 32, len(ids) // 32 * 32)], seen


@pytest.mark.parametrize("name, path, body, deterministic", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_same_answer_as_vllms_fp8_server(servers, name, path, body, deterministic):
    """The parity test's chat and completions cases, against vLLM's server with the same fp8 cache."""
    app_url, fp8_url, _ = servers
    ours_status, ours = _post(app_url, path, body)
    ref_status, ref = _post(fp8_url, path, body)
    assert (ours_status, ref_status) == (200, 200), (ours, ref)
    assert_same_answer(ours, ref, deterministic)
