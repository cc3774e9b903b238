"""Ask the Ray Serve LLM app of ``serve_config.yaml`` (this folder) for one long prompt three times, and show
how prefix-serve's router placed each request.

With the app running (from the repository root, in another terminal:
``serve run examples/ray_serve_llm/serve_config.yaml``):

    .venv/bin/python -m examples.ray_serve_llm.client

sends a chat completion with a system prompt of about ``--words`` words, three times, each under its own
``X-Request-Id``, with the ``openai`` client; prints the prompt tokens and the cached tokens the engine
reports for each; then connects to the Ray cluster and asks the app's ingress
(``app.ray_serve_llm.ingress.PrefixServeIngress``) for each request's decision record: the engine replica
chosen, the router's reason (``no_match`` for the first, ``prefix_hit`` after) and the tokens it predicted
cached. Exits 1 if the repeats were not answered from the cache, or not routed as prefix hits.
"""

from __future__ import annotations

import argparse
import sys
import uuid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.ray_serve_llm.client",
                                     description=__doc__.split("\n\n")[0].replace("``", "`"),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the app's OpenAI base URL")
    parser.add_argument("--model", default="tiny-qwen2", help="the `model` to ask for (the LLMConfig's model_id)")
    parser.add_argument("--app", default="ray-serve-llm", help="the Serve application's name")
    parser.add_argument("--words", type=int, default=600, help="words in the system prompt")
    args = parser.parse_args(argv)

    from openai import OpenAI

    client = OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=120)
    tag = uuid.uuid4().hex[:8]  # a prompt no earlier run cached
    system = f"[{tag}] " + " ".join(f"rule {i}: answer in plain words." for i in range(args.words // 6))
    ids = []
    cached = []
    for turn in range(3):
        request_id = f"example-{tag}-{turn}"
        answer = client.chat.completions.create(
            model=args.model, max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}],
            extra_headers={"x-request-id": request_id})
        details = answer.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details is not None else 0)
        ids.append(request_id)
        print(f"request {request_id}: {answer.usage.prompt_tokens} prompt tokens, {cached[-1]} cached")

    import ray
    from ray import serve

    ray.init(address="auto", log_to_driver=False)
    ingress = serve.get_app_handle(args.app)
    reasons = []
    for request_id in ids:
        d = ingress.routing_decision.remote(request_id).result()
        if d is None:
            print(f"{request_id}: no decision record (is the ingress app.ray_serve_llm.ingress:PrefixServeIngress?)")
            reasons.append(None)
            continue
        reasons.append(d["reason"])
        print(f"{request_id}: replica {d['replica_id']}, reason {d['reason']}, predicted cached "
              f"{d['matched_tokens']} of {d['prompt_tokens']} tokens")
    return 0 if all(c > 0 for c in cached[1:]) and reasons[1:] == ["prefix_hit", "prefix_hit"] else 1


if __name__ == "__main__":
    sys.exit(main())
