"""The ingress's worker loop (``app.ingress.offload.WorkerLoop``): results, errors, context, cancellation, close."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from app.ingress.offload import WorkerLoop

CURRENT = contextvars.ContextVar("current", default=None)


@pytest.fixture
def worker():
    w = WorkerLoop()
    yield w
    w.close()


def test_runs_on_its_own_thread_with_the_callers_context(worker):
    async def probe():
        await asyncio.sleep(0)
        return threading.current_thread().name, CURRENT.get()

    async def main():
        CURRENT.set("span-1")
        return await worker.run(probe())

    name, value = asyncio.run(main())
    assert name == "ingress-prepare" and value == "span-1"


def test_an_exception_reaches_the_caller(worker):
    async def boom():
        raise ValueError("bad body")

    with pytest.raises(ValueError, match="bad body"):
        asyncio.run(worker.run(boom()))


def test_the_serving_loop_keeps_running_while_the_worker_computes(worker):
    async def busy():  # pure-Python CPU work, as validation and rendering are
        total = 0
        for i in range(3_000_000):
            total += i
        return total

    async def main():
        ticks = 0
        job = asyncio.ensure_future(worker.run(busy()))
        while not job.done():
            await asyncio.sleep(0.001)
            ticks += 1
        return ticks, await job

    ticks, total = asyncio.run(main())
    assert total == sum(range(3_000_000)) and ticks >= 5


def test_cancelling_the_caller_cancels_the_work(worker):
    cancelled = threading.Event()

    async def slow():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main():
        job = asyncio.ensure_future(worker.run(slow()))
        await asyncio.sleep(0.05)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job

    asyncio.run(main())
    assert cancelled.wait(2)


def test_close_ends_waiting_callers_and_refuses_new_work():
    w = WorkerLoop()

    async def main():
        job = asyncio.ensure_future(w.run(asyncio.sleep(30)))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(w.close)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(job, 5)
        with pytest.raises(RuntimeError, match="closed"):
            await w.run(asyncio.sleep(0))

    asyncio.run(main())
