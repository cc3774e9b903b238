"""Replay of a Mooncake-format trace: token-id prompts synthesized per hash id, arrivals by timestamp.

Models production traffic as recorded: every trace row (``timestamp`` ms,
``input_length``, ``output_length``, ``hash_ids`` -- one id per 512-token block,
equal ids meaning a shared prefix block) becomes a ``POST /v1/completions`` with a
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

Options (env): --trace-file (MOONCAKE_TRACE; default: the 800-row head of the
Mooncake synthetic trace in ``locustfiles/data/``), --trace-tokens-per-hash-id
(TRACE_TOKENS_PER_HASH_ID, 512), --trace-time-scale (TRACE_TIME_SCALE, 1.0),
--trace-start-row (TRACE_START_ROW, 0), --trace-loop (TRACE_LOOP, true: start over
at the end), plus the common ones.
"""

from __future__ import annotations

import os
import time

from locust import events, task
from locust.exception import StopUser

try:
    from locustfiles._common import LLMUser, _bool, option, workload_module
except ImportError:  # this folder copied alone
    from _common import LLMUser, _bool, option, workload_module  # type: ignore[no-redef]

W = workload_module()
DEFAULT_TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                             "mooncake_synthetic_trace.head800.jsonl")


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--trace-file", env_var="MOONCAKE_TRACE", default=DEFAULT_TRACE,
                        help="Mooncake-format JSON-lines trace")
    parser.add_argument("--trace-tokens-per-hash-id", env_var="TRACE_TOKENS_PER_HASH_ID", type=int,
                        default=W.MOONCAKE_BLOCK_TOKENS, help="tokens synthesized per hash id (512 = faithful)")
    parser.add_argument("--trace-time-scale", env_var="TRACE_TIME_SCALE", type=float, default=1.0,
                        help="multiplies every arrival time (0.5 = twice as fast)")
    parser.add_argument("--trace-start-row", env_var="TRACE_START_ROW", type=int, default=0,
                        help="first row to replay")
    parser.add_argument("--trace-loop", env_var="TRACE_LOOP", type=_bool, default=True,
                        help="start over after the last row (else users stop)")


class _Replay:
    """Per-process replay state: the trace, its synthesizer and the shared schedule."""

    def __init__(self, environment):
        path = option(environment, "trace_file", DEFAULT_TRACE) or DEFAULT_TRACE
        self.entries = W.load_trace(path)
        self.synth = W.MooncakeSynth(seed=int(option(environment, "seed", 0)),
                                     tokens_per_hash_id=int(option(environment, "trace_tokens_per_hash_id",
                                                                   W.MOONCAKE_BLOCK_TOKENS)))
        self.schedule = W.TraceSchedule(self.entries, time_scale=float(option(environment, "trace_time_scale", 1.0)),
                                        loop=_bool(option(environment, "trace_loop", True)),
                                        start_row=int(option(environment, "trace_start_row", 0)))
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
        cap = int(option(self.environment, "max_tokens", 0) or 0) or None
        self.send(r.synth.request(entry, info.max_model_len, cap, row), override_max_tokens=False)
