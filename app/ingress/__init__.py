"""The ingress replica (``OpenAIIngress``, ``deployment``): the HTTP front and the token path's last hop.

Routes (``deployment``, ``admin``) map one typed result (``results``) to HTTP (``sse`` for
streams); the serving layer (``serving``) prepares a request once (``prepare``, with
``json_body`` and the ``offload`` worker loop) and sends it to an engine replica
(``dispatch``), whose streamed items arrive over ``app.stream_channel``. Beside them: the
API key (``auth``), the FastAPI app (``http_app``), warm-up (``warmup``), the admin
broadcasts (``broadcast``) and the ingress's metrics targets (``targets``).
"""
