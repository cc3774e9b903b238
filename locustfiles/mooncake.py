"""Replay of a Mooncake-format trace: token-id prompts synthesized per hash id, arrivals by timestamp.

Models production traffic as recorded: every trace row (``timestamp`` ms,
``input_length``, ``output_length``, ``hash_ids`` -- one id per 512-token block,
equal ids meaning a shared prefix block; read by ``shapes.read_mooncake``, the
simulator's reader too) becomes a ``POST /v1/completions`` with a
token-id prompt built from its hash ids: each hash id always gives the same
``--trace-tokens-per-hash-id`` tokens (for a seed), the last block cut to the
row's length. The rows are handed out in timestamp order to the Locust users of
the process, each sent at ``timestamp x --trace-time-scale`` after the start
(0.5 = twice as fast); a row whose time has come while every user is busy goes
out late, and the delay is recorded as ``arrival_lag``. With ``-u`` high enough
for the concurrency the trace needs, the replay is open-loop.

Prompts that do not fit the context (``--max-model-len``, by default
``max_model_len`` of ``GET /v1/models``) keep their leading blocks; the output is
the row's ``output_length`` (at most ``--max-tokens`` when given, and at most a
quarter of the context).

    # real cluster, faithful sizes:
    locust -f locustfiles/mooncake.py --headless -u 64 -r 16 -t 10m --host http://<ingress>:8000 \\
        --trace-file mooncake_synthetic_trace.jsonl
    # tiny CPU model: a 32-token block per hash id, outputs of at most 16 tokens
    locust -f locustfiles/mooncake.py --headless -u 8 -r 4 -t 60s --host http://127.0.0.1:8000 \\
        --trace-tokens-per-hash-id 32 --max-tokens 16

Its options (``workloads.REPLAY_OPTIONS``; the default trace is the 800-row head of
the Mooncake synthetic trace in ``locustfiles/data/``) are listed below; the common
ones are in ``locustfiles/_common.py``.
"""

from __future__ import annotations

import time

from locust import events, task
from locust.exception import StopUser

try:
    from locustfiles._common import LLMUser, config_from_options, option, register_options, workload_module
except ImportError:  # this folder copied alone
    from _common import LLMUser, config_from_options, option, register_options, workload_module  # type: ignore[no-redef]

W = workload_module()
register_options(W.REPLAY_OPTIONS)
__doc__ = (__doc__ or "") + W.options_doc(W.REPLAY_OPTIONS)


class _Replay:
    """Per-process replay state: the trace, its synthesizer and the shared schedule."""

    def __init__(self, environment):
        cfg = config_from_options(environment, W.ReplayConfig, W.REPLAY_OPTIONS)
        self.entries = cfg.records()
        self.synth = W.MooncakeSynth(seed=option(environment, "seed"), tokens_per_hash_id=cfg.tokens_per_hash_id)
        self.schedule = W.TraceSchedule(self.entries, time_scale=cfg.time_scale, loop=cfg.loop,
                                        start_row=cfg.start_row)
        self.t0 = time.perf_counter()


_REPLAY: dict[int, _Replay] = {}


@events.test_start.add_listener
def _reset(environment, **_kwargs) -> None:
    _REPLAY.pop(id(environment), None)  # a new test in the web UI starts the trace over


def replay(environment) -> _Replay:
    r = _REPLAY.get(id(environment))
    if r is None:
        r = _REPLAY[id(environment)] = _Replay(environment)
    return r


class MooncakeUser(LLMUser):
    workload_name = "mooncake"

    def wait_time(self) -> float:
        return 0.0  # the trace's timestamps pace the requests

    @task
    def send_next_row(self) -> None:
        info = self.server()
        if info is None:
            return
        r = replay(self.environment)
        item = r.schedule.next()
        if item is None:
            raise StopUser()
        row, at_s, entry = item
        delay = r.t0 + at_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        self._fire("arrival_lag", max(0.0, -delay) * 1000)
        cap = option(self.environment, "max_tokens") or None
        self.send(r.synth.request(entry, info.max_model_len, cap, row), override_max_tokens=False)
