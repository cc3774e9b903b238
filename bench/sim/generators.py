"""Generated workloads: shared system prompts, chat sessions, RAG, multi-tenant.

Every generator is deterministic in its ``seed`` and returns a
:class:`~bench.sim.workload.Workload` of about ``num_requests`` requests with
Poisson arrivals at ``rate`` requests/s (scale it with ``Workload.scaled`` or
``--rate-scale``).  Popularity is skewed with a Zipf law (weight of rank ``k``
is ``k ** -zipf``), as production prefix reuse is.  Lengths are drawn uniformly
from the ranges given.

* ``system_prompts``: ``groups`` system prompts (an agent's instructions and
  tool definitions), each request one of them plus its own user message.
* ``chat``: multi-turn sessions; each turn's prompt is the previous turn's
  prompt and answer (the engine's own output tokens) plus a new user message,
  after a think time, on one of a few shared system prompts.
* ``rag``: a short shared instruction, one of ``documents`` retrieved
  documents, then a question: documents x questions.
* ``multi_tenant``: ``tenants`` tenants with their own ``cache_salt``, each
  with a few system prompts; the tenants run the *same* prompt templates, so
  only the salt keeps their caches apart (vLLM never shares blocks across
  salts), with skewed traffic across tenants.

The default rates put round-robin on 8 RTX 4090 replicas (AWQ preset) near its
knee at ``--rate-scale 1``; the benchmark report sweeps around them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from bench.sim.workload import SimRequest, Workload, renumber

__all__ = ["GENERATORS", "generate", "system_prompts", "chat", "rag", "multi_tenant"]

_NAMESPACE_BASE = 1000  # token namespaces of generated workloads: base + generator index


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def _zipf_weights(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return w / w.sum()


def _uniform(rng: np.random.Generator, lo_hi: tuple[int, int], size: int | None = None):
    lo, hi = lo_hi
    return rng.integers(lo, hi + 1, size=size)


def _poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


class _Ids:
    """Fresh segment ids."""

    def __init__(self) -> None:
        self.next = 1

    def __call__(self) -> int:
        self.next += 1
        return self.next - 1


def system_prompts(
    num_requests: int = 10_000,
    *,
    seed: int = 0,
    rate: float = 11.0,
    groups: int = 40,
    zipf: float = 1.1,
    system_len: tuple[int, int] = (1500, 6000),
    user_len: tuple[int, int] = (100, 600),
    output_len: tuple[int, int] = (50, 400),
) -> Workload:
    """Shared system prompts: ``groups`` prompts x requests, Zipf popularity."""
    rng = _rng(seed, 1)
    ids = _Ids()
    sys_ids = [ids() for _ in range(groups)]
    sys_lens = _uniform(rng, system_len, groups)
    pop = _zipf_weights(groups, zipf)
    perm = rng.permutation(groups)  # popularity rank is not prompt length
    group = perm[rng.choice(groups, size=num_requests, p=pop)]
    users = _uniform(rng, user_len, num_requests)
    outs = _uniform(rng, output_len, num_requests)
    times = _poisson_arrivals(rng, num_requests, rate)
    reqs = []
    for i in range(num_requests):
        g = int(group[i])
        segs = ((sys_ids[g], int(sys_lens[g])), (ids(), int(users[i])))
        reqs.append(SimRequest(0, float(times[i]), segs, ids(), sum(n for _, n in segs), int(outs[i]), session=g))
    params = dict(num_requests=num_requests, seed=seed, rate=rate, groups=groups, zipf=zipf,
                  system_len=system_len, user_len=user_len, output_len=output_len)
    return Workload("system_prompts", renumber(reqs), _NAMESPACE_BASE + 1, params)


def chat(
    num_requests: int = 10_000,
    *,
    seed: int = 0,
    rate: float = 6.0,
    system_prompts: int = 8,
    zipf: float = 1.0,
    system_len: tuple[int, int] = (800, 2000),
    turns: tuple[int, int] = (2, 12),
    first_user_len: tuple[int, int] = (200, 1500),
    user_len: tuple[int, int] = (30, 400),
    output_len: tuple[int, int] = (100, 500),
    think_time_s: tuple[float, float] = (15.0, 45.0),
    max_context: int = 30_000,
) -> Workload:
    """Multi-turn chat sessions; turn ``k+1`` extends turn ``k``'s prompt and answer.

    Sessions start as a Poisson process at ``rate / mean turns`` so requests
    arrive at about ``rate``/s; turn ``k+1`` arrives ``think_time_s`` (uniform)
    after turn ``k``.  A session ends after its drawn number of turns or when
    the next prompt would pass ``max_context`` tokens.
    """
    rng = _rng(seed, 2)
    ids = _Ids()
    sys_ids = [ids() for _ in range(system_prompts)]
    sys_lens = _uniform(rng, system_len, system_prompts)
    pop = _zipf_weights(system_prompts, zipf)
    mean_turns = (turns[0] + turns[1]) / 2.0
    reqs: list[SimRequest] = []
    t = 0.0
    session = 0
    while len(reqs) < num_requests:
        t += float(rng.exponential(mean_turns / rate))
        s = int(rng.choice(system_prompts, p=pop))
        history: list[tuple[int, int]] = [(sys_ids[s], int(sys_lens[s]))]
        n_turns = int(_uniform(rng, turns))
        at = t
        for k in range(n_turns):
            user = (ids(), int(_uniform(rng, first_user_len if k == 0 else user_len)))
            out_n = int(_uniform(rng, output_len))
            segs = tuple(history) + (user,)
            prompt = sum(n for _, n in segs)
            if prompt + out_n > max_context:
                break
            out_seg = ids()
            reqs.append(SimRequest(0, at, segs, out_seg, prompt, out_n, session=session))
            history = list(segs) + [(out_seg, out_n)]
            at += float(rng.uniform(*think_time_s))
        session += 1
    reqs = renumber(reqs)[:num_requests]
    params = dict(num_requests=num_requests, seed=seed, rate=rate, system_prompts=system_prompts, zipf=zipf,
                  system_len=system_len, turns=turns, first_user_len=first_user_len, user_len=user_len,
                  output_len=output_len, think_time_s=think_time_s, max_context=max_context, sessions=session)
    return Workload("chat", reqs, _NAMESPACE_BASE + 2, params)


def rag(
    num_requests: int = 10_000,
    *,
    seed: int = 0,
    rate: float = 8.0,
    documents: int = 400,
    zipf: float = 1.0,
    instruction_len: int = 300,
    document_len: tuple[int, int] = (2000, 8000),
    question_len: tuple[int, int] = (20, 200),
    output_len: tuple[int, int] = (50, 300),
) -> Workload:
    """RAG: shared instruction + one of ``documents`` documents (Zipf) + a question."""
    rng = _rng(seed, 3)
    ids = _Ids()
    instr = ids()
    doc_ids = [ids() for _ in range(documents)]
    doc_lens = _uniform(rng, document_len, documents)
    pop = _zipf_weights(documents, zipf)
    perm = rng.permutation(documents)
    doc = perm[rng.choice(documents, size=num_requests, p=pop)]
    qs = _uniform(rng, question_len, num_requests)
    outs = _uniform(rng, output_len, num_requests)
    times = _poisson_arrivals(rng, num_requests, rate)
    reqs = []
    for i in range(num_requests):
        d = int(doc[i])
        segs = ((instr, instruction_len), (doc_ids[d], int(doc_lens[d])), (ids(), int(qs[i])))
        reqs.append(SimRequest(0, float(times[i]), segs, ids(), sum(n for _, n in segs), int(outs[i]), session=d))
    params = dict(num_requests=num_requests, seed=seed, rate=rate, documents=documents, zipf=zipf,
                  instruction_len=instruction_len, document_len=document_len, question_len=question_len,
                  output_len=output_len)
    return Workload("rag", renumber(reqs), _NAMESPACE_BASE + 3, params)


def multi_tenant(
    num_requests: int = 10_000,
    *,
    seed: int = 0,
    rate: float = 11.0,
    tenants: int = 16,
    zipf: float = 1.0,
    prompts_per_tenant: int = 3,
    system_len: tuple[int, int] = (1500, 5000),
    user_len: tuple[int, int] = (100, 600),
    output_len: tuple[int, int] = (50, 400),
) -> Workload:
    """Tenants with their own ``cache_salt`` running the same prompt templates.

    Template ``j`` has the same tokens for every tenant; a tenant's request
    picks one of its ``prompts_per_tenant`` templates uniformly.  Tenant
    traffic is Zipf-skewed.
    """
    rng = _rng(seed, 4)
    ids = _Ids()
    tmpl_ids = [ids() for _ in range(prompts_per_tenant)]
    tmpl_lens = _uniform(rng, system_len, prompts_per_tenant)
    pop = _zipf_weights(tenants, zipf)
    tenant = rng.choice(tenants, size=num_requests, p=pop)
    tmpl = rng.integers(0, prompts_per_tenant, size=num_requests)
    users = _uniform(rng, user_len, num_requests)
    outs = _uniform(rng, output_len, num_requests)
    times = _poisson_arrivals(rng, num_requests, rate)
    reqs = []
    for i in range(num_requests):
        j = int(tmpl[i])
        segs = ((tmpl_ids[j], int(tmpl_lens[j])), (ids(), int(users[i])))
        reqs.append(
            SimRequest(0, float(times[i]), segs, ids(), sum(n for _, n in segs), int(outs[i]),
                       cache_salt=f"tenant-{int(tenant[i])}", session=int(tenant[i]))
        )
    params = dict(num_requests=num_requests, seed=seed, rate=rate, tenants=tenants, zipf=zipf,
                  prompts_per_tenant=prompts_per_tenant, system_len=system_len, user_len=user_len,
                  output_len=output_len)
    return Workload("multi_tenant", renumber(reqs), _NAMESPACE_BASE + 4, params)


GENERATORS: dict[str, Callable[..., Workload]] = {
    "system_prompts": system_prompts,
    "chat": chat,
    "rag": rag,
    "multi_tenant": multi_tenant,
}


def generate(name: str, num_requests: int = 10_000, *, seed: int = 0, **kwargs) -> Workload:
    """Run the generator called ``name``.

    Raises:
        KeyError: unknown workload (the message lists the known ones).
    """
    try:
        gen = GENERATORS[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(GENERATORS)}") from None
    return gen(num_requests, seed=seed, **kwargs)
