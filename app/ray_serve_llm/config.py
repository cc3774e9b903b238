"""The ``request_router_kwargs`` of ``app.ray_serve_llm.router.PrefixServeLLMRouter``."""

from __future__ import annotations

from pydantic import Field

from app.config import AppArgs, RouterConfig, ServingConfig


class RayServeLLMRouterConfig(RouterConfig):
    """The app's router knobs (``RouterConfig``: policy weights, index cap, ...) plus what the router needs
    to render a request's prompt as the engines do, copied from the ``LLMConfig`` the engines run (Serve
    hands a request router its kwargs only, not the ``LLMConfig``).

    ``block_size`` need not be set: each engine replica reports the block size it runs, and until one has,
    requests are routed by load.
    """

    model: str = Field(..., min_length=1,
                       description="the model as the engines load it: LLMConfig.model_loading_config.model_source "
                                   "(a hub id, or a local folder, absolute or under the working directory), or "
                                   "model_id when model_source is unset")
    served_model_name: str = Field(..., min_length=1,
                                   description="the `model` clients send: LLMConfig.model_loading_config.model_id; "
                                               "a request naming another model (a LoRA adapter) is routed by load")
    tokenizer: str | None = Field(None, description="LLMConfig.model_loading_config.tokenizer_source, if set")
    max_model_len: int = Field(..., ge=16,
                               description="the engines' context length: engine_kwargs.max_model_len, or the model's "
                                           "own (config.json's max_position_embeddings) when that is unset; a longer "
                                           "request is routed by load, and refused by the engine")
    serving: ServingConfig = Field(
        default_factory=ServingConfig,
        description="vLLM's front-end settings among engine_kwargs that change what the engines render, under the "
                    "app's names (app.config.ServingConfig): chat_template, chat_template_content_format, "
                    "default_chat_template_kwargs, trust_request_chat_template, enable_auto_tool_choice, "
                    "tool_call_parser, reasoning_parser")

    def app_args(self) -> AppArgs:
        """The app args whose renderer (``app.frontend.Renderer``) renders requests as these engines do.

        Raises:
            pydantic.ValidationError: the model is a local path that does not exist.
        """
        return AppArgs.model_validate({
            "model": self.model, "served_model_name": self.served_model_name, "tokenizer": self.tokenizer,
            "engine": {"max_model_len": self.max_model_len, **({"block_size": self.block_size} if self.block_size
                                                              else {})},
            "serving": self.serving.model_dump(exclude_unset=True),
        })
