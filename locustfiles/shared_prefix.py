"""Shared system prompts: groups of long system prompts with skewed (Zipf) popularity.

Models an app (or a fleet of agents) whose requests start with one of a few long
system prompts -- a few hot, many rare -- followed by a short fresh question. A
request is ``POST /v1/completions`` with a token-id prompt: the group's system
prompt (``--sp-system-tokens``) + ``--sp-question-tokens`` fresh tokens; with
``--sp-text``, the same prompt as text, a word per token id (``workloads.SharedPrefixText``).

    locust -f locustfiles/shared_prefix.py --headless -u 8 -r 4 -t 60s --host http://127.0.0.1:8000

Its options (``workloads.SharedPrefix.options``) are listed below; the common ones
are in ``locustfiles/_common.py`` (``--max-tokens`` 0 keeps the workload's 8). The
default working set is sized against the default CPU replicas' KV cache
(``shapes.SharedPrefixConfig.groups``); on a real cluster, size it to your
traffic or to your replicas' KV cache (vLLM logs "KV cache size: N tokens").
"""

from __future__ import annotations

try:
    from locustfiles._common import SamplingUser, option, register_options, workload_from_options, workload_module
except ImportError:  # this folder copied alone
    from _common import (  # type: ignore[no-redef]
        SamplingUser,
        option,
        register_options,
        workload_from_options,
        workload_module,
    )

W = workload_module()
register_options((*W.SharedPrefix.options, W.SHARED_PREFIX_TEXT))
__doc__ = (__doc__ or "") + W.options_doc((*W.SharedPrefix.options, W.SHARED_PREFIX_TEXT))


class SharedPrefixUser(SamplingUser):
    workload_name = W.SharedPrefix.name
    workload_class = W.SharedPrefix

    def make_workload(self):
        """``workloads.SharedPrefix``, or its text form ``SharedPrefixText`` with ``--sp-text``."""
        if option(self.environment, W.SHARED_PREFIX_TEXT.dest):
            return workload_from_options(self.environment, W.SharedPrefixText)
        return super().make_workload()
