"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a status.

The shape is OpenAI's (and vLLM's ``ErrorResponse``): ``type`` is
``invalid_request_error`` for 4xx caused by the client, ``authentication_error``
for 401, ``not_found_error`` for an unknown model, ``server_error`` for 5xx.
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
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


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

