"""A/B load experiment: the same engines, one request router at a time, the same Locust load.

``python -m bench.ab --help``; what a run does and what it writes: ``bench.ab.cli``.
Modules: ``deploy`` (the routers, their Serve apps, the Ray cluster), ``load`` (warm-up,
working-set sizing, Locust and its outputs), ``measure`` (prefix-cache counters, CPU
seconds, the ingress's metrics, our router's decisions), ``report`` (each router's
summary, the checks, the plots, the table) and ``cli`` (``main``).  The baseline routers
Serve imports by path stay beside this package: ``bench.ab_routers``, ``bench.ab_ray_router``.
"""

from bench.ab.cli import main, parse_args
from bench.ab.deploy import OURS_CLASS, ROUTERS, RSL_ROUTERS, app_entry_for, load_app_entry, ready_paths
from bench.ab.load import arg_value, size_workload
from bench.ab.measure import INGRESS_CACHED, INGRESS_PROMPT, VLLM_HITS, VLLM_QUERIES
from bench.ab.report import checks, format_table, policy_summary

__all__ = [
    "INGRESS_CACHED",
    "INGRESS_PROMPT",
    "OURS_CLASS",
    "ROUTERS",
    "RSL_ROUTERS",
    "VLLM_HITS",
    "VLLM_QUERIES",
    "app_entry_for",
    "arg_value",
    "checks",
    "format_table",
    "load_app_entry",
    "main",
    "parse_args",
    "policy_summary",
    "ready_paths",
    "size_workload",
]
