"""Generated workloads of the simulator: the shapes of ``locustfiles/shapes.py`` as token segments with arrivals.

Each generator takes one shape (:mod:`locustfiles.shapes`; default: its
:data:`~locustfiles.shapes.RTX4090_X8` preset), draws it from numpy
(:class:`NumpyDraws`), deterministic in ``seed``, and returns a
:class:`~bench.sim.workload.Workload` of about ``num_requests`` requests.  Every
shared prefix (system prompt, document, app prompt), fresh part and answer is a
segment of its own; requests arrive as a Poisson process at ``rate``
requests/s (scale it with ``Workload.scaled`` or ``--rate-scale``).

* ``system_prompts`` (:class:`~locustfiles.shapes.SharedPrefixConfig`): one of
  ``groups`` system prompts plus the request's own question.
* ``chat`` (:class:`~locustfiles.shapes.MultiTurnConfig`): sessions start as a
  Poisson process; each turn's prompt is the previous turn's prompt and answer
  (the engine's own output tokens) plus a new user message, ``think_time_s``
  (uniform) after the previous turn.
* ``rag`` (:class:`~locustfiles.shapes.RagConfig`): the shared instruction, one of
  ``documents`` documents, then a question.
* ``multi_tenant`` (:class:`~locustfiles.shapes.MultiTenantConfig`): the same app
  prompts under a ``cache_salt`` per tenant.

The default rates put round-robin on 8 RTX 4090 replicas (AWQ preset) near its
knee at ``--rate-scale 1``; the benchmark report sweeps around them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bench.sim.workload import SimRequest, Workload, renumber
from locustfiles.shapes import (
    RTX4090_X8,
    MultiTenantConfig,
    MultiTurnConfig,
    RagConfig,
    SharedPrefixConfig,
    length_range,
    tenant_salt,
)

__all__ = ["GENERATORS", "NumpyDraws", "generate", "system_prompts", "chat", "rag", "multi_tenant"]

_NAMESPACE_BASE = 1000  # token namespaces of generated workloads: base + generator index


class NumpyDraws:
    """:class:`locustfiles.shapes.Draws` from a numpy ``Generator`` (the simulator's side).

    Each draw is one call of the generator (``integers``, ``choice`` with the
    weights normalized, ``permutation``), returned as Python ints.
    """

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def integers(self, low: int, high: int, size: int | None = None):
        if size is None:
            return int(self.rng.integers(low, high))
        return self.rng.integers(low, high, size=size).tolist()

    def choice(self, n: int, size: int | None = None, weights: Sequence[float] | None = None):
        p = None
        if weights is not None:
            w = np.asarray(weights, dtype=np.float64)
            p = w / w.sum()
        if size is None:
            return int(self.rng.choice(n, p=p))
        return self.rng.choice(n, size=size, p=p).tolist()

    def permutation(self, n: int) -> list[int]:
        return self.rng.permutation(n).tolist()


def _draws(seed: int, stream: int) -> NumpyDraws:
    return NumpyDraws(np.random.default_rng([seed, stream]))


def _poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def _params(num_requests: int, seed: int, rate: float, shape: Any, **more: Any) -> dict[str, Any]:
    """The report's ``workload.params``: the generator's arguments and the shape's fields."""
    return dict(num_requests=num_requests, seed=seed, rate=rate, **dataclasses.asdict(shape), **more)


class _Ids:
    """Fresh segment ids."""

    def __init__(self) -> None:
        self.next = 1

    def __call__(self) -> int:
        self.next += 1
        return self.next - 1


def system_prompts(num_requests: int = 10_000, *, seed: int = 0, rate: float = 11.0,
                   shape: SharedPrefixConfig = RTX4090_X8.shared_prefix) -> Workload:
    """Shared system prompts: segments system prompt + question, Poisson arrivals."""
    draws = _draws(seed, 1)
    ids = _Ids()
    sys_ids = [ids() for _ in range(shape.groups)]
    prompts = shape.prefixes(draws)
    sampled = shape.sample(draws, prompts, num_requests)
    times = _poisson_arrivals(draws.rng, num_requests, rate)
    reqs = []
    for i, g in enumerate(sampled.prefix):
        segs = ((sys_ids[g], prompts.lengths[g]), (ids(), sampled.fresh[i]))
        reqs.append(SimRequest(0, float(times[i]), segs, ids(), sum(n for _, n in segs), sampled.output_tokens[i],
                               session=g))
    return Workload("system_prompts", renumber(reqs), _NAMESPACE_BASE + 1,
                    _params(num_requests, seed, rate, shape))


def chat(num_requests: int = 10_000, *, seed: int = 0, rate: float = 6.0,
         shape: MultiTurnConfig = RTX4090_X8.multi_turn, think_time_s: tuple[float, float] = (15.0, 45.0),
         max_context: int = 30_000) -> Workload:
    """Multi-turn chat sessions; turn ``k+1`` extends turn ``k``'s prompt and answer.

    Sessions start as a Poisson process at ``rate / mean turns`` so requests
    arrive at about ``rate``/s; turn ``k+1`` arrives ``think_time_s`` (uniform)
    after turn ``k``.  A session ends after its drawn number of turns or when
    the next prompt and answer would pass ``max_context`` tokens.
    """
    draws = _draws(seed, 2)
    rng = draws.rng
    ids = _Ids()
    sys_ids = [ids() for _ in range(shape.system_prompts)]
    sys_lens = shape.system_lengths(draws)
    lo, hi = length_range(shape.turns)
    mean_turns = (lo + hi) / 2.0
    reqs: list[SimRequest] = []
    t = 0.0
    session = 0
    while len(reqs) < num_requests:
        t += float(rng.exponential(mean_turns / rate))
        s, n_turns = shape.session(draws)
        history: list[tuple[int, int]] = [(sys_ids[s], sys_lens[s])]
        at = t
        for k in range(n_turns):
            user_id = ids()
            user_len, out_n = shape.turn(draws, k)
            segs = (*history, (user_id, user_len))
            prompt = sum(n for _, n in segs)
            if prompt + out_n > max_context:
                break
            out_seg = ids()
            reqs.append(SimRequest(0, at, segs, out_seg, prompt, out_n, session=session))
            history = [*segs, (out_seg, out_n)]
            at += float(rng.uniform(*think_time_s))
        session += 1
    reqs = renumber(reqs)[:num_requests]
    return Workload("chat", reqs, _NAMESPACE_BASE + 2,
                    _params(num_requests, seed, rate, shape, think_time_s=think_time_s, max_context=max_context,
                            sessions=session))


def rag(num_requests: int = 10_000, *, seed: int = 0, rate: float = 8.0,
        shape: RagConfig = RTX4090_X8.rag) -> Workload:
    """RAG: segments instruction + document + question, Poisson arrivals."""
    draws = _draws(seed, 3)
    ids = _Ids()
    instr = ids()
    doc_ids = [ids() for _ in range(shape.documents)]
    docs = shape.prefixes(draws)
    sampled = shape.sample(draws, docs, num_requests)
    times = _poisson_arrivals(draws.rng, num_requests, rate)
    reqs = []
    for i, d in enumerate(sampled.prefix):
        segs = ((instr, shape.instruction_len), (doc_ids[d], docs.lengths[d]), (ids(), sampled.fresh[i]))
        reqs.append(SimRequest(0, float(times[i]), segs, ids(), sum(n for _, n in segs), sampled.output_tokens[i],
                               session=d))
    return Workload("rag", renumber(reqs), _NAMESPACE_BASE + 3, _params(num_requests, seed, rate, shape))


def multi_tenant(num_requests: int = 10_000, *, seed: int = 0, rate: float = 11.0,
                 shape: MultiTenantConfig = RTX4090_X8.multi_tenant) -> Workload:
    """Tenants with their own ``cache_salt`` running the same app prompts: segments app prompt + question."""
    draws = _draws(seed, 4)
    ids = _Ids()
    prompt_ids = [ids() for _ in range(shape.groups)]
    prompt_lens = shape.prompt_lengths(draws)
    sampled = shape.sample(draws, num_requests)
    times = _poisson_arrivals(draws.rng, num_requests, rate)
    reqs = []
    for i, (t, j) in enumerate(zip(sampled.tenant, sampled.prompt, strict=True)):
        segs = ((prompt_ids[j], prompt_lens[j]), (ids(), sampled.question_tokens[i]))
        reqs.append(SimRequest(0, float(times[i]), segs, ids(), sum(n for _, n in segs), sampled.output_tokens[i],
                               cache_salt=tenant_salt(t), session=t))
    return Workload("multi_tenant", renumber(reqs), _NAMESPACE_BASE + 4, _params(num_requests, seed, rate, shape))


GENERATORS: dict[str, Callable[..., Workload]] = {
    "system_prompts": system_prompts,
    "chat": chat,
    "rag": rag,
    "multi_tenant": multi_tenant,
}


def generate(name: str, num_requests: int = 10_000, *, seed: int = 0, **kwargs) -> Workload:
    """Run the generator called ``name`` (``kwargs``: its ``rate``, ``shape``, ...).

    Raises:
        KeyError: unknown workload (the message lists the known ones).
    """
    try:
        gen = GENERATORS[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(GENERATORS)}") from None
    return gen(num_requests, seed=seed, **kwargs)
