"""Shared system prompts: groups of long system prompts with skewed (Zipf) popularity.

Models an app (or a fleet of agents) whose requests start with one of a few long
system prompts -- a few hot, many rare -- followed by a short fresh question. A
request is ``POST /v1/completions`` with a token-id prompt: the group's system
prompt (``--sp-system-tokens``) + ``--sp-question-tokens`` fresh tokens.

    locust -f locustfiles/shared_prefix.py --headless -u 8 -r 4 -t 60s --host http://127.0.0.1:8000

Options (env): --sp-groups (SP_GROUPS, 32), --sp-system-tokens (SP_SYSTEM_TOKENS, 3072),
--sp-question-tokens (SP_QUESTION_TOKENS, "16-64"), --sp-zipf (SP_ZIPF, 1.0),
--max-tokens (default 8), plus the common ones of ``locustfiles/_common.py``. The
default working set (32 x 3,072 tokens) is 1.5 x one default CPU replica's KV cache
(65,536 tokens) and 0.75 x two replicas'. On a real cluster, size it to your
traffic or to your replicas' KV cache (vLLM logs "KV cache size: N tokens").
"""

from __future__ import annotations

from locust import events

try:
    from locustfiles._common import SamplingUser, option, shared_workload, workload_module
except ImportError:  # this folder copied alone
    from _common import SamplingUser, option, shared_workload, workload_module  # type: ignore[no-redef]

W = workload_module()
_DEFAULT = W.SharedPrefixConfig()


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--sp-groups", env_var="SP_GROUPS", type=int, default=_DEFAULT.groups,
                        help="shared system prompts (groups)")
    parser.add_argument("--sp-system-tokens", env_var="SP_SYSTEM_TOKENS", type=int, default=_DEFAULT.system_tokens,
                        help="tokens of each system prompt")
    parser.add_argument("--sp-question-tokens", env_var="SP_QUESTION_TOKENS", default="16-64",
                        help="fresh tokens after the system prompt, LOW-HIGH")
    parser.add_argument("--sp-zipf", env_var="SP_ZIPF", type=float, default=_DEFAULT.zipf_s,
                        help="Zipf exponent of group popularity (0 = uniform)")


def workload(environment):
    cfg = W.SharedPrefixConfig(
        groups=int(option(environment, "sp_groups", _DEFAULT.groups)),
        system_tokens=int(option(environment, "sp_system_tokens", _DEFAULT.system_tokens)),
        question_tokens=W.parse_range(option(environment, "sp_question_tokens", "16-64")),
        zipf_s=float(option(environment, "sp_zipf", _DEFAULT.zipf_s)),
    )
    return shared_workload(environment, W.SharedPrefix, cfg)


class SharedPrefixUser(SamplingUser):
    workload_name = "shared_prefix"

    def make_workload(self):
        return workload(self.environment)
