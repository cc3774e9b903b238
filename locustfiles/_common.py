"""The Locust side of the load experiments: options, a streaming OpenAI client, metrics.

Every request streams (``stream: true``, ``stream_options.include_usage``) and is
recorded as Locust request entries, so they show in the web UI, ``--csv`` and
``--html`` reports. ``Type`` is the workload name, ``Name`` the metric:

=================  ======================================  ===========================
Name               "response time" column                  "content size" column
=================  ======================================  ===========================
``e2e``            end-to-end latency (ms); failures here   completion tokens
``ttft``           time to the first content chunk (ms)     0
``itl``            one entry per gap between content        0
                   chunks (ms)
``cached_tokens``  ``usage.prompt_tokens_details.           prompt tokens
                   cached_tokens`` (tokens, not ms)
=================  ======================================  ===========================

So the token-weighted prefix-cache hit rate of a run is the ``cached_tokens`` row's
*Average Response Time* divided by its *Average Content Size*. A request fails
(on ``e2e``) on a non-200 status, a chunk carrying ``"error"``, a stream that ends
without ``data: [DONE]`` or without the usage chunk, or a transport error.

Besides Locust's own ``--host`` (``LOCUST_HOST``, the base URL of the
OpenAI-compatible server), every locustfile takes the options of
``workloads.COMMON_OPTIONS``, listed below; each workload adds its own (the
``options`` of its workload class in ``workloads.py``). An option is defined once,
there: ``register_options`` adds it to Locust's parser, ``option`` reads it back.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import requests
from locust import User, events, task
from locust.exception import StopUser


def workload_module():
    """``locustfiles.workloads`` whether this folder is imported as a package or run as a copy."""
    try:
        from locustfiles import workloads
    except ImportError:  # the folder copied alone to a load-generator host
        import workloads  # type: ignore[no-redef]
    return workloads


W = workload_module()
_OPTIONS: dict[str, Any] = {}  # Option.dest -> workloads.Option, every option registered in this process


def register_options(options) -> None:
    """Add ``options`` (``workloads.Option``s) to Locust's command line and web UI; ``option``
    reads them back. An option registered before (same ``dest``) is not added again."""
    new = [o for o in options if o.dest not in _OPTIONS]
    _OPTIONS.update((o.dest, o) for o in new)

    def add(parser) -> None:
        for o in new:
            ranged = isinstance(o.default, tuple)  # kept as LOW-HIGH text until read
            parser.add_argument(o.flag, env_var=o.env_var, default=o.text_default() if ranged else o.default,
                                type=str if ranged else o.parse, help=o.help, is_secret=o.secret,
                                include_in_web_ui=o.web_ui)

    events.init_command_line_parser.add_listener(add)


register_options(W.COMMON_OPTIONS)
__doc__ = (__doc__ or "") + W.options_doc(W.COMMON_OPTIONS, "Common options")


def option(environment, name: str) -> Any:
    """The value of the registered option ``name`` (its ``dest``, e.g. ``"max_tokens"``), as its
    default's type (``workloads.Option.parse``); the default when it is unset or Locust runs
    without parsed options (library use). ``KeyError`` for an option never registered."""
    o = _OPTIONS[name]
    opts = getattr(environment, "parsed_options", None)
    value = getattr(opts, name, None) if opts is not None else None
    return o.default if value is None else o.parse(value)


def config_from_options(environment, config_class: Callable[..., Any], options) -> Any:
    """``config_class`` built from the values of ``options`` (each sets its ``field``)."""
    return config_class(**{o.field: option(environment, o.dest) for o in options})


# ------------------------------------------------------------------------ server discovery


@dataclass
class ServerInfo:
    model: str
    max_model_len: int | None


_SERVER: dict[str, ServerInfo] = {}
_USER_INDEX = itertools.count()


def server_info(environment, host: str, session: requests.Session, headers: dict[str, str]) -> ServerInfo:
    """Model name and context length: from the options, else ``GET /v1/models`` (once per host)."""
    model = option(environment, "model")
    max_len = option(environment, "max_model_len") or None
    key = f"{host}|{model}|{max_len}"
    info = _SERVER.get(key)
    if info is not None:
        return info
    if not model or max_len is None:
        r = session.get(f"{host}/v1/models", headers=headers, timeout=30)
        r.raise_for_status()
        cards = r.json().get("data") or []
        if not cards:
            raise LLMError("GET /v1/models lists no model")
        card = next((c for c in cards if c.get("id") == model), cards[0]) if model else cards[0]
        model = model or card["id"]
        if max_len is None and card.get("max_model_len"):
            max_len = int(card["max_model_len"])
    info = ServerInfo(model=model, max_model_len=max_len)
    _SERVER[key] = info
    return info


# --------------------------------------------------------------------------- the stream


class LLMError(Exception):
    """A failed LLM request (status, error chunk, truncated stream)."""


@dataclass
class StreamResult:
    ok: bool
    text: str = ""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    response_id: str | None = None
    error: Exception | None = None


def _sse_lines(response: requests.Response):
    """The response body's lines (without line ends) as their bytes arrive, whatever the framing.

    ``iter_lines(chunk_size=None)`` yields a chunked body chunk by chunk, but reads a
    close-delimited one (no ``Content-Length``, no chunked encoding: what some
    gateways send) to its end before yielding anything, which would make TTFT
    equal the end-to-end time and every ITL 0. ``read1`` returns whatever bytes
    have arrived, in either framing (urllib3 decodes the chunks, and the compression
    with ``decode_content``). urllib3's own errors are raised as requests' (as
    ``iter_lines`` raises them), so a reset or read timeout is a failed request.
    """
    import urllib3.exceptions

    raw = response.raw
    buffer = b""
    while True:
        try:
            data = raw.read1(65536, decode_content=True)
        except urllib3.exceptions.HTTPError as e:
            raise requests.ConnectionError(f"{type(e).__name__}: {e}") from e
        if not data:
            break
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if buffer:
        yield buffer.rstrip(b"\r")


def stream_completion(session: requests.Session, url: str, body: dict[str, Any], headers: dict[str, str],
                      timeout_s: float) -> StreamResult:
    """POST ``body`` with ``stream: true`` and read the server-sent events to ``[DONE]``.

    TTFT is the time to the first chunk with content (text or delta content; the
    first chunk with choices if none has content), ITL the gaps between content
    chunks, E2E the time to ``[DONE]``.
    """
    start = time.perf_counter()
    first_choice_s = None
    last_content: float | None = None
    res = StreamResult(ok=False)
    parts: list[str] = []
    usage = None
    done = False
    try:
        with session.post(url, json=body, headers=headers, stream=True, timeout=(30.0, timeout_s)) as r:
            if r.status_code != 200:
                raise LLMError(f"HTTP {r.status_code}: {r.text[:300]}")
            for raw in _sse_lines(r):
                if not raw or not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    raise LLMError(f"error chunk: {err.get('message', err) if isinstance(err, dict) else err}")
                now = time.perf_counter()
                if res.response_id is None:
                    res.response_id = chunk.get("id")
                choices = chunk.get("choices") or []
                if choices:
                    if first_choice_s is None:
                        first_choice_s = now - start
                    c = choices[0]
                    content = c.get("text")
                    if content is None:
                        content = (c.get("delta") or {}).get("content")
                    if content:
                        parts.append(content)
                        if last_content is None:
                            res.ttft_s = now - start
                        else:
                            res.itl_s.append(now - last_content)
                        last_content = now
                if chunk.get("usage"):
                    usage = chunk["usage"]
        if not done:
            raise LLMError("stream ended without data: [DONE]")
        if usage is None:
            raise LLMError("stream has no usage chunk (stream_options.include_usage)")
        res.e2e_s = time.perf_counter() - start
        if res.ttft_s is None:
            res.ttft_s = first_choice_s if first_choice_s is not None else res.e2e_s
        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        res.completion_tokens = int(usage.get("completion_tokens") or 0)
        res.cached_tokens = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        res.text = "".join(parts)
        res.ok = True
    except (LLMError, requests.RequestException, ValueError) as e:
        res.e2e_s = time.perf_counter() - start
        res.error = e if isinstance(e, LLMError) else LLMError(f"{type(e).__name__}: {e}")
    return res


# ------------------------------------------------------------------------- sample file

_SAMPLES_LOCK = threading.Lock()
_SAMPLES_FILES: dict[str, Any] = {}


def _write_sample(path: str, row: dict[str, Any]) -> None:
    with _SAMPLES_LOCK:
        f = _SAMPLES_FILES.get(path)
        if f is None:
            f = _SAMPLES_FILES[path] = open(path, "a", encoding="utf-8", buffering=1)
        f.write(json.dumps(row, separators=(",", ":")) + "\n")


_STOPPING = {"now": False}


@events.test_start.add_listener
def _started(**_kwargs) -> None:
    global _USER_INDEX
    _STOPPING["now"] = False
    _USER_INDEX = itertools.count()  # a new test (web UI) gives users the same seeds again


@events.test_stopping.add_listener
def _stopping(**_kwargs) -> None:
    # Requests that finish while Locust stops its users are not in its stats; keep
    # the sample file consistent with them.
    _STOPPING["now"] = True


@events.quitting.add_listener
def _close_samples(**_kwargs) -> None:
    with _SAMPLES_LOCK:
        for f in _SAMPLES_FILES.values():
            f.close()
        _SAMPLES_FILES.clear()


# ----------------------------------------------------------------------------- the user


class LLMUser(User):
    """Base class of the workload users: one streaming request per task call.

    Subclasses set ``workload_name`` and call :meth:`send` with an
    :class:`locustfiles.workloads.LLMRequest`. ``self.rng`` is seeded by
    ``--seed``, the workload and the user's spawn index (and the worker index in
    distributed runs), so with the same seed each user sends the same prompts.
    """

    abstract = True
    workload_name = "llm"
    host = "http://127.0.0.1:8000"

    def wait_time(self) -> float:
        """``--think-time``: exponential think time of that mean (from the user's own rng)."""
        mean = option(self.environment, "think_time")
        rng = getattr(self, "think_rng", None)
        if mean <= 0 or rng is None:
            return 0.0
        return rng.expovariate(1.0 / mean)

    def on_start(self) -> None:
        runner = self.environment.runner
        worker = getattr(runner, "worker_index", 0) if runner is not None else 0
        self.user_index = next(_USER_INDEX)
        self.seed = option(self.environment, "seed")
        self.rng = random.Random(f"{self.seed}:{self.workload_name}:user:{worker}:{self.user_index}")
        self.think_rng = random.Random(f"{self.seed}:{self.workload_name}:think:{worker}:{self.user_index}")
        self.session = requests.Session()
        self.base_url = (self.host or "").rstrip("/")
        if not self.base_url:
            raise StopUser("no --host given")
        key = option(self.environment, "api_key")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout_s = option(self.environment, "request_timeout")
        self.samples_file = option(self.environment, "samples_file")
        self._server: ServerInfo | None = None

    def on_stop(self) -> None:
        session = getattr(self, "session", None)
        if session is not None:
            session.close()

    # ----------------------------------------------------------------- helpers

    def server(self) -> ServerInfo | None:
        """Model and context length (discovered once); records a failure if unreachable."""
        if self._server is None:
            start = time.perf_counter()
            try:
                self._server = server_info(self.environment, self.base_url, self.session, self.headers)
            except Exception as e:  # noqa: BLE001 - recorded as a Locust failure
                self._fire("GET /v1/models", (time.perf_counter() - start) * 1000, 0, LLMError(str(e)))
                time.sleep(1.0)
                return None
        return self._server

    def max_tokens(self, default: int) -> int:
        return option(self.environment, "max_tokens") or default

    def _fire(self, name: str, response_time: float, response_length: int = 0,
              exception: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type=self.workload_name, name=name, response_time=response_time,
            response_length=response_length, response=None, context={}, exception=exception,
        )

    def send(self, request, override_max_tokens: bool = True) -> StreamResult | None:
        """Stream one request and record its metrics; ``None`` if the server is unknown."""
        info = self.server()
        if info is None:
            return None
        body = dict(request.body)
        if override_max_tokens and "max_tokens" in body:
            body["max_tokens"] = self.max_tokens(body["max_tokens"])
        body["model"] = info.model
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        if option(self.environment, "ignore_eos"):
            body["ignore_eos"] = True
        started_at = time.time()
        res = stream_completion(self.session, self.base_url + request.route, body, self.headers, self.timeout_s)
        if res.ok:
            self._fire("e2e", res.e2e_s * 1000, res.completion_tokens)
            self._fire("ttft", (res.ttft_s or 0.0) * 1000)
            for gap in res.itl_s:
                self._fire("itl", gap * 1000)
            self._fire("cached_tokens", res.cached_tokens, res.prompt_tokens)
        else:
            self._fire("e2e", res.e2e_s * 1000, 0, res.error)
        if self.samples_file and not _STOPPING["now"]:
            _write_sample(self.samples_file, {
                "t": round(started_at, 4), "workload": self.workload_name, "user": self.user_index,
                "tag": request.tag, "id": res.response_id, "ok": res.ok, "ttft_s": res.ttft_s,
                "e2e_s": round(res.e2e_s, 6),
                "itl_mean_s": (sum(res.itl_s) / len(res.itl_s)) if res.itl_s else None,
                "prompt_tokens": res.prompt_tokens, "cached_tokens": res.cached_tokens,
                "completion_tokens": res.completion_tokens,
                "error": None if res.ok else str(res.error)[:300],
            })
        return res


_SHARED_WORKLOADS: dict[tuple, Any] = {}


def shared_workload(environment, factory: Callable[[Any, int], Any], cfg: Any) -> Any:
    """One workload object per (factory, ``cfg``, ``--seed``) in this process, shared by its users.

    ``factory(cfg, seed)`` builds it (e.g. ``workloads.Rag``); ``cfg`` must be hashable.
    """
    seed = option(environment, "seed")
    key = (factory, cfg, seed)
    if key not in _SHARED_WORKLOADS:
        _SHARED_WORKLOADS[key] = factory(cfg, seed)
    return _SHARED_WORKLOADS[key]


def workload_from_options(environment, workload_class: Any) -> Any:
    """The shared ``workload_class`` (e.g. ``workloads.Rag``) configured by its ``options``
    (registered with ``register_options``); see :func:`shared_workload`."""
    cfg = config_from_options(environment, workload_class.config_class, workload_class.options)
    return shared_workload(environment, workload_class, cfg)


class SamplingUser(LLMUser):
    """A user whose every task sends one request sampled from a shared workload.

    Subclasses set ``workload_class`` (e.g. ``workloads.Rag``) and ``workload_name``
    (its ``name``), and register its ``options`` with ``register_options``.
    """

    abstract = True
    workload_class: Any = None

    def make_workload(self) -> Any:
        """The workload this user samples from (see :func:`workload_from_options`)."""
        return workload_from_options(self.environment, self.workload_class)

    def on_start(self) -> None:
        super().on_start()
        self.workload = self.make_workload()

    @task
    def ask(self) -> None:
        self.send(self.workload.sample(self.rng))

