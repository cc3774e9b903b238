"""The address a replica binds and announces to other nodes: its node's Ray IP.

Every engine replica binds its KV-event relay and its metrics endpoint on one
address and announces that same address to the routers and to Prometheus; every
ingress replica does so for its metrics endpoint. Routers and scrapers run on
other nodes, so the address must be one that other nodes reach *this* node at.

The rule (``announce_address``): the node's address as Ray knows it
(``ray.util.get_node_ip_address()``, the address every other Ray node already
reaches this node at; choose it per node with ``ray start --node-ip-address``).
``VLLM_HOST_IP``, when set, is kept only when it is that same address. Any other
value (``127.0.0.1`` set for the whole cluster in a ``runtime_env``, one node's IP
copied into every node's environment, a hostname, ``0.0.0.0``) would announce an
address the routers on other nodes cannot reach, or reach the wrong node at; it
is ignored with a warning that names it. ``resolve`` then writes the chosen
address back to ``VLLM_HOST_IP``, so vLLM's own sockets in this process and its
engine-core child bind the same one.
"""

from __future__ import annotations

import ipaddress
import logging
import os

ENV = "VLLM_HOST_IP"
logger = logging.getLogger("prefix_serve.node_address")


def _same_address(a: str, b: str) -> bool:
    """Whether two IP literals name the same address (``fd00::2`` == ``fd00:0::2``); else plain equality."""
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a == b


def announce_address(configured: str | None, node_ip: str) -> tuple[str, str | None]:
    """The address to bind and announce, and a warning when ``configured`` was ignored.

    Args:
        configured: ``VLLM_HOST_IP`` as set in this process's environment (None or
            blank: unset).
        node_ip: this node's IP as Ray knows it (``ray.util.get_node_ip_address()``).

    Returns:
        ``(node_ip, None)`` when ``configured`` is unset or names the same address;
        otherwise ``(node_ip, warning)``, the warning naming the ignored value.

    Raises:
        ValueError: ``node_ip`` is blank (Ray gave no address to fall back on).
    """
    node_ip = (node_ip or "").strip()
    if not node_ip:
        raise ValueError("this node has no IP address from Ray (ray.util.get_node_ip_address() is empty)")
    value = (configured or "").strip()
    if not value or _same_address(value, node_ip):
        return node_ip, None
    return node_ip, (
        f"{ENV}={value!r} is not this node's address ({node_ip}, as Ray knows it): ignored, binding and "
        f"announcing {node_ip}. Routers on other nodes reach this replica only at this node's own address; "
        f"set {ENV} per node (or choose the node's address with `ray start --node-ip-address`), never for "
        "the whole cluster")


def resolve() -> str:
    """This process's bind-and-announce address by ``announce_address``, from Ray's node IP.

    Logs the warning when ``VLLM_HOST_IP`` is ignored and sets ``VLLM_HOST_IP`` to
    the result (vLLM's sockets and its engine-core child read it). Needs Ray
    (call it in a replica).
    """
    import ray

    host, warning = announce_address(os.environ.get(ENV), ray.util.get_node_ip_address())
    if warning is not None:
        logger.warning(warning)
    os.environ[ENV] = host
    return host
