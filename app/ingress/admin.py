"""The ingress's routes beside the generate API: probes, debug, metrics, models and the tokenizer.

``AdminRoutes`` is a base class of ``app.ingress.deployment.OpenAIIngress`` (Serve's class-based
ingress mounts the routes of every class in its MRO). It reads ``self.engine`` (the
engine deployment's handle), ``self.serving`` (``app.ingress.serving.OpenAIServing``),
``self.announcer`` (``app.ingress.targets.Announcer``) and ``self.args``.

- ``GET /health``: liveness (this ingress replica is up; the engines may still be loading);
  ``GET|POST /ping`` the same, as vLLM answers it; ``GET /version``: vLLM's version.
- ``GET /ready``: readiness (no API key); see ``ready``.
- ``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``: vLLM's runtime adapter routes, on
  every engine replica (``app.adapters``);
- ``GET /load``: vLLM's server load, per engine replica and in sum; ``POST /reset_prefix_cache``:
  vLLM's reset, on every engine replica (``app.ingress.broadcast``).
- ``GET /debug/routing``, ``GET /debug/routing/decisions/{id}``: the routers' state and
  a request's routing decision.
- ``GET /metrics``: this replica's Prometheus metrics; ``GET /metrics/engines`` and
  ``GET /metrics/ingresses``: every replica's own endpoint (Prometheus ``http_sd_configs``).
- ``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize`` (also under ``/v1/``): vLLM's.

The routers' state is read on each router's own loop (``router.ask``): the ingress never
touches it from its own.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import Request
from starlette.responses import Response

from app import metrics
from app.errors import OpenAIError, error_body
from app.ingress.http_app import fastapi_app, read_body
from app.ingress.results import JSONResponse, json_response

logger = logging.getLogger("prefix_serve.ingress")
READY_ENGINE_TIMEOUT_S = 2.0
"""How long ``GET /ready`` waits for an engine replica to answer when this process has no router yet."""
RESET_TRIES, RESET_RETRY_S = 3, 0.5
"""How often ``POST /reset_prefix_cache`` asks a replica that refused, and how far apart."""
PUBLIC_PATHS = frozenset({"/ready", "/ping", "/version"})
"""Routes served without the API key (probes carry no credentials; vLLM's server asks for the key
under ``/v1`` only)."""
METRICS_PATHS = frozenset({"/metrics", "/metrics/engines", "/metrics/ingresses"})
"""Routes served without the API key when ``metrics_public`` is set."""


async def ask_router(router: Any, fn: Any) -> Any:
    """``fn()`` run on the router's own event loop (its state's owner), when it has one."""
    ask = getattr(router, "ask", None)
    return await ask(fn) if ask is not None else fn()


async def _awaited(response: Any) -> Any:
    """``await response`` as a coroutine (for ``asyncio.wait_for`` on a Serve ``DeploymentResponse``)."""
    return await response


def sd_targets(targets: dict[str, str]) -> list[dict[str, Any]]:
    """Prometheus ``http_sd_configs`` entries, one per ``replica_id -> host:port``, labelled ``replica``."""
    return [{"targets": [hostport], "labels": {"replica": uid}} for uid, hostport in sorted(targets.items())]


class AdminRoutes:
    """Probe, debug, metrics, model-list and tokenizer routes (see module doc)."""

    engine: Any
    serving: Any
    announcer: Any
    args: Any

    @fastapi_app.get("/health")
    async def health(self) -> dict[str, str]:
        """Liveness: this ingress replica is up (the engines may still be loading)."""
        return {"status": "ok"}

    @fastapi_app.api_route("/ping", methods=["GET", "POST"])
    async def ping(self) -> Response:
        """vLLM's ``/ping`` (SageMaker's probe, GET or POST): 200 with an empty body while this
        ingress replica is up."""
        return Response(status_code=200)

    @fastapi_app.get("/version")
    async def version(self) -> dict[str, str]:
        """vLLM's ``/version``: the vLLM version the engines run."""
        from vllm.version import __version__

        return {"version": __version__}

    @fastapi_app.get("/load")
    async def load(self) -> dict[str, Any]:
        """vLLM's ``/load`` (``{"server_load": requests in flight}``), summed over the engine replicas,
        with each replica's own figure under ``replicas``: its running and waiting requests as it last
        reported them to the routers (about every 10 s: Serve's routing-stats period)."""
        from app.ingress.broadcast import replica_ids

        await replica_ids(self.engine)  # a router exists from here on
        loads: dict[str, int] = {}
        for router in list(metrics.ROUTERS):
            report = getattr(router, "replica_loads", None)
            if report is not None:
                loads.update(await ask_router(router, report))
        return {"server_load": sum(loads.values()), "replicas": dict(sorted(loads.items()))}

    @fastapi_app.post("/reset_prefix_cache")
    async def reset_prefix_cache(self, reset_running_requests: bool = False,
                                 reset_external: bool = False) -> dict[str, Any]:
        """vLLM's ``/reset_prefix_cache`` on every engine replica (``app.ingress.broadcast``): ``{"success": true}``
        when each one reset, with each replica's answer under ``replicas``. vLLM refuses a reset
        (``success: false``) while blocks are held by running requests, unless ``reset_running_requests``;
        ``reset_external`` also resets the host-memory tier. Each engine publishes ``AllBlocksCleared``:
        every router's index drops the replica's blocks. A replica that refused is asked again, up to
        ``RESET_TRIES`` times ``RESET_RETRY_S`` apart (vLLM: "callers may retry"): blocks of requests that
        just ended can still be held for a step."""
        from app.ingress.broadcast import to_every_replica

        body = {"reset_running_requests": reset_running_requests, "reset_external": reset_external}
        answers = await to_every_replica(self.engine, "reset_prefix_cache", body)
        for _ in range(RESET_TRIES - 1):
            again = [uid for uid, a in answers.items() if a.get("success") is not True]
            if not again:
                break
            await asyncio.sleep(RESET_RETRY_S)
            answers.update(await to_every_replica(self.engine, "reset_prefix_cache", body, again))
        ok = bool(answers) and all(a.get("success") is True for a in answers.values())
        return {"success": ok, "replicas": answers}

    @fastapi_app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's runtime adapter load (``{"lora_name", "lora_path", "load_inplace"}``), on every engine
        replica and on every one started later (``app.adapters``), or, with ``"replicas": [ids]``, on those
        replicas only (a replica started later does not load it): vLLM's ``Success: ...``
        text, or the replicas' error. 404 unless ``serving.allow_runtime_lora_updating`` (vLLM: no such
        route)."""
        return await self._lora_adapter("load", request)

    @fastapi_app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's runtime adapter unload (``{"lora_name"}``), from every engine replica."""
        return await self._lora_adapter("unload", request)

    async def _lora_adapter(self, op: str, request: Request) -> Response:
        from pydantic import ValidationError
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

        from app import adapters
        from app.ingress.broadcast import to_every_replica
        from app.ingress.prepare import decode, validation_error

        if not self.args.serving.allow_runtime_lora_updating:
            raise OpenAIError(f"Not Found: no route POST {request.url.path} (runtime LoRA updating is off: "
                              "serving.allow_runtime_lora_updating)", 404, "NotFoundError")
        raw = await read_body(request, self.args.max_request_body_bytes)
        try:
            fields = decode(raw)
            body = (LoadLoRAAdapterRequest if op == "load" else UnloadLoRAAdapterRequest).model_validate(fields)
        except ValidationError as e:
            return json_response(validation_error(e))
        only = fields.get("replicas") if op == "load" else None
        if only is not None:  # this app's extension: these replicas only, and no replica started later
            from app.ingress.broadcast import replica_ids

            running = await replica_ids(self.engine)
            if not isinstance(only, list) or not only or not all(isinstance(u, str) for u in only):
                raise OpenAIError("replicas: a non-empty list of engine replica ids", 400, param="replicas")
            if missing := sorted(set(only) - set(running)):
                raise OpenAIError(f"replicas: no engine replica {', '.join(missing)} is running (running: "
                                  f"{', '.join(running)}; GET /load lists them)", 404, "NotFoundError", "replicas")
        app_name = self.serving.app_name
        book = adapters.book(app_name, create=True)
        earlier = await book.entry.remote(body.lora_name)  # (path, replicas) before this call, or None
        path = getattr(body, "lora_path", None)
        if op == "load":  # first: a replica starting now loads it too (unless the load names replicas)
            await book.add.remote(body.lora_name, path, only)
        elif op == "unload":
            await book.remove.remote(body.lora_name)
        answers = await to_every_replica(self.engine, "lora_adapter", (op, body), only)
        done = [a["ok"] for a in answers.values() if "ok" in a]
        errors = {}  # vLLM's error body, or one for a call that failed (a lost replica) or went astray
        for uid, a in answers.items():
            if "ok" not in a:
                vllms = a.get("error")
                errors[uid] = vllms if isinstance(vllms, dict) else error_body(
                    f"engine replica {uid}: {vllms or a}", 500)
        if op == "load" and not done and earlier != (path, only):  # loaded nowhere: the book as it was
            await (book.add.remote(body.lora_name, *earlier) if earlier is not None else book.remove.remote(
                body.lora_name))
        if not answers:
            raise OpenAIError("no engine replica is running", 503, "ServiceUnavailableError")
        if not errors:
            return Response(done[0], status_code=200)
        uid, first = next(iter(errors.items()))
        if not done:  # every replica refused alike (a bad path, a duplicate name): vLLM's own answer
            return JSONResponse(first, status_code=int(first["error"]["code"]))
        message = (f"{op}ed on {len(done)} of {len(answers)} engine replicas; replica {uid}: "
                   f"{first['error']['message']}")
        return JSONResponse(error_body(message, 500), status_code=500)

    @fastapi_app.get("/ready")
    async def ready(self):
        """Readiness: can this ingress serve a request now?

        200 ``{"status": "ready", "routers": [<each router's readiness detail>], ...}``
        once the engines can serve and every request router of this process is
        subscribed (every engine replica it knows loaded, warmed up, its KV-event
        snapshot applied) and the configured warm-up prompts are prefilled
        (``app.ingress.warmup``; ``"warmup": {"state", "done", "total", "requests_done", "failed", "short",
        "prefill_tokens"}``, and per prompt its holders once done); with re-warm or replication on, ``"rewarm":
        {"joins", "leaves", "copies", "recent": [each join, leave or copy: its replica, state, requests and
        prefill tokens]}``;
        otherwise 503 with an OpenAI error body (``ServiceUnavailableError``) whose message
        says what is missing (``warming up: 2 of 4 prompts done``, with ``"warmup"`` beside
        ``"error"``). Answers within about ``READY_ENGINE_TIMEOUT_S``; needs no API key.
        """
        ready, detail = await self._readiness()
        if ready:
            return {"status": "ready", **detail}
        response = error_body(detail["reason"], 503, "ServiceUnavailableError")
        if "warmup" in detail:
            response["warmup"] = detail["warmup"]
        return JSONResponse(response, status_code=503)

    async def _readiness(self) -> tuple[bool, dict[str, Any]]:
        """``(ready, detail)``: the router's readiness (``_router_readiness``), then the warm-up's
        (``app.ingress.warmup``, when this ingress has one): not ready while it runs, ``detail["warmup"]``
        saying how far it got."""
        ready, detail = await self._router_readiness()
        warmup = getattr(self, "warmup", None)
        if not ready or warmup is None:
            return ready, detail
        warmup.start()  # normally started with the replica; here if that found no running loop
        if warmup.cfg.warmup.rewarm or warmup.cfg.warmup.replicate:
            detail = {**detail, "rewarm": warmup.progress.rewarm_detail()}
        if not warmup.progress.total:
            return ready, detail
        progress = warmup.progress.detail()
        if not warmup.finished:
            return False, {"reason": f"warming up: {progress['done']} of {progress['total']} prompts done",
                           "warmup": progress}
        return True, {**detail, "warmup": progress}

    async def _router_readiness(self) -> tuple[bool, dict[str, Any]]:
        """``(ready, detail)``; ``detail["reason"]`` says what is missing when not ready.

        Serve creates the engine handle's request router with the handle's first
        call, so with no router in this process yet the engines are asked first
        (``VLLMEngine.readiness``). Then every router in ``metrics.ROUTERS`` must
        report ready (``router.readiness() -> (bool, detail)``). If the call made no
        router of ours (a baseline router of the A/B harness), the engine's answer decides.
        """
        detail: dict[str, Any] = {}
        if not metrics.ROUTERS:
            ready, engine = await self._engine_readiness()
            if not ready:
                return False, engine
            detail["engine"] = engine
        states = []
        for router in list(metrics.ROUTERS):
            check = getattr(router, "readiness", None)
            if check is None:
                return False, {"reason": f"request router {type(router).__name__} has no readiness() check"}
            try:
                ok, state = await ask_router(router, check)
            except Exception as e:  # noqa: BLE001 - a router bug must not fail the probe with a 500
                logger.exception("router readiness check failed")
                return False, {"reason": f"request router readiness check failed: {type(e).__name__}"}
            if not ok:
                return False, {"reason": f"request router not ready: {state.get('reason') or 'unknown'}"}
            states.append(state)
        return True, {"routers": states, **detail} if states else detail

    async def _engine_readiness(self) -> tuple[bool, dict[str, Any]]:
        """``(True, the engine replica's answer)``, or ``(False, {"reason": ...})``; at most
        ``READY_ENGINE_TIMEOUT_S``."""
        response = self.engine.readiness.remote()
        try:
            engine = await asyncio.wait_for(_awaited(response), READY_ENGINE_TIMEOUT_S)
        except asyncio.TimeoutError:
            response.cancel()
            return False, {"reason": f"engines not running yet: no engine replica answered within "
                                     f"{READY_ENGINE_TIMEOUT_S:g} s"}
        except Exception as e:  # noqa: BLE001 - a replica dying or still starting: not ready, say why
            cause = getattr(e, "cause", None) or e
            return False, {"reason": f"engines not running yet: readiness call failed: {type(cause).__name__}"}
        engine = engine if isinstance(engine, dict) else {"ready": bool(engine)}
        if engine.get("ready"):
            return True, engine
        if engine.get("reason"):
            why = engine["reason"]
        elif not engine.get("warmed", True):
            why = "warming up"
        elif not engine.get("relay_alive", True):
            why = "its KV-event relay is not running"
        else:
            why = "loading"
        return False, {"reason": f"engine replica not ready: {why}"}

    @fastapi_app.get("/debug/routing")
    async def debug_routing(self) -> dict[str, Any]:
        """Index and event-path state of every request router in this ingress process."""
        return {"routers": [await ask_router(r, r.snapshot) for r in list(metrics.ROUTERS)]}

    @fastapi_app.get("/debug/routing/decisions/{request_id}")
    async def debug_decision(self, request_id: str) -> dict[str, Any]:
        """How the request with this response ``id`` was routed (recent requests only). A stored
        response's id names its home replica (``app.home``); it was routed under the id without it."""
        from app.home import base_of

        found: list[dict[str, Any]] = []
        ids = [request_id] if base_of(request_id) == request_id else [base_of(request_id), request_id]
        for router in list(metrics.ROUTERS):  # the create first: retrieves and cancels come after it
            for rid in ids:
                found += await ask_router(router, lambda r=router, rid=rid: r.decisions_for(rid))
        if found:  # a client may send two requests under one id: the newest, with the others named
            return {**found[-1], "earlier": found[:-1]} if len(found) > 1 else found[-1]
        raise OpenAIError(f"no routing decision recorded for request `{request_id}`", 404)

    @fastapi_app.get("/metrics")
    async def prometheus_metrics(self) -> Response:
        """Prometheus text format: router, ingress and process metrics of this replica."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        for router in list(metrics.ROUTERS):
            try:
                await ask_router(router, router.export_gauges)
            except Exception:  # noqa: BLE001 - a scrape still answers, with that router's gauges as they were
                logger.exception("refreshing a router's gauges failed")
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @fastapi_app.get("/metrics/engines")
    async def engine_metrics_targets(self) -> list[dict[str, Any]]:
        """Engine replicas' metrics endpoints in Prometheus ``http_sd_configs`` format."""
        targets: dict[str, str] = {}
        for router in list(metrics.ROUTERS):
            targets.update(await ask_router(router, router.engine_metrics_targets))
        return sd_targets(targets)

    @fastapi_app.get("/metrics/ingresses")
    async def ingress_metrics_targets(self) -> list[dict[str, Any]]:
        """Ingress replicas' own metrics endpoints in Prometheus ``http_sd_configs``
        format, each labelled ``replica`` (``app.ingress.targets``)."""
        return sd_targets(await self.announcer.targets())

    @fastapi_app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        """vLLM's model list: the base model, then the configured LoRA adapters."""
        return (await self.serving.models()).model_dump()

    @fastapi_app.post("/tokenize")
    @fastapi_app.post("/v1/tokenize")
    async def http_tokenize(self, request: Request) -> JSONResponse:
        """vLLM's ``/tokenize`` (completion or chat shape), answered by vLLM's ``ServingTokenization``."""
        from pydantic import TypeAdapter
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeRequest

        raw = await read_body(request, self.args.max_request_body_bytes)
        return json_response(await self.serving.tokenization(raw, TypeAdapter(TokenizeRequest), "create_tokenize",
                                                             request))

    @fastapi_app.post("/detokenize")
    @fastapi_app.post("/v1/detokenize")
    async def http_detokenize(self, request: Request) -> JSONResponse:
        """vLLM's ``/detokenize``, answered by vLLM's ``ServingTokenization``."""
        from pydantic import TypeAdapter
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest

        raw = await read_body(request, self.args.max_request_body_bytes)
        return json_response(await self.serving.tokenization(raw, TypeAdapter(DetokenizeRequest),
                                                             "create_detokenize", request))
