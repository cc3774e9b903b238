"""Multi-turn chat: every simulated user keeps and grows its own conversation.

Models chat users: each Locust user holds one conversation (a shared system
prompt, then its own questions and the model's answers, appended turn by turn,
as a chat client does) and sends the whole history with every new question on
``POST /v1/chat/completions``. A conversation ends after ``--chat-turns`` turns
or when the next turn might not fit the context; then the user starts a new one.
Each turn's prefix is the previous turn's prompt plus its answer, so a router
that keeps a conversation on one replica serves most of it from cache.

    locust -f locustfiles/multi_turn.py --headless -u 8 -r 4 -t 60s --host http://127.0.0.1:8000

Options (env): --chat-system-words (CHAT_SYSTEM_WORDS, 120), --chat-user-words
(CHAT_USER_WORDS, "12-40"), --chat-turns (CHAT_TURNS, "3-8"), plus the common ones
(``--think-time`` is the user's pause between turns).
"""

from __future__ import annotations

from locust import events, task

try:
    from locustfiles._common import LLMUser, option, shared_workload, workload_module
except ImportError:  # this folder copied alone
    from _common import LLMUser, option, shared_workload, workload_module  # type: ignore[no-redef]

W = workload_module()
_DEFAULT = W.MultiTurnConfig()


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--chat-system-words", env_var="CHAT_SYSTEM_WORDS", type=int, default=_DEFAULT.system_words,
                        help="words of the shared system prompt")
    parser.add_argument("--chat-user-words", env_var="CHAT_USER_WORDS", default="12-40",
                        help="words of each user message, LOW-HIGH")
    parser.add_argument("--chat-turns", env_var="CHAT_TURNS", default="3-8",
                        help="turns of a conversation, LOW-HIGH")


def workload(environment):
    cfg = W.MultiTurnConfig(
        system_words=int(option(environment, "chat_system_words", _DEFAULT.system_words)),
        user_words=W.parse_range(option(environment, "chat_user_words", "12-40")),
        turns=W.parse_range(option(environment, "chat_turns", "3-8")),
        max_tokens=_DEFAULT.max_tokens,
    )
    return shared_workload(environment, W.MultiTurn, cfg)


class MultiTurnUser(LLMUser):
    workload_name = "multi_turn"

    def on_start(self) -> None:
        super().on_start()
        self.workload = workload(self.environment)
        self.conversation = None

    @task
    def turn(self) -> None:
        info = self.server()
        if info is None:
            return
        if self.conversation is None or self.conversation.finished():
            self.conversation = self.workload.new_conversation(
                self.rng, info.max_model_len, self.max_tokens(self.workload.cfg.max_tokens))
        conv = self.conversation
        res = self.send(conv.next_request(), override_max_tokens=False)
        if res is not None and res.ok:
            conv.record_reply(res.text, res.prompt_tokens, res.completion_tokens)
        else:
            conv.abandon_turn()
            self.conversation = None  # start over after a failure
