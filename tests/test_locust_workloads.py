"""Pure tests of Locust's workloads (``locustfiles/workloads.py``, over ``locustfiles/shapes.py``).

No Locust, no engines: determinism for a seed, popularity skew, sizes within the
default model's context (measured with its real tokenizer and chat template), and
Mooncake synthesis (a hash id always gives the same tokens; prompts keep the
trace's block structure and fit the context).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from locustfiles import shapes as S
from locustfiles import workloads as W

REPO = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 4096  # serve_config.yaml engine.max_model_len
VOCAB = 1024  # the tiny default model's vocabulary
TRACE = Path(W.DEFAULT_TRACE)


def draw(workload, seed: int, n: int):
    rng = random.Random(seed)
    return [workload.sample(rng) for _ in range(n)]


@pytest.mark.parametrize("factory", [
    lambda s: W.SharedPrefix(W.SharedPrefixConfig(), s),
    lambda s: W.Rag(W.RagConfig(), s),
    lambda s: W.MultiTenant(W.MultiTenantConfig(), s),
])
def test_same_seed_same_requests_other_seed_other_requests(factory):
    a = [(r.route, r.body, r.tag) for r in draw(factory(0), 1, 50)]
    b = [(r.route, r.body, r.tag) for r in draw(factory(0), 1, 50)]
    c = [(r.route, r.body, r.tag) for r in draw(factory(1), 1, 50)]
    assert a == b
    assert a != c


def test_shared_prefix_groups_share_their_system_prompt_and_popularity_is_skewed():
    cfg = W.SharedPrefixConfig(groups=8, system_tokens=256, question_tokens=(16, 64), zipf_s=1.0)
    wl = W.SharedPrefix(cfg, seed=3)
    reqs = draw(wl, 5, 4000)
    counts = Counter(r.meta["group"] for r in reqs)
    for r in reqs:
        prompt = r.body["prompt"]
        assert prompt[:256] == wl.systems[r.meta["group"]]
        assert 256 + 16 <= len(prompt) <= 256 + 64
        assert all(10 <= t < VOCAB for t in prompt)
        assert r.body["max_tokens"] == cfg.output_tokens
    # Zipf(1): the group of popularity rank 0 is drawn about 8x as often as rank 7's (1/1 vs 1/8).
    first, last = wl.prefixes.by_rank[0], wl.prefixes.by_rank[7]
    assert sorted(wl.prefixes.by_rank) == list(range(8))
    assert counts[first] > 3 * counts[last]
    assert counts[first] == max(counts.values())
    weights = S.zipf_weights(8, 1.0)
    expected0 = weights[0] / sum(weights) * 4000
    assert abs(counts[first] - expected0) < 0.15 * expected0
    # distinct system prompts per group
    assert len({tuple(s) for s in wl.systems}) == 8


def test_shared_prefix_text_is_the_same_prompts_a_word_per_token_id():
    """The text form draws what the token-id form draws (same seed, same order) and writes token id
    ``t`` as ``WORDS[t % len(WORDS)]``: a group's requests share its system prompt's text, whole words."""
    cfg = W.SharedPrefixConfig(groups=4, system_tokens=64, question_tokens=(8, 16))
    ids, text = draw(W.SharedPrefix(cfg, seed=2), 9, 200), draw(W.SharedPrefixText(cfg, seed=2), 9, 200)
    for a, b in zip(ids, text, strict=True):
        assert (a.route, a.tag, a.meta, a.body["max_tokens"]) == (b.route, b.tag, b.meta, b.body["max_tokens"])
        words = b.body["prompt"].split(" ")
        assert words == [W.WORDS[t % len(W.WORDS)] for t in a.body["prompt"]]
    system = {r.meta["group"]: " ".join(r.body["prompt"].split(" ")[:64]) + " " for r in text}
    assert len(set(system.values())) == len(system) > 1  # distinct system prompts
    assert all(r.body["prompt"].startswith(system[r.meta["group"]]) for r in text)


def test_zipf_zero_is_uniform_and_weights_follow_the_rank():
    assert S.zipf_weights(4, 0.0) == [1.0] * 4
    w = S.zipf_weights(24, 1.2)
    assert all(abs(w[k] / w[0] - (k + 1) ** -1.2) < 1e-12 for k in range(24))


def test_shared_prefix_default_fits_the_context():
    cfg = W.SharedPrefixConfig()
    assert cfg.max_prompt_tokens() + S.longest(cfg.output_tokens) <= MAX_MODEL_LEN


def test_multi_tenant_salts_per_tenant_same_ids_across_tenants():
    wl = W.MultiTenant(W.MultiTenantConfig(tenants=4, groups=2), seed=0)
    reqs = draw(wl, 2, 2000)
    tenants = Counter(r.meta["tenant"] for r in reqs)
    assert set(tenants) == {0, 1, 2, 3}
    assert tenants[0] > tenants[3]
    for r in reqs:
        assert r.body["cache_salt"] == S.tenant_salt(r.meta["tenant"])
        assert r.body["prompt"][:768] == wl.prompts[r.meta["group"]]
    assert {r.meta["group"] for r in reqs} == {0, 1}
    assert len({S.tenant_salt(t) for t in range(100)}) == 100
    assert wl.cfg.max_prompt_tokens() + S.longest(wl.cfg.output_tokens) <= MAX_MODEL_LEN


def test_parse_range():
    assert W.parse_range("16-64") == (16, 64)
    assert W.parse_range("32") == (32, 32)
    assert W.parse_range(8) == (8, 8)
    with pytest.raises(ValueError):
        W.parse_range("9-3")


OPTION_TABLES = {"common": (W.COMMON_OPTIONS, None), "replay": (W.REPLAY_OPTIONS, W.ReplayConfig),
                 **{c.name: (c.options, c.config_class) for c in (W.SharedPrefix, W.MultiTurn, W.Rag, W.MultiTenant)}}


@pytest.mark.parametrize("table", sorted(OPTION_TABLES))
def test_each_workload_option_sets_a_config_field_and_takes_its_default_from_it(table):
    options, config_class = OPTION_TABLES[table]
    if config_class is None:
        assert all(o.field is None for o in options)
        return
    cfg = config_class()
    for o in options:
        assert getattr(cfg, o.field) == o.default
        assert o.parse(o.text_default()) == o.default  # the command-line form reads back as the default
    # a config built from the defaults is the config's own default
    assert config_class(**{o.field: o.parse(o.text_default()) for o in options}) == cfg


def test_flags_and_env_vars_are_unique_across_the_locustfiles():
    every = [o for options, _ in OPTION_TABLES.values() for o in options]
    assert len({o.flag for o in every}) == len(every)
    assert len({o.env_var for o in every}) == len(every)
    assert W.COMMON["seed"].flag == "--seed" and W.COMMON["samples_file"].env_var == "LOCUST_SAMPLES_FILE"
    assert W.by_field(W.SharedPrefix.options, "groups").dest == "sp_groups"
    with pytest.raises(KeyError):
        W.by_field(W.SharedPrefix.options, "no_such_field")


def test_option_parse_follows_the_default_type():
    assert W.by_field(W.MultiTenant.options, "question_tokens").parse("3-9") == (3, 9)
    assert W.COMMON["ignore_eos"].parse("off") is False and W.COMMON["ignore_eos"].parse("YES") is True
    assert W.COMMON["request_timeout"].parse("2") == 2.0
    with pytest.raises(ValueError):
        W.COMMON["ignore_eos"].parse("maybe")
    with pytest.raises(ValueError):
        W.COMMON["seed"].parse("x")


def test_options_doc_lists_every_option_with_its_default():
    doc = W.options_doc(W.SharedPrefix.options)
    for o in W.SharedPrefix.options:
        assert f"``{o.flag}`` (``{o.env_var}``, default {o.text_default()})" in doc


# ------------------------------------------------------------------ text workloads (tokenizer)


def chat_tokens(tokenizer, messages) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_rag_prompts_fit_the_context_and_share_the_document(tokenizer):
    wl = W.Rag(W.RagConfig(), seed=0)
    reqs = draw(wl, 9, 60)
    longest = max(chat_tokens(tokenizer, r.body["messages"]) for r in reqs)
    assert longest + S.longest(wl.cfg.output_tokens) <= MAX_MODEL_LEN
    assert longest > 400  # documents are long
    by_doc = {}
    for r in reqs:
        user = r.body["messages"][1]["content"]
        doc = user.split("\n\nQuestion: ")[0]
        assert doc == wl.documents[r.meta["doc"]]
        by_doc.setdefault(r.meta["doc"], set()).add(user)
    assert any(len(v) > 1 for v in by_doc.values())  # one document, several questions


def test_words_stay_under_the_token_bound(tokenizer):
    text = W.words(random.Random(0), 2000)
    assert len(tokenizer.encode(text, add_special_tokens=False)) <= 2000 * W.TOKENS_PER_WORD_BOUND


def test_multi_turn_history_grows_and_conversations_fit_the_context(tokenizer):
    cfg = W.MultiTurnConfig(turns=(50, 50))  # only the context ends these conversations
    wl = W.MultiTurn(cfg, seed=0)
    rng = random.Random(4)
    conv = wl.new_conversation(rng, max_model_len=1024)
    previous = None
    turns = 0
    while not conv.finished():
        req = conv.next_request()
        msgs = req.body["messages"]
        n = chat_tokens(tokenizer, msgs)
        assert n + S.longest(cfg.output_tokens) <= 1024
        if previous is not None:  # the previous turn's messages are a prefix of this one's
            assert msgs[:len(previous)] == previous
        reply = W.words(rng, 12)  # stands in for the model's answer
        conv.record_reply(reply, prompt_tokens=n, completion_tokens=len(tokenizer.encode(reply)))
        previous = msgs + [{"role": "assistant", "content": reply}]
        turns += 1
    assert 3 <= turns < 50
    # same seed, same conversation
    a = W.MultiTurn(cfg, 0).new_conversation(random.Random(4)).next_request().body
    b = W.MultiTurn(cfg, 0).new_conversation(random.Random(4)).next_request().body
    assert a == b


def test_multi_turn_default_turns_end_a_conversation():
    wl = W.MultiTurn(W.MultiTurnConfig(turns=(3, 3)), seed=0)
    conv = wl.new_conversation(random.Random(0), max_model_len=4096)
    for _ in range(3):
        assert not conv.finished()
        conv.next_request()
        conv.record_reply("ok", 100, 2)
    assert conv.finished()


def test_multi_turn_failed_turn_keeps_the_history_alternating():
    conv = W.MultiTurn(W.MultiTurnConfig(), 0).new_conversation(random.Random(0))
    conv.next_request()
    conv.abandon_turn()
    assert [m["role"] for m in conv.messages] == ["system"]


# ------------------------------------------------------------------------------- Mooncake


def test_mooncake_same_hash_id_same_tokens():
    a = W.MooncakeSynth(seed=0, tokens_per_hash_id=32)
    b = W.MooncakeSynth(seed=0, tokens_per_hash_id=32, cache_blocks=1)
    for h in (0, 1, 17, 43923, 17, 0):
        assert a.block(h) == b.block(h)
        assert len(a.block(h)) == 32
    assert a.block(1) != a.block(2)
    assert W.MooncakeSynth(seed=1, tokens_per_hash_id=32).block(1) != a.block(1)
    # the same hash id at another position of another row gives the same tokens
    e1 = S.MooncakeRecord(0, 3 * 512, 10, (5, 6, 7))
    e2 = S.MooncakeRecord(0, 2 * 512, 10, (9, 6))
    assert a.prompt(e1)[32:64] == a.prompt(e2)[32:64] == a.block(6)


def test_mooncake_prompt_lengths_scale_and_cut_the_last_block():
    s = W.MooncakeSynth(seed=0, tokens_per_hash_id=512)
    e = S.MooncakeRecord(0, 1200, 10, (1, 2, 3))
    p = s.prompt(e)
    assert len(p) == 1200
    assert p[:512] == s.block(1) and p[1024:] == s.block(3)[:176]
    small = W.MooncakeSynth(seed=0, tokens_per_hash_id=32)
    assert small.prompt_length(e) == 75  # ceil(1200 * 32 / 512)
    assert small.prompt(e)[64:] == small.block(3)[:11]
    assert len(small.prompt(e, max_prompt_tokens=40)) == 40
    assert small.prompt(e, max_prompt_tokens=40) == small.prompt(e)[:40]


def test_mooncake_trace_rows_fit_the_context_and_share_prefixes():
    records = S.read_mooncake(TRACE)
    assert len(records) == 800
    for tokens_per_id in (32, 512):
        s = W.MooncakeSynth(seed=0, tokens_per_hash_id=tokens_per_id)
        for i, e in enumerate(records[:200]):
            req = s.request(e, max_model_len=MAX_MODEL_LEN, max_output_tokens=16, row=i)
            n = len(req.body["prompt"])
            assert 1 <= n and n + req.body["max_tokens"] <= MAX_MODEL_LEN
            assert 1 <= req.body["max_tokens"] <= 16
            assert all(10 <= t < VOCAB for t in req.body["prompt"])
    # rows that share leading hash ids share leading tokens
    s = W.MooncakeSynth(seed=0, tokens_per_hash_id=32)
    pairs = [(a, b) for a in records[:300] for b in records[:300]
             if a is not b and len(a.hash_ids) > 2 and a.hash_ids[:2] == b.hash_ids[:2]]
    assert pairs, "the trace head has rows sharing a prefix"
    a, b = pairs[0]
    assert s.prompt(a)[:64] == s.prompt(b)[:64]


def test_trace_schedule_follows_timestamps_scaled_and_loops():
    records = [S.MooncakeRecord(t, 10, 1, (i,)) for i, t in enumerate((1000, 1500, 1000, 4000))]
    sch = W.TraceSchedule(records, time_scale=0.5)
    got = [sch.next() for _ in range(6)]
    assert [g[2].hash_ids[0] for g in got] == [0, 2, 1, 3, 0, 2]  # timestamp order, ties in file order
    assert [g[0] for g in got] == [0, 1, 2, 3, 0, 1]
    assert [round(g[1], 4) for g in got[:4]] == [0.0, 0.0, 0.25, 1.5]
    assert got[4][1] > got[3][1]  # the second lap comes after the first
    once = W.TraceSchedule(records, loop=False)
    assert [once.next() is None for _ in range(5)] == [False] * 4 + [True]
    with pytest.raises(ValueError):
        W.TraceSchedule([])


def test_replay_reads_the_default_trace_when_none_is_given():
    assert W.ReplayConfig(trace_file="").records() == S.read_mooncake(TRACE)


def test_vendored_trace_head_is_the_trace_format():
    with open(TRACE, encoding="utf-8") as f:
        row = json.loads(f.readline())
    assert set(row) == {"timestamp", "input_length", "output_length", "hash_ids"}
