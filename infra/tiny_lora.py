"""Build a tiny LoRA adapter for the embedded tiny model, the way the model itself is built.

``python -m infra.tiny_lora --out models/tiny-qwen2-lora`` writes a PEFT adapter
folder (``adapter_config.json`` and ``adapter_model.safetensors``) that vLLM loads
with ``--lora-modules name=path`` (app args: ``serving.lora_modules``). Rank 8 on
the attention ``q_proj`` and ``v_proj`` of both layers of ``models/tiny-qwen2``
(hidden size 128, two heads of 64: both projections are 128 x 128). The weights
are drawn from a seeded generator, with ``lora_B`` non-zero (PEFT initialises it
to zero, which would make the adapter a no-op), so the adapter changes the
model's output and two builds give identical files.

Tensor names follow PEFT's layout for a causal LM:
``base_model.model.model.layers.{i}.self_attn.{q,v}_proj.lora_{A,B}.weight``,
with ``lora_A`` of shape ``[r, in_features]`` and ``lora_B`` of ``[out_features, r]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_OUT = Path("models/tiny-qwen2-lora")
BASE_MODEL = "models/tiny-qwen2"
RANK = 8
ALPHA = 16
TARGETS = ("q_proj", "v_proj")
SEED = 1


def build(out: Path = DEFAULT_OUT, base: Path = Path(BASE_MODEL), force: bool = False) -> Path:
    """Write the adapter for the model at ``base`` (read for its shapes); skipped when built."""
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    if (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists() and not force:
        return out
    with open(Path(base) / "config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    out_features = {"q_proj": cfg["num_attention_heads"] * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(SEED)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(RANK, hidden, generator=gen) * 0.5).to(torch.bfloat16)
            lora_b = torch.randn(out_features[target], RANK, generator=gen) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = lora_b.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
        "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0, "target_modules": list(TARGETS),
        "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    parser.add_argument("--base", type=Path, default=Path(BASE_MODEL), help="base model folder (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    args = parser.parse_args(argv)
    print(f"tiny LoRA adapter ready at {build(args.out, args.base, force=args.force)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
