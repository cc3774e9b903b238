"""Build the embedded default model: a tiny Qwen2-architecture causal LM.

``python -m infra.tiny_model --out models/tiny-qwen2`` writes a Hugging Face model
folder (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` with a ChatML chat template, ``generation_config.json``)
that vLLM loads offline. The build is deterministic: the tokenizer is a byte-level
BPE trained with ``tokenizers`` on ``infra/corpus.txt`` (kept in the repo) and the
weights are drawn from a seeded generator, so two builds give byte-identical files.

Shape choices follow what the vLLM CPU attention backend accepts (checked on this
machine, see ``shared/DESIGN.md``): ``head_dim`` 64 (16 is rejected), two layers,
hidden size 128. The weights are random: the model produces token salad, which is
all routing, caching and latency work needs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

CORPUS = Path(__file__).with_name("corpus.txt")
DEFAULT_OUT = Path("models/tiny-qwen2")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 1024  # BPE target; the corpus may yield fewer merges
MAX_POSITION_EMBEDDINGS = 16384
SEED = 0

# ChatML, the template family Qwen2 uses.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(out: Path) -> int:
    """Train the byte-level BPE tokenizer and save it; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return tok.get_vocab_size()


def build_model(out: Path, vocab_size: int, eos_ids: list[int], pad_id: int) -> None:
    """Write a seeded random Qwen2 causal LM sized for the CPU backend."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=pad_id,
        eos_token_id=eos_ids[0],
        pad_token_id=pad_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.eval()
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_id, bos_token_id=pad_id).save_pretrained(str(out))


def is_built(out: Path) -> bool:
    """True when ``out`` holds every file this script writes."""
    needed = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    return all((out / name).exists() for name in needed)


def build(out: Path = DEFAULT_OUT, force: bool = False) -> Path:
    """Build the model folder at ``out`` (skipped when already built unless ``force``)."""
    out = Path(out)
    if is_built(out) and not force:
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    out.mkdir(parents=True, exist_ok=True)
    trained = build_tokenizer(out)
    vocab_size = ((trained + 63) // 64) * 64  # pad the embedding table to a multiple of 64
    with open(out / "tokenizer.json", encoding="utf-8") as f:
        spec = json.load(f)
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    eos_ids = [vocab["<|im_end|>"], vocab["<|endoftext|>"]]
    build_model(out, vocab_size, eos_ids, vocab["<|endoftext|>"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    args = parser.parse_args(argv)
    out = build(args.out, force=args.force)
    print(f"tiny model ready at {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
