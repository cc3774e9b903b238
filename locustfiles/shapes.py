"""Workload shapes, defined once for the Locust load tests and the cluster simulator.

A *shape* says what the requests of a load pattern look like, not how they are
sent: how many shared prefixes there are (system prompts, documents, app
prompts), how long they are, which one a request uses (popularity), what fresh
part follows, and how many tokens it generates. Two sides turn a shape's draws
into requests:

* Locust (``locustfiles/workloads.py``): HTTP bodies, token ids or text, one
  request at a time per simulated user, drawn from Python's ``random.Random``
  (:class:`PyDraws`);
* the simulator (``bench/sim/generators.py``): ``SimRequest`` token segments
  with open-loop arrivals (Poisson, think times), drawn from numpy
  (``bench.sim.generators.NumpyDraws``).

Every random choice of a shape goes through :class:`Draws`, in an order fixed
here, so a shape and a seed give the same requests on a side every time. How
requests *arrive* (request rate, think time, context bounds) belongs to each
side: Locust users run a closed loop paced by ``--think-time``; the simulator
draws arrival times.

Shapes (one config dataclass each; see their docstrings):

* :class:`SharedPrefixConfig` -- shared system prompts (Locust ``shared_prefix``,
  simulator ``system_prompts``);
* :class:`MultiTurnConfig` -- multi-turn chat (``multi_turn`` / ``chat``);
* :class:`RagConfig` -- documents x questions (``rag``);
* :class:`MultiTenantConfig` -- tenants with a ``cache_salt`` each (``multi_tenant``).

Lengths: a :data:`Length` is a number or a ``(low, high)`` range drawn
uniformly, both ends included. Fields named ``*_tokens`` count tokens. Fields
named ``*_len`` count tokens in the simulator and words in Locust's text prompts
(chat and RAG are text there: about 1.4 tokens a word on the tiny default
model, 1.3 with large vocabularies; ``workloads.TOKENS_PER_WORD_BOUND``).

Popularity is Zipf, as production prefix reuse is: the item of rank ``k``
(0-based) has weight ``(k + 1) ** -zipf_s`` (:func:`zipf_weights`; 0 is uniform).

Presets: the dataclass defaults are :data:`CPU_TINY` (Locust's defaults: a
2-core CPU box serving the tiny Qwen2 model, two replicas of 2,048 blocks x 32
tokens); :data:`RTX4090_X8` holds the simulator's (8 RTX 4090 replicas of
Qwen2.5-7B, ``docs/benchmarks.md``).

Mooncake traces: :func:`read_mooncake` reads the FAST'25 Mooncake trace format
(kvcache-ai/Mooncake, ``mooncake_trace.jsonl``) into :class:`MooncakeRecord`\\ s;
Locust synthesizes token ids per hash id, the simulator token segments.

Standard library only: the locustfiles folder also runs copied alone to a
load-generator host, and the simulator imports this module without Locust.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, overload

Length = int | tuple[int, int]
"""A length: a number, or a ``(low, high)`` range drawn uniformly (ends included)."""


def length_range(length: Length) -> tuple[int, int]:
    """``length`` as ``(low, high)``: ``32`` -> ``(32, 32)``."""
    if isinstance(length, int):
        return length, length
    lo, hi = length
    return int(lo), int(hi)


def longest(length: Length) -> int:
    """The largest value ``length`` can take."""
    return length_range(length)[1]


def zipf_weights(n: int, s: float) -> list[float]:
    """Relative popularity of ``n`` items under Zipf(``s``): rank ``k`` (0-based) has ``1 / (k + 1) ** s``.

    Not normalized (divide by the sum for probabilities); ``s = 0`` is uniform.
    """
    if n < 1:
        raise ValueError("need at least one item")
    return [1.0 / (k + 1) ** s for k in range(n)]


def tenant_salt(tenant: int) -> str:
    """The ``cache_salt`` of tenant ``tenant`` (vLLM's rules: non-empty, <= 128 chars, no ``@ / \\``)."""
    return f"tenant-{tenant}"


# ----------------------------------------------------------------------------- draws


class Draws(Protocol):
    """The random draws a shape makes, modelled on ``numpy.random.Generator``'s
    ``integers``, ``choice`` and ``permutation``.

    ``size=None`` draws one value, ``size=n`` a list of ``n`` (Python ints);
    integers are in ``[low, high)``; ``weights`` of :meth:`choice` are relative
    (they need not sum to 1).
    """

    @overload
    def integers(self, low: int, high: int, size: None = None) -> int: ...
    @overload
    def integers(self, low: int, high: int, size: int) -> list[int]: ...
    @overload
    def choice(self, n: int, size: None = None, weights: Sequence[float] | None = None) -> int: ...
    @overload
    def choice(self, n: int, size: int, weights: Sequence[float] | None = None) -> list[int]: ...
    def permutation(self, n: int) -> list[int]:
        """``0 .. n-1`` in random order."""
        ...


class PyDraws:
    """:class:`Draws` from a ``random.Random`` (Locust's side).

    A draw with one possible outcome (a range of one value, one item) takes
    nothing from the stream, so fixed lengths leave the other draws as they were.
    """

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integers(self, low: int, high: int, size: int | None = None):
        if size is not None:
            return [self.integers(low, high) for _ in range(size)]
        return low if high - low == 1 else self.rng.randrange(low, high)

    def choice(self, n: int, size: int | None = None, weights: Sequence[float] | None = None):
        if size is not None:
            return [self.choice(n, None, weights) for _ in range(size)]
        if n == 1:
            return 0
        if weights is None:
            return self.rng.randrange(n)
        return self.rng.choices(range(n), weights=weights)[0]

    def permutation(self, n: int) -> list[int]:
        out = list(range(n))
        self.rng.shuffle(out)
        return out


@overload
def draw_length(draws: Draws, length: Length, size: None = None) -> int: ...
@overload
def draw_length(draws: Draws, length: Length, size: int) -> list[int]: ...
def draw_length(draws: Draws, length: Length, size: int | None = None) -> int | list[int]:
    """One length (``size=None``) or ``size`` lengths, uniform in ``length``'s range."""
    lo, hi = length_range(length)
    return draws.integers(lo, hi + 1, size=size)


@dataclass(frozen=True)
class Prefixes:
    """The shared prefixes of a workload: their lengths and their popularity.

    Attributes:
        lengths: length of prefix ``i`` (units of the shape's field).
        by_rank: the prefix of each popularity rank (``by_rank[0]`` is the most
            popular); a random permutation, so that popularity is not length.
        weights: relative popularity of each rank (:func:`zipf_weights`).
    """

    lengths: list[int]
    by_rank: list[int]
    weights: list[float]

    @classmethod
    def draw(cls, draws: Draws, count: int, length: Length, zipf_s: float) -> Prefixes:
        """``count`` prefixes: lengths drawn first, then the rank permutation."""
        lengths = draw_length(draws, length, count)
        return cls(lengths, draws.permutation(count), zipf_weights(count, zipf_s))

    def pick(self, draws: Draws, n: int) -> list[int]:
        """The prefixes of ``n`` requests (by popularity)."""
        return [self.by_rank[r] for r in draws.choice(len(self.lengths), n, self.weights)]


@dataclass(frozen=True)
class PrefixRequests:
    """``n`` requests of a shared-prefix shape, as columns.

    Attributes:
        prefix: the shared prefix (system prompt, document) each request starts with.
        fresh: length of the request's own part after it (question, user message).
        output_tokens: tokens it generates.
    """

    prefix: list[int]
    fresh: list[int]
    output_tokens: list[int]


def _prefix_requests(draws: Draws, prefixes: Prefixes, n: int, fresh: Length, output: Length) -> PrefixRequests:
    """Draw order: prefixes, then fresh lengths, then output lengths (all ``n`` of each)."""
    prefix = prefixes.pick(draws, n)
    return PrefixRequests(prefix, draw_length(draws, fresh, n), draw_length(draws, output, n))


# ------------------------------------------------------------------------------ shapes


@dataclass(frozen=True)
class SharedPrefixConfig:
    """Shared system prompts: ``groups`` long system prompts (an app's or an agent's
    instructions and tool definitions) of Zipf popularity; each request is one of
    them plus a fresh question. Token ids on both sides."""

    groups: int = 32
    """System prompts. The default working set (32 x 3,072 = 98,304 tokens) is 1.5
    times one default CPU replica's KV cache (2,048 blocks x 32 = 65,536 tokens) and
    0.75 times two replicas': it fits the cluster only if each replica keeps to its
    share of the groups."""
    system_tokens: Length = 3072
    """Tokens of each system prompt (drawn once per prompt). Long (agent/tool-style):
    on the tiny CPU model a miss then costs a prefill that is large against the fixed
    per-request overhead of the stack."""
    question_tokens: Length = (16, 64)
    """Fresh tokens after the system prompt."""
    zipf_s: float = 1.0
    """Zipf exponent of system-prompt popularity."""
    output_tokens: Length = 8
    """Tokens generated per request."""

    def max_prompt_tokens(self) -> int:
        return longest(self.system_tokens) + longest(self.question_tokens)

    def prefixes(self, draws: Draws) -> Prefixes:
        """The system prompts."""
        return Prefixes.draw(draws, self.groups, self.system_tokens, self.zipf_s)

    def sample(self, draws: Draws, prefixes: Prefixes, n: int) -> PrefixRequests:
        """``n`` requests: system prompt, question tokens, output tokens."""
        return _prefix_requests(draws, prefixes, n, self.question_tokens, self.output_tokens)


@dataclass(frozen=True)
class MultiTurnConfig:
    """Multi-turn chat: a session starts on one of ``system_prompts`` system prompts
    (Zipf, rank = index) and runs ``turns`` turns; each turn's prompt is the previous
    turn's prompt and answer plus a new user message. A session also ends when its
    next turn would not fit the context (each side knows its own context). Text on
    Locust (the answers are the model's), token segments in the simulator."""

    system_prompts: int = 1
    """Shared system prompts."""
    system_len: Length = 120
    """Length of each system prompt (drawn once per prompt)."""
    zipf_s: float = 1.0
    """Zipf exponent of system-prompt popularity."""
    turns: Length = (3, 8)
    """Turns of one session."""
    first_user_len: Length | None = None
    """The first user message (a pasted document, a long question); None: as ``user_len``."""
    user_len: Length = (12, 40)
    """Every later user message."""
    output_tokens: Length = 24
    """Tokens generated per turn."""

    def system_lengths(self, draws: Draws) -> list[int]:
        """The system prompts' lengths."""
        return draw_length(draws, self.system_len, self.system_prompts)

    def session(self, draws: Draws) -> tuple[int, int]:
        """A new session: ``(system prompt, turns)``, drawn in that order."""
        system = draws.choice(self.system_prompts, weights=zipf_weights(self.system_prompts, self.zipf_s))
        return system, draw_length(draws, self.turns)

    def user_length(self, turn: int) -> Length:
        """The user-message length of turn ``turn`` (0-based)."""
        return self.first_user_len if turn == 0 and self.first_user_len is not None else self.user_len

    def turn(self, draws: Draws, turn: int) -> tuple[int, int]:
        """Turn ``turn`` (0-based) of a session: ``(user message length, output tokens)``, in that order."""
        return draw_length(draws, self.user_length(turn)), draw_length(draws, self.output_tokens)


@dataclass(frozen=True)
class RagConfig:
    """Retrieval-augmented generation: a shared instruction, one of ``documents``
    retrieved documents (Zipf popularity), then a fresh question: documents x
    questions. Text on Locust, token segments in the simulator."""

    documents: int = 16
    """Documents in the corpus."""
    zipf_s: float = 0.6
    """Zipf exponent of document popularity."""
    instruction_len: int = 13
    """The instruction before the document, shared by every request (Locust's is
    ``workloads.RAG_SYSTEM``, 13 words, extended with words when longer)."""
    document_len: Length = 400
    """Length of each document (drawn once per document); 400 words are about 560
    tokens on the tiny model, 520 on large vocabularies."""
    question_len: Length = (8, 24)
    """Length of each question."""
    output_tokens: Length = 16
    """Tokens generated per request."""

    def prefixes(self, draws: Draws) -> Prefixes:
        """The documents."""
        return Prefixes.draw(draws, self.documents, self.document_len, self.zipf_s)

    def sample(self, draws: Draws, prefixes: Prefixes, n: int) -> PrefixRequests:
        """``n`` requests: document, question length, output tokens."""
        return _prefix_requests(draws, prefixes, n, self.question_len, self.output_tokens)


@dataclass(frozen=True)
class TenantRequests:
    """``n`` requests of :class:`MultiTenantConfig`, as columns (tenant, app prompt,
    question tokens, output tokens)."""

    tenant: list[int]
    prompt: list[int]
    question_tokens: list[int]
    output_tokens: list[int]


@dataclass(frozen=True)
class MultiTenantConfig:
    """Multi-tenant: ``tenants`` tenants (Zipf traffic, tenant 0 the busiest) run the
    same ``groups`` app prompts (the same tokens for every tenant, one picked
    uniformly per request), each under its own ``cache_salt`` (:func:`tenant_salt`):
    vLLM never shares blocks across salts, so hits come only from the same tenant.
    Token ids on both sides."""

    tenants: int = 4
    """Tenants (one ``cache_salt`` each)."""
    zipf_s: float = 0.8
    """Zipf exponent of tenant traffic."""
    groups: int = 4
    """App prompts, shared by all tenants."""
    system_tokens: Length = 768
    """Tokens of each app prompt (drawn once per prompt)."""
    question_tokens: Length = (16, 64)
    """Fresh tokens after the app prompt."""
    output_tokens: Length = 16
    """Tokens generated per request."""

    def max_prompt_tokens(self) -> int:
        return longest(self.system_tokens) + longest(self.question_tokens)

    def prompt_lengths(self, draws: Draws) -> list[int]:
        """The app prompts' lengths."""
        return draw_length(draws, self.system_tokens, self.groups)

    def sample(self, draws: Draws, n: int) -> TenantRequests:
        """``n`` requests; draw order: tenants, app prompts, question lengths, output lengths."""
        tenant = draws.choice(self.tenants, n, zipf_weights(self.tenants, self.zipf_s))
        prompt = draws.integers(0, self.groups, size=n)
        return TenantRequests(tenant, prompt, draw_length(draws, self.question_tokens, n),
                              draw_length(draws, self.output_tokens, n))


# ----------------------------------------------------------------------------- presets


@dataclass(frozen=True)
class Preset:
    """One parameter set of every shape, sized for one cluster."""

    shared_prefix: SharedPrefixConfig
    multi_turn: MultiTurnConfig
    rag: RagConfig
    multi_tenant: MultiTenantConfig


CPU_TINY = Preset(SharedPrefixConfig(), MultiTurnConfig(), RagConfig(), MultiTenantConfig())
"""Locust's defaults (the dataclass defaults): 2 CPU replicas of the tiny Qwen2 model
(``serve_config.yaml``: 2,048 blocks x 32 tokens each, 4,096-token context)."""

RTX4090_X8 = Preset(
    shared_prefix=SharedPrefixConfig(groups=40, system_tokens=(1500, 6000), question_tokens=(100, 600), zipf_s=1.1,
                                     output_tokens=(50, 400)),
    multi_turn=MultiTurnConfig(system_prompts=8, system_len=(800, 2000), zipf_s=1.0, turns=(2, 12),
                               first_user_len=(200, 1500), user_len=(30, 400), output_tokens=(100, 500)),
    rag=RagConfig(documents=400, zipf_s=1.0, instruction_len=300, document_len=(2000, 8000), question_len=(20, 200),
                  output_tokens=(50, 300)),
    multi_tenant=MultiTenantConfig(tenants=16, zipf_s=1.0, groups=3, system_tokens=(1500, 5000),
                                   question_tokens=(100, 600), output_tokens=(50, 400)),
)
"""The simulator's defaults: 8 RTX 4090 replicas of Qwen2.5-7B (``bench/sim/latency.py``
presets), lengths in tokens; ``docs/benchmarks.md`` reports them."""


# ---------------------------------------------------------------------------- Mooncake

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens one Mooncake ``hash_id`` stands for in the original trace."""


@dataclass(frozen=True)
class MooncakeRecord:
    """One request of a Mooncake-format trace.

    Attributes:
        timestamp_ms: arrival, milliseconds from the start of the trace.
        input_length: prompt tokens.
        output_length: completion tokens (0 in some rows; see :attr:`output_tokens`).
        hash_ids: one id per ``MOONCAKE_BLOCK_TOKENS``-token block of the prompt;
            equal ids at equal positions are a shared prefix.
        line: the row's line in its file (1-based; 0 when not read from a file).
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int = 0

    @property
    def output_tokens(self) -> int:
        """Tokens to generate: ``output_length``, at least 1 (vLLM's ``max_tokens`` >= 1)."""
        return max(1, self.output_length)

    def segments(self, tokens_per_hash_id: int = MOONCAKE_BLOCK_TOKENS,
                 block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> tuple[tuple[int, int], ...]:
        """The prompt as ``(hash id, tokens)`` pairs, ``tokens_per_hash_id`` tokens a hash id.

        The prompt has ``ceil(input_length * tokens_per_hash_id / block_tokens)``
        tokens (the row's length at that scale): every hash id but the last gives
        ``tokens_per_hash_id``, the last the rest. ``tokens_per_hash_id`` below the
        trace's ``block_tokens`` scales a prompt down while keeping its blocks.
        """
        n = -(-self.input_length * tokens_per_hash_id // block_tokens)
        full = len(self.hash_ids) - 1
        return (*((h, tokens_per_hash_id) for h in self.hash_ids[:full]),
                (self.hash_ids[full], n - full * tokens_per_hash_id))


def read_mooncake(path: str | os.PathLike, *, limit: int | None = None,
                  block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[MooncakeRecord]:
    """The records of a Mooncake JSON-lines trace, in file order.

    One JSON object a line: ``{"timestamp": 0, "input_length": 40160,
    "output_length": 6, "hash_ids": [0, 1, ...]}``; blank lines are skipped.

    Args:
        path: the ``.jsonl`` file.
        limit: keep the first ``limit`` records.
        block_tokens: tokens per hash id in the file (512 in the Mooncake release).

    Raises:
        ValueError: a line that is not a trace record, or whose ``hash_ids`` do not
            cover ``input_length`` (one per ``block_tokens``, the last partial).
    """
    records: list[MooncakeRecord] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(records) >= limit:
                break
            try:
                row = json.loads(line)
                rec = MooncakeRecord(float(row["timestamp"]), int(row["input_length"]), int(row["output_length"]),
                                     tuple(int(h) for h in row["hash_ids"]), line_no)
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace record: {exc}") from exc
            if rec.input_length <= 0 or len(rec.hash_ids) != -(-rec.input_length // block_tokens):
                raise ValueError(f"{path}:{line_no}: {len(rec.hash_ids)} hash_ids do not cover input_length "
                                 f"{rec.input_length} at {block_tokens} tokens per id")
            records.append(rec)
    return records
