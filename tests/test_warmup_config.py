"""The ``warmup`` block as ``serve run`` builds it, without Ray: what is a config error, and what a warm
request looks like. The live warm-up is in ``tests/test_warmup.py``."""

from __future__ import annotations

import json

import pytest

from app.builder import build_app
from app.config import AppArgs, WarmupConfig, WarmupPrompt, parse_app_args
from app.prepare import CHAT, COMPLETION
from app.warmup import request_body
from routing.candidate_set import Candidate, CandidateSet


def test_a_prompt_needs_exactly_one_form():
    for bad in ({}, {"prompt": "a", "prompt_token_ids": [1]}):
        with pytest.raises(ValueError, match="exactly one of messages, prompt or prompt_token_ids"):
            parse_app_args({"warmup": {"prompts": [bad]}})
    with pytest.raises(ValueError, match=r"warmup\.prompts\.0\.copies"):
        parse_app_args({"warmup": {"prompts": [{"prompt": "a", "copies": 0}]}})


def test_the_build_names_a_prompt_that_does_not_fit_the_context():
    with pytest.raises(ValueError, match=r"warmup prompt 'huge': .*maximum context length is 4096"):
        build_app({"warmup": {"prompts": [{"name": "huge", "prompt_token_ids": [11] * 5000}]}})
    with pytest.raises(ValueError, match=r"warmup prompt 'full': its 4096 prompt tokens leave no room for an "
                                         r"output token within engine.max_model_len = 4096"):
        build_app({"warmup": {"prompts": [{"name": "full", "prompt_token_ids": [11] * 4096}]}})
    # 4,095 ids leave one token for the output: a valid warm prompt.
    build_app({"warmup": {"prompts": [{"prompt_token_ids": [11] * 4095}]}})


def test_the_build_names_a_prompt_that_fails_to_render():
    with pytest.raises(ValueError, match=r"warmup prompt 'warmup.prompts\[1\]': .*out of vocabulary"):
        build_app({"warmup": {"prompts": [{"prompt": "fine"}, {"prompt_token_ids": [10**9]}]}})


def test_a_file_is_read_once_at_build_and_its_lines_are_named(tmp_path):
    good = tmp_path / "warm.jsonl"
    good.write_text(json.dumps({"prompt": "alpha"}) + "\n\n" + json.dumps({"name": "b", "prompt_token_ids": [5, 6]})
                    + "\n")
    cfg = WarmupConfig(prompts=[WarmupPrompt(prompt="inline")], file=str(good))
    assert [n for n, _ in cfg.named()] == ["warmup.prompts[0]", f"{good}:1", "b"]
    inlined = cfg.inlined()
    assert inlined.file is None and [p.name for p in inlined.prompts] == ["warmup.prompts[0]", f"{good}:1", "b"]
    assert [p.prompt or p.prompt_token_ids for p in inlined.prompts] == ["inline", "alpha", [5, 6]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": "x", "copies": -1}) + "\n")
    with pytest.raises(ValueError, match=rf"warmup.file {bad}:2: copies"):
        build_app({"warmup": {"file": str(bad)}})
    with pytest.raises(ValueError, match="warmup.file: path .* does not exist"):
        parse_app_args({"warmup": {"file": "models/no-such-file.jsonl"}})


def test_names_must_be_unique():
    with pytest.raises(ValueError, match="'a' given twice"):
        build_app({"warmup": {"prompts": [{"name": "a", "prompt": "x"}, {"name": "a", "prompt": "y"}]}})


def test_a_warm_request_is_one_output_token_and_chat_has_no_generation_prompt():
    model = AppArgs().served_model_name
    kind, body = request_body(WarmupPrompt(messages=[{"role": "system", "content": "s"}], cache_salt="t"), model)
    assert kind == CHAT
    assert body == {"model": model, "max_tokens": 1, "temperature": 0.0, "stream": False, "cache_salt": "t",
                    "messages": [{"role": "system", "content": "s"}], "add_generation_prompt": False}
    kind, body = request_body(WarmupPrompt(prompt_token_ids=[1, 2]), model)
    assert (kind, body["prompt"], body["max_tokens"]) == (COMPLETION, [1, 2], 1)


def test_a_candidate_set_without_some_replicas_keeps_the_others_in_order():
    cs = CandidateSet([Candidate(u, {}, 8) for u in ("r1", "r2", "r3")])
    assert cs.without({"r2"}).uids == ("r1", "r3")
    assert cs.without(set()) is cs
    assert cs.without({"r1", "r2", "r3"}) is cs  # every replica avoided: the request still goes somewhere
