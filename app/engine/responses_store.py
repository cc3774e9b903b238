"""vLLM's Responses-API store, bounded: a response, its input messages and its background
stream's events are one entry of one bounded map (``ResponsesStore``), which vLLM's
``OpenAIServingResponses`` reads and writes through its own three dicts
(``response_store``, ``msg_store``, ``event_store``; ``bound_responses_store``)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

from app.config import ResponsesStoreConfig


def bound_responses_store(serving: Any, cfg: ResponsesStoreConfig) -> None:
    """Turn vLLM's Responses store on or off (``cfg.enabled``, in place of its process-wide
    ``VLLM_ENABLE_RESPONSES_API_STORE``) and bound it (vLLM's are three dicts that never shrink).

    vLLM's ``response_store``, ``msg_store`` and ``event_store`` become three views of one
    ``ResponsesStore``: a response, its input messages and its background stream's events are one
    entry, which lives and leaves as one. See ``ResponsesStore`` for the bound.
    """
    store = ResponsesStore(cfg.max_entries, cfg.ttl_s, running=lambda key: key in serving.background_tasks)
    serving.enable_store = cfg.enabled
    serving.response_store = store.responses
    serving.msg_store = store.messages
    serving.event_store = store.events


class ResponsesStore:
    """vLLM's Responses store as one bounded map of entries: id -> (response, input messages, events).

    vLLM writes an entry's input messages first (``msg_store``), then its response
    (``response_store``: a background one as "queued", then again when it ends), then, for a
    background stream, its events (``event_store``). Here:

    - Any read or write of an entry, through any of the three views, renews the whole entry:
      its place in the count order and its age (``ttl_s`` seconds, ``time.monotonic``).
    - Past ``max_entries`` entries, the least recently used entry that is done leaves; a request
      still generating (messages written, no response yet) leaves only when none is done. A running
      background response (in vLLM's ``background_tasks``) never leaves, by count or by age, so its
      cancel and its stream always find it; it counts towards ``max_entries``, which the store
      passes only while more than that many requests run.
    - An entry is born with its messages: a response or events written for an id without an
      entry (one that left while its request ran) are not kept, so a stored response always
      has its whole history, and a follow-up whose history is gone gets vLLM's 404
      ("Response with id ... not found"), never a shorter prompt.
    - Deleting an id through any view removes the whole entry.
    """

    def __init__(self, max_entries: int, ttl_s: float, running: Callable[[str], bool]):
        self.max_entries, self.ttl_s, self.running = max_entries, ttl_s, running
        self.entries: OrderedDict[str, list[Any]] = OrderedDict()  # id -> [response, messages, events, used_at]
        self.responses = _StoreView(self, 0)
        self.messages = _StoreView(self, 1)
        self.events = _StoreView(self, 2)

    def read(self, key: str, field: int) -> Any:
        """The field of entry ``key`` (None when absent), renewing the entry."""
        self._expire()
        entry = self.entries.get(key)
        if entry is None:
            return None
        self._renew(key, entry)
        return entry[field]

    def write(self, key: str, field: int, value: Any) -> None:
        """Set a field of entry ``key``; only messages create an entry."""
        self._expire()
        entry = self.entries.get(key)
        if entry is None:
            if field != 1:
                return  # its entry (and so its history) is gone: kept as never stored
            entry = self.entries[key] = [None, None, None, 0.0]
        entry[field] = value
        self._renew(key, entry)
        self._evict()

    def remove(self, key: str) -> None:
        self.entries.pop(key, None)

    def _renew(self, key: str, entry: list[Any]) -> None:
        entry[3] = time.monotonic()
        self.entries.move_to_end(key)

    def _expire(self) -> None:
        oldest = time.monotonic() - self.ttl_s
        for key, entry in list(self.entries.items()):
            if entry[3] > oldest:
                break  # in order of use: the rest are younger
            if not self.running(key):
                del self.entries[key]

    def _evict(self) -> None:
        while len(self.entries) > self.max_entries:
            done = next((k for k, e in self.entries.items() if e[0] is not None and not self.running(k)), None)
            if done is None:
                done = next((k for k in self.entries if not self.running(k)), None)
            if done is None:
                return
            del self.entries[done]


class _StoreView(MutableMapping):
    """One of vLLM's three store dicts (responses, messages, events): one field of each entry."""

    def __init__(self, store: ResponsesStore, field: int):
        self.store, self.field = store, field

    def __getitem__(self, key: str) -> Any:
        value = self.store.read(key, self.field)
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        self.store.write(key, self.field, value)

    def __delitem__(self, key: str) -> None:
        if key not in self:
            raise KeyError(key)
        self.store.remove(key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.store.read(key, self.field) is not None

    def __iter__(self) -> Iterator[str]:
        self.store._expire()
        return iter([k for k, e in self.store.entries.items() if e[self.field] is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)
