"""A completion body with a list of token-id prompts is validated a prompt at a time (issue 38,
fault 5), with the very result and errors of vLLM's model on the whole body.

Through the ingress's ``Preparer.request`` (the body decoded a piece at a time, ``check_size``,
``app.ingress.prepare.token_prompts_request``), every body must give what
``CompletionRequest.model_validate(json.loads(raw))`` gives: the same request, or the same first
error. How long the serving loop stalls during such a body is measured by
``python -m bench.ingress_stall`` (``make bench``), not here.
"""

from __future__ import annotations

import json
import random

import pytest

from app.config import AppArgs
from app.errors import OpenAIError
from app.ingress.prepare import COMPLETION, PIECEWISE_BODY_BYTES, PIECEWISE_PROMPT_IDS, Preparer, token_prompts_request

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


PREPARER = Preparer(AppArgs.model_validate({"engine": {"max_model_len": MAX_LEN}}), renderer=None)


def piecewise(raw: bytes):
    """The ingress's request of ``raw`` (decoded a piece at a time: ``raw`` is over 64 KiB)."""
    assert len(raw) > PIECEWISE_BODY_BYTES
    try:
        return PREPARER.request(COMPLETION, raw)
    except Exception as e:  # noqa: BLE001
        return refusal(e)


def dump(req: CompletionRequest) -> dict:
    return req.model_dump(exclude={"request_id"})  # vLLM draws one at random unless the body names it


BULK = [ids(3800) for _ in range(5)]  # puts every case over the piecewise sizes, after its own prompts


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
    "every id negative": [[-1] * 4000] * 5,
    "every id a numeric string": [["7"] * 4000] * 5,
    "a bad prompt after coerced ones": [[1.0] * 4000, ["2"] * 4000, [3, -3], [4, "x"]],
}


@pytest.mark.parametrize("name", list(SAME))
def test_the_piecewise_request_is_vllms_model_of_the_whole_body(name: str) -> None:
    raw = raw_of(SAME[name] + BULK, stream=True, temperature=0.5, vllm_xargs={"k": 1})
    expected, got = whole(raw), piecewise(raw)
    if isinstance(expected, CompletionRequest):
        assert isinstance(got, CompletionRequest), got
        assert dump(got) == dump(expected)
        assert got.model_fields_set == expected.model_fields_set
    else:
        assert got == expected


@pytest.mark.parametrize("prompt", ["a text prompt", ["two", "texts"], [1, 2, 3], [], None, [[1, 2]] * 3])
def test_other_shapes_and_small_lists_are_validated_whole(prompt) -> None:
    assert token_prompts_request({"model": "m", "prompt": prompt}) is None
    assert sum(map(len, BULK)) > PIECEWISE_PROMPT_IDS


def test_a_repeated_field_is_decoded_as_json_loads_decodes_it() -> None:
    """The last one wins, the prompt's included."""
    bulk = json.dumps([[1, 2], [3]] + BULK).encode()
    raw = b'{"model": "m", "max_tokens": 1, "max_tokens": 3, "prompt": [[9]], "prompt": ' + bulk + b"}"
    expected, got = whole(raw), piecewise(raw)
    assert got.max_tokens == 3 and got.prompt[:2] == [[1, 2], [3]]
    assert dump(got) == dump(expected)


def test_a_prompt_past_the_context_is_refused_as_vllm_refuses_it() -> None:
    with pytest.raises(OpenAIError) as refused:
        PREPARER.request(COMPLETION, raw_of([ids(3), ids(MAX_LEN + 1)] + BULK))
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
