"""Call prefix-serve from another Ray Serve app through a DeploymentHandle.

With ``make serve`` running in another terminal:

    .venv/bin/python -m examples.handle_client

deploys the ``HandleClient`` app next to ``prefix-serve`` on the same Ray cluster,
asks it for one unary and one streamed chat completion, prints both and removes
itself. The handle's methods take the OpenAI request body (a dict, or vLLM's
``ChatCompletionRequest``) and return vLLM's response models.
"""

from __future__ import annotations

import argparse
from typing import Any

from ray import serve

PREFIX_SERVE_APP = "prefix-serve"


@serve.deployment(name="HandleClient", ray_actor_options={"num_cpus": 0.05})
class HandleClient:
    """A deployment of another app that calls prefix-serve through its handle."""

    def __init__(self, app_name: str = PREFIX_SERVE_APP):
        self.app_name = app_name
        # The handle returns vLLM's response models: the first one a process receives
        # imports vLLM to unpickle it (about 7 s on a 2-core machine). Importing the
        # protocol modules here moves that cost to the deploy, out of the first call.
        import vllm.entrypoints.openai.chat_completion.protocol  # noqa: F401

    async def ask(self, prompt: str, max_tokens: int = 8, model: str = "tiny-qwen2") -> dict[str, Any]:
        """Return the unary answer (text, usage) and the streamed pieces of the same prompt."""
        handle = serve.get_app_handle(self.app_name)
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0}
        unary = await handle.chat.remote(body)
        pieces: list[str] = []
        usage = None
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async for chunk in handle.options(stream=True).chat_stream.remote(stream_body):
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
        return {
            "unary_text": unary.choices[0].message.content,
            "unary_usage": unary.usage.model_dump(),
            "stream_pieces": pieces,
            "stream_usage": usage,
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.handle_client", description=__doc__.split("\n\n")[0])
    parser.add_argument("--app", default=PREFIX_SERVE_APP,
                        help="prefix-serve's Serve application name (default: %(default)s)")
    parser.add_argument("--address", default="auto",
                        help="Ray cluster to join (default: %(default)s: RAY_ADDRESS, else the one on this machine)")
    parser.add_argument("--prompt", default="Say hello to the cluster.", help="user message (default: %(default)r)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens to generate (default: %(default)s)")
    parser.add_argument("--model", default="tiny-qwen2", help="model name (default: %(default)s)")
    args = parser.parse_args(argv)

    import ray

    ray.init(address=args.address)  # join the running cluster; a bare ray.init() would start an empty one
    handle = serve.run(HandleClient.bind(args.app), name="handle-client", route_prefix=None)
    try:
        result = handle.ask.remote(args.prompt, args.max_tokens, args.model).result()
    finally:
        serve.delete("handle-client")
    print("unary :", repr(result["unary_text"]), result["unary_usage"])
    print("stream:", result["stream_pieces"], result["stream_usage"])


if __name__ == "__main__":
    main()
