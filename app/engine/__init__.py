"""The engine replica (``VLLMEngine``, ``deployment``): one vLLM engine behind vLLM's serving classes.

Its answers stream to the ingress over ``app.stream_channel``; ``probe`` records what each
request cost the engine, ``responses_store`` bounds vLLM's Responses-API store.
"""
