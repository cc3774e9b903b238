"""Ray's ``PrefixCacheAffinityRouter``, able to read prefix-serve's requests (A/B baseline).

Ray ships ``ray.serve.llm.request_router:PrefixCacheAffinityRouter`` (``rsl_prefix`` runs
it as is, in Ray Serve LLM's own app); this module subclasses the class that path
re-exports,
``ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter``,
to run it in our app.

Ray's router looks for a ``prompt`` or ``messages`` attribute on the request's
arguments and matches the *text* in a character prefix tree (an actor). Our
engine deployment receives an ``app.protocol.EngineRequest`` that carries only
token ids, so Ray's router would raise on every request (and a router that
raises leaves the request hanging). :class:`RayPrefixCacheAffinityRouter` hands
it a text rendering of the token ids -- ``" ".join(map(str, ids))``, prefixed by
``[salt] `` when the request has a ``cache_salt`` -- so equal token prefixes are
equal text prefixes. Ray's policy is unchanged. The subclass also creates the
prefix-tree actor with ``num_cpus=0`` (a default Ray actor needs a free CPU to
be placed, which the 2-CPU default deployment does not leave) under Ray's name
and namespace, and registers it for cleanup on ``serve.shutdown()`` as Ray does.

Serve pickles a request-router module BY VALUE into every process that routes:
this module keeps no globals beyond imports.
"""

from __future__ import annotations

from typing import Any, cast

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve.request_router import PendingRequest, RunningReplica


def token_text(request: Any) -> str | None:
    """Text rendering of an ``EngineRequest``-like object's prompt token ids (None if it has none)."""
    ids = getattr(request, "prompt_token_ids", None)
    if ids is None:
        return None
    text = " ".join(map(str, ids))
    salt = getattr(request, "cache_salt", None)
    return f"[{salt}] {text}" if salt else text


class RayPrefixCacheAffinityRouter(PrefixCacheAffinityRouter):
    """Ray's ``PrefixCacheAffinityRouter`` fed a text rendering of our token-id requests."""

    # Serve passes request_router_kwargs by keyword; every one goes on to Ray's initialize_state.
    def initialize_state(self, **kwargs: Any) -> None:  # type: ignore[override]
        if kwargs.get("tree_actor") is None:
            kwargs["tree_actor"] = self._create_tree_actor()
        super().initialize_state(**kwargs)

    def _create_tree_actor(self):
        """Ray's detached prefix-tree actor (same name and namespace), without a CPU reservation."""
        import ray
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTreeActor
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        parts = [SERVE_NAMESPACE]
        if self._deployment_id is not None:
            parts += [self._deployment_id.app_name, self._deployment_id.name]
        # @ray.remote made PrefixTreeActor an ActorClass; mypy keeps a decorated class's own type.
        actor = PrefixTreeActor.options(  # type: ignore[attr-defined]
            name="LlmPrefixTreeActor", namespace="::".join(p for p in parts if p),
            get_if_exists=True, lifetime="detached", num_cpus=0,
        ).remote()
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        ray.get(controller._register_shutdown_cleanup_actor.remote(actor))
        return actor

    def _extract_text_from_request(self, pending_request: PendingRequest) -> str:
        for arg in pending_request.args or ():
            text = token_text(arg)
            if text:
                return text
        return super()._extract_text_from_request(pending_request)

    # Ranks of replicas, as every RequestRouter; Ray's PrefixCacheAffinityRouter annotates a flat list.
    async def choose_replicas(  # type: ignore[override]
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

        try:
            ranks = await super().choose_replicas(candidate_replicas, pending_request)
            return cast("list[list[RunningReplica]]", ranks)
        except Exception:  # a request it cannot read: route it like Serve's default, never hang it
            # Serve's default policy borrowed as a function: it reads only RequestRouter state.
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(
                self, candidate_replicas, pending_request)  # type: ignore[arg-type]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        try:
            super().on_request_routed(pending_request, replica_id, result)
        except ValueError:
            pass
