"""Multi-tenant: tenants send the same app prompts but never share cache (a cache_salt each).

Models a platform serving several tenants with one app: every request carries its
tenant's ``cache_salt`` (``tenant-0``, ``tenant-1``, ...; ``shapes.tenant_salt``), so identical prompt
tokens of two tenants are different cache entries. A request is
``POST /v1/completions`` with a token-id prompt (one of ``--tenant-groups`` app
prompts, the same ids for every tenant, + a fresh question); the tenant is drawn
per request with skewed popularity. Hits can only come from the same tenant.

    locust -f locustfiles/multi_tenant.py --headless -u 8 -r 4 -t 60s --host http://127.0.0.1:8000

Its options (``workloads.MultiTenant.options``) are listed below; the common ones
are in ``locustfiles/_common.py``.
"""

from __future__ import annotations

try:
    from locustfiles._common import SamplingUser, register_options, workload_module
except ImportError:  # this folder copied alone
    from _common import SamplingUser, register_options, workload_module  # type: ignore[no-redef]

W = workload_module()
register_options(W.MultiTenant.options)
__doc__ = (__doc__ or "") + W.options_doc(W.MultiTenant.options)


class MultiTenantUser(SamplingUser):
    workload_name = W.MultiTenant.name
    workload_class = W.MultiTenant
