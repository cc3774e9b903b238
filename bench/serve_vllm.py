"""vLLM's own OpenAI server app inside one Ray Serve replica: the floor of any Serve-hosted serving path.

``python -m bench.serving_overhead --app-kind serve-vllm`` runs this Serve application in
place of prefix-serve, beside vLLM's bare server, to measure what Ray Serve itself costs a
request on this machine with no router, no ingress hop and none of the app's work:

- one deployment, ``VLLMInServe``, one replica: vLLM's ``AsyncLLM`` and vLLM's own FastAPI app
  (``vllm.entrypoints.launchers.build_app`` + ``init_app_state``, as ``vllm serve`` builds it,
  from the same command line ``bench.vllm_server.command`` gives vLLM's bare server);
- the app is the replica's late-bound ASGI ingress (``serve.ingress()`` with
  ``__serve_build_asgi_app__``, the hook Ray Serve LLM's direct streaming uses), so with the
  serving-path settings (``infra.ray_env``) HAProxy forwards each request to the replica's own
  HTTP server and the tokens go engine -> replica's HTTP server -> HAProxy -> client.

What is left between it and vLLM's bare server is Serve's own cost: the replica's ASGI wrapper
per request (request context, metrics), HAProxy, and Ray's and Serve's background processes
(GCS, raylet, dashboard, controller) on the same cores. A design in which each engine replica
serves HTTP itself, picked by our router through HAProxy (issue 34), can do no better than this.

Bench-only: not part of the app, not in ``serve_config.yaml``. Readiness is vLLM's ``/health``.
"""

from __future__ import annotations

import types
from typing import Any

from ray import serve
from ray.serve import Application


class VLLMInServe:
    """One vLLM engine and vLLM's own OpenAI app in a Serve replica (see the module doc).

    Args:
        args: the app args of ``serve_config.yaml`` (model, engine, serving), as a dict.
    """

    def __init__(self, args: dict[str, Any]):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.v1.engine.async_llm import AsyncLLM

        from bench import vllm_server

        # vLLM's bare server's command line, less `python -m vllm.entrypoints.openai.api_server`.
        cmd = vllm_server.command(args, port=0)[3:]
        self.vllm_args = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd)
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(self.vllm_args))

    async def __serve_build_asgi_app__(self) -> Any:
        """vLLM's FastAPI app over this replica's engine (Serve calls this once, after ``__init__``)."""
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app

        tasks = await self.engine.get_supported_tasks()
        app = build_app(self.vllm_args, tasks, self.engine.model_config)
        await init_app_state(self.engine, app.state, self.vllm_args, tasks)
        # vLLM's engine-error handler reads app.state.server (the uvicorn server its launcher sets).
        app.state.server = types.SimpleNamespace()
        return app

    def check_health(self) -> None:
        if self.engine.errored:
            raise RuntimeError("the engine errored")


def build(args: dict[str, Any]) -> Application:
    """The Serve application: one ``VLLMInServe`` replica (``serve run`` import path ``bench.serve_vllm:build``)."""
    deployment = serve.deployment(name="VLLMInServe", num_replicas=1, max_ongoing_requests=256,
                                  ray_actor_options={"num_cpus": 0.5})(serve.ingress()(VLLMInServe))
    return deployment.bind(args)
