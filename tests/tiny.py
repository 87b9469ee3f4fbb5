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
LLAMA_LIKE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(LLAMA_LIKE, tie_word_embeddings=False),
    "mistral": dict(LLAMA_LIKE, sliding_window=None),
    "qwen2": dict(LLAMA_LIKE, tie_word_embeddings=True),
    "qwen3": dict(LLAMA_LIKE, head_dim=16, tie_word_embeddings=True),
    "phi3": dict(LLAMA_LIKE, partial_rotary_factor=0.5),
    "gemma": dict(LLAMA_LIKE, head_dim=16, hidden_activation="gelu_pytorch_tanh"),
    "gemma2": dict(
        LLAMA_LIKE,
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

# Families with no entry in kvforge's architecture table: read through transformers' config
# classes, traced as they are. Each config sets what makes the family differ (the comments).
_NO_GQA: dict[str, Any] = {k: v for k, v in LLAMA_LIKE.items() if k != "num_key_value_heads"}
# Gated delta nets (a convolution and a recurrent state each) around a gated attention layer.
_GATED_DELTA_NETS: dict[str, Any] = dict(
    LLAMA_LIKE,
    head_dim=16,
    num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
# Mamba-2 layers' shapes, in the names bamba and granitemoehybrid share.
_MAMBA2: dict[str, Any] = dict(
    LLAMA_LIKE,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_n_groups=1,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_chunk_size=16,
)
GENERIC_CONFIGS: dict[str, dict[str, Any]] = {
    "stablelm": dict(LLAMA_LIKE, partial_rotary_factor=0.25),  # partial rotary, LayerNorm
    "phi": dict(LLAMA_LIKE, partial_rotary_factor=0.5),  # parallel block, dense bias
    "granite": dict(  # embedding / residual / attention / logit multipliers
        LLAMA_LIKE, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0
    ),
    "starcoder2": dict(LLAMA_LIKE),  # LayerNorm with bias, GELU MLP
    "smollm3": dict(LLAMA_LIKE, no_rope_layer_interval=2),  # every second layer without rotary
    "opt": dict(_NO_GQA, ffn_dim=128, word_embed_proj_dim=64),  # learned positions (offset 2)
    "olmo2": dict(LLAMA_LIKE),  # norms after each block, q/k norm over the whole projection
    "gemma3_text": dict(  # alternating sliding / full layers, q/k norm, a rope base per layer kind
        LLAMA_LIKE,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
    ),
    "cohere": dict(LLAMA_LIKE, logit_scale=0.5),  # parallel block, logit scale
    "falcon": dict(_NO_GQA, new_decoder_architecture=True, num_kv_heads=2),  # parallel attention, grouped KV heads
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4),  # ALiBi; as its real configs, no context length
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, multi_query=True),  # one KV head
    "qwen3_moe": dict(  # MoE, softmax top-k
        LLAMA_LIKE, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[]
    ),
    "mixtral": dict(LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(  # attention sinks, alternating sliding window, MoE with biases
        LLAMA_LIKE,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "deepseek_v3": dict(  # multi-head latent attention, shared + routed experts, grouped top-k, dense first layer
        _NO_GQA,
        num_key_value_heads=4,  # as many as query heads, as its real configs say (the class default is 128)
        num_hidden_layers=3,
        moe_intermediate_size=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
    ),
    "lfm2": dict(  # short-convolution layers around an attention layer: a fixed-size state per conv layer
        LLAMA_LIKE, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"]
    ),
    "qwen3_5_text": dict(_GATED_DELTA_NETS),
    # Mamba-2 layers (a convolution and an SSM state each; transformers' layer type linear_attention) with attention
    "bamba": dict(
        _MAMBA2,
        attn_layer_indices=[1],
    ),
    "granitemoehybrid": dict(  # granite's multipliers over Mamba-2 and attention layers
        _MAMBA2,
        layer_types=["mamba", "attention"],
        num_local_experts=0,
    ),
    "nemotron_h": dict(  # a Mamba-2 block and an attention block, each its own layer
        LLAMA_LIKE,
        hybrid_override_pattern="M*",
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=1,
        ssm_state_size=8,
        conv_kernel=4,
        chunk_size=16,
        head_dim=16,
    ),
    "falcon_h1": dict(  # every layer attention and a Mamba-2 mixer side by side, with falcon_h1's multipliers
        _MAMBA2,
        mamba_d_ssm=128,  # mamba_n_heads × mamba_d_head
        key_multiplier=0.5,
        ssm_out_multiplier=2.0,
        lm_head_multiplier=0.5,
    ),
    "jamba": dict(  # Mamba-1 layers (a convolution and a selective-scan state each) around an attention layer with MoE
        LLAMA_LIKE,
        num_hidden_layers=3,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
    ),
    "qwen3_next": dict(  # qwen3_5's layers with MoE (softmax top-k) and a gated shared expert
        _GATED_DELTA_NETS,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        mlp_only_layers=[],
    ),
}
GENERIC = tuple(GENERIC_CONFIGS)
# Families whose config.json names no context length: the `--context` (BuildOptions.context)
# their tiny checkpoints are built with.
BUILD_CONTEXT: dict[str, int] = {"bloom": 256}
FAMILIES = SUPPORTED + GENERIC

# Weights widened further, by family: lfm2's random convolution inputs are small, so its
# convolution state would barely matter, and a test could not tell a wrong state from a right one;
# likewise a gated delta net's recurrent state (widened, forgetting it changes 17-19 of 24 greedy tokens).
_WIDER: dict[str, tuple[str, float]] = {
    "lfm2": (".conv.in_proj.", 3.0),
    "qwen3_5_text": (".linear_attn.", 3.0),
    "qwen3_next": (".linear_attn.", 3.0),
    "falcon_h1": (".mamba.", 3.0),
}

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
    arch: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random-weight checkpoint of `model_type` into `directory` (its config
    from ARCH_CONFIGS / GENERIC_CONFIGS unless `arch` gives one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    make_tokenizer(directory)
    if arch is None:
        arch = ARCH_CONFIGS[model_type] if model_type in ARCH_CONFIGS else GENERIC_CONFIGS[model_type]
    config = AutoConfig.for_model(model_type, **{**_COMMON, **arch, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[dtype])
    wider, factor = _WIDER.get(model_type, (None, 1.0))
    with torch.no_grad():  # random init gives near-uniform logits; widen them so greedy is decisive
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(2.0 * factor if wider is not None and wider in name else 2.0)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def hf_greedy(model: Any, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy `generate`: the reference the compiled model must equal."""
    import copy

    pad = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id
    # No eos (an empty list; None falls back to the model's) rather than `min_new_tokens`,
    # which masks the eos logit: where eos wins, the compiled model's greedy token is eos too.
    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=[], do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            generation_config=config,
        )
    return out[0, len(prompt_ids) :].tolist()
