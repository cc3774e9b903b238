"""Locust's side of the workloads: options, and the shapes of ``shapes.py`` as HTTP requests.

The workload *shapes* (their parameters, how requests share prefixes, the
Mooncake reader) are written once, in ``locustfiles/shapes.py``, for Locust and
the simulator (``bench/sim/generators.py``). This module turns them into OpenAI
requests: pure, seeded, free of Locust and of I/O beyond the trace file. Every
request is a deterministic function of a seed and a caller-owned
``random.Random`` (one per simulated user), so a run with the same seed sends the
same prompts in the same per-user order whatever router serves them. The Locust
users in this folder only turn these requests into HTTP calls.

Workloads (what each models; the shape's docstring has its parameters):

* :class:`SharedPrefix` (``shapes.SharedPrefixConfig``) -- an app with a few long
  system prompts (``groups``) whose popularity is skewed (Zipf); every request is
  one system prompt plus a short fresh question. Token-id prompts on ``/v1/completions``.
* :class:`MultiTurn` (``shapes.MultiTurnConfig``) -- chat users, each keeping and
  growing its own history (its own questions and the model's answers) on
  ``/v1/chat/completions``.
* :class:`Rag` (``shapes.RagConfig``) -- long documents, each asked many different
  questions; the document is the shared prefix. Text on ``/v1/chat/completions``.
* :class:`MultiTenant` (``shapes.MultiTenantConfig``) -- tenants that send the same
  app prompts but must never share cache: one ``cache_salt`` per tenant. Token ids
  on ``/v1/completions``.
* :class:`MooncakeSynth` + :class:`TraceSchedule` -- replay of a Mooncake-format
  trace (``shapes.read_mooncake``): token ids synthesized per hash id, arrivals by
  timestamp.

Lengths of the text workloads (chat, RAG) are words here (``*_len`` fields);
token-id prompts draw their ids from ``[10, 1000)`` by default: valid in the tiny
default model's ~1k vocabulary and ordinary (non-special) tokens in any large
vocabulary.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    from locustfiles import shapes
except ImportError:  # this folder copied alone to a load-generator host
    import shapes  # type: ignore[no-redef, import-not-found]

# The shapes' configs, as the configs of the workloads below (``SharedPrefix.config_class``, ...).
SharedPrefixConfig = shapes.SharedPrefixConfig
MultiTurnConfig = shapes.MultiTurnConfig
RagConfig = shapes.RagConfig
MultiTenantConfig = shapes.MultiTenantConfig

DEFAULT_TOKEN_RANGE: tuple[int, int] = (10, 1000)
"""Token ids of synthesized prompts, ``[low, high)``."""

# Common English words that the tiny default model's tokenizer encodes in one or
# two tokens (about 1.4 tokens a word there, about 1.3 with large vocabularies),
# so text sizes given in words stay predictable.
WORDS: tuple[str, ...] = (
    "about", "across", "again", "against", "an", "and", "another", "answer", "are", "as", "assistant",
    "at", "attention", "bake", "balance", "batching", "be", "becomes", "begins", "below", "block",
    "blocks", "borrowed", "bound", "break", "brown", "by", "cache", "caching", "can", "capital",
    "carries", "chat", "clock", "closes", "cloudy", "cluster", "compute", "count", "cup", "cut", "days",
    "decides", "decode", "degrees", "do", "document", "dog", "done", "drawn", "drifts", "drops", "each",
    "end", "engine", "every", "fail", "feel", "few", "finds", "first", "fixed", "fleet", "flour", "fold",
    "follows", "for", "forever", "fox", "from", "front", "full", "goes", "gull", "has", "hash", "hello",
    "high", "history", "hit", "holds", "hour", "how", "idle", "if", "in", "input", "instead", "into",
    "is", "it", "its", "jumps", "keeping", "keeps", "keys", "knead", "know", "large", "latency",
    "layers", "lazy", "leap", "lengths", "library", "light", "load", "long", "lost", "many", "means",
    "memory", "message", "minutes", "mix", "model", "morning", "name", "never", "new", "next", "nine",
    "noon", "not", "notices", "number", "numbers", "of", "on", "once", "one", "opens", "or", "others",
    "over", "part", "partial", "passes", "per", "phase", "pinch", "predicts", "prefill", "prefix",
    "print", "process", "produced", "prompt", "question", "queue", "quick", "range", "rate", "reader",
    "reading", "reads", "records", "renewed", "replica", "report", "request", "requests", "reserved",
    "rest", "retries", "return", "robust", "role", "router", "routing", "runs", "safe", "salt", "same",
    "say", "sea", "second", "seconds", "sends", "sentences", "served", "serving", "shared", "sit", "six",
    "skips", "so", "span", "splits", "start", "status", "step", "stream", "such", "symbols", "system",
    "ten", "that", "the", "them", "then", "thirty", "this", "three", "through", "tide", "time", "to",
    "together", "token", "tokens", "trace", "true", "tune", "turns", "twice", "two", "unless", "use",
    "user", "users", "values", "village", "voices", "waits", "water", "waves", "ways", "weeks",
    "weights", "west", "what", "when", "where", "whole", "wind", "with", "work", "write", "written",
    "year", "you",
)

TOKENS_PER_WORD_BOUND = 2.0
"""Upper bound of tokens per word of :func:`words` text, used for context budgets."""


# ----------------------------------------------------------------------------- helpers


def make_rng(seed: int, *parts: Any) -> random.Random:
    """A ``Random`` seeded by ``seed`` and ``parts`` (stable across processes and runs)."""
    return random.Random(":".join(str(p) for p in (seed, *parts)))


def token_ids(rng: random.Random, n: int, token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> list[int]:
    """``n`` token ids drawn uniformly from ``[low, high)``."""
    lo, hi = token_range
    return rng.choices(range(lo, hi), k=n)


def words(rng: random.Random, n: int) -> str:
    """``n`` words of text, in sentences of 6 to 14 words."""
    out: list[str] = []
    left = n
    while left > 0:
        k = min(left, rng.randint(6, 14))
        sentence = [rng.choice(WORDS) for _ in range(k)]
        sentence[0] = sentence[0].capitalize()
        out.append(" ".join(sentence) + ".")
        left -= k
    return " ".join(out)


def parse_range(value: str | int | Sequence[int]) -> tuple[int, int]:
    """``"16-64"`` -> ``(16, 64)``; ``"32"`` or ``32`` -> ``(32, 32)``."""
    if isinstance(value, int):
        lo = hi = value
    elif isinstance(value, str):
        parts = value.replace(":", "-").split("-")
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError(f"not a range: {value!r} (use LOW-HIGH)")
    else:
        lo, hi = (int(v) for v in value)
    if lo < 0 or hi < lo:
        raise ValueError(f"bad range {lo}-{hi}")
    return lo, hi


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(value: Any) -> bool:
    """``True``/``False``, or a string among ``1 true yes on`` / ``0 false no off`` (any case).

    Raises:
        ValueError: any other value.
    """
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"not a boolean: {value!r}")


# ----------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Option:
    """One option of the locustfiles, written once: its flag, environment variable, default, help.

    The locustfiles add it to Locust's command line (``locustfiles._common.register_options``),
    read it back parsed (``_common.option``) and list it in their docstrings
    (:func:`options_doc`); the A/B harness (``bench.ab``) finds flags here too.

    Attributes:
        flag: the command-line flag, e.g. ``"--sp-groups"``; Locust's attribute is :attr:`dest`.
        env_var: the environment variable that sets it.
        default: its value when not given; its type is the option's (``bool``, ``int``,
            ``float``, ``str``, or a ``(low, high)`` tuple given as ``LOW-HIGH``).
        help: one line for ``--help``.
        field: the workload config's field it sets (None for options read directly).
        secret: Locust hides the value (``is_secret``).
        web_ui: Locust shows it in its web UI (``include_in_web_ui``).
    """

    flag: str
    env_var: str
    default: Any
    help: str
    field: str | None = None
    secret: bool = False
    web_ui: bool = True

    @property
    def dest(self) -> str:
        """Locust's attribute name of the parsed value: ``"--sp-groups"`` -> ``"sp_groups"``."""
        return self.flag.lstrip("-").replace("-", "_")

    def parse(self, value: Any) -> Any:
        """``value`` (a string from the command line or environment, or already parsed) as
        the default's type. Raises ``ValueError`` on a bad value."""
        d = self.default
        if isinstance(d, bool):
            return parse_bool(value)
        if isinstance(d, tuple):
            return parse_range(value)
        if isinstance(d, int):
            return int(value)
        if isinstance(d, float):
            return float(value)
        return str(value)

    def text_default(self) -> str:
        """The default as written on a command line (``16-64``, ``true``, ``300.0``)."""
        d = self.default
        if isinstance(d, bool):
            return str(d).lower()
        if isinstance(d, tuple):
            return f"{d[0]}-{d[1]}"
        return str(d)


def config_options(config: Any, *specs: tuple[str, str, str, str]) -> tuple[Option, ...]:
    """The options of a workload config: ``(flag, env_var, field, help)`` each, the
    default being ``config``'s value of ``field`` (so it is written only in the config)."""
    return tuple(Option(flag, env, getattr(config, name), help, field=name) for flag, env, name, help in specs)


def by_field(options: Sequence[Option], name: str) -> Option:
    """The option of ``options`` that sets config field ``name``; ``KeyError`` if none does."""
    for o in options:
        if o.field == name:
            return o
    raise KeyError(name)


def options_doc(options: Sequence[Option], title: str = "Options") -> str:
    """A reST list of ``options`` for a module docstring: flag, environment variable, default, help."""
    lines = [f"\n\n{title} (command line, ``locust.conf``, or environment):\n"]
    for o in options:
        lines.append(f"* ``{o.flag}`` (``{o.env_var}``, default {o.text_default() or 'empty'}): {o.help}.")
    return "\n".join(lines) + "\n"


COMMON_OPTIONS: tuple[Option, ...] = (
    Option("--model", "LOCUST_MODEL", "", "model name to request (empty: the first of GET /v1/models)"),
    Option("--api-key", "OPENAI_API_KEY", "", "bearer token sent as 'Authorization: Bearer ...' (optional)",
           secret=True),
    Option("--seed", "LOCUST_SEED", 0, "seed of the prompt generators (same seed, same prompts)"),
    Option("--max-tokens", "LOCUST_MAX_TOKENS", 0, "completion tokens per request (0: the workload's default)"),
    Option("--ignore-eos", "LOCUST_IGNORE_EOS", True, "generate exactly max_tokens (vLLM's ignore_eos)"),
    Option("--max-model-len", "LOCUST_MAX_MODEL_LEN", 0,
           "context length of the model (0: from GET /v1/models, else unbounded)"),
    Option("--request-timeout", "LOCUST_REQUEST_TIMEOUT", 300.0, "seconds a request may take"),
    Option("--think-time", "LOCUST_THINK_TIME", 0.0,
           "mean seconds a user waits between its requests, exponentially distributed (0: back to back, "
           "a closed loop)"),
    Option("--samples-file", "LOCUST_SAMPLES_FILE", "", "append one JSON line per request to this file",
           web_ui=False),
)
"""Options of every locustfile (``locustfiles/_common.py``)."""

COMMON: dict[str, Option] = {o.dest: o for o in COMMON_OPTIONS}
""":data:`COMMON_OPTIONS` by :attr:`Option.dest` (``COMMON["seed"].env_var == "LOCUST_SEED"``)."""


@dataclass
class LLMRequest:
    """One request to send: an OpenAI route and its body (without ``model``/``stream``).

    ``tag`` names what the request shares (group, document, tenant, trace row) for
    per-request sample files.
    """

    route: str
    body: dict[str, Any]
    tag: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


# ------------------------------------------------------------------- shared system prompts


class SharedPrefix:
    """Shared system prompts (``shapes.SharedPrefixConfig``) as token-id completions."""

    name = "shared_prefix"
    config_class = SharedPrefixConfig
    options = config_options(
        SharedPrefixConfig(),
        ("--sp-groups", "SP_GROUPS", "groups", "shared system prompts (groups)"),
        ("--sp-system-tokens", "SP_SYSTEM_TOKENS", "system_tokens", "tokens of each system prompt"),
        ("--sp-question-tokens", "SP_QUESTION_TOKENS", "question_tokens",
         "fresh tokens after the system prompt, LOW-HIGH"),
        ("--sp-zipf", "SP_ZIPF", "zipf_s", "Zipf exponent of group popularity (0 = uniform)"),
    )

    def __init__(self, cfg: SharedPrefixConfig = shapes.CPU_TINY.shared_prefix, seed: int = 0):
        self.cfg = cfg
        self.prefixes = cfg.prefixes(shapes.PyDraws(make_rng(seed, "shared_prefix", "prefixes")))
        self.systems = [token_ids(make_rng(seed, "shared_prefix", "system", g), n)
                        for g, n in enumerate(self.prefixes.lengths)]

    def sample(self, rng: random.Random) -> LLMRequest:
        drawn = self.cfg.sample(shapes.PyDraws(rng), self.prefixes, 1)
        g = drawn.prefix[0]
        prompt = self.systems[g] + token_ids(rng, drawn.fresh[0])
        return LLMRequest(COMPLETIONS, {"prompt": prompt, "max_tokens": drawn.output_tokens[0]},
                          tag=f"group-{g}", meta={"group": g})


def ids_as_text(ids: Sequence[int]) -> str:
    """Token ids as text, a word of ``WORDS`` per id (``WORDS[t % len(WORDS)]``), joined by spaces:
    two id lists that share a prefix give texts that share a prefix of whole words."""
    return " ".join(WORDS[t % len(WORDS)] for t in ids)


class SharedPrefixText(SharedPrefix):
    """:class:`SharedPrefix` with text prompts: each token id ``t`` of a prompt becomes the word
    ``WORDS[t % len(WORDS)]``, words joined by spaces, so two prompts that share a token-id prefix
    share a text prefix, and after tokenization a token prefix (a word never spans two). For
    routers that match text (Ray's ``PrefixCacheAffinityRouter`` reads a prompt's text and sees
    nothing in token ids). A word is about 1.4 tokens on the tiny default model (one on a large
    vocabulary), so a system prompt of ``system_tokens`` words is longer in tokens than its
    token-id form; usage reports the tokens."""

    name = "shared_prefix_text"

    def sample(self, rng: random.Random) -> LLMRequest:
        req = super().sample(rng)
        req.body["prompt"] = ids_as_text(req.body["prompt"])
        return req


SHARED_PREFIX_TEXT = Option("--sp-text", "SP_TEXT", False,
                            "send each prompt as text, a word per token id (SharedPrefixText), not token ids; "
                            "--sp-system-tokens and --sp-question-tokens then count words")
"""The option of ``locustfiles/shared_prefix.py`` that picks :class:`SharedPrefixText`."""


# --------------------------------------------------------------------------- multi-turn chat


CHAT_SYSTEM_PREAMBLE = "You are a helpful assistant of the prefix-serve load test. "


class MultiTurn:
    """Chat users that keep and grow their own history (``shapes.MultiTurnConfig``; see module doc)."""

    name = "multi_turn"
    config_class = MultiTurnConfig
    options = config_options(
        MultiTurnConfig(),
        ("--chat-system-words", "CHAT_SYSTEM_WORDS", "system_len", "words of the shared system prompt"),
        ("--chat-user-words", "CHAT_USER_WORDS", "user_len", "words of each user message, LOW-HIGH"),
        ("--chat-turns", "CHAT_TURNS", "turns", "turns of a conversation, LOW-HIGH"),
    )

    def __init__(self, cfg: MultiTurnConfig = shapes.CPU_TINY.multi_turn, seed: int = 0):
        self.cfg = cfg
        lengths = cfg.system_lengths(shapes.PyDraws(make_rng(seed, "multi_turn", "lengths")))
        self.systems = [CHAT_SYSTEM_PREAMBLE + words(make_rng(seed, "multi_turn", "system", i), n)
                        for i, n in enumerate(lengths)]

    def new_conversation(self, rng: random.Random, max_model_len: int | None = None,
                         max_tokens: int | None = None) -> Conversation:
        """A new conversation; ``max_model_len`` bounds its growth (``None``: turns only);
        ``max_tokens`` replaces the shape's ``output_tokens`` (``None``: the shape's)."""
        system, turns = self.cfg.session(shapes.PyDraws(rng))
        return Conversation(self, rng, system, turns, max_model_len, max_tokens)


class Conversation:
    """One simulated user's chat: the history it sends and grows turn by turn."""

    def __init__(self, workload: MultiTurn, rng: random.Random, system: int, turns: int,
                 max_model_len: int | None, max_tokens: int | None):
        self.workload = workload
        self.rng = rng
        self.system = system
        self.turns_left = turns
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        self.messages: list[dict[str, str]] = [{"role": "system", "content": workload.systems[system]}]
        self.turn = 0
        self.last_prompt_tokens: int | None = None
        self.last_max_tokens = 0
        self.last_reply_tokens = 0
        self.conversation_id = rng.getrandbits(32)

    def next_request(self) -> LLMRequest:
        """The next user turn: history plus a new question (appended to the history)."""
        user_len, output_tokens = self.workload.cfg.turn(shapes.PyDraws(self.rng), self.turn)
        self.messages.append({"role": "user", "content": words(self.rng, user_len)})
        self.turn += 1
        self.turns_left -= 1
        self.last_max_tokens = self.max_tokens or output_tokens
        return LLMRequest(CHAT, {"messages": [dict(m) for m in self.messages], "max_tokens": self.last_max_tokens},
                          tag=f"conv-{self.conversation_id:08x}-turn-{self.turn}",
                          meta={"turn": self.turn, "system": self.system})

    def record_reply(self, text: str, prompt_tokens: int | None = None, completion_tokens: int | None = None) -> None:
        """Append the assistant's answer to the history (what a chat client does)."""
        self.messages.append({"role": "assistant", "content": text})
        if prompt_tokens is not None:
            self.last_prompt_tokens = prompt_tokens
        self.last_reply_tokens = completion_tokens or self.last_max_tokens

    def abandon_turn(self) -> None:
        """Drop the last user message (its request failed), so the history stays alternating."""
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()

    def max_output_tokens(self) -> int:
        """The most tokens a turn may generate."""
        return self.max_tokens or shapes.longest(self.workload.cfg.output_tokens)

    def estimated_next_prompt_tokens(self) -> int:
        """An upper estimate of the next turn's prompt tokens."""
        user_words = shapes.longest(self.workload.cfg.user_length(self.turn))
        growth = self.last_reply_tokens + int(user_words * TOKENS_PER_WORD_BOUND) + 16
        if self.last_prompt_tokens is not None:
            return self.last_prompt_tokens + growth
        chars = sum(len(m["content"]) for m in self.messages)
        return int(chars / 3) + 8 * len(self.messages) + growth

    def finished(self) -> bool:
        """No turns left, or the next turn might not fit the context."""
        if self.turns_left <= 0:
            return True
        if self.max_model_len is not None:
            return self.estimated_next_prompt_tokens() + self.max_output_tokens() > self.max_model_len
        return False


# ------------------------------------------------------------------------------------ RAG


RAG_SYSTEM = "Answer the question with the document below. Quote the document where you can."
"""The instruction of every RAG request (13 words; ``RagConfig.instruction_len`` longer adds words)."""


class Rag:
    """Long documents x many questions (``shapes.RagConfig``): the document is the shared prefix."""

    name = "rag"
    config_class = RagConfig
    options = config_options(
        RagConfig(),
        ("--rag-documents", "RAG_DOCUMENTS", "documents", "documents in the corpus"),
        ("--rag-document-words", "RAG_DOCUMENT_WORDS", "document_len",
         "words of each document (400: about 560 tokens on the tiny model, 520 on large vocabularies)"),
        ("--rag-question-words", "RAG_QUESTION_WORDS", "question_len", "words of each question, LOW-HIGH"),
        ("--rag-zipf", "RAG_ZIPF", "zipf_s", "Zipf exponent of document popularity (0 = uniform)"),
    )

    def __init__(self, cfg: RagConfig = shapes.CPU_TINY.rag, seed: int = 0):
        self.cfg = cfg
        extra = cfg.instruction_len - len(RAG_SYSTEM.split())
        self.instruction = RAG_SYSTEM + (" " + words(make_rng(seed, "rag", "instruction"), extra) if extra > 0 else "")
        self.prefixes = cfg.prefixes(shapes.PyDraws(make_rng(seed, "rag", "prefixes")))
        self.documents = [f"Document {d}. " + words(make_rng(seed, "rag", "doc", d), n)
                          for d, n in enumerate(self.prefixes.lengths)]

    def sample(self, rng: random.Random) -> LLMRequest:
        drawn = self.cfg.sample(shapes.PyDraws(rng), self.prefixes, 1)
        d = drawn.prefix[0]
        question = words(rng, drawn.fresh[0]).rstrip(".") + "?"
        messages = [
            {"role": "system", "content": self.instruction},
            {"role": "user", "content": f"{self.documents[d]}\n\nQuestion: {question}"},
        ]
        return LLMRequest(CHAT, {"messages": messages, "max_tokens": drawn.output_tokens[0]}, tag=f"doc-{d}",
                          meta={"doc": d})


# ---------------------------------------------------------------------------- multi-tenant


class MultiTenant:
    """Tenants sending the same app prompts, isolated by a ``cache_salt`` each (``shapes.MultiTenantConfig``)."""

    name = "multi_tenant"
    config_class = MultiTenantConfig
    options = config_options(
        MultiTenantConfig(),
        ("--tenants", "TENANTS", "tenants", "tenants (one cache_salt each)"),
        ("--tenant-zipf", "TENANT_ZIPF", "zipf_s", "Zipf exponent of tenant popularity (0 = uniform)"),
        ("--tenant-groups", "TENANT_GROUPS", "groups", "app prompts shared by all tenants"),
        ("--tenant-prompt-tokens", "TENANT_PROMPT_TOKENS", "system_tokens", "tokens of each app prompt"),
        ("--tenant-question-tokens", "TENANT_QUESTION_TOKENS", "question_tokens",
         "fresh tokens after the app prompt, LOW-HIGH"),
    )

    def __init__(self, cfg: MultiTenantConfig = shapes.CPU_TINY.multi_tenant, seed: int = 0):
        self.cfg = cfg
        lengths = cfg.prompt_lengths(shapes.PyDraws(make_rng(seed, "multi_tenant", "lengths")))
        self.prompts = [token_ids(make_rng(seed, "multi_tenant", "prompt", g), n) for g, n in enumerate(lengths)]

    def sample(self, rng: random.Random) -> LLMRequest:
        drawn = self.cfg.sample(shapes.PyDraws(rng), 1)
        t, g = drawn.tenant[0], drawn.prompt[0]
        question = token_ids(rng, drawn.question_tokens[0])
        body = {"prompt": self.prompts[g] + question, "max_tokens": drawn.output_tokens[0],
                "cache_salt": shapes.tenant_salt(t)}
        return LLMRequest(COMPLETIONS, body, tag=f"{shapes.tenant_salt(t)}-prompt-{g}", meta={"tenant": t, "group": g})


# ------------------------------------------------------------------------- Mooncake replay


class MooncakeSynth:
    """Token ids for trace records: each hash id always gives the same ``tokens_per_hash_id`` tokens.

    ``tokens_per_hash_id`` is 512 in the original trace (faithful default); smaller
    values scale every prompt down by ``tokens_per_hash_id / 512`` (e.g. 32 on the tiny
    CPU model: one hash id per 32-token KV block) while keeping its block structure
    (``shapes.MooncakeRecord.segments``).
    """

    def __init__(self, seed: int = 0, tokens_per_hash_id: int = shapes.MOONCAKE_BLOCK_TOKENS,
                 token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE, cache_blocks: int = 1024):
        if tokens_per_hash_id < 1:
            raise ValueError("tokens_per_hash_id must be >= 1")
        self.seed = seed
        self.tokens_per_hash_id = tokens_per_hash_id
        self.token_range = token_range
        self._cache: OrderedDict[int, list[int]] = OrderedDict()
        self._cache_blocks = cache_blocks

    def block(self, hash_id: int) -> list[int]:
        """The tokens of one hash id (a pure function of seed, hash id and size)."""
        toks = self._cache.get(hash_id)
        if toks is None:
            toks = token_ids(make_rng(self.seed, "mooncake", self.tokens_per_hash_id, hash_id),
                             self.tokens_per_hash_id, self.token_range)
            self._cache[hash_id] = toks
            if len(self._cache) > self._cache_blocks:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(hash_id)
        return toks

    def prompt_length(self, record: shapes.MooncakeRecord) -> int:
        """The record's input length scaled to ``tokens_per_hash_id`` (the last block cut)."""
        return sum(n for _, n in record.segments(self.tokens_per_hash_id))

    def prompt(self, record: shapes.MooncakeRecord, max_prompt_tokens: int | None = None) -> list[int]:
        """The record's prompt, truncated to ``max_prompt_tokens`` (keeps the leading blocks)."""
        limit = None if max_prompt_tokens is None else max(1, max_prompt_tokens)
        out: list[int] = []
        for h, n in record.segments(self.tokens_per_hash_id):
            if limit is not None and len(out) >= limit:
                break
            out.extend(self.block(h)[:n])
        return out[:limit]

    def request(self, record: shapes.MooncakeRecord, max_model_len: int | None = None,
                max_output_tokens: int | None = None, row: int | None = None) -> LLMRequest:
        """The record as a completions request that fits ``max_model_len`` (prompt + output)."""
        out = record.output_tokens
        if max_output_tokens:
            out = min(out, max_output_tokens)
        limit = None
        if max_model_len is not None:
            out = min(out, max(1, max_model_len // 4))
            limit = max_model_len - out
        prompt = self.prompt(record, limit)
        return LLMRequest(COMPLETIONS, {"prompt": prompt, "max_tokens": out},
                          tag=f"row-{row}" if row is not None else "", meta={"row": row})


DEFAULT_TRACE = str(Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.head800.jsonl")
"""The 800-row head of the Mooncake synthetic trace (``locustfiles/data/``)."""


@dataclass(frozen=True)
class ReplayConfig:
    """How ``locustfiles/mooncake.py`` replays a trace (see :class:`MooncakeSynth`, :class:`TraceSchedule`)."""

    trace_file: str = DEFAULT_TRACE
    tokens_per_hash_id: int = shapes.MOONCAKE_BLOCK_TOKENS
    time_scale: float = 1.0
    start_row: int = 0
    loop: bool = True

    def records(self) -> list[shapes.MooncakeRecord]:
        """The trace's records (``shapes.read_mooncake``; :data:`DEFAULT_TRACE` when ``trace_file`` is empty)."""
        return shapes.read_mooncake(self.trace_file or DEFAULT_TRACE)


REPLAY_OPTIONS = config_options(
    ReplayConfig(),
    ("--trace-file", "MOONCAKE_TRACE", "trace_file", "Mooncake-format JSON-lines trace"),
    ("--trace-tokens-per-hash-id", "TRACE_TOKENS_PER_HASH_ID", "tokens_per_hash_id",
     "tokens synthesized per hash id (512 = faithful)"),
    ("--trace-time-scale", "TRACE_TIME_SCALE", "time_scale", "multiplies every arrival time (0.5 = twice as fast)"),
    ("--trace-start-row", "TRACE_START_ROW", "start_row", "first row to replay"),
    ("--trace-loop", "TRACE_LOOP", "loop", "start over after the last row (else users stop)"),
)
"""Options of ``locustfiles/mooncake.py``."""


class TraceSchedule:
    """Arrival times of a trace, shared by all users of a process.

    ``next()`` hands out records in timestamp order (rows are indices in that
    order) with their send time in seconds from the start of the replay:
    ``timestamp_ms / 1000 * time_scale`` (0.5 replays twice as fast). With
    ``loop`` the trace starts over after its last row.
    """

    def __init__(self, records: Sequence[shapes.MooncakeRecord], time_scale: float = 1.0, loop: bool = True,
                 start_row: int = 0):
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if not records:
            raise ValueError("the trace has no rows")
        self.entries = sorted(records, key=lambda r: r.timestamp_ms)
        self.time_scale = time_scale
        self.loop = loop
        self._next = 0
        t0 = self.entries[0].timestamp_ms
        self._offsets_ms = [e.timestamp_ms - t0 for e in self.entries]
        gaps = [b - a for a, b in zip(self._offsets_ms, self._offsets_ms[1:], strict=False)]
        mean_gap = (sum(gaps) / len(gaps)) if gaps else 1000.0
        self.lap_ms = self._offsets_ms[-1] + mean_gap
        self._start_row = start_row % len(self.entries)
        self._shift_ms = self._offsets_ms[self._start_row]

    def next(self) -> tuple[int, float, shapes.MooncakeRecord] | None:
        """``(row, send_at_s, record)``; ``None`` when the trace is over and not looping."""
        k = self._next + self._start_row
        lap, row = divmod(k, len(self.entries))
        if lap and not self.loop:
            return None
        self._next += 1
        at_ms = lap * self.lap_ms + self._offsets_ms[row] - self._shift_ms
        return row, at_ms / 1000.0 * self.time_scale, self.entries[row]
