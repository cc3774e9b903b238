"""prefix-serve's Ray Serve application, grouped by the process each module runs in.

- ``app.ingress``: the HTTP front, the ``OpenAIIngress`` replica (HAProxy forwards each request
  to its own HTTP server): routes, the serving layer, preparation (render and tokenize once),
  the dispatch to an engine replica and the SSE writer.
- ``app.engine``: the engine replica, ``VLLMEngine``: one vLLM ``AsyncLLM`` behind vLLM's own
  serving classes, its KV-event relay and its request probe.
- ``app.router``: the request router's Ray Serve glue (``PrefixAffinityRouter``), run on the
  loop of the process that holds the handle (the ingress); the policy itself is ``routing/``.
- Here, beside them, what more than one process imports: the app args (``config``), the
  builder that wires both deployments (``builder``), what crosses between ingress and engine
  (``protocol``, ``stream_channel``), vLLM's serving layer built from the args (``frontend``),
  errors, metrics, tracing, addresses and the records shared across replicas
  (``adapters``, ``home``).

A streamed token's path, in order: ``app.engine.deployment`` (vLLM's SSE string) ->
``app.stream_channel`` (a TCP connection to the ingress's loop) -> ``app.ingress.dispatch`` (the call's
mailbox) -> ``app.ingress.sse`` (written to the client's socket, through HAProxy).
"""
