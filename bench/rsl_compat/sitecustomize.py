"""Run at start-up by every Python process of a Ray Serve LLM app of the benchmarks, whose
``PYTHONPATH`` names this folder (``bench.serve_rsl.llm_config``'s ``runtime_env``).

Ray 2.60's KV-aware pre-routing tokenizer
(``ray/llm/_internal/serve/routing_policies/kv_aware/vllm/tokenizer.py``, which ``KVAwareRouter``'s
``LLMRouter`` imports) takes ``load_chat_template`` from ``vllm.entrypoints.chat_utils``, where it was
before vLLM moved the module to ``vllm.renderers.chat_utils`` (vLLM 0.32, pinned here; ``ray[llm]``
pins 0.29). Every other vLLM module it imports is where it looks. Without this, that replica fails
to start (``ModuleNotFoundError``). The finder below answers only that one name, only when nothing
else finds it, and loads nothing until it is imported. Ray passes a deployment's
``runtime_env`` to ``LLMRouter`` as environment variables only, hence a ``sitecustomize``.
Standard library only: it runs before anything else is on the path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

MOVED = {"vllm.entrypoints.chat_utils": "vllm.renderers.chat_utils"}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An import of a key of ``MOVED`` that no other finder answers gets the module it names."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: Any) -> Any:
        return None  # the default: an empty module, replaced below

    def exec_module(self, module: Any) -> None:
        # The import returns what sys.modules holds under the name once this returns: the moved
        # module itself, whose own name and spec stay as they are.
        sys.modules[module.__name__] = importlib.import_module(MOVED[module.__name__])


if not any(isinstance(f, MovedModules) for f in sys.meta_path):
    sys.meta_path.append(MovedModules())  # after the path finders: a module that exists wins
