"""Application args: both shipped configs validate; bad args fail with a clear message."""

from __future__ import annotations

import pytest
import yaml

from app.config import AppArgs, RouterConfig, parse_app_args
from tests.conftest import REPO

CONFIGS = [REPO / "serve_config.yaml", REPO / "infra" / "serve_config.4090.yaml"]


def _app_entry(path):
    return yaml.safe_load(path.read_text())["applications"][0]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(doc)  # Serve's own schema
    entry = doc["applications"][0]
    args = parse_app_args(entry["args"])
    rcfg = entry["deployments"][0]["request_router_config"]
    assert rcfg["request_router_class"] == "app.router:PrefixAffinityRouter"
    RouterConfig.model_validate(rcfg["request_router_kwargs"])
    assert args.engine.block_size % 16 == 0


def test_kubray_manifest_embeds_a_valid_config():
    doc = yaml.safe_load((REPO / "infra" / "rayservice.4090.yaml").read_text())
    serve_cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
    parse_app_args(serve_cfg["applications"][0]["args"])


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


@pytest.mark.parametrize(
    "args, needle",
    [
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
    """Every ServingConfig field is a flag of vLLM's OpenAI server (same name, dashes for underscores)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from app.config import ServingConfig

    parser = make_arg_parser(FlexibleArgumentParser())
    dests = {a.dest for a in parser._actions}
    assert set(ServingConfig.model_fields) <= dests, set(ServingConfig.model_fields) - dests
