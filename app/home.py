"""Where a stored response lives: the engine replica that answered it, named in its id.

vLLM's Responses API keeps a ``store: true`` response (and its input messages) in
the memory of the server that produced it; ``previous_response_id``, ``GET
/v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` read it there. With
several engine replicas, the request naming a stored response must reach that
replica, whichever ingress replica (and request router) it enters by. So the engine
replica that stores a response names itself in the response id (``home_id``) and
every router reads the home back out of the id (``home_of``): no directory to keep
in step across ingress replicas, nothing lost when a router restarts.

Format: ``<vLLM's id>.<replica id>``, e.g. ``resp_6f1c...e2.k3b9x0qa`` (a Serve
replica's ``unique_id``: 8 letters and digits). A home that is gone (the replica
stopped, or the id was never ours) is no error here: the request is routed as any
other and the replica it reaches answers with vLLM's own 404 "Response with id
... not found".
"""

from __future__ import annotations

import re

SEP = "."
_HOME = re.compile(r"\.([A-Za-z0-9]{1,64})$")


def home_id(response_id: str, replica_id: str) -> str:
    """``response_id`` naming ``replica_id`` as its home (unchanged if it already names it)."""
    return response_id if home_of(response_id) == replica_id else f"{response_id}{SEP}{replica_id}"


def home_of(response_id: str | None) -> str | None:
    """The replica id a response id names as its home, or None (no home in it)."""
    if not response_id:
        return None
    m = _HOME.search(response_id)
    return m.group(1) if m else None


def base_of(response_id: str) -> str:
    """``response_id`` without its home: the id the request was routed under."""
    m = _HOME.search(response_id)
    return response_id[:m.start()] if m else response_id
