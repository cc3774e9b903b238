"""The direct path, with the app's routing work on HAProxy's router hop: what it would cost, measured.

``python -m bench.serving_overhead --app-kind serve-direct`` runs this Serve application in place
of prefix-serve, beside vLLM's bare server. It is the design issue 34 names, built far enough to
measure its cost per request and per token, before the app is rebuilt on it:

- the engine replica is ``bench.serve_vllm``'s (vLLM's ``AsyncLLM`` and vLLM's own OpenAI app as
  the replica's late-bound ASGI ingress), so the tokens go engine -> replica's HTTP server ->
  HAProxy -> client, as in the floor (``--app-kind serve-vllm``);
- and it is picked per request through Ray Serve 2.60's ingress-request-router hook
  (``Application._with_ingress_request_router``, the hook Ray Serve LLM's direct streaming uses):
  HAProxy's Lua action posts each request's body (``RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1``)
  to ``POST /internal/route`` on the ``DirectRouter`` replica, on a new TCP connection, and forwards
  the request to the replica whose actor name comes back (``{"replica_id": ...}``);
- ``/internal/route`` does the routing work the app's ingress does today: vLLM's request model and
  renderer over the body (``app.ingress.prepare.Preparer``: the body decoded once, the prompt rendered
  once; the bench's prompts are token ids, so nothing is tokenized from text), the prompt's block keys
  (``routing.block_keys``), and the policy's choice (``routing.router_state.RouterState.choose``) over
  the replica Serve picks (``DeploymentHandle.choose_replica`` with ``_reserve=False``, as Ray Serve
  LLM's ``LLMRouter``), whose actor name it answers.

What it leaves out, as a measurement: the policy chooses among one candidate, Serve's pick (so with
more than one engine replica it would not route by prefix: ``choose`` over N candidates is ``make
bench``'s measure); the engine renders the prompt again (the router's ids do not reach it); the
router's record of each request ends when it answers (no first-token or completion signal comes back,
so its load numbers are not the engine's); no KV-event relay runs, so the index holds only the
router's own predictions of what each request adds. This measures what the hop, the parsing and the
rendering cost on the token path's machine.

Bench-only: not part of the app, not in ``serve_config.yaml``. HAProxy routes only POSTs through the
router (its Lua action runs ``if METH_POST``); a GET, such as the readiness probe (vLLM's ``/health``),
goes to an engine replica directly.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from bench.serve_vllm import VLLMInServe

logger = logging.getLogger("ray.serve")

FORWARD_BODY = "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY"
"""Ray Serve's switch that makes HAProxy's Lua action forward the request's body to ``/internal/route``
(``ray/serve/_private/constants.py``); without it the router sees an empty body."""

router_app = FastAPI()


def request_kind(body: dict[str, Any]) -> str:
    """The API a routed body is for, as ``app.ingress.prepare`` names it, from the body's fields: HAProxy's
    hook forwards the body, not the path (``messages``: a chat completion; otherwise a completion)."""
    from app.ingress.prepare import CHAT, COMPLETION

    return CHAT if "messages" in body else COMPLETION


class DirectRouter:
    """The ingress request router of ``build`` (see the module doc): ``POST /internal/route`` (``build`` makes
    it Serve's ingress over ``router_app``).

    Args:
        engine: the handle of the engine deployment (``VLLMInServe``), for Serve's view of its replicas.
        args: the app args of ``serve_config.yaml``, as a dict, plus the bench-only key
            ``direct_router_work``: ``"route"`` (default: the routing work of the module doc) or
            ``"none"`` (Serve's pick alone, the body unread: the hop's own cost, a lower bound of Ray
            Serve LLM's ``LLMRouter`` with its default router, which also decodes the body).

    Raises:
        ValueError: ``direct_router_work`` is neither.
    """

    def __init__(self, engine: DeploymentHandle, args: dict[str, Any]):
        from app.config import AppArgs
        from app.frontend import Renderer
        from app.ingress.prepare import Preparer

        args = dict(args)
        self.work = args.pop("direct_router_work", "route")
        if self.work not in ("route", "none"):
            raise ValueError(f"direct_router_work is 'route' or 'none', not {self.work!r}")
        cfg = AppArgs.model_validate(args)
        self.preparer = Preparer(cfg, Renderer(cfg))
        self.block_size = cfg.engine.block_size
        self.state = cfg.router.router_state(random.Random(0))
        self.engine = engine
        self.routed = 0
        """Requests routed with the routing work (``direct_router_work: route``)."""
        self.unprepared = 0
        """Of those, bodies not prepared (routed by load; the first is logged)."""
        self._followed: set[str] = set()

    @router_app.post("/internal/route")
    async def route(self, request: Request) -> Any:
        if self.work == "none":
            async with self.engine.choose_replica(_reserve=False) as selection:
                return JSONResponse({"replica_id": selection._replica.replica_id.to_full_id_str()})
        from app.ingress.prepare import decode
        from app.ingress.results import Failed
        from app.protocol import EngineRequest

        raw = await request.body()
        self.routed += 1
        route_id = f"direct-{self.routed}"
        prepared: Any = None
        if raw:  # a POST without a body: routed by load
            try:
                body = decode(raw)
                prepared = await self.preparer.prepare(request_kind(body), body)
            except Exception as e:  # noqa: BLE001 - the engine's own app answers the bad body
                prepared = e
            if not isinstance(prepared, EngineRequest):  # not prepared (Failed or an error): by load
                self.unprepared += 1
                if self.unprepared == 1:
                    detail = prepared.body() if isinstance(prepared, Failed) else repr(prepared)
                    logger.warning("direct router: a body was not prepared (%s); routed by load", detail)
                prepared = None
        async with self.engine.choose_replica(_reserve=False) as selection:
            replica = selection._replica
            uid = replica.replica_id.unique_id
            if uid not in self._followed:
                self.state.follow_in_order(uid)  # no relay runs: a feed that is in order and empty
                self._followed.add(uid)
            self._decide(route_id, prepared, uid, replica.routing_stats, replica.max_ongoing_requests)
            return JSONResponse({"replica_id": replica.replica_id.to_full_id_str()})

    def _decide(self, route_id: str, prepared: Any, uid: str, stats: dict[str, Any], max_ongoing: int) -> None:
        """The app's routing work for one request (keys and ``RouteRequest`` as
        ``app.router.prefix_affinity.PrefixAffinityRouter._route_request`` makes them; ``prepared`` ``None``:
        no keys), over the one candidate Serve picked; the record ends at once (the module doc)."""
        from routing.block_keys import block_keys
        from routing.candidate_set import Candidate, CandidateSet
        from routing.router_state import RouteRequest

        if prepared is None:
            request = RouteRequest((), 1, self.block_size)
        else:
            ids = prepared.prompt_token_ids
            keys = block_keys(ids, self.block_size, cache_salt=prepared.cache_salt,
                              lora_name=prepared.lora_name, lora_path=prepared.lora_path)
            request = RouteRequest(keys, len(ids), self.block_size, prepared.prefill_tokens,
                                   prepared.bypass_cache, prepared.request_id)
        now = time.time()
        try:
            decision = self.state.choose(route_id, request, CandidateSet([Candidate(uid, stats, max_ongoing)]),
                                         now, time.time_ns())
            self.state.routed(route_id, decision.replica_id, now)
        finally:
            self.state.completed(route_id, now)

    @router_app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}


def build(args: dict[str, Any]) -> Application:
    """The engine replica as the ingress, ``DirectRouter`` as its ingress request router (``serve run``
    import path ``bench.serve_direct:build``); Serve must run with ``RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1``
    (``bench.serving_overhead`` sets it for this kind)."""
    engine = serve.deployment(name="VLLMInServe", num_replicas=1, max_ongoing_requests=256,
                              ray_actor_options={"num_cpus": 0.5})(serve.ingress()(VLLMInServe)).bind(args)
    router = serve.deployment(name="DirectRouter", num_replicas=1, max_ongoing_requests=1024,
                              ray_actor_options={"num_cpus": 0})(serve.ingress(router_app)(DirectRouter))
    return engine._with_ingress_request_router(router.bind(engine, args))
