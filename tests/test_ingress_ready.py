"""The ingress's readiness route and its error plumbing, without Ray.

``GET /ready`` is driven with a fake engine handle and fake routers in
``app.metrics.ROUTERS``; the log filter and the error class Ray hands a handle
caller are checked on their own. The same paths on a live app are in
``tests/test_serve_single_replica.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import time

import pytest

from app import metrics
from app.errors import ClientErrorLogFilter, OpenAIError, quiet_client_errors
from app.ingress import admin, auth


class _Probe(admin.AdminRoutes):
    """The ingress's readiness routes over a fake engine handle (no replica, no vLLM)."""

    def __init__(self, engine):
        self.engine = engine


class _Response:
    """A ``DeploymentResponse`` stand-in: awaitable, cancellable."""

    def __init__(self, answer):
        self.answer = answer
        self.cancelled = False

    def __await__(self):
        return self._get().__await__()

    async def _get(self):
        if self.answer == "hang":
            await asyncio.sleep(3600)
        if isinstance(self.answer, BaseException):
            raise self.answer
        if callable(self.answer):
            return self.answer()
        return self.answer

    def cancel(self):
        self.cancelled = True


class _Method:
    def __init__(self, answer):
        self.answer = answer
        self.calls: list[_Response] = []

    def remote(self):
        self.calls.append(_Response(self.answer))
        return self.calls[-1]


class _Engine:
    def __init__(self, answer):
        self.readiness = _Method(answer)


class _Router:
    def __init__(self, ok: bool, detail: dict):
        self.ok, self.detail = ok, detail

    def readiness(self):
        return self.ok, self.detail


@pytest.fixture(autouse=True)
def no_routers():
    saved = list(metrics.ROUTERS)
    metrics.ROUTERS.clear()
    yield
    metrics.ROUTERS.clear()
    for r in saved:
        metrics.ROUTERS.add(r)


def _get(probe: _Probe) -> tuple[int, dict]:
    out = asyncio.run(probe.ready())
    if isinstance(out, dict):
        return 200, out
    return out.status_code, json.loads(out.body)


def _assert_503(status: int, body: dict, fragment: str) -> None:
    assert status == 503
    err = body["error"]
    assert err["code"] == 503 and err["type"] == "ServiceUnavailableError"
    assert fragment in err["message"], err["message"]


def test_no_engine_answer_is_503_within_the_timeout(monkeypatch):
    monkeypatch.setattr(admin, "READY_ENGINE_TIMEOUT_S", 0.2)
    engine = _Engine("hang")
    t0 = time.monotonic()
    status, body = _get(_Probe(engine))
    assert time.monotonic() - t0 < 2.0
    _assert_503(status, body, "engines not running yet: no engine replica answered within 0.2 s")
    assert engine.readiness.calls[0].cancelled  # the pending call is not left behind


def test_failed_engine_call_is_503_naming_the_error():
    status, body = _get(_Probe(_Engine(RuntimeError("replica died"))))
    _assert_503(status, body, "engines not running yet: readiness call failed: RuntimeError")


@pytest.mark.parametrize("answer, reason", [
    ({"ready": False, "warmed": False, "relay_alive": True}, "warming up"),
    ({"ready": False, "warmed": True, "relay_alive": False}, "its KV-event relay is not running"),
    ({"ready": False, "reason": "adapters loading"}, "adapters loading"),
])
def test_engine_not_ready_is_503_with_its_reason(answer, reason):
    status, body = _get(_Probe(_Engine(answer)))
    _assert_503(status, body, f"engine replica not ready: {reason}")


def test_first_call_creates_the_router_whose_readiness_decides():
    """The engine call makes Serve create this process's router; it must be ready too."""
    held = []

    def answer():
        held.append(_Router(False, {"reason": "KV-event snapshot of replica r1 not applied"}))
        metrics.ROUTERS.add(held[-1])
        return {"ready": True}

    status, body = _get(_Probe(_Engine(answer)))
    _assert_503(status, body, "request router not ready: KV-event snapshot of replica r1 not applied")
    held[0].ok, held[0].detail = True, {"replicas": 1}
    engine = _Engine("hang")  # a router exists: the engines are not asked again
    assert _get(_Probe(engine)) == (200, {"status": "ready", "routers": [{"replicas": 1}]})
    assert engine.readiness.calls == []


def test_every_router_of_the_process_must_be_ready():
    a, b = _Router(True, {"replicas": 2}), _Router(False, {"reason": "not subscribed to replica r2"})
    metrics.ROUTERS.add(a)
    metrics.ROUTERS.add(b)
    status, body = _get(_Probe(_Engine("hang")))
    _assert_503(status, body, "not subscribed to replica r2")
    b.ok, b.detail = True, {"replicas": 2}
    status, body = _get(_Probe(_Engine("hang")))
    assert status == 200 and body["status"] == "ready" and body["routers"] == [{"replicas": 2}] * 2


def test_router_without_readiness_or_failing_is_503():
    class Old:
        pass

    class Broken:
        def readiness(self):
            raise KeyError("x")

    old = Old()
    metrics.ROUTERS.add(old)
    _assert_503(*_get(_Probe(_Engine("hang"))), "has no readiness() check")
    metrics.ROUTERS.clear()
    broken = Broken()
    metrics.ROUTERS.add(broken)
    _assert_503(*_get(_Probe(_Engine("hang"))), "readiness check failed: KeyError")


def test_engine_ready_without_a_router_of_ours_is_ready():
    """A baseline router (A/B harness) never joins metrics.ROUTERS: the engine's answer decides."""
    status, body = _get(_Probe(_Engine({"ready": True, "replica_id": "r1"})))
    assert status == 200 and body == {"status": "ready", "engine": {"ready": True, "replica_id": "r1"}}


def test_ready_needs_no_api_key_but_health_does(monkeypatch):
    monkeypatch.setenv("PREFIX_SERVE_TEST_KEY", "sk-test")
    saved = dict(auth._state)
    try:
        assert auth.configure("PREFIX_SERVE_TEST_KEY", admin.PUBLIC_PATHS)
        assert auth.rejection("/ready", None) is None
        assert auth.rejection("/health", None)[1] == 401
        assert auth.rejection("/health", "Bearer sk-test") is None
    finally:
        auth._state.update(saved)


# ----------------------------------------------------------------- errors and logs

def _record(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:  # noqa: BLE001
        import sys

        return logging.LogRecord("ray.serve", logging.ERROR, __file__, 1, "Request failed.", None, sys.exc_info())


def test_client_errors_are_logged_without_traceback():
    record = _record(OpenAIError("max_tokens: must be at least 1", 400, param="max_tokens"))
    assert ClientErrorLogFilter().filter(record)
    text = logging.Formatter().format(record)
    assert text == "Request failed. (OpenAIError 400 BadRequestError, param max_tokens)"
    assert "Traceback" not in text and "must be at least" not in text  # the client's text stays out


@pytest.mark.parametrize("exc", [OpenAIError("engine error", 503), RuntimeError("bug")])
def test_server_errors_keep_their_traceback(exc):
    record = _record(exc)
    assert ClientErrorLogFilter().filter(record)
    assert "Traceback" in logging.Formatter().format(record)


def test_filter_is_installed_once_on_serves_logger():
    logger = logging.getLogger("ray.serve")
    before = list(logger.filters)
    try:
        quiet_client_errors()
        quiet_client_errors()
        assert sum(isinstance(f, ClientErrorLogFilter) for f in logger.filters) == 1
    finally:
        logger.filters[:] = before


def test_handle_caller_catches_ray_task_error_as_openai_error():
    """What Serve raises in the caller: Ray's RayTaskError made an instance of the cause's class."""
    from ray.exceptions import RayTaskError

    cause = pickle.loads(pickle.dumps(OpenAIError("unknown model `gpt-0`", 404, param="model")))
    err = RayTaskError("OpenAIIngress.chat", "Traceback ...", cause).as_instanceof_cause()
    with pytest.raises(OpenAIError) as caught:
        raise err
    e = caught.value
    assert isinstance(e, RayTaskError)
    assert (e.status, e.err_type, e.param, e.message) == (404, "NotFoundError", "model", "unknown model `gpt-0`")
    assert e.body()["error"] == {"message": "unknown model `gpt-0`", "type": "NotFoundError", "param": "model",
                                 "code": 404}
