"""Optional bearer API key for every route of the ingress.

The key is read from the environment variable named by ``AppArgs.api_key_env``
(default ``PREFIX_SERVE_API_KEY``) in each ingress process; it is never part of
the app args, logs or spans. Comparison is constant-time (``hmac.compare_digest``).
State lives in this module, not in ``app.ingress.deployment``: Serve pickles the FastAPI app
(and the middleware with it) by value, so only a module imported by reference is
shared with the replica that configures it.
"""

from __future__ import annotations

import hmac
import os
from typing import TypedDict

from app.errors import error_body


class _State(TypedDict):
    key: str | None
    public: frozenset[str]


_state: _State = {"key": None, "public": frozenset()}


def configure(env_var: str, public_paths: frozenset[str] = frozenset()) -> bool:
    """Load the key from ``env_var``; returns True if requests must carry it."""
    _state["key"] = os.environ.get(env_var) or None
    _state["public"] = public_paths
    return _state["key"] is not None


def required() -> bool:
    """True if this process has a key configured (requests outside the public paths must carry it)."""
    return _state["key"] is not None


def rejection(path: str, authorization: str | None) -> tuple[dict, int] | None:
    """``(OpenAI error body, 401)`` if the request must be refused, else None."""
    key = _state["key"]
    if not key or path in _state["public"]:
        return None
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), str(key).encode()):
        return None
    return error_body("Invalid or missing API key: send `Authorization: Bearer <key>`.", 401), 401
