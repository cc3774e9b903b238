"""Block keys: expected values computed independently with xxhash's streaming API."""

from __future__ import annotations

import random
import struct
from array import array

import pytest
import xxhash

from routing.block_keys import (
    ROOT_SEED,
    block_keys,
    block_keys_from_stored,
    chain_keys,
    extra_keys_tail,
    split_event_extra_keys,
)


def expected_chain(tokens: list[int], block_size: int, tails: list[bytes] | None = None, seed: int = 0) -> array:
    """The documented definition, spelled out with struct and the xxh3 object API (an ``array('Q')``, as
    ``block_keys`` returns)."""
    keys = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        data = struct.pack(f"<{block_size}I", *block) + (tails[i] if tails else b"")
        seed = xxhash.xxh3_64(data, seed=seed).intdigest()
        keys.append(seed)
    return array("Q", keys)


TOKENS = [random.Random(7).randrange(0, 200_000) for _ in range(16 * 6 + 5)]


def test_chain_matches_hand_computed_values() -> None:
    keys = block_keys(TOKENS, 16)
    assert isinstance(keys, array) and keys.typecode == "Q"
    assert len(keys) == 6  # the trailing 5 tokens are a partial block: no key
    assert keys == expected_chain(TOKENS, 16)
    # A fixed vector pins the definition across refactors.
    first = xxhash.xxh3_64(struct.pack("<4I", 1, 2, 3, 4), seed=ROOT_SEED).intdigest()
    assert block_keys([1, 2, 3, 4], 4).tolist() == [first]
    second = xxhash.xxh3_64(struct.pack("<4I", 5, 6, 7, 8), seed=first).intdigest()
    assert block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4).tolist() == [first, second]


def test_keys_are_prefix_fingerprints() -> None:
    other = list(TOKENS)
    other[20] += 1  # change one token of block 1
    a, b = block_keys(TOKENS, 16), block_keys(other, 16)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))  # every later key changes too
    assert all(0 <= k < 2**64 for k in a)


def test_parent_continues_the_chain() -> None:
    full = block_keys(TOKENS, 16)
    head = block_keys(TOKENS[:32], 16)
    tail = block_keys(TOKENS[32:], 16, parent=head[-1])
    assert head + tail == full


def test_input_forms_agree() -> None:
    as_list = block_keys(TOKENS, 16)
    assert block_keys(tuple(TOKENS), 16) == as_list
    assert block_keys(array("I", TOKENS), 16) == as_list
    assert block_keys(struct.pack(f"<{len(TOKENS)}I", *TOKENS), 16) == as_list
    assert chain_keys(array("I", TOKENS[:96]), 16) == as_list


def test_cache_salt_only_on_first_block() -> None:
    salt_tail = b"\xff" + b"\x93\xc0\xa4salt\xc0"  # msgpack [nil, "salt", nil], by hand
    assert extra_keys_tail(None, "salt") == salt_tail
    salted = block_keys(TOKENS, 16, cache_salt="salt")
    tails = [salt_tail] + [b""] * 5
    assert salted == expected_chain(TOKENS, 16, tails)
    assert salted[0] != block_keys(TOKENS, 16)[0]
    # With a parent the sequence does not start here: the salt is not applied.
    parent = 12345
    assert block_keys(TOKENS, 16, cache_salt="salt", parent=parent) == expected_chain(TOKENS, 16, seed=parent)
    # Empty salt behaves like no salt (vLLM tests `if request.cache_salt`).
    assert block_keys(TOKENS, 16, cache_salt="") == block_keys(TOKENS, 16)


def test_lora_name_on_every_block() -> None:
    lora_tail = b"\xff" + b"\x93\xa4lora\xc0\xc0"  # msgpack ["lora", nil, nil]
    both_tail = b"\xff" + b"\x93\xa4lora\xa4salt\xc0"
    keys = block_keys(TOKENS, 16, lora_name="lora", cache_salt="salt")
    assert keys == expected_chain(TOKENS, 16, [both_tail] + [lora_tail] * 5)
    assert block_keys(TOKENS, 16, lora_name="lora") == expected_chain(TOKENS, 16, [lora_tail] * 6)


def test_from_stored_reads_vllm_extra_keys() -> None:
    # vLLM publishes per block: LoRA name first, then the salt (first block only).
    extra = [("ad", "salty"), ("ad",), ("ad",)]
    keys = block_keys_from_stored(TOKENS[:48], 16, None, lora_name="ad", extra_keys=extra)
    assert keys == block_keys(TOKENS[:48], 16, lora_name="ad", cache_salt="salty")
    # A continuation event: parent key given, no salt in its extra keys.
    rest = block_keys_from_stored(TOKENS[48:96], 16, keys[-1], lora_name="ad", extra_keys=[("ad",), ("ad",), ("ad",)])
    assert keys + rest == block_keys(TOKENS[:96], 16, lora_name="ad", cache_salt="salty")
    # Plain events.
    assert block_keys_from_stored(TOKENS[:96], 16, None) == block_keys(TOKENS[:96], 16)
    assert block_keys_from_stored(TOKENS[:96], 16, None, extra_keys=[None] * 6) == block_keys(TOKENS[:96], 16)
    salted = block_keys(TOKENS[:16], 16, cache_salt="s")
    assert block_keys_from_stored(TOKENS[:16], 16, None, extra_keys=[["s"]]) == salted


def test_tails_changing_from_block_to_block() -> None:
    """Runs of equal tails (hashed one C loop a run) interleaved with single tailed blocks."""
    extra = [None, [["img", 0]], [["img", 0]], None, [["img", 16]], None]
    tails = [extra_keys_tail(*split_event_extra_keys(e, None)) for e in extra]
    assert tails[0] == tails[3] == tails[5] == b"" and tails[1] == tails[2] != tails[4]
    assert block_keys_from_stored(TOKENS[:96], 16, None, extra_keys=extra) == expected_chain(TOKENS, 16, tails)
    assert block_keys_from_stored(TOKENS[:96], 16, 77, extra_keys=extra) == expected_chain(TOKENS, 16, tails, seed=77)


def test_multimodal_extra_keys_never_match_text() -> None:
    lora, salt, other = split_event_extra_keys(["ad", ["img-hash", 3], "salt", b"\x01" * 32], "ad")
    assert (lora, salt, other) == ("ad", "salt", (["img-hash", 3], b"\x01" * 32))
    mm = block_keys_from_stored(TOKENS[:16], 16, None, extra_keys=[[["img", 0]]])
    assert mm != block_keys(TOKENS[:16], 16)


def test_invalid_input() -> None:
    with pytest.raises(ValueError):
        block_keys(TOKENS, 0)
    with pytest.raises(ValueError):
        block_keys([1, -2, 3], 1)
    with pytest.raises(ValueError):
        block_keys([2**32], 1)
    assert block_keys([], 16) == array("Q")
    assert block_keys(TOKENS[:15], 16) == array("Q")
