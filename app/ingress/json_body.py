"""A large JSON request body decoded a piece at a time, so no single call holds the GIL for all of it.

``json.loads`` is one C call: on a 4 MiB body of small values (50,000 tool definitions,
300,000 ``logit_bias`` entries, 137,000 one-word messages) it holds the GIL for 70-400 ms,
and every thread of the ingress, the serving loop included, waits that long. A worker
thread does not help while one call holds the GIL.

``decode_pieces(raw)`` gives what ``json.loads(raw)`` gives, built from pieces of at most
``PIECE_BYTES``: msgspec splits an object into its members and an array into its items
without building them (``msgspec.Raw``: one scan, about 1.3 ms a MiB), pieces larger than
``PIECE_BYTES`` are split again (to ``MAX_SPLIT_DEPTH`` levels), and each piece is decoded
by ``json.loads`` itself, so numbers, strings, escapes and repeated keys (the last wins, in
the first one's place) come out exactly as ``json.loads`` makes them. Between calls the
decoding thread gives the GIL up (CPython's switch interval), so the longest hold is one
scan or one piece.

msgspec reads only standard JSON (RFC 8259): UTF-8 text without ``NaN`` or ``Infinity``,
and no lone UTF-16 surrogate escape. ``json.loads`` also takes those; a body over the
piecewise size that holds them is refused (``OpenAIError`` 400) rather than decoded in one
call. Nothing here imports vLLM or Ray.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from app.errors import OpenAIError

PIECE_BYTES = 64 * 1024
"""Pieces at most this long are decoded whole by ``json.loads`` (about 1-6 ms of the GIL, by shape)."""
MAX_SPLIT_DEPTH = 32
"""Levels of objects and arrays over ``PIECE_BYTES`` split further (each level is one scan of its
piece); a deeper one is refused as nested too deeply: no request nests 64 KiB that deep."""
MAX_ITEMS = 131_072
"""Most items an object or array over ``PIECE_BYTES`` may hold. Splitting one into its items is one
call that builds each item: about 50 ns an array item and 230 ns an object member (300,000
``logit_bias`` entries: 70 ms). So the items are bounded before the split, from counts of the
piece's bytes (``_items_at_most``, about 0.3 ms a MiB), and a piece that may hold more is refused.
The bound counts commas, colons, quotes and brackets at every depth and inside strings too, so
a piece whose nested items or text hold more than this many of each may be refused with it. An array whose first
item is a container and the rest scalars escapes the bound: a contrived 4 MiB one costs one call
of about 100 ms (vLLM's models refuse such arrays)."""

_OBJECT = dict[str, msgspec.Raw]
_ARRAY = list[msgspec.Raw]
_WHITESPACE = b" \t\r\n"


def decode_pieces(raw: bytes | bytearray | memoryview) -> Any:
    """``json.loads(raw)``, decoded a piece at a time (see the module doc).

    Raises:
        OpenAIError: 400: not JSON, not standard JSON (non-UTF-8 text, ``NaN``, a lone surrogate
            escape), or nested too deeply for ``json.loads``.
    """
    try:
        bytes(raw).decode("utf-8", "surrogatepass")  # as json.loads reads it; msgspec does not check what it skips
        return _decode(memoryview(raw), 0, "")
    except (msgspec.DecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"request body is not valid JSON (a body over {PIECE_BYTES // 1024} KiB must be "
                          f"standard JSON: UTF-8 text, no NaN or Infinity, no lone surrogate escape): {e}",
                          400) from None
    except RecursionError:
        raise OpenAIError("request body is not valid JSON: nested too deeply", 400) from None


def _items_at_most(data: bytes, head: bytes, start: int) -> int:
    """An upper bound on the members of the object (``head`` ``{``) or the items of the array
    (``[``) that ``data`` holds from ``start``, from counts of its bytes (C loops, no objects).

    Every member but the last is followed by a comma, has a colon, and its key is a string (two
    quotes); an array whose first item is an array (or object) is bounded by its ``[`` (or ``{``)
    count, which assumes its other items are containers too (see ``MAX_ITEMS``)."""
    commas = data.count(b",") + 1
    if head == b"{":
        return min(commas, data.count(b":"), data.count(b'"') // 2)
    first = data[start + 1:start + 64].lstrip(_WHITESPACE)[:1]
    if first in (b"[", b"{"):
        return min(commas, data.count(first) - (first == b"["))
    return commas


def _decode(piece: memoryview, depth: int, path: str) -> Any:
    if len(piece) <= PIECE_BYTES:
        return json.loads(bytes(piece))
    start = 0
    while piece[start] in _WHITESPACE:  # a piece over PIECE_BYTES has a value after its whitespace, or fails below
        start += 1
        if start == len(piece):
            return json.loads(bytes(piece))  # whitespace alone: json.loads's own error
    head = piece[start:start + 1].tobytes()
    if head in (b"{", b"[") and depth >= MAX_SPLIT_DEPTH:
        raise RecursionError  # decode_pieces: nested too deeply
    if head in (b"{", b"[") and _items_at_most(bytes(piece), head, start) > MAX_ITEMS:
        where = f"{path}: " if path else "request body: "
        raise OpenAIError(f"{where}a JSON {'object' if head == b'{' else 'array'} of more than {MAX_ITEMS:,} "
                          "items; too many to decode without stalling the server", 400, param=path or None)
    if head == b"{":
        members = msgspec.json.decode(piece, type=_OBJECT)
        return {key: _decode(memoryview(value), depth + 1, path or key) for key, value in members.items()}
    if head == b"[":
        items = msgspec.json.decode(piece, type=_ARRAY)
        return [_decode(memoryview(item), depth + 1, path) for item in items]
    msgspec.json.decode(piece, type=msgspec.Raw)  # one value: checked as standard JSON, as split ones are
    return json.loads(bytes(piece))  # a string or number: one linear call
