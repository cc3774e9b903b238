"""Which errors the ingress treats as the loss of an engine replica (and so retries).

Matched by class (``isinstance``) on Ray's public exceptions, so Ray's wrapped
task errors (``RayTaskError(ActorDiedError)``, a subclass of both) and chained
causes count too; nothing else does.
"""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
from ray.serve.exceptions import ReplicaUnavailableError

from app.ingress.dispatch import caused_by_replica_loss
from app.stream_channel import ChannelClosed


def _chained(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize("error", [
    ActorDiedError(),
    ActorUnavailableError("unreachable", None),
    ReplicaUnavailableError("replica-1"),
    _chained(RuntimeError("handle call failed"), ActorDiedError()),
    RayTaskError("chat", "traceback", ActorDiedError()).as_instanceof_cause(),
    # An engine replica that cannot open its stream connection to this ingress (app.stream_channel):
    # resent elsewhere while nothing was answered.
    RayTaskError("completions", "traceback", ChannelClosed("cannot connect")).as_instanceof_cause(),
])
def test_replica_loss_is_recognised(error):
    assert caused_by_replica_loss(error)


@pytest.mark.parametrize("error", [
    None,
    RuntimeError("engine error"),
    ValueError("bad request"),
    type("ActorDiedError", (Exception,), {})(),  # a look-alike name is not Ray's class
    _chained(RuntimeError("a"), _chained(RuntimeError("b"), _chained(RuntimeError("c"), _chained(
        RuntimeError("d"), _chained(RuntimeError("e"), ActorDiedError()))))),  # past the 5-link bound
])
def test_other_errors_are_not_replica_loss(error):
    assert not caused_by_replica_loss(error)
