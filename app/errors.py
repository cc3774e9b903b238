"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a status.

The shape is OpenAI's and vLLM's ``ErrorResponse``. Most errors are vLLM's own
(its serving layer answers every request); the ones this app raises itself (body
not JSON or too large, missing API key, unknown debug id, a lost engine replica)
use vLLM's names for ``type`` (``vllm.entrypoints.serve.create_error_response``):
``BadRequestError`` (4xx caused by the client), ``AuthenticationError`` (401),
``NotFoundError`` (404), ``RateLimitError`` (429), ``ServiceUnavailableError`` (503)
and ``InternalServerError`` (other 5xx).
"""

from __future__ import annotations

from typing import Any


class OpenAIError(Exception):
    """An error to send to the client as OpenAI JSON with an HTTP status."""

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

