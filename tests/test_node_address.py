"""The address rule of ``app.node_address``: bind and announce the node's Ray IP; a
``VLLM_HOST_IP`` naming any other address is ignored with a warning that names it."""

from __future__ import annotations

import logging
import os

import pytest

from app import node_address
from app.node_address import announce_address


@pytest.mark.parametrize("configured", [None, "", "  "])
def test_unset_value_gives_the_node_ip_without_warning(configured):
    assert announce_address(configured, "10.0.0.5") == ("10.0.0.5", None)


@pytest.mark.parametrize(("configured", "node_ip"), [
    ("10.0.0.5", "10.0.0.5"),
    (" 10.0.0.5 ", "10.0.0.5"),
    ("127.0.0.1", "127.0.0.1"),  # a one-node cluster on loopback (the test harness)
    ("fd00:0:0::2", "fd00::2"),  # one IPv6 address, spelled two ways
])
def test_the_node_ip_itself_is_kept(configured, node_ip):
    assert announce_address(configured, node_ip) == (node_ip, None)


@pytest.mark.parametrize(("configured", "why"), [
    ("127.0.0.1", "loopback set for the whole cluster"),
    ("10.0.0.6", "another node's IP copied into every node's environment"),
    ("0.0.0.0", "every interface: no address to dial"),
    ("localhost", "a hostname every node resolves to itself"),
    ("node-a.cluster.local", "a hostname"),
    ("fd00::3", "another IPv6 address"),
])
def test_any_other_value_is_replaced_and_named_in_the_warning(configured, why):
    host, warning = announce_address(configured, "10.0.0.5")
    assert host == "10.0.0.5", why
    assert warning is not None and repr(configured) in warning and "10.0.0.5" in warning, warning


def test_a_blank_node_ip_is_refused():
    with pytest.raises(ValueError, match="no IP address from Ray"):
        announce_address("127.0.0.1", " ")


def test_resolve_writes_the_chosen_address_back_and_logs_the_ignored_one(monkeypatch, caplog):
    """``resolve`` reads Ray's node IP (no cluster needed: Ray finds this machine's address)
    and leaves vLLM the same address in ``VLLM_HOST_IP``."""
    import ray

    node_ip = ray.util.get_node_ip_address()
    wrong = "198.51.100.7" if node_ip != "198.51.100.7" else "198.51.100.8"  # TEST-NET-2: not this node
    monkeypatch.setenv(node_address.ENV, wrong)
    with caplog.at_level(logging.WARNING, logger="prefix_serve.node_address"):
        assert node_address.resolve() == node_ip
    assert node_address.ENV in caplog.text and repr(wrong) in caplog.text
    assert os.environ[node_address.ENV] == node_ip
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prefix_serve.node_address"):
        assert node_address.resolve() == node_ip  # now set to the node IP: kept, no warning
    assert caplog.text == ""
