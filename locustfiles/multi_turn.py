"""Multi-turn chat: every simulated user keeps and grows its own conversation.

Models chat users: each Locust user holds one conversation (a shared system
prompt, then its own questions and the model's answers, appended turn by turn,
as a chat client does) and sends the whole history with every new question on
``POST /v1/chat/completions``. A conversation ends after ``--chat-turns`` turns
or when the next turn might not fit the context; then the user starts a new one.
Each turn's prefix is the previous turn's prompt plus its answer, so a router
that keeps a conversation on one replica serves most of it from cache.

    locust -f locustfiles/multi_turn.py --headless -u 8 -r 4 -t 60s --host http://127.0.0.1:8000

Its options (``workloads.MultiTurn.options``) are listed below; the common ones are
in ``locustfiles/_common.py`` (``--think-time`` is the user's pause between turns).
"""

from __future__ import annotations

from locust import task

try:
    from locustfiles._common import LLMUser, register_options, workload_from_options, workload_module
except ImportError:  # this folder copied alone
    from _common import LLMUser, register_options, workload_from_options, workload_module  # type: ignore[no-redef]

W = workload_module()
register_options(W.MultiTurn.options)
__doc__ = (__doc__ or "") + W.options_doc(W.MultiTurn.options)


class MultiTurnUser(LLMUser):
    workload_name = W.MultiTurn.name

    def on_start(self) -> None:
        super().on_start()
        self.workload = workload_from_options(self.environment, W.MultiTurn)
        self.conversation = None

    @task
    def turn(self) -> None:
        info = self.server()
        if info is None:
            return
        if self.conversation is None or self.conversation.finished():
            self.conversation = self.workload.new_conversation(self.rng, info.max_model_len,
                                                               self.max_tokens(0) or None)
        conv = self.conversation
        res = self.send(conv.next_request(), override_max_tokens=False)
        if res is not None and res.ok:
            conv.record_reply(res.text, res.prompt_tokens, res.completion_tokens)
        else:
            conv.abandon_turn()
            self.conversation = None  # start over after a failure
