"""RAG: long documents, each asked many different questions.

Models retrieval-augmented generation: every request carries one long retrieved
document (popularity skewed: some documents are retrieved far more often) and a
fresh question about it, as a chat turn on ``POST /v1/chat/completions``:
``[system: instructions, user: "<document>\\n\\nQuestion: <question>"]``. The
instructions + document are the shared prefix; the question is never cached.

    locust -f locustfiles/rag.py --headless -u 8 -r 4 -t 60s --host http://127.0.0.1:8000

Its options (``workloads.Rag.options``) are listed below; the common ones are in
``locustfiles/_common.py``.
"""

from __future__ import annotations

try:
    from locustfiles._common import SamplingUser, register_options, workload_module
except ImportError:  # this folder copied alone
    from _common import SamplingUser, register_options, workload_module  # type: ignore[no-redef]

W = workload_module()
register_options(W.Rag.options)
__doc__ = (__doc__ or "") + W.options_doc(W.Rag.options)


class RagUser(SamplingUser):
    workload_name = W.Rag.name
    workload_class = W.Rag
