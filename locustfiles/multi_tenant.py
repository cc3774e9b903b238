"""Multi-tenant: tenants send the same app prompts but never share cache (a cache_salt each).

Models a platform serving several tenants with one app: every request carries its
tenant's ``cache_salt`` (``tenant-000``, ``tenant-001``, ...), so identical prompt
tokens of two tenants are different cache entries. A request is
``POST /v1/completions`` with a token-id prompt (one of ``--tenant-groups`` app
prompts, the same ids for every tenant, + a fresh question); the tenant is drawn
per request with skewed popularity. Hits can only come from the same tenant.

    locust -f locustfiles/multi_tenant.py --headless -u 8 -r 4 -t 60s --host http://127.0.0.1:8000

Options (env): --tenants (TENANTS, 4), --tenant-zipf (TENANT_ZIPF, 0.8),
--tenant-groups (TENANT_GROUPS, 4), --tenant-prompt-tokens (TENANT_PROMPT_TOKENS, 768),
--tenant-question-tokens (TENANT_QUESTION_TOKENS, "16-64"), plus the common ones.
"""

from __future__ import annotations

from locust import events

try:
    from locustfiles._common import SamplingUser, option, shared_workload, workload_module
except ImportError:  # this folder copied alone
    from _common import SamplingUser, option, shared_workload, workload_module  # type: ignore[no-redef]

W = workload_module()
_DEFAULT = W.MultiTenantConfig()


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--tenants", env_var="TENANTS", type=int, default=_DEFAULT.tenants,
                        help="tenants (one cache_salt each)")
    parser.add_argument("--tenant-zipf", env_var="TENANT_ZIPF", type=float, default=_DEFAULT.zipf_s,
                        help="Zipf exponent of tenant popularity (0 = uniform)")
    parser.add_argument("--tenant-groups", env_var="TENANT_GROUPS", type=int, default=_DEFAULT.groups,
                        help="app prompts shared by all tenants")
    parser.add_argument("--tenant-prompt-tokens", env_var="TENANT_PROMPT_TOKENS", type=int,
                        default=_DEFAULT.system_tokens, help="tokens of each app prompt")
    parser.add_argument("--tenant-question-tokens", env_var="TENANT_QUESTION_TOKENS", default="16-64",
                        help="fresh tokens after the app prompt, LOW-HIGH")


def workload(environment):
    cfg = W.MultiTenantConfig(
        tenants=int(option(environment, "tenants", _DEFAULT.tenants)),
        zipf_s=float(option(environment, "tenant_zipf", _DEFAULT.zipf_s)),
        groups=int(option(environment, "tenant_groups", _DEFAULT.groups)),
        system_tokens=int(option(environment, "tenant_prompt_tokens", _DEFAULT.system_tokens)),
        question_tokens=W.parse_range(option(environment, "tenant_question_tokens", "16-64")),
    )
    return shared_workload(environment, W.MultiTenant, cfg)


class MultiTenantUser(SamplingUser):
    workload_name = "multi_tenant"

    def make_workload(self):
        return workload(self.environment)
