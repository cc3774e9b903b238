"""A streamed answer's items from the engine replica to the ingress that asked, over ZMQ.

A Ray Serve streaming call carries each item it yields as one object of Ray's
streaming-generator protocol: a gRPC message out of the engine replica, a
core-worker callback and an asyncio wake-up in the ingress. Measured with py-spy
beside vLLM's own server (``bench.serving_overhead``, 8 streams), that machinery
was most of both replicas' CPU per streamed token. So a stream's items take this
channel instead, and the Ray call carries only the request and its outcome: the
engine replica sends each item into a ZMQ PUSH socket connected to the asking
ingress; the ingress reads them from its PULL socket on its serving loop.

What stays on the Ray call: choosing the replica (the request router), the request
itself, a refusal or a whole answer (``app.ingress.dispatch``), cancellation (a client gone,
the deadline: cancelling the call aborts the request in the engine) and replica
loss (the call fails; the ingress ends the stream with the error event, or resends
the request when nothing of its answer came yet).

- ``StreamInbox`` (the ingress): one PULL socket per process, bound on the node's
  address at a free port (``address``). ``open(key)`` gives the ``Mailbox`` of one
  call; the socket's reader, on the loop that opened the first mailbox (the
  serving loop, the owner of the mailboxes), puts each item into its mailbox and
  drops those of a key no longer open (a request that ended or left).
- ``StreamOutbox`` (the engine replica): one PUSH socket per ingress address,
  connected on first use; ``send`` never blocks (a stream whose ingress stopped
  reading fills the socket's queue, ``SNDHWM`` items, and ``ChannelClosed`` ends it,
  which aborts the request).

Wire format, one single-frame ZMQ message per item (one frame: a third of the
cost of three in pyzmq): the length of the call's key (one byte), the key (its
``EngineRequest.route_id``, ASCII), the item's kind (one byte) and its payload:
``s`` an SSE string (UTF-8), ``a`` ``Accepted``, ``f`` ``FirstOutput``, ``e``
``StreamError``, ``z`` ``EngineSummary`` (``app.protocol``'s dataclasses as
MessagePack, by msgspec). No pickle: the socket takes bytes from the network.
Items of one call arrive in the order they were sent (one socket, one TCP
connection from each engine replica to each ingress).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from app.protocol import Accepted, EngineSummary, FirstOutput, StreamError

logger = logging.getLogger("prefix_serve.stream_channel")
SNDHWM = 1_000_000
"""Items an engine replica queues for one ingress before a send fails (``ChannelClosed``): far
above what live streams hold in flight; reached only by an ingress that stopped reading."""

DRAIN_BATCH = 1024
"""Items the inbox reads in one turn of the serving loop (about a millisecond of work)."""

_KINDS: dict[type, bytes] = {Accepted: b"a", FirstOutput: b"f", StreamError: b"e", EngineSummary: b"z"}
_TYPES: dict[bytes, type] = {kind: cls for cls, kind in _KINDS.items()}
_encode = msgspec.msgpack.Encoder().encode
_decoders: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
    kind: msgspec.msgpack.Decoder(cls) for kind, cls in _TYPES.items()}


class ChannelClosed(RuntimeError):
    """The ingress of a stream stopped reading (its socket queue is full): the stream cannot go on."""


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


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, 1)
    return sock


def _tcp_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


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
    """The ingress's end: one PULL socket, one mailbox per open call (see module doc).

    Args:
        host: the address to bind and announce (``app.node_address.resolve()`` in a replica).
    """

    def __init__(self, host: str):
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sock = _socket(self._ctx, zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        port = self._sock.bind_to_random_port(f"tcp://{_tcp_host(host)}")
        self.address = f"tcp://{_tcp_host(host)}:{port}"
        self._boxes: dict[bytes, Mailbox] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dropped = 0  # items of calls no longer open, or that did not decode

    def open(self, key: str) -> Mailbox:
        """The mailbox of the call ``key`` (its ``EngineRequest.route_id``); call on the serving loop.
        The first call starts the socket's reader on this loop."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._sock.fileno(), self._drain)
        box = self._boxes[key.encode()] = Mailbox(key.encode())
        self._drain()  # items may have come before the reader ran (the FD is edge-triggered)
        return box

    def close_box(self, box: Mailbox) -> None:
        """Forget a call's mailbox: its items still in flight are dropped."""
        if self._boxes.get(box.key) is box:
            del self._boxes[box.key]

    def poll(self) -> None:
        """Read what the socket holds now into the mailboxes (as its reader does when woken); call on
        the serving loop."""
        self._drain()

    def _drain(self) -> None:
        """Every item waiting on the socket into its mailbox (ZMQ's FD signals edges: read until empty),
        at most ``DRAIN_BATCH`` a turn of the loop: the rest on its next turn, so a flood never holds
        the serving loop."""
        sock, boxes = self._sock, self._boxes
        for _ in range(DRAIN_BATCH):
            try:
                msg = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed
                return
            end = 1 + msg[0] if msg else 0
            box = boxes.get(msg[1:end]) if len(msg) > end else None
            if box is None:
                self.dropped += 1
                continue
            try:
                box.put(decode(msg[end:end + 1], msg[end + 1:]))
            except ValueError:
                self.dropped += 1
                logger.warning("dropped a stream item that did not decode (kind %r)", msg[end:end + 1])
        if self._loop is not None:  # not empty yet: the FD will not signal again for what is queued
            self._loop.call_soon(self._drain)

    def close(self) -> None:
        """Stop reading and close the socket (the replica's shutdown)."""
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            try:
                loop.remove_reader(self._sock.fileno())
            except Exception:  # noqa: BLE001 - shutting down: the loop may already be stopping
                pass
        self._sock.close(0)


class StreamOutbox:
    """The engine replica's end: one PUSH socket per ingress address (see module doc).

    ``sndhwm``: items queued for one ingress before a send fails (``SNDHWM``). Used from one
    thread (the replica's event loop): ZMQ sockets are not thread-safe.
    """

    def __init__(self, sndhwm: int = SNDHWM):
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sndhwm = sndhwm
        self._socks: dict[str, zmq.Socket] = {}

    def sender(self, address: str, key: str) -> Callable[[Any], None]:
        """A function that sends one item of the call ``key`` to the ingress at ``address``.

        The function raises ``ChannelClosed`` when that ingress's queue is full, and
        ``TypeError`` for an item that is not a stream item. Raises ``ValueError`` for a key
        that is empty or over 255 bytes."""
        sock = self._socks.get(address)
        if sock is None:
            sock = _socket(self._ctx, zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, self._sndhwm)
            sock.connect(address)
            self._socks[address] = sock
        k = key.encode()
        if not 0 < len(k) < 256:
            raise ValueError(f"a call's key is 1-255 bytes, not {len(k)}")
        head = bytes((len(k),)) + k

        def send(item: Any) -> None:
            kind, payload = encode(item)
            try:
                sock.send(head + kind + payload, zmq.NOBLOCK)
            except zmq.Again as e:
                raise ChannelClosed(f"the ingress at {address} is not reading its streams") from e

        return send

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()
