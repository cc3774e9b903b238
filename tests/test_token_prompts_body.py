"""A completion body with a list of token-id prompts is decoded and validated a prompt at a time
(issue 38, fault 5), with the very result and errors of vLLM's model on the whole body.

``app.prepare.token_prompts_request`` must give what ``CompletionRequest.model_validate(json.loads(raw))``
gives for every body it takes (the same request, or a ``ValidationError`` with the same first error),
and leave every other shape to the whole-body path (None). How long the serving loop stalls during
such a body is measured by ``python -m bench.ingress_stall`` (``make bench``), not here.
"""

from __future__ import annotations

import json
import random

import pytest

from app.config import AppArgs
from app.errors import OpenAIError
from app.prepare import COMPLETION, PIECEWISE_BODY_BYTES, Preparer, token_prompts_request

pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
from pydantic import ValidationError  # noqa: E402
from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # noqa: E402

MAX_LEN = 4096
rng = random.Random(3)


def ids(n: int) -> list[int]:
    return [rng.randrange(0, 150_000) for _ in range(n)]


def refusal(e: Exception):
    """What the ingress maps an error from: pydantic's first error, or vLLM's validator's error."""
    if isinstance(e, ValidationError):
        return e.errors()[0]["loc"], e.errors()[0]["msg"]
    return type(e), str(e)


def whole(raw: bytes):
    """vLLM's model of the whole body: the request, or its refusal."""
    try:
        return CompletionRequest.model_validate(json.loads(raw))
    except Exception as e:  # noqa: BLE001 - compared with the piecewise path's
        return refusal(e)


def piecewise(raw: bytes):
    try:
        return token_prompts_request(raw, MAX_LEN)
    except Exception as e:  # noqa: BLE001
        return refusal(e)


def dump(req: CompletionRequest) -> dict:
    return req.model_dump(exclude={"request_id"})  # vLLM draws one at random unless the body names it


def raw_of(prompt, **fields) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 1, **fields, "prompt": prompt}).encode()


SAME = {
    "plain": [ids(40), ids(7), ids(300)],
    "one prompt": [ids(5)],
    "an empty prompt": [ids(5), []],
    "a float id": [ids(5), [1, 2.0, 3]],
    "a numeric string id": [[1, "5", 3], ids(4)],
    "a negative id": [ids(5), [1, -1]],
    "a bool id": [[True, 2]],
    "an id past 64 bits": [[1, 2**70]],
    "a fractional id": [[1, 2.5]],
    "a prompt nested too deep": [[[1, 2]], ids(3)],
    "a text prompt among id prompts": [ids(3), "text"],
    "a null prompt": [ids(3), None],
    "too many prompts": [[1]] * 1025,  # vLLM's VLLM_MAX_COMPLETION_PROMPTS (1024)
}


@pytest.mark.parametrize("name", list(SAME))
def test_the_piecewise_request_is_vllms_model_of_the_whole_body(name: str) -> None:
    raw = raw_of(SAME[name], stream=True, temperature=0.5, vllm_xargs={"k": 1})
    expected, got = whole(raw), piecewise(raw)
    if isinstance(expected, CompletionRequest):
        assert isinstance(got, CompletionRequest), got
        assert dump(got) == dump(expected)
        assert got.model_fields_set == expected.model_fields_set
    else:
        assert got == expected


@pytest.mark.parametrize("raw", [
    raw_of("a text prompt"), raw_of(["two", "texts"]), raw_of([1, 2, 3]), raw_of([]), raw_of(None),
    b'{"model": "m", "max_tokens": 1}', b"[1, 2]", b"not json", b'{"prompt": [[1, 2]]',
    b'{"prompt": [[1, 2]], "temperature": NaN}',  # json.loads takes NaN, msgspec does not: decoded whole
    raw_of([[1, 2]], user="\\ud800").replace(b"\\\\ud800", b"\\ud800"),  # a lone surrogate escape
])
def test_other_shapes_are_left_to_the_whole_body_path(raw: bytes) -> None:
    assert token_prompts_request(raw, MAX_LEN) is None


def test_a_repeated_field_is_decoded_as_json_loads_decodes_it() -> None:
    """The last one wins, the prompt's included."""
    raw = b'{"model": "m", "max_tokens": 1, "max_tokens": 3, "prompt": [[9]], "prompt": [[1, 2], [3]]}'
    expected, got = whole(raw), piecewise(raw)
    assert got.max_tokens == 3 and got.prompt == [[1, 2], [3]]
    assert dump(got) == dump(expected)


def test_a_prompt_past_the_context_is_refused_as_vllm_refuses_it() -> None:
    with pytest.raises(OpenAIError) as refused:
        token_prompts_request(raw_of([ids(3), ids(MAX_LEN + 1)]), MAX_LEN)
    assert refused.value.status == 400 and refused.value.param == "input_tokens"
    assert f"your prompt contains {MAX_LEN + 1} input tokens" in refused.value.message


def test_the_preparer_takes_large_token_prompt_bodies_piecewise_and_small_ones_whole() -> None:
    """Through ``Preparer.request`` (the ingress's path): the same request either way; the report-mode
    guard still refuses (issue 38, fault 1)."""
    preparer = Preparer(AppArgs(), renderer=None)
    big = [ids(3800) for _ in range(4)]
    raw = raw_of(big)
    assert len(raw) > PIECEWISE_BODY_BYTES
    assert dump(preparer.request(COMPLETION, raw)) == dump(CompletionRequest.model_validate(json.loads(raw)))
    small = raw_of([ids(10)])
    assert len(small) <= PIECEWISE_BODY_BYTES
    assert preparer.request(COMPLETION, small).prompt == json.loads(small)["prompt"]
    with pytest.raises(OpenAIError) as refused:
        preparer.request(COMPLETION, raw_of(big, vllm_xargs={"kv_cache_report_mode": "full"}))
    assert refused.value.status == 400 and refused.value.param == "vllm_xargs.kv_cache_report_mode"
