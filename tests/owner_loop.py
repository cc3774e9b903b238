"""A router's state and relay reader owned by an event loop on a thread of its own, as Serve's
router loop owns them in the live router; tests read and change the state only through ``call``."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

from routing.index import BlockIndex
from routing.relay_reader import RelayReader
from routing.router_state import RouterState


class Owner:
    """A router's state and relay reader on an event loop of their own thread (Serve's router loop here);
    every read and change goes through ``call``, which runs on that loop."""

    def __init__(self, index: BlockIndex, state_block_size: int | None = None, **reader_kw) -> None:
        self.index = index
        self.state = RouterState(index, block_size=state_block_size)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.reader: RelayReader = self.call(lambda: RelayReader(self.state, **reader_kw))
        self.call(self.reader.ensure_running)

    def call(self, fn, *args):
        async def run():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    # The old subscriber's questions, asked of the owner.
    def set_replica(self, rid: str, events: str, snapshot: str) -> None:
        self.call(self.state.follow, rid, events, snapshot, time.time())

    def remove_replica(self, rid: str) -> None:
        self.call(self.state.unfollow, rid)

    def synced(self, rid: str) -> bool:
        return self.call(self.state.synced, rid)

    def endpoints(self) -> dict[str, str]:
        return self.call(lambda: {f.replica_id: f.events_endpoint for f in self.state.feeds()})

    @property
    def stats(self):
        return self.call(lambda: Counter(self.state.stats))

    def alive(self) -> bool:
        return self.call(self.reader.alive)

    def last_event_at(self, rid: str):
        return self.call(self.state.last_event_at, rid)

    def last_message_at(self, rid: str):
        return self.call(lambda: (f.last_message_at if (f := self.state.feed(rid)) is not None and f.batches
                                  else None))

    def blocks(self, rid: str = "replica-a") -> int:
        return self.call(self.index.replica_blocks, rid)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.reader.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=2)


def wait_for(cond, timeout: float = 10.0) -> None:
    """Poll ``cond`` every 20 ms until true; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")
