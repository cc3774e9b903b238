"""LoRA adapters loaded at run time (``POST /v1/load_lora_adapter``): the one record of them.

vLLM's server loads an adapter into its one engine (with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); here it must reach every engine replica,
including those Serve starts later. ``AdapterBook`` is the record: a named Ray actor
(one per app, detached so it outlives the ingress replica that made it, none per
process) that owns ``{adapter name: path}`` of the adapters loaded at run time, and
nothing else. The ingress writes it (``serving.allow_runtime_lora_updating``) and then
sends the load to every running engine replica (``app.ingress.broadcast``), or to the replicas
the load names; an engine replica reads it when it warms up and loads those loaded on
every replica, after the configured adapters;
the ingresses read it to accept ``model: <adapter>`` and list the adapter in
``/v1/models``. Unloading removes the entry first, then the adapter from every replica.
"""

from __future__ import annotations

from typing import Any

import ray

NAMESPACE = "prefix-serve"


@ray.remote(num_cpus=0)
class AdapterBook:
    """The adapters loaded at run time (see module doc): each one's path, and the replicas it was
    loaded on when a load named them (None: every replica, those started later included)."""

    def __init__(self) -> None:
        self.paths: dict[str, str] = {}
        self.only: dict[str, list[str]] = {}

    def add(self, name: str, path: str, replicas: list[str] | None = None) -> None:
        self.paths[name] = path
        self.only.pop(name, None)
        if replicas is not None:
            self.only[name] = list(replicas)

    def remove(self, name: str) -> str | None:
        self.only.pop(name, None)
        return self.paths.pop(name, None)

    def entry(self, name: str) -> tuple[str, list[str] | None] | None:
        """``(path, replicas)`` of one adapter (see ``add``), or None."""
        return (self.paths[name], self.only.get(name)) if name in self.paths else None

    def all(self) -> dict[str, str]:
        """``{name: path}`` of every adapter loaded at run time."""
        return dict(self.paths)

    def for_every_replica(self) -> dict[str, str]:
        """``{name: path}`` of those loaded on every replica: what a replica starting now loads."""
        return {n: p for n, p in self.paths.items() if n not in self.only}


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


async def loaded(app_name: str, every_replica: bool = False) -> dict[str, str]:
    """``{name: path}`` of the adapters loaded at run time ({} before the first load); with
    ``every_replica``, only those loaded on every replica (a replica starting now loads these)."""
    handle = book(app_name)
    if handle is None:
        return {}
    return await (handle.for_every_replica.remote() if every_replica else handle.all.remote())
