"""Our router inside Ray Serve LLM's own apps (``ray.serve.llm.build_openai_app``).

A Ray Serve LLM user keeps their ``LLMConfig`` and sets three of its keys (``docs/ray-serve-llm.md``,
``examples/ray_serve_llm/``):

- ``server_cls: app.ray_serve_llm.server:PrefixServeLLMServer``: each engine replica publishes vLLM's
  KV events and runs the KV-event relay our routers follow (``server``);
- ``deployment_config.request_router_config.request_router_class:
  app.ray_serve_llm.router:PrefixServeLLMRouter``, with the model in ``request_router_kwargs``: the
  request router renders each request's prompt as the engines will and routes it by the same policy
  and index as the app (``router``);
- optionally ``ingress_cls_config.ingress_cls: app.ray_serve_llm.ingress:PrefixServeIngress``: Ray
  Serve LLM's OpenAI ingress plus handle methods that answer the router's decision records and state
  (``ingress``).
"""
