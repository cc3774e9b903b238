"""The stream channel (``app.stream_channel``) over real TCP sockets, and the dispatcher's reading of it
(``app.ingress.dispatch.Dispatcher._channel_items``): order, keys, bad frames, a gone ingress, late items."""

from __future__ import annotations

import asyncio
import socket

import pytest

import app.stream_channel as stream_channel
from app.ingress.dispatch import LATE_ITEMS_S, Dispatcher, _Call
from app.protocol import Accepted, EngineSummary, FirstOutput, StreamError
from app.stream_channel import ChannelClosed, StreamInbox, StreamOutbox, decode, encode, parse_address

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


def _record(key: bytes, body: bytes) -> bytes:
    """One record of the wire format, built here from the module doc (not by the code under test):
    length (4 bytes, little-endian), then the key's length, the key and ``body`` (kind and payload)."""
    rec = bytes((len(key),)) + key + body
    return len(rec).to_bytes(4, "little") + rec


def _records(data: bytes) -> list[tuple[bytes, object]]:
    """(key, item) of each record in ``data``, read by the module doc's format."""
    out, off = [], 0
    while off < len(data):
        size = int.from_bytes(data[off:off + 4], "little")
        rec = data[off + 4:off + 4 + size]
        off += 4 + size
        k = rec[1:1 + rec[0]]
        out.append((k, decode(rec[1 + rec[0]:2 + rec[0]], rec[2 + rec[0]:])))
    return out


async def _read(box, n: int, timeout: float = 5.0) -> list:
    return [await asyncio.wait_for(box.get(), timeout) for _ in range(n)]


async def _until(cond, timeout: float = 5.0) -> None:
    """Turn the loop until ``cond()`` holds (bytes in flight reach their reader)."""
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.01)


def test_items_reach_their_own_call_in_order_and_strays_are_dropped():
    async def run():
        inbox, outbox = StreamInbox("127.0.0.1"), StreamOutbox()
        try:
            a, b = inbox.open("call-a"), inbox.open("call-b")
            send_a = await outbox.sender(inbox.address, "call-a")
            send_b = await outbox.sender(inbox.address, "call-b")
            send_gone = await outbox.sender(inbox.address, "call-gone")  # a call that ended: nobody reads it
            # Sent without yielding to the loop: written each FLUSH_RECORDS items, read as they come.
            tokens = [f"data: {i}\n\n" for i in range(2500)]
            for i, t in enumerate(tokens):
                send_a(t)
                send_gone(t)
                if i % 2:
                    send_b(t)
            # Records that are not one of ours, on a connection of their own: dropped, the calls go on.
            host, port = parse_address(inbox.address)
            _, raw = await asyncio.open_connection(host, port)
            raw.write(_record(b"call-a", b"z\xc1"))  # call-a's key, an EngineSummary that is not MessagePack
            raw.write(_record(b"call-a", b""))  # a key and nothing else
            raw.write(_record(b"call-a", b"s")[:-3])  # a record cut short by its connection's end
            await raw.drain()
            raw.close()
            send_a(ITEMS[-1])
            got_a = await _read(a, 2501)
            got_b = await _read(b, 1250)
            assert got_a == tokens + [ITEMS[-1]]
            assert got_b == tokens[1::2]
            await _until(lambda: inbox.dropped == 2500 + 3)
            inbox.close_box(a)
            send_a("data: late\n\n")
            send_b("data: on time\n\n")
            assert await _read(b, 1) == ["data: on time\n\n"]
            assert inbox.dropped == 2504
            with pytest.raises(ValueError):
                await outbox.sender(inbox.address, "k" * 256)
            with pytest.raises(ValueError):
                await outbox.sender("ipc:///tmp/x", "k")
        finally:
            inbox.close()
            outbox.close()

    asyncio.run(run())


def test_a_record_longer_than_any_of_ours_ends_its_connection_only():
    async def run():
        inbox, outbox = StreamInbox("127.0.0.1"), StreamOutbox()
        try:
            box = inbox.open("k")
            host, port = parse_address(inbox.address)
            reader, raw = await asyncio.open_connection(host, port)
            raw.write((stream_channel.MAX_RECORD + 1).to_bytes(4, "little") + b"\x01k")
            assert await asyncio.wait_for(reader.read(), 5) == b""  # the inbox closed it
            assert inbox.dropped == 1
            send = await outbox.sender(inbox.address, "k")  # other connections go on
            send(ITEMS[0])
            assert await _read(box, 1) == [ITEMS[0]]
        finally:
            inbox.close()
            outbox.close()

    asyncio.run(run())


def test_a_stream_whose_ingress_is_gone_fails_instead_of_blocking():
    """An ingress that is gone: a new stream cannot connect, and a stream on a connection the ingress
    closed fails on its next send (``ChannelClosed``), which ends the request in the engine."""
    async def run():
        inbox, outbox = StreamInbox("127.0.0.1"), StreamOutbox()
        try:
            inbox.open("k")
            send = await outbox.sender(inbox.address, "k")
            send(ITEMS[0])
            send.flush()
            inbox.close()
            with pytest.raises(ChannelClosed):
                for _ in range(500):  # the closing reaches the engine's side within a few turns
                    send("data: x\n\n")
                    await asyncio.sleep(0.01)
            with pytest.raises(ChannelClosed):
                await outbox.sender(inbox.address, "k2")  # nothing listens there now
        finally:
            outbox.close()

    asyncio.run(run())


def test_an_ingress_that_stops_reading_fails_every_call_on_its_connection():
    """Its connection holds the writes up to ``max_buffered`` bytes, then is dropped: every call on it
    fails (an item of each may be lost), not only the one whose write went past; a new call to the
    same ingress opens a new connection."""
    async def run():
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # accepts (the kernel does) and never reads
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        outbox = StreamOutbox(max_buffered=64 * 1024)
        try:
            a, b = await outbox.sender(address, "a"), await outbox.sender(address, "b")
            chunk = "data: " + "x" * 8192 + "\n\n"
            for _ in range(10_000):  # the socket buffers fill, then the outbox's, then it gives up
                a(chunk)
                b(chunk)
                try:
                    a.flush()
                except ChannelClosed:
                    break
            else:
                pytest.fail("the connection never filled")
            with pytest.raises(ChannelClosed):
                b(chunk)
            c = await outbox.sender(address, "c")  # a connection of its own: the lost one is not reused
            c(ITEMS[0])
            c.flush()
            with pytest.raises(ChannelClosed):
                a(ITEMS[0])  # the old senders stay on the lost connection
            with pytest.raises(ValueError):  # an item the inbox would refuse fails its own call only
                c("x" * (stream_channel.MAX_RECORD + 1))
            c(ITEMS[1])
        finally:
            outbox.close()
            listener.close()

    asyncio.run(run())


def test_the_items_of_one_loop_turn_leave_together_and_flush_writes_at_once():
    """Items of several calls sent in one turn of the loop are written at its end, in the order sent;
    ``flush`` writes what is held without waiting for the turn's end."""
    async def run():
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        outbox = StreamOutbox()
        conn = None
        try:
            a, b = await outbox.sender(address, "a"), await outbox.sender(address, "b")
            conn, _ = listener.accept()
            conn.setblocking(False)
            a(ITEMS[0])
            b("data: 1\n\n")
            a(ITEMS[1])
            with pytest.raises(BlockingIOError):
                conn.recv(65536)  # held until the turn ends
            conn.settimeout(5)
            await asyncio.sleep(0)
            want = _record(b"a", b"".join(encode(ITEMS[0]))) + _record(b"b", b"sdata: 1\n\n") + \
                _record(b"a", b"".join(encode(ITEMS[1])))
            got = b""
            while len(got) < len(want):
                got += conn.recv(65536)
            assert _records(got) == [(b"a", ITEMS[0]), (b"b", "data: 1\n\n"), (b"a", ITEMS[1])]
            b(ITEMS[-1])
            b.flush()  # at once, the loop never turned
            want = _record(b"b", b"".join(encode(ITEMS[-1])))
            got = b""
            while len(got) < len(want):
                got += conn.recv(65536)
            assert _records(got) == [(b"b", ITEMS[-1])]
        finally:
            if conn is not None:
                conn.close()
            outbox.close()
            listener.close()

    asyncio.run(run())


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
            send = await outbox.sender(inbox.address, "k")

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
            send = await outbox.sender(inbox.address, "k")
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


def test_an_item_that_came_as_the_wait_for_the_end_ran_out_is_read(monkeypatch):
    """The call returned; the stream's last item reaches its mailbox, but the wait for it lost the race
    to the timeout (both in one turn of the loop: here the mailbox's wait never wakes). The stream
    still ends with the item instead of failing."""
    import app.ingress.dispatch as dispatch
    from app.stream_channel import Mailbox

    monkeypatch.setattr(dispatch, "LATE_ITEMS_S", 0.2)

    class LateBox(Mailbox):
        waits = 0

        async def get(self):
            self.waits += 1
            if self.waits == 1:  # the call's return
                return await Mailbox.get(self)
            self.put(ITEMS[-1])  # the last item comes as this wait starts, and the timeout wins the turn
            await asyncio.sleep(3600)

    async def run():
        inbox = StreamInbox("127.0.0.1")
        try:
            box = LateBox(b"k")
            call = _returned_call()
            got = [item async for item in _dispatcher(inbox)._channel_items(call, box)]
            assert got == [ITEMS[-1]]
            call.close()
        finally:
            inbox.close()

    asyncio.run(run())
