"""Block keys: the router's own 64-bit fingerprint of each full KV-cache block.

A prompt of ``n`` tokens at block size ``B`` has ``n // B`` full blocks; the
trailing partial block is never cached by vLLM and gets no key.  Key ``i``
fingerprints the whole prefix ``token_ids[: (i + 1) * B]`` by chaining::

    key_0 = xxh3_64(block_bytes_0 + tail_0, seed=ROOT_SEED)      # no parent
    key_i = xxh3_64(block_bytes_i + tail_i, seed=key_{i-1})

* ``block_bytes_i``: the block's token ids as unsigned 32-bit little-endian
  integers (``4 * B`` bytes).
* The parent key enters as the xxh3 *seed* rather than as 8 prepended bytes.
  It plays the same role (key ``i`` depends on every earlier block) and lets
  the chaining loop (C, ``routing/_chain.c``, on xxHash's C library) hash each
  block where it lies in the token buffer.
* ``tail_i``: the block's extra keys; empty when there are none, else
  ``b"\\xff" + msgpack([lora, cache_salt, other])``.  As in vLLM, the
  LoRA adapter goes into every block and the ``cache_salt`` only into the
  first block of a sequence (the block without a parent).  ``lora`` is the
  adapter's identity as vLLM hashes it (``_gen_lora_extra_hash_keys``: name
  and path, so a name re-pointed to another path shares no block):
  ``[name, path]``, or the name alone where the path is unknown (such keys
  never match a router's, which always knows the path).  ``other``
  holds multimodal / prompt-embeds extra keys seen in ``BlockStored``
  events; the router cannot compute those from token ids, so such blocks
  never match a text-only prompt, which is right.

Why our own keys rather than the engine's block hashes: the engine's hash
seed may be random per process and its digest covers the LoRA path, so a
router cannot recompute it.  The index maps each replica's engine hashes to
these keys (``routing.index``), so a lookup needs only token ids.

Keys are ints in ``[0, 2**64)``, stable across processes and hosts.  Token
ids must fit in an unsigned 32-bit integer, else ``ValueError``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

from routing._chain import chain_keys as _chain_loop

__all__ = [
    "ROOT_SEED",
    "Keys",
    "TokenIds",
    "block_keys",
    "block_keys_from_stored",
    "chain_keys",
    "extra_keys_tail",
    "split_event_extra_keys",
]

ROOT_SEED = 0
"""Seed of the first block of a sequence (the block without a parent)."""

TokenIds = Sequence[int] | array | bytes
"""Token ids: a sequence of ints, an ``array('I')``, or uint32-LE ``bytes``."""

Keys = array
"""Block keys: an ``array('Q')`` of ints in ``[0, 2**64)``, one per full block, in order.

A sequence of ints (index, slice, iterate, ``len``) that is also a buffer of
native-order uint64, so ``routing.index`` reads it without making a Python int
a key, and that the garbage collector does not traverse (8 bytes a key, not a
list's 8 plus 32 of an int object)."""

_msgpack_encode = msgspec.msgpack.Encoder().encode
_BIG_ENDIAN_HOST = sys.byteorder == "big"


def _as_uint32(token_ids: TokenIds, block_size: int) -> array:
    """The token ids of the full blocks as ``array('I')`` in little-endian order.

    Raises:
        ValueError: ``block_size`` not positive, or an id outside ``[0, 2**32)``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if isinstance(token_ids, array) and token_ids.typecode == "I" and token_ids.itemsize == 4:
        tokens = token_ids
    elif isinstance(token_ids, (bytes, bytearray, memoryview)):
        raw = bytes(token_ids)
        tokens = array("I")
        tokens.frombytes(raw[: len(raw) // (4 * block_size) * (4 * block_size)])
        return tokens  # already little-endian bytes, whatever the host
    else:
        try:
            tokens = array("I", token_ids)
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from exc
    if _BIG_ENDIAN_HOST:  # pragma: no cover - keys are defined on little-endian bytes
        tokens = array("I", tokens)
        tokens.byteswap()
    usable = len(tokens) // block_size * block_size
    return tokens if usable == len(tokens) else tokens[:usable]


def chain_keys(tokens: array, block_size: int, seed: int = ROOT_SEED) -> Keys:
    """Chained keys of blocks without extra keys (the common, fast path).

    Args:
        tokens: ``array('I')`` of whole blocks (``len(tokens) % block_size == 0``),
            little-endian host (see ``_as_uint32`` otherwise).
        block_size: tokens per block (> 0).
        seed: the parent block's key, or ``ROOT_SEED`` at a sequence start.

    The loop runs in C (``routing._chain``, on xxHash's C library).

    Raises:
        ValueError: ``tokens`` is not a whole number of blocks.
    """
    return _as_keys(_chain_loop(tokens, block_size, seed, b""))


def _as_keys(packed: bytes) -> Keys:
    """The C loop's native-order uint64 keys as an ``array('Q')``."""
    keys = array("Q")
    keys.frombytes(packed)
    return keys


def _chain_with_tails(tokens: array, block_size: int, seed: int, tails: Sequence[bytes]) -> Keys:
    """Like :func:`chain_keys`, appending ``tails[i]`` to block ``i``'s bytes.

    One C loop per run of equal tails (a salt is on the first block only, a
    LoRA name on every block).
    """
    keys = array("Q")
    key = seed
    start = 0
    n = len(tails)
    while start < n:
        tail = tails[start]
        end = start + 1
        while end < n and tails[end] == tail:
            end += 1
        keys.frombytes(_chain_loop(tokens[start * block_size : end * block_size], block_size, key, tail))
        key = keys[-1]
        start = end
    return keys


def extra_keys_tail(lora_name: str | None, cache_salt: str | None, other: Sequence[Any] | None = None,
                    lora_path: str | None = None) -> bytes:
    """Bytes appended to one block's token bytes for its extra keys.

    ``b""`` when the block has none, so plain blocks hash only their tokens.
    ``other`` must be msgpack-encodable.  ``lora_path`` (the adapter's path, as
    the engine loaded it) goes in with ``lora_name``; without it the name alone.
    """
    if lora_name is None and not cache_salt and not other:
        return b""
    lora = lora_name if lora_name is None or lora_path is None else [lora_name, lora_path]
    return b"\xff" + _msgpack_encode([lora, cache_salt or None, list(other) if other else None])


def block_keys(
    token_ids: TokenIds,
    block_size: int,
    *,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    parent: int | None = None,
    lora_path: str | None = None,
) -> Keys:
    """Keys of the full blocks of ``token_ids``, chained from ``parent``.

    Args:
        token_ids: the tokens (list of ints, ``array('I')`` or uint32-LE bytes).
        block_size: tokens per block (> 0), the engine's KV-cache block size.
        cache_salt: the request's cache salt; folded into the first block
            only, and only when ``parent`` is None (the sequence starts here).
        lora_name: the LoRA adapter name; folded into every block.
        parent: key of the block just before ``token_ids[0]``, or None when
            ``token_ids`` starts the sequence.
        lora_path: the adapter's path as the engines load it (configured or
            loaded at run time); folded in with ``lora_name``.

    Returns:
        ``len(token_ids) // block_size`` keys (``Keys``); key ``i`` covers
        ``token_ids[: (i + 1) * block_size]`` and whatever ``parent`` covers.

    Raises:
        ValueError: ``block_size`` not positive or a token id out of range.
    """
    tokens = _as_uint32(token_ids, block_size)
    seed = ROOT_SEED if parent is None else parent
    salt = cache_salt if parent is None else None
    if lora_name is None and not salt:
        return chain_keys(tokens, block_size, seed)
    n_blocks = len(tokens) // block_size
    tails = [extra_keys_tail(lora_name, None, lora_path=lora_path)] * n_blocks
    if n_blocks:
        tails[0] = extra_keys_tail(lora_name, salt, lora_path=lora_path)
    return _chain_with_tails(tokens, block_size, seed, tails)


def split_event_extra_keys(
    entry: Sequence[Any] | None, lora_name: str | None
) -> tuple[str | None, str | None, tuple[Any, ...] | None]:
    """Split one block's ``extra_keys`` entry of a ``BlockStored`` event.

    vLLM publishes, per block and in this order: the LoRA name (when the
    event's ``lora_name`` is set), ``[mm_identifier, offset]`` pairs, the
    cache_salt string (first block of a sequence only) and prompt-embeds
    digests (bytes).

    Returns:
        ``(lora_name, cache_salt, other)``; ``other`` holds the multimodal and
        prompt-embeds items, or None.
    """
    if not entry:
        return lora_name, None, None
    items = list(entry)
    if lora_name is not None and items[0] == lora_name:
        items.pop(0)
    salt: str | None = None
    other: list[Any] = []
    for item in items:
        if salt is None and isinstance(item, str):
            salt = item
        else:
            other.append(item)
    return lora_name, salt, tuple(other) if other else None


def block_keys_from_stored(
    token_ids: TokenIds,
    block_size: int,
    parent: int | None,
    *,
    lora_name: str | None = None,
    extra_keys: Sequence[Sequence[Any] | None] | None = None,
    lora_path: str | None = None,
) -> Keys:
    """Keys of the blocks carried by one ``BlockStored`` event.

    The chain of :func:`block_keys`, with the extra keys taken from the
    event: ``extra_keys[i]`` is block ``i``'s untagged entry as vLLM publishes
    it (see :func:`split_event_extra_keys`).  Without ``extra_keys`` only
    ``lora_name`` (every block) is folded in.

    Args:
        token_ids: the event's ``token_ids`` (``n * block_size`` ids).
        block_size: the event's ``block_size``.
        parent: our key of the event's parent block, or None when the event
            starts a sequence (its ``parent_block_hash`` is None).
        lora_name: the event's ``lora_name``.
        extra_keys: the event's ``extra_keys`` (one entry per block), or None.
        lora_path: the path of the adapter the event's ``lora_id`` names, as
            the engine loaded it (events carry the name only); None: unknown.

    Returns:
        One key per full block of ``token_ids`` (``Keys``).

    Raises:
        ValueError: ``block_size`` not positive or a token id out of range.
    """
    tokens = _as_uint32(token_ids, block_size)
    n_blocks = len(tokens) // block_size
    seed = ROOT_SEED if parent is None else parent
    if extra_keys:
        tails = [
            extra_keys_tail(*split_event_extra_keys(extra_keys[i] if i < len(extra_keys) else None, lora_name),
                            lora_path=lora_path)
            for i in range(n_blocks)
        ]
    elif lora_name is not None:
        tails = [extra_keys_tail(lora_name, None, lora_path=lora_path)] * n_blocks
    else:
        return chain_keys(tokens, block_size, seed)
    return _chain_with_tails(tokens, block_size, seed, tails)
