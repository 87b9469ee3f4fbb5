"""Tiny Hugging Face checkpoints made in code, one per supported architecture.

Each is small enough to export and verify in seconds, and uses the real transformers
config and model classes, so the checkpoint on disk is what `save_pretrained` writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)  # squares\n",
    "héllo wörld, naïve café: 日本語のテキスト 🙂 — ok\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
]

VOCAB_SIZE = 384

# Shapes shared by every architecture: 2 layers, 4 query heads over 2 KV heads (GQA),
# head_dim 16. Fields are each config class's own names.
_COMMON: dict[str, Any] = dict(vocab_size=VOCAB_SIZE, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_LLAMA_LIKE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(_LLAMA_LIKE, tie_word_embeddings=False),
    "mistral": dict(_LLAMA_LIKE, sliding_window=None),
    "qwen2": dict(_LLAMA_LIKE, tie_word_embeddings=True),
    "qwen3": dict(_LLAMA_LIKE, head_dim=16, tie_word_embeddings=True),
    "phi3": dict(_LLAMA_LIKE, partial_rotary_factor=0.5),
    "gemma": dict(_LLAMA_LIKE, head_dim=16, hidden_activation="gelu_pytorch_tanh"),
    "gemma2": dict(
        _LLAMA_LIKE,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, tie_word_embeddings=True),
    "gpt_neox": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        rotary_pct=0.5,
        use_parallel_residual=True,
    ),
}
SUPPORTED = tuple(ARCH_CONFIGS)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def make_tokenizer(directory: Path) -> Tokenizer:
    """A byte-level BPE tokenizer trained on CORPUS, saved with an HF tokenizer_config."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", '
        "\"chat_template\": \"{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}"
        '{% if add_generation_prompt %}assistant:{% endif %}"}\n'
    )
    return tok


def make_checkpoint(
    directory: Path,
    model_type: str = "llama",
    dtype: str = "float32",
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write a tiny random-weight checkpoint of `model_type` into `directory`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    make_tokenizer(directory)
    config = AutoConfig.for_model(model_type, **{**_COMMON, **ARCH_CONFIGS[model_type], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[dtype])
    with torch.no_grad():  # random init gives near-uniform logits; widen them so greedy is decisive
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(2.0)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy `generate`: the reference the compiled model must equal."""
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id
    with torch.no_grad():
        out = model.generate(  # type: ignore[operator]
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad,
        )
    return out[0, len(prompt_ids) :].tolist()
