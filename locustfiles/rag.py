"""RAG: long documents, each asked many different questions.

Models retrieval-augmented generation: every request carries one long retrieved
document (popularity skewed: some documents are retrieved far more often) and a
fresh question about it, as a chat turn on ``POST /v1/chat/completions``:
``[system: instructions, user: "<document>\\n\\nQuestion: <question>"]``. The
instructions + document are the shared prefix; the question is never cached.

    locust -f locustfiles/rag.py --headless -u 8 -r 4 -t 60s --host http://127.0.0.1:8000

Options (env): --rag-documents (RAG_DOCUMENTS, 16), --rag-document-words
(RAG_DOCUMENT_WORDS, 400: about 560 tokens on the tiny model, 520 on large
vocabularies), --rag-question-words (RAG_QUESTION_WORDS, "8-24"), --rag-zipf
(RAG_ZIPF, 0.6), plus the common ones.
"""

from __future__ import annotations

from locust import events

try:
    from locustfiles._common import SamplingUser, option, shared_workload, workload_module
except ImportError:  # this folder copied alone
    from _common import SamplingUser, option, shared_workload, workload_module  # type: ignore[no-redef]

W = workload_module()
_DEFAULT = W.RagConfig()


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--rag-documents", env_var="RAG_DOCUMENTS", type=int, default=_DEFAULT.documents,
                        help="documents in the corpus")
    parser.add_argument("--rag-document-words", env_var="RAG_DOCUMENT_WORDS", type=int, default=_DEFAULT.document_words,
                        help="words of each document")
    parser.add_argument("--rag-question-words", env_var="RAG_QUESTION_WORDS", default="8-24",
                        help="words of each question, LOW-HIGH")
    parser.add_argument("--rag-zipf", env_var="RAG_ZIPF", type=float, default=_DEFAULT.zipf_s,
                        help="Zipf exponent of document popularity (0 = uniform)")


def workload(environment):
    cfg = W.RagConfig(
        documents=int(option(environment, "rag_documents", _DEFAULT.documents)),
        document_words=int(option(environment, "rag_document_words", _DEFAULT.document_words)),
        question_words=W.parse_range(option(environment, "rag_question_words", "8-24")),
        zipf_s=float(option(environment, "rag_zipf", _DEFAULT.zipf_s)),
    )
    return shared_workload(environment, W.Rag, cfg)


class RagUser(SamplingUser):
    workload_name = "rag"

    def make_workload(self):
        return workload(self.environment)
