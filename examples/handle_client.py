"""Call prefix-serve from another Ray Serve app through a DeploymentHandle.

With ``make serve`` running in another terminal:

    .venv/bin/python -m examples.handle_client

deploys the ``HandleClient`` app next to ``prefix-serve`` on the same Ray cluster,
asks it for one unary and one streamed chat completion, prints both and removes
itself. The handle's methods take the OpenAI request body (a dict, or vLLM's
``ChatCompletionRequest``) and return vLLM's response models.
"""

from __future__ import annotations

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


def main() -> None:
    import ray

    ray.init(address="auto")
    handle = serve.run(HandleClient.bind(), name="handle-client", route_prefix=None)
    result = handle.ask.remote("Say hello to the cluster.").result()
    print("unary :", repr(result["unary_text"]), result["unary_usage"])
    print("stream:", result["stream_pieces"], result["stream_usage"])
    serve.delete("handle-client")


if __name__ == "__main__":
    main()
