"""One call to every engine replica: the admin operations that concern each engine, not one request.

vLLM's server has one engine; ``POST /reset_prefix_cache`` (and, later, adapters loaded
at run time) must reach every engine replica here. Serve's handle sends a call to one
replica of its router's choosing, so each call is pinned: it carries the replica's id
as ``EngineRequest.home_replica``, which the prefix-affinity router honours (``[[that
replica]]``), and the engine method checks that it is the replica named (a replica
that left between the listing and the call is reported, not silently stood in for).

The replica ids come from this process's request routers (``metrics.ROUTERS``), each
asked on its own loop. Serve creates a handle's router with its first call, so with
no router yet the engines are asked for their readiness first (one call), which
makes it.
"""

from __future__ import annotations

import asyncio
import uuid
from array import array
from typing import Any

from app import metrics
from app.protocol import EngineRequest

CALL_TIMEOUT_S = 60.0
"""Longest one replica's answer is awaited."""


async def replica_ids(engine: Any) -> list[str]:
    """The engine replicas this process's routers know (sorted ids); makes a router if there is none."""
    if not metrics.ROUTERS:
        await engine.readiness.remote()
    ids: set[str] = set()
    for router in list(metrics.ROUTERS):
        known = getattr(router, "replica_ids", None)
        if known is not None:
            ids.update(await router.ask(known))
    return sorted(ids)


async def to_every_replica(engine: Any, method: str, body: Any,
                           only: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """``{replica id: its answer}`` of ``method(EngineRequest(body=body, home_replica=id))`` on every
    engine replica (or on those of ``only`` that run), called at once; a failed or late call answers
    ``{"error": "<why>"}``."""
    uids = await replica_ids(engine)
    if only is not None:
        uids = [u for u in uids if u in only]

    async def call(uid: str) -> dict[str, Any]:
        request = EngineRequest(request_id=f"{method}-{uuid.uuid4().hex}", prompt_token_ids=array("I"), body=body,
                                home_replica=uid)
        try:
            return await asyncio.wait_for(_awaited(getattr(engine, method).remote(request)), CALL_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - one replica's failure is its answer, the others still count
            return {"error": f"{type(e).__name__}: {e}"[:500]}

    answers = await asyncio.gather(*(call(u) for u in uids))
    return dict(zip(uids, answers, strict=True))


async def _awaited(response: Any) -> Any:
    return await response
