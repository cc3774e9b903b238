"""A streamed answer's items from the engine replica to the ingress that asked, over a TCP socket.

A Ray Serve streaming call carries each item it yields as one object of Ray's
streaming-generator protocol: a gRPC message out of the engine replica, a
core-worker callback and an asyncio wake-up in the ingress. Measured with py-spy
beside vLLM's own server (``bench.serving_overhead``, 8 streams), that machinery
was most of both replicas' CPU per streamed token. So a stream's items take this
channel instead, and the Ray call carries only the request and its outcome: the
engine replica writes each item to a TCP connection to the asking ingress, from
its event loop; the ingress reads them on its serving loop.

What stays on the Ray call: choosing the replica (the request router), the request
itself, a refusal or a whole answer (``app.ingress.dispatch``), cancellation (a client gone,
the deadline: cancelling the call aborts the request in the engine) and replica
loss (the call fails; the ingress ends the stream with the error event, or resends
the request when nothing of its answer came yet).

- ``StreamInbox`` (the ingress): one listening socket per process, bound on the node's
  address at a free port (``address``). ``open(key)`` gives the ``Mailbox`` of one
  call; the serving loop (the loop that opened the first mailbox, the owner of the
  mailboxes) accepts the engine replicas' connections and, as bytes arrive, puts each
  item into its mailbox, dropping those of a key no longer open (a request that ended
  or left).
- ``StreamOutbox`` (the engine replica): one connection per ingress address, opened on
  first use (``await sender(address, key)``); a ``StreamSender`` per call queues its
  items, and a turn's worth leaves in one write. Nothing blocks: a connection the
  ingress does not read holds the writes in memory up to ``MAX_BUFFERED`` bytes, and
  then it is dropped and every call on it fails with ``ChannelClosed``, which aborts its
  request; so does a connection that fails or cannot be opened (the ingress is gone).

Why a TCP connection on the two event loops and not a ZMQ socket (the first version):
ZMQ moves each message through an I/O thread of its own on both sides, two more
thread wake-ups per message; a ping-pong of 100-byte messages between two processes
here took 190-250 µs and 95-118 µs of CPU a round trip each side over ZMQ, 87-135 µs
and 37-44 µs over asyncio's TCP transports (``uvloop``).

Wire format: a stream of records on the connection. A record is one item: its length
(4 bytes, little-endian, at most ``MAX_RECORD``), the length of the call's key (one
byte), the key (its ``EngineRequest.route_id``, ASCII), the item's kind (one byte) and
its payload: ``s`` an SSE string (UTF-8), ``a`` ``Accepted``, ``f`` ``FirstOutput``,
``e`` ``StreamError``, ``z`` ``EngineSummary`` (``app.protocol``'s dataclasses as
MessagePack, by msgspec). No pickle: the socket takes bytes from the network; a
length over ``MAX_RECORD`` ends the connection. Items of one call arrive in the
order they were sent (one connection from each engine replica to each ingress).

Why a turn's items go together: vLLM's output handler hands one engine step's tokens to
every running stream at once, so under load each turn of the engine replica's loop sends
one item for each stream: one write (one system call, one wake-up of the ingress's loop)
per engine step instead of one per token. The items wait at most until the end of the
loop turn that sent them (``StreamSender.flush`` writes at once: the engine replica calls
it as a stream ends, so a stream's last items leave before its call returns).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

import msgspec

from app.protocol import Accepted, EngineSummary, FirstOutput, StreamError

logger = logging.getLogger("prefix_serve.stream_channel")
MAX_BUFFERED = 16 * 1024 * 1024
"""Bytes an engine replica holds for one ingress that does not read them before it drops that
connection (``ChannelClosed``): some 100,000 tokens' events, far above what live streams hold in
flight; reached only by an ingress that stopped reading."""

USER_TIMEOUT_MS = 30_000
"""Longest time written bytes may go unacknowledged before the engine replica's kernel drops the
connection (``TCP_USER_TIMEOUT``): an ingress whose host died or was cut off fails its streams then,
not after TCP's retransmissions give up (about 15 minutes)."""

MAX_RECORD = 64 * 1024 * 1024
"""The longest record an inbox takes (an item is a token's SSE event or a stream's end): a longer
length ends the connection as not one of ours."""

FLUSH_RECORDS = 256
"""Items an outbox holds for one ingress before it writes them without waiting for the loop turn's
end (a sender that never yields to its loop still sends)."""

CONNECT_TIMEOUT_S = 10.0
"""Longest wait for an ingress to take an engine replica's connection before its streams fail."""

_LEN = 4  # bytes of a record's length

_KINDS: dict[type, bytes] = {Accepted: b"a", FirstOutput: b"f", StreamError: b"e", EngineSummary: b"z"}
_TYPES: dict[bytes, type] = {kind: cls for cls, kind in _KINDS.items()}
_encode = msgspec.msgpack.Encoder().encode
_decoders: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
    kind: msgspec.msgpack.Decoder(cls) for kind, cls in _TYPES.items()}


class ChannelClosed(RuntimeError):
    """The connection to a stream's ingress cannot carry it: it could not be opened, it closed, or the
    ingress stopped reading (``MAX_BUFFERED``). The stream cannot go on."""


def encode(item: Any) -> tuple[bytes, bytes]:
    """``(kind, payload)`` of one stream item: an SSE ``str`` or one of ``app.protocol``'s items.

    Raises:
        TypeError: any other item.
    """
    if isinstance(item, str):
        return b"s", item.encode()
    kind = _KINDS.get(type(item))
    if kind is None:
        raise TypeError(f"not a stream item: {type(item).__name__}")
    return kind, _encode(item)


def decode(kind: bytes, payload: bytes) -> Any:
    """The item ``encode`` made.

    Raises:
        ValueError: an unknown kind or a payload that does not decode as its kind.
    """
    if kind == b"s":
        return payload.decode()
    decoder = _decoders.get(kind)
    if decoder is None:
        raise ValueError(f"unknown stream item kind {kind!r}")
    try:
        return decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"bad stream item of kind {kind!r}: {e}") from e


def _tcp_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def parse_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of a ``tcp://host:port`` address (``[v6]`` brackets dropped).

    Raises:
        ValueError: not of that form.
    """
    rest = address.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if rest == address or not sep or not host or not port.isdigit():
        raise ValueError(f"not a tcp://host:port address: {address!r}")
    return host.strip("[]"), int(port)


class Mailbox:
    """The items of one call, in arrival order (``get``); filled by the inbox's reader."""

    __slots__ = ("key", "_queue")

    def __init__(self, key: bytes):
        self.key = key
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:
        """Add an item (from the owner loop only)."""
        self._queue.put_nowait(item)

    async def get(self) -> Any:
        """The next item, waiting for it."""
        return await self._queue.get()

    def get_nowait(self) -> Any:
        """The next item if one is here, else None."""
        return None if self._queue.empty() else self._queue.get_nowait()


class StreamInbox:
    """The ingress's end: one listening socket, one mailbox per open call (see module doc).

    Args:
        host: the address to bind and announce (``app.node_address.resolve()`` in a replica).
    """

    def __init__(self, host: str):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(1024)  # connections wait here until the serving loop accepts them
        self._listener.setblocking(False)
        self.address = f"tcp://{_tcp_host(host)}:{self._listener.getsockname()[1]}"
        self._boxes: dict[bytes, Mailbox] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Future | None = None
        self._conns: set[_InboxConnection] = set()
        self.dropped = 0  # items of calls no longer open, or that did not decode; connections cut short

    def open(self, key: str) -> Mailbox:
        """The mailbox of the call ``key`` (its ``EngineRequest.route_id``); call on the serving loop.
        The first call starts accepting connections on this loop."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._server = asyncio.ensure_future(
                self._loop.create_server(lambda: _InboxConnection(self), sock=self._listener, backlog=1024))
        box = self._boxes[key.encode()] = Mailbox(key.encode())
        return box

    def close_box(self, box: Mailbox) -> None:
        """Forget a call's mailbox: its items still in flight are dropped."""
        if self._boxes.get(box.key) is box:
            del self._boxes[box.key]

    def deliver(self, buf: bytearray) -> int:
        """Put each whole record at the start of ``buf`` into its call's mailbox (a record of a call no
        longer open, or that does not decode, is dropped and counted); the bytes consumed.

        Raises:
            ValueError: a record longer than ``MAX_RECORD`` (the connection is not one of ours).
        """
        boxes, off, n = self._boxes, 0, len(buf)
        while n - off >= _LEN:
            size = int.from_bytes(buf[off:off + _LEN], "little")
            if size > MAX_RECORD:
                raise ValueError(f"a stream record of {size} bytes")
            if n - off - _LEN < size:
                break
            rec = bytes(buf[off + _LEN:off + _LEN + size])
            off += _LEN + size
            end = 1 + rec[0] if rec else 0
            box = boxes.get(rec[1:end]) if len(rec) > end else None
            if box is None:
                self.dropped += 1
                continue
            try:
                box.put(decode(rec[end:end + 1], rec[end + 1:]))
            except ValueError:
                self.dropped += 1
                logger.warning("dropped a stream item that did not decode (kind %r)", rec[end:end + 1])
        return off

    def close(self) -> None:
        """Stop accepting, drop the connections and close the socket (the replica's shutdown); from any
        thread: done on the serving loop."""
        def shut() -> None:
            for conn in list(self._conns):
                conn.close()
            server, self._server = self._server, None
            if server is not None:
                if server.done() and not server.cancelled() and server.exception() is None:
                    server.result().close()
                else:
                    server.cancel()
            self._listener.close()

        _on_loop(self._loop, shut)


class _InboxConnection(asyncio.Protocol):
    """One engine replica's connection to an inbox: bytes in, records out (``StreamInbox.deliver``)."""

    def __init__(self, inbox: StreamInbox):
        self.inbox = inbox
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.inbox._conns.add(self)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        try:
            used = self.inbox.deliver(buf)
        except ValueError as e:
            self.inbox.dropped += 1
            logger.warning("dropped a stream connection: %s", e)
            buf.clear()
            self.close()
            return
        del buf[:used]

    def connection_lost(self, exc: Exception | None) -> None:
        self.inbox._conns.discard(self)
        if self.buf:
            self.inbox.dropped += 1  # a record cut short
            self.buf.clear()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class _Route:
    """An outbox's connection to one ingress and the records not written yet."""

    __slots__ = ("address", "ready", "transport", "records", "scheduled", "lost")

    def __init__(self, address: str):
        self.address = address
        self.ready: asyncio.Future[None] | None = None  # the connection is open (or failed)
        self.transport: asyncio.Transport | None = None
        self.records: list[bytes] = []
        self.scheduled = False  # a flush is due at the end of this turn of the loop
        self.lost: str | None = None  # why this connection can carry nothing more


class _OutboxConnection(asyncio.Protocol):
    def __init__(self, route: _Route):
        self.route = route

    def connection_lost(self, exc: Exception | None) -> None:
        self.route.lost = self.route.lost or f"the connection to the ingress at {self.route.address} closed"


class StreamSender:
    """Sends the items of one call to one ingress (``StreamOutbox.sender``): calling it queues one item,
    written with the others of this turn of the loop; ``flush`` writes what is queued now (into the
    connection's transport, which sends it as the socket takes it).

    Both raise ``ChannelClosed`` when the connection to that ingress can carry nothing more (an item
    of this call may be lost); a call raises ``TypeError`` for an item that is not a stream item and
    ``ValueError`` for one over ``MAX_RECORD``."""

    __slots__ = ("_outbox", "_route", "_head")

    def __init__(self, outbox: StreamOutbox, route: _Route, head: bytes):
        self._outbox, self._route, self._head = outbox, route, head

    def __call__(self, item: Any) -> None:
        kind, payload = encode(item)
        route = self._route
        if route.lost is not None:
            raise ChannelClosed(route.lost)
        size = len(self._head) + 1 + len(payload)
        if size > MAX_RECORD:  # the inbox would drop the connection, and every stream on it
            raise ValueError(f"a stream item of {size} bytes (MAX_RECORD {MAX_RECORD})")
        route.records.append(b"".join((size.to_bytes(_LEN, "little"), self._head, kind, payload)))
        if len(route.records) >= FLUSH_RECORDS:
            self._outbox.flush(route)
        elif not route.scheduled:
            route.scheduled = True
            asyncio.get_running_loop().call_soon(self._outbox.flush, route)
        if route.lost is not None:
            raise ChannelClosed(route.lost)

    def flush(self) -> None:
        """Write this ingress's queued items now (the end of a stream: before its call returns)."""
        self._outbox.flush(self._route)
        if self._route.lost is not None:
            raise ChannelClosed(self._route.lost)


class StreamOutbox:
    """The engine replica's end: one connection per ingress address (see module doc).

    ``max_buffered``: bytes held for one ingress that does not read before its connection is dropped
    (``MAX_BUFFERED``). Used from one event loop (the replica's): the connections are that loop's.
    """

    def __init__(self, max_buffered: int = MAX_BUFFERED):
        self._max_buffered = max_buffered
        self._routes: dict[str, _Route] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the connections are on

    async def sender(self, address: str, key: str) -> StreamSender:
        """The ``StreamSender`` of the call ``key`` to the ingress at ``address`` (a ``tcp://host:port``
        ``StreamInbox.address``), once the connection to it is open.

        Raises:
            ValueError: a key that is empty or over 255 bytes, or an address not of that form.
            ChannelClosed: the connection cannot be opened (that ingress is gone).
        """
        k = key.encode()
        if not 0 < len(k) < 256:
            raise ValueError(f"a call's key is 1-255 bytes, not {len(k)}")
        self._loop = asyncio.get_running_loop()
        route = self._routes.get(address)
        if route is None or route.lost is not None:
            host, port = parse_address(address)
            route = self._routes[address] = _Route(address)
            route.ready = asyncio.ensure_future(self._connect(route, host, port))
        assert route.ready is not None
        await asyncio.shield(route.ready)  # a call cancelled while it waits leaves the connect to the others
        if route.lost is not None:
            raise ChannelClosed(route.lost)
        return StreamSender(self, route, bytes((len(k),)) + k)

    async def _connect(self, route: _Route, host: str, port: int) -> None:
        """Open ``route``'s connection; on any failure mark it lost (``sender`` then opens a new one)."""
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await asyncio.wait_for(
                loop.create_connection(lambda: _OutboxConnection(route), host, port), CONNECT_TIMEOUT_S)
            sock = transport.get_extra_info("socket")  # TCP_NODELAY is the transports' default
            if sock is not None and hasattr(socket, "TCP_USER_TIMEOUT"):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
        except BaseException as e:
            route.lost = f"cannot connect to the ingress at {route.address}: {e!r}"
            if not isinstance(e, Exception):
                raise
            return
        route.transport = transport

    def flush(self, route: _Route) -> None:
        """Write what ``route`` holds in one write. A connection holding more than ``max_buffered``
        bytes the ingress has not read is dropped: every call on it then fails (``ChannelClosed``)."""
        route.scheduled = False
        if not route.records:
            return
        records, route.records = route.records, []
        transport = route.transport
        if route.lost is not None or transport is None:
            return
        if transport.is_closing():  # closed by the peer, its connection_lost not run yet: a write is dropped
            route.lost = f"the connection to the ingress at {route.address} closed"
            return
        transport.write(b"".join(records))
        if transport.get_write_buffer_size() > self._max_buffered:
            route.lost = f"the ingress at {route.address} is not reading its streams"
            transport.abort()

    def close(self) -> None:
        """Close every connection once what it holds is sent (the replica's shutdown, after the drain);
        from any thread: done on the connections' loop."""
        def shut() -> None:
            routes, self._routes = list(self._routes.values()), {}
            for route in routes:
                self.flush(route)
                route.lost = route.lost or "the engine replica is shutting down"
                if route.transport is not None:
                    route.transport.close()

        _on_loop(self._loop, shut)


def _on_loop(loop: asyncio.AbstractEventLoop | None, fn: Callable[[], None]) -> None:
    """Run ``fn`` on ``loop`` (now if it is this thread's running loop, else posted to it); now if there
    is no loop or it is closed."""
    if loop is None or loop.is_closed():
        fn()
    elif asyncio._get_running_loop() is loop:
        fn()
    else:
        loop.call_soon_threadsafe(fn)
