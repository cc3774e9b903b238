"""The installed environment can load and run the embedded model (no network)."""

from __future__ import annotations

import importlib.util
import json

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
