"""Our router inside a Ray Serve LLM app (``app.ray_serve_llm``, ``examples/ray_serve_llm/``).

Without a cluster: the Ray internals the glue reads are still there; the engine replica turns vLLM's
KV events on and refuses a config that would blind the router; the router renders Ray Serve LLM's own
request models into the token ids the engine computes (the tokenizer's own chat template, applied
here independently), leaves the body the engine gets untouched, records its decision under Serve's
request id, and routes by load what it cannot render.

With a cluster (``engine``): the example's ``serve_config.yaml`` deployed as ``serve run`` deploys it,
two engine replicas on the tiny model: a repeated 1,024-token prompt goes back to the replica that holds
it with its full blocks cached and our policy's reason in its decision record, and a replica added by a
scale-up is followed from its first event (a prompt routed to it is a hit there next time).
"""

from __future__ import annotations

import inspect
import time
import uuid
from typing import Any

import httpx
import pytest
import yaml

from app.protocol import STAT_BLOCK_SIZE
from tests.conftest import BASE_URL, REPO, deploy, stop_all
from tests.test_router_glue import ResultEnds, on_loop, replica

pytest.importorskip("ray.llm")

EXAMPLE = REPO / "examples" / "ray_serve_llm" / "serve_config.yaml"
MODEL_DIR = REPO / "models" / "tiny-qwen2"
BLOCK = 32


def example_entry(replicas: int | None = None) -> dict[str, Any]:
    """The example's application entry, as ``serve run`` reads it; with ``replicas``, that many engine replicas,
    each with a third of its CPUs (three replicas and the ingress fit the test cluster's 2 CPUs)."""
    with open(EXAMPLE, encoding="utf-8") as f:
        entry = yaml.safe_load(f)["applications"][0]
    if replicas is not None:
        llm = entry["args"]["llm_configs"][0]
        llm["deployment_config"]["num_replicas"] = replicas
        llm["deployment_config"]["ray_actor_options"] = {"num_cpus": 0.1}
        llm["placement_group_config"] = {"bundles": [{"CPU": 0.2}]}
        # Serve's external scaling API: the test scales the engines up without a redeploy (a redeploy of
        # a Ray Serve LLM app replaces every replica: its builder makes a new version each time).
        entry["external_scaler_enabled"] = True
    return entry


def example_llm_config() -> dict[str, Any]:
    return example_entry()["args"]["llm_configs"][0]


# ------------------------------------------------------------------ without a cluster


def test_the_ray_internals_the_glue_reads_are_still_there():
    """Pinned to Ray 2.60 (``pyproject.toml``): the engine's ``AsyncLLM`` attribute, and the ``LLMServer``
    methods the engine replica overrides with their signatures."""
    from ray.llm._internal.serve.core.server.llm_server import LLMServer
    from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine

    from app.ray_serve_llm.server import ENGINE_CLIENT_ATTR

    assert f"self.{ENGINE_CLIENT_ATTR} = self._start_async_llm_engine(" in inspect.getsource(VLLMEngine.start)
    assert list(inspect.signature(LLMServer._init_shared).parameters) == [
        "self", "llm_config", "engine_cls", "model_downloader"]
    assert "self._init_shared(" in inspect.getsource(LLMServer.__init__)
    assert "instance._init_shared(" in inspect.getsource(LLMServer.sync_init)
    assert inspect.iscoroutinefunction(LLMServer.start) and inspect.iscoroutinefunction(LLMServer.record_routing_stats)


def test_the_engine_replica_turns_kv_events_on_and_refuses_what_would_blind_the_router():
    from ray.serve.llm import LLMConfig

    from app.ray_serve_llm.server import PrefixServeLLMServer, kv_events_config

    llm = LLMConfig(**example_llm_config())
    assert llm.server_cls is PrefixServeLLMServer  # the example's import path resolves to it
    server = PrefixServeLLMServer.sync_init(llm)  # unstarted: no engine runs
    assert llm.engine_kwargs["kv_events_config"] == kv_events_config(f"kv@{server.replica_id}")
    assert llm.engine_kwargs["kv_events_config"]["enable_kv_cache_events"] is True

    off = example_llm_config()
    off["engine_kwargs"]["enable_prefix_caching"] = False
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        PrefixServeLLMServer.sync_init(LLMConfig(**off))
    theirs = example_llm_config()
    theirs["engine_kwargs"]["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq"}
    with pytest.raises(ValueError, match="kv_events_config"):
        PrefixServeLLMServer.sync_init(LLMConfig(**theirs))


def test_request_kind_is_serves_call_method_for_chat_and_completions_only():
    from app.ray_serve_llm.router import request_kind

    assert request_kind("chat") == "chat" and request_kind("completions") == "completions"
    for other in ("embeddings", "check_health", "tokenize", "__call__"):  # "__call__": direct streaming
        assert request_kind(other) is None


def test_the_engine_replica_refuses_a_kv_cache_report_mode_its_relay_cannot_follow():
    from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest, ErrorResponse

    from app.ray_serve_llm.server import refusal

    def body(**xargs: Any) -> Any:
        return CompletionRequest(model="tiny-qwen2", prompt="hi", max_tokens=1, vllm_xargs=xargs or None)

    for mode in ("full", "anything"):
        err = refusal(body(kv_cache_report_mode=mode))
        assert isinstance(err, ErrorResponse) and err.error.code == 400  # Ray's ingress answers its status
        assert err.error.param == "vllm_xargs.kv_cache_report_mode" and repr(mode) in err.error.message
    assert refusal(body(kv_cache_report_mode="incremental")) is None
    assert refusal(body()) is None and refusal(body(other=1)) is None


def make_router(**kwargs):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from app.ray_serve_llm.router import PrefixServeLLMRouter

    router = PrefixServeLLMRouter(DeploymentID(name="LLMServer:tiny-qwen2", app_name="ray-serve-llm"),
                                  DeploymentHandleSource.REPLICA)
    router.initialize_state(**kwargs)
    return router


def rsl_pending(body: Any, call_method: str, request_id: str):
    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest

    return PendingRequest(args=[body, None], kwargs={}, metadata=RequestMetadata(
        request_id=request_id, internal_request_id=uuid.uuid4().hex, call_method=call_method))


ROUTER_KWARGS = {"model": str(MODEL_DIR), "served_model_name": "tiny-qwen2", "max_model_len": 4096}


@on_loop
async def test_the_router_renders_ray_serve_llms_requests_as_the_engine_and_leaves_the_body_alone(tokenizer):
    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, CompletionRequest

    from app.ray_serve_llm.router import PREPARED_ATTR

    router = make_router(**ROUTER_KWARGS)
    cands = [replica("a", {STAT_BLOCK_SIZE: BLOCK}), replica("b", {STAT_BLOCK_SIZE: BLOCK})]
    messages = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Hi?"}]
    chat = ChatCompletionRequest(model="tiny-qwen2", messages=messages, max_tokens=2)
    prompt_ids = [5 + (i * 7) % 900 for i in range(100)]
    completion = CompletionRequest(model="tiny-qwen2", prompt=prompt_ids, max_tokens=2, cache_salt="tenant-a")
    want = {"chat": tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"],
            "completions": prompt_ids}
    for kind, body in (("chat", chat), ("completions", completion)):
        before = body.model_dump()
        p = rsl_pending(body, kind, f"req-{kind}")
        ranks = await router.choose_replicas(cands, p)
        prepared = getattr(p, PREPARED_ATTR)
        assert list(prepared.prompt_token_ids) == list(want[kind]), kind
        assert prepared.request_id == f"req-{kind}"
        assert body.model_dump() == before  # the engine gets the client's body, prompt and all
        chosen = ranks[0][0]
        router.on_request_routed(p, chosen.replica_id, ResultEnds())
        d = router.decisions_for(f"req-{kind}")[-1]
        assert d["replica_id"] == chosen.replica_id.unique_id and d["prompt_tokens"] == len(want[kind])
        assert d["reason"] == "no_match"  # nothing indexed: no replica holds it
    assert getattr(rsl_pending(completion, "completions", "x"), PREPARED_ATTR, None) is None
    # The salt is in the keys: the completion's record keys differ from the same ids without it.
    from routing.block_keys import block_keys

    p = rsl_pending(completion, "completions", "salted")
    await router.choose_replicas(cands, p)
    keys = block_keys(getattr(p, PREPARED_ATTR).prompt_token_ids, BLOCK, cache_salt="tenant-a")
    assert keys != block_keys(prompt_ids, BLOCK)
    assert router.unprepared == 0
    # Before any replica reported its block size, a request is not keyed in a guessed one: routed by load.
    fresh = make_router(**ROUTER_KWARGS)
    p = rsl_pending(completion, "completions", "early")
    ranks = await fresh.choose_replicas([replica("a"), replica("b")], p)
    fresh.on_request_routed(p, ranks[0][0].replica_id, ResultEnds())
    assert fresh.decisions_for("early")[-1]["reason"] == "fallback_no_block_size"


@on_loop
async def test_what_the_router_cannot_render_is_routed_by_load_and_a_bad_model_says_why():
    from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest

    from app.ray_serve_llm.router import PREPARED_ATTR

    cands = [replica("a", {STAT_BLOCK_SIZE: BLOCK}), replica("b", {STAT_BLOCK_SIZE: BLOCK})]
    router = make_router(**ROUTER_KWARGS)
    other = CompletionRequest(model="not-served", prompt=[1, 2, 3], max_tokens=1)
    p = rsl_pending(other, "completions", "other")
    ranks = await router.choose_replicas(cands, p)
    assert sorted(r.replica_id.unique_id for r in ranks[0]) == ["a", "b"]  # every candidate, by load
    assert getattr(p, PREPARED_ATTR) is None and router.unprepared == 1
    health = rsl_pending(None, "check_health", "h")
    assert len((await router.choose_replicas(cands, health))[0]) == 2 and router.unprepared == 1



@on_loop
async def test_a_renderer_that_cannot_load_routes_by_load_says_why_and_is_tried_again(tmp_path, monkeypatch):
    from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest

    from app.ray_serve_llm import router as rsl_router

    cands = [replica("a", {STAT_BLOCK_SIZE: BLOCK}), replica("b", {STAT_BLOCK_SIZE: BLOCK})]
    later = tmp_path / "tiny-qwen2"  # the model is not there yet (a mount not ready, a download under way)
    broken = make_router(**{**ROUTER_KWARGS, "model": str(later)})
    ids = _fresh(3, 64)

    async def route(request_id: str) -> dict[str, Any]:
        p = rsl_pending(CompletionRequest(model="tiny-qwen2", prompt=ids, max_tokens=1), "completions", request_id)
        ranks = await broken.choose_replicas(cands, p)
        broken.on_request_routed(p, ranks[0][0].replica_id, ResultEnds())
        return broken.decisions_for(request_id)[-1]

    assert (await route("b1"))["reason"] == "fallback_router_config"
    assert str(later) in (broken.init_error or "")
    later.symlink_to(MODEL_DIR)
    assert (await route("b2"))["reason"] == "fallback_router_config"  # not before RENDERER_RETRY_S
    monkeypatch.setattr(rsl_router, "RENDERER_RETRY_S", 0.0)
    broken._retry_at = 0.0
    d = await route("b3")
    assert d["reason"] == "no_match" and d["prompt_tokens"] == len(ids) and broken.init_error is None


# ------------------------------------------------------------------ with a cluster


APP = "ray-serve-llm"
ENGINE_DEPLOYMENT = "PrefixServeLLMServer:tiny-qwen2"  # Ray Serve LLM's name: the server class and the model id


def _completion(ids: list[int], request_id: str) -> dict[str, Any]:
    r = httpx.post(f"{BASE_URL}/v1/completions", headers={"x-request-id": request_id}, timeout=120,
                   json={"model": "tiny-qwen2", "prompt": ids, "max_tokens": 2})
    assert r.status_code == 200, r.text
    return r.json()


def _ingress():
    from ray import serve

    return serve.get_app_handle(APP)


def _state() -> dict[str, Any]:
    return _ingress().routing_state.remote().result()["routers"][0]


def _wait(replicas: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """Until the app runs and its router follows ``replicas`` engine replicas, each synced; their state."""
    from ray import serve

    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        status = serve.status().applications.get(APP)
        if status is not None and str(status.status).endswith(("DEPLOY_FAILED", "UNHEALTHY")):
            raise RuntimeError(f"{APP} failed: {status.message}")
        if status is not None and str(status.status).endswith("RUNNING"):
            try:
                # Under a block: it stores nothing. The router is made by the first call.
                _completion([7] * 20, f"probe-{uuid.uuid4().hex[:6]}")
                last = _state()
                if len(last["subscribed"]) == replicas and len(last["synced"]) == replicas:
                    return last
            except (httpx.HTTPError, AssertionError) as e:
                last = repr(e)
        time.sleep(1.0)
    raise TimeoutError(f"{APP} not following {replicas} replicas after {timeout_s} s: {last}")


@pytest.fixture(scope="module")
def rsl_app():
    import ray

    entry = example_entry(replicas=2)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             _node_ip_address="127.0.0.1")
    try:
        deploy(entry)
        _wait(2)
        yield entry
    finally:
        stop_all()


def _fresh(seed: int, n: int = 1024) -> list[int]:
    """``n`` token ids no other prompt here starts with (the tiny model's vocabulary is 1,024)."""
    return [10 + seed] + [10 + (seed * 31 + i * 7) % 1000 for i in range(1, n)]


@pytest.mark.engine
def test_a_repeated_prompt_goes_back_to_its_replica_with_its_full_blocks_cached(rsl_app):
    ids = _fresh(1)
    tag = uuid.uuid4().hex[:6]
    answers = [_completion(ids, f"{tag}-{i}") for i in range(3)]
    full = (len(ids) - 1) // BLOCK * BLOCK  # vLLM computes the last token again: its block is not a hit
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0, full, full]
    decisions = [_ingress().routing_decision.remote(f"{tag}-{i}").result() for i in range(3)]
    assert all(d is not None for d in decisions), decisions
    assert decisions[0]["matched_tokens"] == 0
    for d in decisions[1:]:
        assert d["replica_id"] == decisions[0]["replica_id"]
        assert d["reason"] == "prefix_hit" and d["matched_tokens"] == full, d
    state = _state()
    assert state["replica_blocks"][decisions[0]["replica_id"]] >= len(ids) // BLOCK  # from the engine's events
    assert state["router_error"] is None and state["event_path_alive"] is True
    # A report mode the relay cannot follow is refused by the engine replica, in OpenAI's shape.
    r = httpx.post(f"{BASE_URL}/v1/completions", timeout=120, json={
        "model": "tiny-qwen2", "prompt": ids, "max_tokens": 1, "vllm_xargs": {"kv_cache_report_mode": "full"}})
    assert r.status_code == 400 and "kv_cache_report_mode" in r.json()["error"]["message"], r.text


@pytest.mark.engine
def test_a_scale_up_replica_is_followed_from_its_first_event(rsl_app):
    before = set(_state()["subscribed"])
    import ray
    from ray.serve._private.common import DeploymentID
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller  # what Serve's REST scaling route calls
    ray.get(controller.update_deployment_replicas.remote(DeploymentID(name=ENGINE_DEPLOYMENT, app_name=APP), 3))
    state = _wait(3)
    assert before < set(state["subscribed"]), (before, state["subscribed"])  # the first two still serve
    (new,) = set(state["subscribed"]) - before
    assert state["replica_blocks"][new] == 0  # its engine has stored nothing yet
    tag = uuid.uuid4().hex[:6]
    for seed in range(100, 124):  # fresh prompts until one is placed on the new replica
        ids = _fresh(seed)
        _completion(ids, f"{tag}-{seed}")
        if _ingress().routing_decision.remote(f"{tag}-{seed}").result()["replica_id"] == new:
            break
    else:
        pytest.fail(f"no fresh prompt was placed on the new replica {new}")
    deadline = time.monotonic() + 10
    while _state()["replica_blocks"][new] < len(ids) // BLOCK and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _state()["replica_blocks"][new] == len(ids) // BLOCK  # every block it stored, from its first event
    again = _completion(ids, f"{tag}-again")
    d = _ingress().routing_decision.remote(f"{tag}-again").result()
    assert d["replica_id"] == new and d["reason"] == "prefix_hit"
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // BLOCK * BLOCK
