"""Placing replicas with Ray custom resources: ``engine_replicas.resources`` and
``ingress_replicas.resources`` reach Serve as each replica's ``ray_actor_options``
(and the first placement-group bundle under tensor parallelism); bad values fail the
build naming the key. Serve validates the options itself when ``build_app`` binds them."""

from __future__ import annotations

import pytest

from app.config import parse_app_args


def _replica_configs(application):
    """``(ingress, engine)`` Serve replica configs of a built (not running) application."""
    ingress = application._bound_deployment  # noqa: SLF001 - the bound ingress and its engine argument
    engine = next(a for a in ingress.init_args if hasattr(a, "_bound_deployment"))._bound_deployment
    return ingress._replica_config, engine._replica_config  # noqa: SLF001


def test_resources_reach_each_deployments_actor_options():
    from app.builder import build_app

    ingress, engine = _replica_configs(build_app({
        "engine_replicas": {"num_replicas": 3, "num_cpus": 0.5, "resources": {"node_a": 0.5, "rtx4090": 1}},
        "ingress_replicas": {"num_replicas": 2, "num_cpus": 0.25, "resources": {"ingress_slot": 1}},
    }))
    assert engine.ray_actor_options["resources"] == {"node_a": 0.5, "rtx4090": 1}
    assert engine.ray_actor_options["num_cpus"] == 0.5
    assert ingress.ray_actor_options["resources"] == {"ingress_slot": 1}
    assert ingress.ray_actor_options["num_cpus"] == 0.25


def test_without_resources_no_custom_resource_is_asked():
    from app.builder import build_app

    ingress, engine = _replica_configs(build_app({}))
    assert not engine.ray_actor_options.get("resources") and not ingress.ray_actor_options.get("resources")


def test_tensor_parallel_replicas_reserve_their_resources_in_the_first_bundle():
    """Under tensor parallelism the replica actor runs in the first bundle of its placement
    group: the custom resources go there (Serve refuses actor options that bundle cannot hold)."""
    from app.builder import build_app

    _, engine = _replica_configs(build_app({
        "engine": {"tensor_parallel_size": 2},
        "engine_replicas": {"num_replicas": 1, "num_cpus": 1, "resources": {"rtx4090": 2}},
    }))
    assert engine.placement_group_bundles == [{"CPU": 1, "GPU": 1, "rtx4090": 2}, {"GPU": 1}]
    assert engine.ray_actor_options["resources"] == {"rtx4090": 2} and engine.ray_actor_options["num_gpus"] == 0


@pytest.mark.parametrize("resources, needle", [
    ({"CPU": 1}, "'CPU' is not a custom resource"),
    ({"GPU": 1}, "'GPU' is not a custom resource"),
    ({"memory": 1e9}, "'memory' is not a custom resource"),
    ({"node_a": 0}, "'node_a': 0.0 must be above 0"),
    ({"node_a": -1}, "'node_a': -1.0 must be above 0"),
    ({"node_a": 0.00005}, "multiple of 0.0001"),
    ({" ": 1}, "a resource name is empty"),
    ({"node_a": float("inf")}, "finite number"),
    ({"node_a": "one"}, "valid number"),
    ([["node_a", 1]], "valid dictionary"),
])
@pytest.mark.parametrize("deployment", ["engine_replicas", "ingress_replicas"])
def test_bad_resources_fail_the_build_naming_the_key(deployment, resources, needle):
    from app.builder import build_app

    args = {deployment: {"num_replicas": 1, "num_cpus": 0.5, "resources": resources}}
    for call in (parse_app_args, build_app):
        with pytest.raises(ValueError, match=f"{deployment}\\.resources") as e:
            call(args)
        assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("amount", [0.1, 0.3, 0.7, 0.0001, 1.0001, 2, 2.5])
def test_fractions_in_rays_unit_are_accepted(amount):
    assert parse_app_args({"engine_replicas": {"num_replicas": 1, "num_cpus": 0.5,
                                               "resources": {"node_a": amount}}}).engine_replicas.resources == {
        "node_a": amount}
