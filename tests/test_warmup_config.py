"""The ``warmup`` block as ``serve run`` builds it, without Ray: what is a config error, and what a warm
request looks like. The live warm-up is in ``tests/test_warmup.py``."""

from __future__ import annotations

import json
import re

import pytest

from app.builder import build_app
from app.config import AppArgs, WarmupConfig, WarmupPrompt, parse_app_args
from app.ingress.prepare import CHAT, COMPLETION
from app.ingress.warmup import request_body
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


class _Serving:
    """The ingress's preparer and dispatcher as the warm-up calls them, over a fleet of named replicas:
    each warm request goes to the first running replica it does not avoid (the router's ``avoid_replicas``
    rule), else to the first running one. A stand-in: the live path is in tests/test_warmup.py."""

    def __init__(self, running: list[str]):
        from types import SimpleNamespace

        self.running = running
        self.sent: list[tuple[str, ...]] = []
        self.preparer = SimpleNamespace(prepare=self._prepare)
        self.dispatcher = SimpleNamespace(answer=self._answer)

    async def _prepare(self, kind, body, stream=False):
        from array import array

        from app.protocol import EngineRequest

        return EngineRequest(request_id=f"cmpl-{len(self.sent)}", prompt_token_ids=array("I", [1, 2, 3]))

    async def _answer(self, kind, ereq, span, deadline, summaries):
        from app.protocol import EngineSummary

        self.sent.append(ereq.avoid_replicas)
        free = [r for r in self.running if r not in ereq.avoid_replicas] or self.running
        summaries.append(EngineSummary(replica_id=free[0], prompt_tokens=3, cached_tokens=0))
        yield "answer"


def _warmup(serving, copies: list[int], live):
    import asyncio

    from app.ingress.warmup import Warmup

    cfg = AppArgs.model_validate({"warmup": {"rewarm": False, "prompts": [
        {"name": f"p{i}", "prompt_token_ids": [1, 2, 3], "copies": c} for i, c in enumerate(copies)]}})

    async def ready():
        return True

    async def running():
        return set(live())

    async def run():
        w = Warmup(serving, cfg, ready, running)
        w.start()
        await w._task
        return w.progress

    return asyncio.run(run())


def test_copies_go_to_distinct_replicas_and_stop_when_every_running_replica_holds_one():
    serving = _Serving(["r1", "r2"])
    progress = _warmup(serving, [2, 5], lambda: serving.running)
    assert progress.detail()["prompts"]["p0"]["replicas"] == ["r1", "r2"]
    assert progress.detail()["prompts"]["p1"]["replicas"] == ["r1", "r2"]  # 5 asked, 2 run: a third send ends it
    assert (progress.done, progress.requests_done, progress.short, progress.failed) == (2, 5, [], [])
    assert progress.prefill_tokens == 3 * 5


def test_copies_on_a_replica_lost_during_the_warm_up_are_sent_again_elsewhere():
    serving = _Serving(["r1", "r2"])

    def live():  # r2 is gone by the end of the first pass; r3 replaced it
        serving.running = ["r1", "r3"]
        return serving.running

    progress = _warmup(serving, [2, 1], live)
    d = progress.detail()
    assert d["prompts"]["p0"]["replicas"] == ["r1", "r3"]  # r2's copy warmed again on r3, never listed dead
    assert d["prompts"]["p1"]["replicas"] == ["r1"]
    assert (d["done"], d["total"], d["short"], d["failed"]) == (2, 2, [], [])
    assert serving.sent[-1] == ("r1",)  # the repair avoided the live holder


def test_a_prompt_left_with_fewer_live_copies_than_asked_is_named_short():
    serving = _Serving(["r1", "r2", "r3"])
    # After the first pass r2 is gone and r4 runs; the repair's copy goes to r4, which is gone by the end
    # while r5 runs: three replicas run, two hold the prompt.
    lost = iter([["r1", "r3", "r4"], ["r1", "r3", "r5"]])

    def live():
        serving.running = next(lost, serving.running)
        return serving.running

    progress = _warmup(serving, [3], live)
    assert progress.detail()["prompts"]["p0"]["replicas"] == ["r1", "r3"]
    assert (progress.short, progress.failed, progress.requests_done) == (["p0"], [], 4)


def test_a_file_with_a_byte_order_mark_reads_and_a_file_that_is_not_utf8_or_empty_is_named(tmp_path):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "x"}).encode() + b"\n")
    assert [p.prompt for _, p in WarmupConfig(file=str(bom)).named()] == ["x"]
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "h\xff\xfe"}\n')
    with pytest.raises(ValueError, match=rf"warmup.file {latin}: 'utf-8' codec can't decode"):
        build_app({"warmup": {"file": str(latin)}})
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match=rf"warmup.file {empty}: no prompt in it"):
        build_app({"warmup": {"file": str(empty)}})


def test_blank_names_lax_ids_and_unbounded_copies_are_refused():
    for bad, where in (({"name": "  ", "prompt": "x"}, "name"),
                       ({"prompt_token_ids": [True, 1]}, "prompt_token_ids.0"),
                       ({"prompt_token_ids": [1.0]}, "prompt_token_ids.0"),
                       ({"prompt": "x", "copies": 1025}, "copies")):
        with pytest.raises(ValueError, match=rf"warmup\.prompts\.0\.{re.escape(where)}"):
            parse_app_args({"warmup": {"prompts": [bad]}})


class _Router:
    """A request router's re-warm calls as the warm-up makes them (``app.router.prefix_affinity.PrefixAffinityRouter``'s
    ``ask`` and ``rewarm_*``), over a scripted book: one join and one leave. A stand-in: the live path is
    in tests/test_autoscaling.py, the router's own side in tests/test_router_glue.py."""

    def __init__(self, plan, leave):
        self.plan, self.leave = plan, leave
        self.watched, self.released, self.taken = [], [], False

    async def ask(self, fn):
        return fn()

    def rewarm_watch(self, known, join_timeout_s, token_budget):
        self.watched.append((set(known), join_timeout_s, token_budget))

    def rewarm_take(self):
        if self.taken:
            return [], []
        self.taken = True
        return ["joiner"], [self.leave]

    def rewarm_join_plan(self, configured):
        self.configured = configured
        return self.plan

    def rewarm_release(self, uid):
        self.released.append(uid)
        return True


def _rewarm(serving, router, gone_after: int | None = None):
    cfg = AppArgs.model_validate({"warmup": {"prompts": [{"name": "sys", "prompt_token_ids": [1, 2, 3]}],
                                             "rewarm_tokens": 4096}})

    async def running():
        if gone_after is not None and len(serving.sent) >= gone_after:
            return {"r1"}
        return {"r1", "joiner"}

    return _run_warmup(serving, cfg, running, router, lambda w: router.released and w.progress.jobs and all(
        j.state != "running" for j in w.progress.jobs)).progress


def _run_warmup(serving, cfg, running, router, done):
    """A ``Warmup`` over ``serving`` and ``router`` (ready at once), run until ``done(warmup)`` (4 s at most)."""
    import asyncio

    from app.ingress.warmup import Warmup

    async def ready():
        return True

    async def run():
        w = Warmup(serving, cfg, ready, running, lambda: [router])
        w.start()
        for _ in range(200):
            await asyncio.sleep(0.02)
            if done(w):
                break
        w.stop()
        return w

    return asyncio.run(run())


def test_a_joiner_gets_its_plan_pinned_to_it_then_is_released_and_a_leave_goes_through_the_router():
    from array import array

    from routing.hot_prefixes import WarmPrompt
    from routing.rewarm import LeaveJob

    ids = array("I", range(100, 164))
    plan = [WarmPrompt((1,), 16, (array("I", [1, 2, 3]), None, None), configured=True),
            WarmPrompt((5, 6), 32, (ids, "tenant", None))]
    leave = LeaveJob("gone", (WarmPrompt((9,), 16, (ids, None, None)),), 0.0)
    serving, router = _ServingPinned(["r1", "joiner"]), _Router(plan, leave)
    progress = _rewarm(serving, router)
    assert router.watched == [({"r1", "joiner"}, 30.0, 4096)]
    assert [c[-1] for c in router.configured] == ["sys"]  # the configured prompt, rendered for the plan
    assert router.released == ["joiner"]
    start, *rest = serving.bodies
    join = [b for b in rest if b[0] == "join"]
    assert [(home, body["prompt"], body.get("cache_salt")) for _, home, body in join] == [
        ("joiner", [1, 2, 3], None), ("joiner", list(range(100, 132)), "tenant")]  # a hot prefix: its 2 blocks
    assert [(home, body["prompt"]) for r, home, body in rest if r == "leave"] == [(None, list(range(100, 116)))]
    jobs = {j.reason: j for j in progress.jobs}
    assert (jobs["join"].state, jobs["join"].requests_done, jobs["leave"].state) == ("done", 2, "done")
    assert progress.rewarm_detail()["joins"] == progress.rewarm_detail()["leaves"] == 1


def test_a_join_stops_when_its_replica_goes_and_the_replica_is_released_all_the_same():
    from array import array

    from routing.hot_prefixes import WarmPrompt
    from routing.rewarm import LeaveJob

    ids = array("I", range(64))
    plan = [WarmPrompt((i,), 16, (ids, None, None)) for i in range(4)]
    serving, router = _ServingPinned(["r1", "joiner"]), _Router(plan, LeaveJob("x", (), 0.0))
    progress = _rewarm(serving, router, gone_after=2)  # the start's request and one join request
    (join,) = [j for j in progress.jobs if j.reason == "join"]
    assert join.state == "cancelled" and join.requests_done == 1 and router.released == ["joiner"]


class _ServingPinned(_Serving):
    """``_Serving`` that also keeps each warm request's reason, pinned replica and body."""

    def __init__(self, running):
        super().__init__(running)
        self.bodies = []

    async def _prepare(self, kind, body, stream=False):
        self.body = body
        return await super()._prepare(kind, body, stream)

    async def _answer(self, kind, ereq, span, deadline, summaries):
        from app.protocol import EngineSummary

        self.bodies.append((ereq.warmup, ereq.home_replica, self.body))
        if ereq.home_replica is not None and ereq.home_replica not in self.running:  # gone: no answer comes
            return
        if ereq.home_replica is not None:  # pinned: the router sends it there (tests/test_router_glue.py)
            self.sent.append(())
            summaries.append(EngineSummary(replica_id=ereq.home_replica, prompt_tokens=3, cached_tokens=0))
            yield "answer"
            return
        async for item in super()._answer(kind, ereq, span, deadline, summaries):
            yield item


class _ReplicatingRouter:
    """A request router's replication calls as the warm-up makes them (``ask`` and ``replication_plan``), over a
    scripted plan: one copy, named at the first check. A stand-in: the router's own side is in
    tests/test_router_glue.py, the live path in tests/test_warmup.py."""

    def __init__(self, copy, again=False):
        self.copy, self.calls, self.again = copy, [], again

    async def ask(self, fn):
        return fn()

    def replication_plan(self, max_copies, share, spent_tokens, skip):
        self.calls.append((max_copies, share, spent_tokens, skip))
        if self.copy[0].keys[-1] in skip:
            return []
        return [self.copy] if len(self.calls) == 1 or self.again else []


def test_a_copy_named_by_a_replication_check_goes_pinned_to_its_target_and_counts_its_prefill():
    from array import array

    from routing.hot_prefixes import WarmPrompt
    from routing.replication import ReplicationDecision

    prefix = WarmPrompt((7, 8), 32, (array("I", range(100, 140)), "tenant", None), heat=64.0)
    router = _ReplicatingRouter((prefix, ReplicationDecision("r2", "replicate", ("r1",), 0.5, 0.1, 0.8, 0.2)))
    serving = _ServingPinned(["r1", "r2"])
    cfg = AppArgs.model_validate({"warmup": {"rewarm": False, "replicate": True, "max_copies": 3,
                                             "replicate_share": 0.5, "replicate_interval_s": 0.5}})

    async def running():
        return {"r1", "r2"}

    w = _run_warmup(serving, cfg, running, router, lambda w: len(router.calls) >= 3 and w.progress.jobs
                    and w.progress.jobs[0].state != "running")
    assert serving.bodies == [("replicate", "r2", {"model": cfg.served_model_name, "prompt": list(range(100, 132)),
                                                  "max_tokens": 1, "temperature": 0.0, "stream": False,
                                                  "cache_salt": "tenant"})]
    (job,) = w.progress.jobs
    assert (job.reason, job.replica_id, job.state, job.requests_done, job.prefill_tokens) == ("replicate", "r2",
                                                                                            "done", 1, 3)
    assert w.progress.rewarm_detail()["copies"] == 1 and w.replicate_spent_tokens == 32
    # Charged when sent: the prefix's 32 prompt tokens (the engine's prefill of it, 3 here, is the job's).
    assert router.calls[0] == (3, 0.5, 0, frozenset()) and router.calls[-1] == (3, 0.5, 32, frozenset())


def test_a_copy_that_fails_is_charged_and_its_prefix_is_skipped_for_a_while():
    from array import array

    from routing.hot_prefixes import WarmPrompt
    from routing.replication import ReplicationDecision

    prefix = WarmPrompt((7, 8), 32, (array("I", range(100, 140)), None, None), heat=64.0)
    router = _ReplicatingRouter((prefix, ReplicationDecision("gone", "replicate", ("r1",), 0.5, 0.1, 0.8, 0.2)),
                                again=True)
    serving = _ServingPinned(["r1", "r2"])  # "gone" is not running: the pinned copy fails
    cfg = AppArgs.model_validate({"warmup": {"rewarm": False, "replicate": True, "replicate_interval_s": 0.5}})

    async def running():
        return {"r1", "r2"}

    w = _run_warmup(serving, cfg, running, router, lambda w: len(router.calls) >= 2)
    (job,) = w.progress.jobs
    assert (job.state, job.failed, w.replicate_spent_tokens) == ("failed", 1, 32)
    assert router.calls[1][3] == frozenset({8})  # the next check skips it (for COPY_COOLDOWN_S)
