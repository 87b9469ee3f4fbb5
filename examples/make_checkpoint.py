"""Write a Llama-shaped Hugging Face checkpoint with random weights, made in code.

    python examples/make_checkpoint.py OUT [--preset small|125m|1.5b] [--dtype float32|float16|bfloat16]

The tokenizer is a byte-level BPE trained on the Python standard library's source
(PSF license), which every Python installation carries. Random weights produce random
text: this checkpoint exercises the compiler, not the language model.
"""

from __future__ import annotations

import argparse
import glob
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PRESETS = {
    "small": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    ),
    "125m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ),
    # 1.50B parameters (3.0 GB in fp16/bf16): the memory-bounded build's showcase.
    "1.5b": dict(
        vocab_size=32000,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=30,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ),
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(vocab_size: int) -> Tokenizer:
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:200]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    args = parser.parse_args()
    if (args.out / "model.safetensors").exists():
        print(f"{args.out} already holds a checkpoint; keeping it")
        return
    shape = PRESETS[args.preset]
    tok = train_tokenizer(shape["vocab_size"])
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE
    ).save_pretrained(args.out)
    config = LlamaConfig(
        **{**shape, "vocab_size": tok.get_vocab_size()}, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(getattr(torch, args.dtype)).save_pretrained(args.out, safe_serialization=True)
    print(f"wrote {args.out} ({args.preset}, {args.dtype})")


if __name__ == "__main__":
    main()
