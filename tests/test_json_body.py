"""A large body decoded a piece at a time is ``json.loads`` of it (``app.ingress.json_body``), and the
fields whose validation would hold the GIL are bounded (``app.ingress.prepare.check_size``; issue 38, fault 5).

The stall itself is measured by ``python -m bench.ingress_stall`` (``make bench``), not here.
"""

from __future__ import annotations

import json
import random

import pytest

from app.config import AppArgs
from app.errors import OpenAIError
from app.ingress.json_body import MAX_ITEMS, MAX_SPLIT_DEPTH, PIECE_BYTES, decode_pieces
from app.ingress.prepare import (
    CHAT,
    CHAT_BATCH,
    COMPLETION,
    MAX_FIELD_ITEMS,
    MAX_MESSAGE_ITEMS,
    RESPONSES,
    Preparer,
    check_size,
)


def value(rng: random.Random, depth: int = 0):
    """A random JSON value: nested objects and arrays, every scalar kind, escapes and non-ASCII text."""
    kind = rng.randrange(10 if depth < 3 else 6)
    if kind == 0:
        return rng.randrange(-2**70, 2**70)
    if kind == 1:
        return rng.choice([0.1, -0.0, 1e300, 2.5e-8, 3.0])
    if kind == 2:
        return rng.choice(["", "plain", 'quote " and \\\\ backslash', "tab\tnew\nline", "é 日本 \U0001F600", "\u00e9"])
    if kind == 3:
        return rng.choice([True, False, None])
    if kind in (4, 5):
        return rng.randrange(1000)
    if kind in (6, 7):
        return [value(rng, depth + 1) for _ in range(rng.randrange(20))]
    return {f"k{rng.randrange(30)}": value(rng, depth + 1) for _ in range(rng.randrange(20))}


@pytest.mark.parametrize("seed", range(3))
def test_a_large_body_is_decoded_as_json_loads_decodes_it(seed: int) -> None:
    rng = random.Random(seed)
    body = {"messages": [value(rng) for _ in range(300)], "tools": {f"t{i}": value(rng) for i in range(300)},
            "prompt": [[rng.randrange(1000) for _ in range(3000)] for _ in range(8)], "text": "x" * 100_000}
    for indent, separators in ((None, (",", ":")), (2, (", ", ": "))):
        raw = json.dumps(body, indent=indent, separators=separators, ensure_ascii=seed % 2 == 0).encode()
        assert len(raw) > 4 * PIECE_BYTES
        assert decode_pieces(raw) == json.loads(raw)


def test_what_json_loads_does_with_repeated_keys_escapes_and_numbers() -> None:
    pad = '"pad": [' + ",".join(["1"] * 40_000) + "]"
    raw = ('  \n{"a": 1, "b": {"x": [1, 2], "x": [3]}, "a": 2, "s": "\\u00e9\\ud83d\\ude00\\n\\"", '
           '"n": [-0, 1E3, 1.5e-3, 123456789012345678901234567890], ' + pad + "}\n  ").encode()
    assert len(raw) > PIECE_BYTES
    got = decode_pieces(raw)
    assert got == json.loads(raw) and list(got) == list(json.loads(raw))  # values and key order
    assert got["a"] == 2 and got["b"] == {"x": [3]}


def test_nesting_is_split_level_by_level_to_its_bound() -> None:
    inner: object = {"leaf": list(range(30_000))}
    for _ in range(MAX_SPLIT_DEPTH - 2):  # the leaf list, over 64 KiB, at depth MAX_SPLIT_DEPTH - 1
        inner = {"down": inner, "side": list(range(2_000))}
    raw = json.dumps(inner).encode()
    assert decode_pieces(raw) == json.loads(raw)
    with pytest.raises(OpenAIError) as refused:  # one level more, each over 64 KiB: no request nests so
        decode_pieces(json.dumps({"down": inner}).encode())
    assert refused.value.status == 400 and "nested too deeply" in refused.value.message


@pytest.mark.parametrize("raw, why", [
    (b'{"t": NaN, "pad": "' + b"x" * PIECE_BYTES + b'"}', "NaN"),
    (json.dumps({"pad": "x" * PIECE_BYTES}).encode("utf-16"), "UTF-16"),
    (b'{"t": "\\ud800", "pad": "' + b"x" * PIECE_BYTES + b'"}', "a lone surrogate escape"),
    (b'{"pad": "' + b"x" * PIECE_BYTES + b'"', "truncated"),
    (b'{"pad": "' + b"x" * PIECE_BYTES + b'"} trailing', "trailing data"),
    (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
    (b" " * (PIECE_BYTES + 10), "whitespace only"),
    (b'{"user": "\xff", "user": "u", "pad": "' + b"x" * PIECE_BYTES + b'"}', "bad UTF-8 a repeated key drops"),
])
def test_a_large_body_that_is_not_standard_json_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        decode_pieces(raw)
    assert refused.value.status == 400 and "not valid JSON" in refused.value.message, why


@pytest.mark.parametrize("pad", [0, PIECE_BYTES])
def test_a_surrogate_encoded_in_the_bytes_is_refused_naming_its_field(pad: int) -> None:
    """json.loads reads UTF-8-encoded surrogates (``surrogatepass``) as a lone surrogate, as it reads
    a ``\\ud800`` escape: refused like one, small body or large."""
    raw = b'{"model": "m", "prompt": "hi", "user": "a\xed\xa0\x80b", "pad": "' + b"x" * pad + b'"}'
    with pytest.raises(OpenAIError) as refused:
        Preparer(AppArgs(), renderer=None).request(COMPLETION, raw)
    assert refused.value.status == 400 and refused.value.param == "user", refused.value.message


FIELDS = {
    "logit_bias": {str(i): 1.0 for i in range(MAX_FIELD_ITEMS + 1)},
    "stop": ["ab"] * (MAX_FIELD_ITEMS + 1),
    "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_FIELD_ITEMS + 1)],
}


@pytest.mark.parametrize("name", list(FIELDS))
def test_a_field_of_too_many_items_is_refused_naming_it(name: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        check_size(CHAT, {"messages": [], name: FIELDS[name]}, 4096)
    assert refused.value.status == 400 and refused.value.param == name
    assert f"{MAX_FIELD_ITEMS + 1} items exceed the limit of {MAX_FIELD_ITEMS}" in refused.value.message
    at_limit = FIELDS[name][:MAX_FIELD_ITEMS] if isinstance(FIELDS[name], list) else dict(
        list(FIELDS[name].items())[:MAX_FIELD_ITEMS])
    check_size(CHAT, {"messages": [], name: at_limit}, 4096)


def test_lists_of_numbers_and_the_prompt_are_not_counted_as_fields() -> None:
    check_size(COMPLETION, {"prompt": [[1]] * 1000 + [list(range(10))] * 5000,
                            "allowed_token_ids": list(range(1_000_000))}, 4096)


@pytest.mark.parametrize("kind, body", [
    (CHAT, {"messages": [{"role": "user", "content": "a"}] * (MAX_MESSAGE_ITEMS + 1)}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * MAX_MESSAGE_ITEMS}]}),
    (CHAT_BATCH, {"messages": [[{"role": "user", "content": "a"}] * 2000] * 3}),
    (RESPONSES, {"input": [{"role": "user", "content": "a"}] * (MAX_MESSAGE_ITEMS + 1)}),
])
def test_a_conversation_of_too_many_items_is_refused_naming_its_field(kind: str, body: dict) -> None:
    with pytest.raises(OpenAIError) as refused:
        check_size(kind, body, 4096)
    field = "input" if kind == RESPONSES else "messages"
    assert refused.value.status == 400 and refused.value.param == field
    assert f"exceed the limit of {MAX_MESSAGE_ITEMS}" in refused.value.message


@pytest.mark.parametrize("n, param", [(5_000, "tools"), (51_000, None)])
def test_the_ingress_refuses_a_body_of_too_many_tools_before_validating_it(n: int, param) -> None:
    """Through ``Preparer.request``: 5,000 tools are decoded a piece at a time and refused by count
    (``check_size``); 51,000 (4 MiB) by the byte counts, before the body is split."""
    pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
             for i in range(n)]
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}).encode()
    with pytest.raises(OpenAIError) as refused:
        Preparer(AppArgs(), renderer=None).request(CHAT, raw)
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message


@pytest.mark.parametrize("body, param", [
    # its keys' quotes and commas bound the body itself: refused before even the body is split
    ({"model": "m", "prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(MAX_ITEMS + 1)}}, None),
    ({"model": "m", "prompt": "hi", "allowed_token_ids": list(range(MAX_ITEMS + 1))}, "allowed_token_ids"),
    ({**{f"k{i}": 1 for i in range(MAX_ITEMS + 1)}, "model": "m"}, None),
])
def test_a_collection_too_large_to_split_in_one_short_call_is_refused_before_it(body: dict, param) -> None:
    raw = json.dumps(body).encode()
    with pytest.raises(OpenAIError) as refused:
        decode_pieces(raw)
    assert refused.value.status == 400 and refused.value.param == param
    assert f"more than {MAX_ITEMS:,} items" in refused.value.message


def test_text_full_of_commas_is_no_collection_of_items() -> None:
    """A chat message of 400,000 commas: one string, decoded whole (CSV pasted into a chat)."""
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "a," * 400_000}]}).encode()
    assert decode_pieces(raw) == json.loads(raw)
