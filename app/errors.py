"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a status.

The shape is OpenAI's and vLLM's ``ErrorResponse``. Most errors are vLLM's own
(its serving layer answers every request); the ones this app raises itself (body
not JSON or too large, missing API key, unknown debug id, a lost engine replica)
use vLLM's names for ``type`` (``vllm.entrypoints.serve.create_error_response``):
``BadRequestError`` (4xx caused by the client), ``AuthenticationError`` (401),
``NotFoundError`` (404), ``RateLimitError`` (429), ``ServiceUnavailableError`` (503)
and ``InternalServerError`` (other 5xx).

Handle callers (``serve.get_app_handle("prefix-serve").chat.remote(body)``) get the
``OpenAIError`` the ingress raised as Ray's ``RayTaskError(OpenAIError)``: a subclass
of both, so ``except OpenAIError as e`` catches it and ``e.status``, ``e.err_type``,
``e.message``, ``e.param`` and ``e.body()`` read the original's (Ray forwards
attribute lookups to the cause); ``str(e)`` is Ray's text with the remote traceback.
``ClientErrorLogFilter`` keeps the traceback of a 4xx out of the ingress's log.
"""

from __future__ import annotations

import logging
from typing import Any

SERVE_LOGGER = "ray.serve"
"""The logger Ray Serve's replica logs a failed handle call on ("Request failed.",
with the exception's traceback: ``ray/serve/_private/replica.py``)."""


class OpenAIError(Exception):
    """An error to send to the client as OpenAI JSON with an HTTP status.

    Args:
        message: what went wrong, for the client.
        status: the HTTP status (4xx: the client's request; 5xx: the service).
        err_type: OpenAI/vLLM error type; by default derived from ``status``.
        param: the request field at fault, if any.
    """

    def __init__(self, message: str, status: int = 400, err_type: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.err_type = err_type or _default_type(self.status)
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.err_type, self.param)

    def __reduce__(self):  # survive pickling across Ray processes
        return (OpenAIError, (self.message, self.status, self.err_type, self.param))


def _default_type(status: int) -> str:
    if status == 401:
        return "AuthenticationError"
    if status == 404:
        return "NotFoundError"
    if status == 429:
        return "RateLimitError"
    if status == 503:
        return "ServiceUnavailableError"
    if status >= 500:
        return "InternalServerError"
    return "BadRequestError"


def error_body(message: str, status: int, err_type: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The JSON body for an error; ``code`` is the HTTP status, as vLLM sends it."""
    return {
        "error": {
            "message": message,
            "type": err_type or _default_type(status),
            "param": param,
            "code": int(status),
        }
    }


class ClientErrorLogFilter(logging.Filter):
    """Drops the traceback of a client error (``OpenAIError`` with status < 500) from a log record.

    Ray Serve logs every exception a handle call raises with its traceback
    (``logger.exception("Request failed.")`` on the ``ray.serve`` logger). For a
    bad request that is noise: the record keeps its level and message, with
    `` (OpenAIError <status> <type>[, param <param>])`` appended, but no traceback.
    The error's message is not logged (it may quote the client's input). Errors
    with status >= 500, and every other exception, keep their traceback.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, OpenAIError) and exc.status < 500:
            param = f", param {exc.param}" if exc.param else ""
            record.msg = f"{record.getMessage()} (OpenAIError {exc.status} {exc.err_type}{param})"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def quiet_client_errors(logger_name: str = SERVE_LOGGER) -> None:
    """Install ``ClientErrorLogFilter`` on ``logger_name`` (once; idempotent).

    A filter on the logger itself, not on its handlers: Ray Serve replaces the
    handlers when it (re)configures a replica's logging, but keeps the logger's filters.
    """
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, ClientErrorLogFilter) for f in logger.filters):
        logger.addFilter(ClientErrorLogFilter())
