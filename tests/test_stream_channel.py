"""The stream channel (``app.stream_channel``) over real ZMQ sockets, and the dispatcher's reading of it
(``app.ingress.dispatch.Dispatcher._channel_items``): order, keys, bad frames, a gone ingress, late items."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from app.ingress.dispatch import LATE_ITEMS_S, Dispatcher, _Call
from app.protocol import Accepted, EngineSummary, FirstOutput, StreamError
from app.stream_channel import ChannelClosed, StreamInbox, StreamOutbox, decode, encode

ITEMS = [Accepted("r1"), FirstOutput("r1", 'data: {"a": 1}\n\n'), 'data: {"b": "é"}\n\n',
         StreamError(500, {"error": {"code": 500, "message": "m", "type": "t", "param": None}}, "data: x\n\n"),
         EngineSummary("r1", prompt_tokens=96, cached_tokens=64, output_tokens=2, finish_reasons=["length"],
                       ttft_s=0.01, e2e_s=0.02, data="data: [DONE]\n\n")]


def test_every_item_kind_crosses_as_it_was():
    for item in ITEMS:
        kind, payload = encode(item)
        assert decode(kind, payload) == item and type(decode(kind, payload)) is type(item)
    with pytest.raises(TypeError):
        encode({"not": "an item"})
    with pytest.raises(ValueError):
        decode(b"?", b"")
    with pytest.raises(ValueError):
        decode(b"z", b"\xc1")  # not MessagePack


async def _read(box, n: int, timeout: float = 5.0) -> list:
    return [await asyncio.wait_for(box.get(), timeout) for _ in range(n)]


def test_items_reach_their_own_call_in_order_and_strays_are_dropped():
    async def run():
        inbox, outbox = StreamInbox("127.0.0.1"), StreamOutbox()
        try:
            a, b = inbox.open("call-a"), inbox.open("call-b")
            send_a, send_b = outbox.sender(inbox.address, "call-a"), outbox.sender(inbox.address, "call-b")
            send_gone = outbox.sender(inbox.address, "call-gone")  # a call that ended: nobody reads it
            tokens = [f"data: {i}\n\n" for i in range(2500)]  # past DRAIN_BATCH: read over several turns
            for i, t in enumerate(tokens):
                send_a(t)
                send_gone(t)
                if i % 2:
                    send_b(t)
            # A frame that is not one of ours, from another socket: dropped, the calls go on.
            raw = zmq.Context.instance().socket(zmq.PUSH)
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(inbox.address)
            raw.send(b"\x06call-az\xc1")  # call-a's key, an EngineSummary that is not MessagePack
            raw.send(b"\x06call-a")  # a key and nothing else
            raw.send(b"")
            send_a(ITEMS[-1])
            got_a = await _read(a, 2501)
            got_b = await _read(b, 1250)
            raw.close(0)
            assert got_a == tokens + [ITEMS[-1]]
            assert got_b == tokens[1::2]
            assert inbox.dropped == 2500 + 3
            inbox.close_box(a)
            send_a("data: late\n\n")
            send_b("data: on time\n\n")
            assert await _read(b, 1) == ["data: on time\n\n"]
            assert inbox.dropped == 2504
            with pytest.raises(ValueError):
                outbox.sender(inbox.address, "k" * 256)
        finally:
            inbox.close()
            outbox.close()

    asyncio.run(run())


def test_a_stream_whose_ingress_is_gone_fails_instead_of_blocking():
    """An ingress that stopped reading: the engine's sends fill the socket's queue, then fail
    (``ChannelClosed``), which ends the request in the engine; no send ever blocks."""
    inbox = StreamInbox("127.0.0.1")
    address = inbox.address
    inbox.close()
    outbox = StreamOutbox(sndhwm=10)
    send = outbox.sender(address, "k")
    sent = 0
    with pytest.raises(ChannelClosed):
        for _ in range(10_000):
            send("data: x\n\n")
            sent += 1
    assert 10 <= sent < 10_000
    outbox.close()


class CallStandIn:
    """Stands in for Serve's ``DeploymentResponseGenerator`` in the timing tests below, where the order
    of the call's return and the channel's items must be set, not left to Serve: the items the call
    yields, then its return (or ``error``) once ``release`` is set. ``cancel`` is Serve's cancel."""

    def __init__(self, items=(), error: BaseException | None = None):
        self.items, self.error = list(items), error
        self.release = asyncio.Event()
        self.cancelled = False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for item in self.items:
            yield item
        await self.release.wait()
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True
        self.release.set()


def _dispatcher(inbox):
    return Dispatcher(engine=None, timeout_s=60, inbox=inbox)


def _returned_call() -> _Call:
    """A call (on the running loop) that has returned, with no item of its own."""
    call_gen = CallStandIn()
    call_gen.release.set()
    return _Call(call_gen, asyncio.get_running_loop().time() + 60)


def test_items_sent_before_the_call_returned_are_read_though_they_arrive_after_it():
    """The engine sends its last items, then its call returns: the return may reach the ingress
    first. The stream still ends with every item, in order."""
    async def run():
        inbox, outbox = StreamInbox("127.0.0.1"), StreamOutbox()
        try:
            box = inbox.open("k")
            call = _returned_call()  # the call has returned before any item came
            reader = _dispatcher(inbox)._channel_items(call, box)
            send = outbox.sender(inbox.address, "k")

            async def late():
                await asyncio.sleep(0.2)
                for item in ITEMS:
                    send(item)

            task = asyncio.ensure_future(late())
            got = [item async for item in reader]
            await task
            assert got == ITEMS
            call.close()
        finally:
            inbox.close()
            outbox.close()

    asyncio.run(run())


def test_a_call_that_fails_mid_stream_raises_after_the_items_that_came():
    """A lost engine replica: the items it sent are read, then its call's error is raised (the
    dispatcher then ends the stream with the error event)."""
    from ray.exceptions import ActorDiedError

    async def run():
        inbox, outbox = StreamInbox("127.0.0.1"), StreamOutbox()
        try:
            box = inbox.open("k")
            call_gen = CallStandIn(error=ActorDiedError())
            call = _Call(call_gen, asyncio.get_running_loop().time() + 60)
            reader = _dispatcher(inbox)._channel_items(call, box)
            send = outbox.sender(inbox.address, "k")
            for item in ITEMS[:3]:
                send(item)
            got = [await anext(reader) for _ in range(3)]
            assert got == ITEMS[:3]
            call_gen.release.set()
            with pytest.raises(ActorDiedError):
                await anext(reader)
            call.close()
        finally:
            inbox.close()
            outbox.close()

    asyncio.run(run())


def test_a_refusal_through_the_call_ends_the_stream_and_a_reader_that_leaves_cancels_the_call():
    async def run():
        inbox = StreamInbox("127.0.0.1")
        try:
            refusal = EngineSummary("r1", data={"error": "refused"})
            call = _Call(CallStandIn([refusal]), asyncio.get_running_loop().time() + 60)
            reader = _dispatcher(inbox)._channel_items(call, inbox.open("k1"))
            assert [item async for item in reader] == [refusal]
            call.close()
            # A reader that leaves while the stream runs (a client gone): the call is cancelled.
            call_gen = CallStandIn()
            call = _Call(call_gen, asyncio.get_running_loop().time() + 60)
            reader = _dispatcher(inbox)._channel_items(call, inbox.open("k2"))
            pending = asyncio.ensure_future(anext(reader))
            await asyncio.sleep(0.05)
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
            call.close()
            assert call_gen.cancelled
        finally:
            inbox.close()

    asyncio.run(run())


def test_a_call_that_returned_without_its_streams_end_fails_after_the_wait(monkeypatch):
    import app.ingress.dispatch as dispatch

    monkeypatch.setattr(dispatch, "LATE_ITEMS_S", 0.2)
    assert LATE_ITEMS_S == 5.0

    async def run():
        inbox = StreamInbox("127.0.0.1")
        try:
            call = _returned_call()
            reader = _dispatcher(inbox)._channel_items(call, inbox.open("k"))
            with pytest.raises(RuntimeError, match="without the end of its stream"):
                await anext(reader)
            call.close()
        finally:
            inbox.close()

    asyncio.run(run())


def test_items_whose_wake_up_the_reader_missed_are_read_when_the_wait_ends(monkeypatch):
    """The call returned and its last items sit in the socket, but the reader was never woken for
    them (here: it is taken off the loop). When the wait for the stream's end runs out, the socket is
    read once more and the stream ends with every item instead of failing."""
    import app.ingress.dispatch as dispatch

    monkeypatch.setattr(dispatch, "LATE_ITEMS_S", 0.3)

    async def run():
        inbox, outbox = StreamInbox("127.0.0.1"), StreamOutbox()
        try:
            box = inbox.open("k")
            asyncio.get_running_loop().remove_reader(inbox._sock.fileno())  # no wake-up from now on
            call = _returned_call()
            send = outbox.sender(inbox.address, "k")
            for item in ITEMS:
                send(item)
            poller = zmq.Poller()  # the items are in the socket before the wait starts
            poller.register(inbox._sock, zmq.POLLIN)
            assert poller.poll(10_000)
            got = [item async for item in _dispatcher(inbox)._channel_items(call, box)]
            assert got == ITEMS
            call.close()
        finally:
            inbox.close()
            outbox.close()

    asyncio.run(run())
