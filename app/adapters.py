"""LoRA adapters loaded at run time (``POST /v1/load_lora_adapter``): the one record of them.

vLLM's server loads an adapter into its one engine (with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); here it must reach every engine replica,
including those Serve starts later. ``AdapterBook`` is the record: a named Ray actor
(one per app, detached so it outlives the ingress replica that made it, none per
process) that owns ``{adapter name: path}`` of the adapters loaded at run time, and
nothing else. The ingress writes it (``serving.allow_runtime_lora_updating``) and then
sends the load to every running engine replica (``app.broadcast``); an engine replica
reads it when it warms up and loads what it lists, after the configured adapters;
the ingresses read it to accept ``model: <adapter>`` and list the adapter in
``/v1/models``. Unloading removes the entry first, then the adapter from every replica.
"""

from __future__ import annotations

from typing import Any

import ray

NAMESPACE = "prefix-serve"


@ray.remote(num_cpus=0)
class AdapterBook:
    """``{adapter name: path}`` of the adapters loaded at run time (see module doc)."""

    def __init__(self) -> None:
        self.paths: dict[str, str] = {}

    def add(self, name: str, path: str) -> None:
        self.paths[name] = path

    def remove(self, name: str) -> str | None:
        return self.paths.pop(name, None)

    def all(self) -> dict[str, str]:
        return dict(self.paths)


def book_name(app_name: str) -> str:
    return f"lora-adapters:{app_name}"


def book(app_name: str, create: bool = False) -> Any:
    """The app's ``AdapterBook`` handle; made if ``create`` (else None when there is none yet)."""
    if create:
        return AdapterBook.options(  # type: ignore[attr-defined]  # a Ray actor class
            name=book_name(app_name), namespace=NAMESPACE, lifetime="detached", get_if_exists=True).remote()
    try:
        return ray.get_actor(book_name(app_name), namespace=NAMESPACE)
    except ValueError:
        return None


async def loaded(app_name: str) -> dict[str, str]:
    """``{name: path}`` of the adapters loaded at run time ({} before the first load)."""
    handle = book(app_name)
    return {} if handle is None else await handle.all.remote()
