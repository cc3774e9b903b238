"""Ray Serve LLM's own OpenAI app (``ray.serve.llm.build_openai_app``) on the app's model and engine flags.

``python -m bench.serving_overhead --app-kind ray-serve-llm`` runs this Serve application in
place of prefix-serve, beside vLLM's bare server: the framework this project's users are
offered for the same job, measured on the same machine, load and engine (issues 34 and 37):

- one ``LLMConfig``: the model and served name of ``serve_config.yaml``, its engine flags as
  vLLM engine arguments (``engine_kwargs``: block size, context length, KV blocks, batch size,
  prefix caching, eager mode, seed 0: what ``bench.vllm_server.command`` gives vLLM's bare
  server), its engine replicas' count, CPUs, GPUs and ``max_ongoing_requests`` (one replica for
  ``bench.serving_overhead``), each in one placement bundle (Ray Serve LLM infers the CPU
  accelerator from CPU-only bundles);
- Ray Serve LLM's own ingress (``OpenAiIngress``) and its default request router, so the tokens
  go engine -> ``LLMServer`` replica -> ingress replica -> HAProxy -> client under the app's
  serving-path settings (``infra.ray_env``).

Bench-only: not part of the app. Ray Serve LLM imports ``pyarrow``, which ``ray[serve]`` does not
install: the ``bench`` extra does (``make install``). Its ``/v1/models`` answers before its engine
replica is up, so ``bench.serving_overhead`` waits for a first completion (``vllm_server.warm_until``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ray.serve import Application

REPO = Path(__file__).resolve().parents[1]
COMPAT = REPO / "bench" / "rsl_compat"
"""On the ``PYTHONPATH`` of the app's processes: its ``sitecustomize`` maps the one vLLM module Ray
2.60's KV-aware tokenizer looks for at its old path (see that file)."""
DIRECT_STREAMING = "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING"
"""Ray Serve LLM's switch for direct streaming (``ray/llm/_internal/serve/constants.py``)."""


def llm_config(args: dict[str, Any]) -> dict[str, Any]:
    """The ``LLMConfig`` (as a dict) of the app args ``args`` (``serve_config.yaml``'s: ``model``,
    ``served_model_name``, ``engine``, ``engine_replicas``: a fixed ``num_replicas``, and ``num_cpus``
    and ``num_gpus``, each replica's placement bundle, and ``max_ongoing_requests``), plus the
    bench-only key ``rsl``: ``{"request_router_class": import path, "request_router_kwargs": {...}}``,
    the request router of the engine deployment (default: Ray Serve LLM's own, power of two choices).

    The engine flags are ``bench.vllm_server.command``'s (``enable_prompt_tokens_details``, a flag
    of vLLM's OpenAI server, goes to Ray Serve LLM's frontend arguments), so each answer's
    ``usage.prompt_tokens_details.cached_tokens`` reports the prefix-cache hit as ours does.

    Raises:
        KeyError: ``args`` lacks ``engine``.
        pydantic.ValidationError: ``args`` (less ``rsl``) are not valid app args.
        ValueError: an autoscaled engine deployment (no fixed count).
    """
    engine = args["engine"]
    kwargs: dict[str, Any] = {
        "block_size": engine["block_size"], "max_model_len": engine["max_model_len"],
        "gpu_memory_utilization": engine["gpu_memory_utilization"], "max_num_seqs": engine["max_num_seqs"],
        "enable_prefix_caching": True, "enforce_eager": True, "seed": 0,
        "kv_cache_dtype": engine.get("kv_cache_dtype", "auto"), "enable_prompt_tokens_details": True,
    }
    for key in ("num_gpu_blocks_override", "kv_cache_memory_bytes"):
        if engine.get(key) is not None:
            kwargs[key] = engine[key]
    from app.config import AppArgs

    app = AppArgs.model_validate({k: v for k, v in args.items() if k != "rsl"})  # our app's defaults and checks
    replicas = app.engine_replicas
    if replicas.num_replicas is None:
        raise ValueError("Ray Serve LLM's app here takes a fixed engine_replicas.num_replicas, not autoscaling")
    deployment: dict[str, Any] = {"num_replicas": replicas.num_replicas,
                                  "max_ongoing_requests": replicas.max_ongoing_requests,
                                  "ray_actor_options": {"num_cpus": 0.25}}
    bundle = {"CPU": replicas.num_cpus, **({"GPU": replicas.num_gpus} if replicas.num_gpus else {})}
    router = args.get("rsl") or {}
    if router.get("request_router_class"):
        deployment["request_router_config"] = {
            "request_router_class": router["request_router_class"],
            "request_router_kwargs": dict(router.get("request_router_kwargs") or {})}
    return {
        "model_loading_config": {"model_id": app.served_model_name, "model_source": app.resolved_model()},
        # Ray 2.60's KV-aware tokenizer on vLLM 0.32: one module path that moved (bench/rsl_compat),
        # before the cluster's own PYTHONPATH (Ray expands ${PYTHONPATH}).
        "runtime_env": {"env_vars": {"PYTHONPATH": f"{COMPAT}:${{PYTHONPATH}}"}},
        "engine_kwargs": kwargs,
        "placement_group_config": {"bundles": [bundle]},
        "deployment_config": deployment,
    }


def build(args: dict[str, Any]) -> Application:
    """Ray Serve LLM's OpenAI app over ``llm_config(args)`` (``serve run`` import path ``bench.serve_rsl:build``).

    With ``RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1`` in the app's environment (read as Ray Serve LLM
    reads it), Ray Serve LLM's direct streaming: the engine replicas are the ingress, behind HAProxy
    and its ingress request router (``LLMRouter``), and there is no ingress deployment to configure.
    """
    from ray.serve.llm import build_openai_app

    if os.environ.get(DIRECT_STREAMING, "0") == "1":
        return build_openai_app({"llm_configs": [llm_config(args)]})
    return build_openai_app({"llm_configs": [llm_config(args)],
                             "ingress_deployment_config": {"max_ongoing_requests": 1024,
                                                           "ray_actor_options": {"num_cpus": 0.25}}})
