"""Write a Llama-3.1-8B-shaped checkpoint with random bf16 weights, shard by shard.

    python benchmarks/make_8b.py OUT [--layers 32] [--tokenizer DIR (default: examples/model)]

Hidden 4096, 32 layers, 32 query heads over 8 KV heads, MLP 14336, vocabulary 128256, bf16:
8.03B parameters, 16.1 GB, in shards of about 2 GB with a `model.safetensors.index.json`,
as the Hub's checkpoints are. Each tensor is drawn and written on its own (normal, std 0.02,
norms at 1), so making it needs about one shard of memory, not the model's. The tokenizer is
`--tokenizer`'s (its ids index the 128k table whatever its own vocabulary). Random weights
make random text: this checkpoint measures the build's time and memory, not a model.

With `--int4-grid`, every matrix holds whole multiples of 2^-8 in -7 .. 7 with a +7 in each
block of 32 along its rows: symmetric int4 in blocks of 32 (kvforge's default `--weights
int4`, codes -8 .. 7, the scale max(-min / 8, max / 7) searched downwards from there)
represents it exactly, so an int4 build's gate measures the pipeline rather than the
rounding of random weights (whose nearly flat next-token distributions round-to-nearest
int4 moves beyond the gate's bounds, as the 1.5B checkpoint in docs/performance.md shows).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "model"
SHAPE = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
)
SHARD_BYTES = 2 << 30


def tensors(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """Llama's weight names and shapes, in file order."""
    h, f, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    kv = h // SHAPE["num_attention_heads"] * SHAPE["num_key_value_heads"]
    names: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (f, h)),
            (p + "mlp.up_proj.weight", (f, h)),
            (p + "mlp.down_proj.weight", (h, f)),
        ]
    return names + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def on_int4_grid(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Codes uniform in -7 .. 7 times 2^-8 (std 0.017), the first of every 32 along a row +7, so that
    each block's symmetric scale is exactly 2^-8: max / 7 = 2^-8 >= -min / 8 (a block whose
    largest magnitude were a -7 would get the scale 7/8 of that, off the grid), and it rounds
    with no error, which no smaller scale the search tries can beat."""
    codes = torch.randint(-7, 8, shape, generator=generator, dtype=torch.int8)
    codes[..., ::32] = 7
    return codes.to(torch.bfloat16) / 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    parser.add_argument("--tokenizer", type=Path, default=EXAMPLE)
    parser.add_argument("--int4-grid", action="store_true", help="weights int4 in blocks of 32 represents exactly")
    args = parser.parse_args()
    if (args.out / "model.safetensors.index.json").exists():
        print(f"{args.out} already holds a checkpoint; keeping it")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (args.tokenizer / name).exists():
            (args.out / name).write_bytes((args.tokenizer / name).read_bytes())
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        **SHAPE,
        "num_hidden_layers": args.layers,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(0)
    plan = tensors(args.layers)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in plan:
        nbytes = 2 * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for index, shard in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        data = {}
        for name, shape in shard:
            if len(shape) == 1:
                data[name] = torch.ones(shape, dtype=torch.bfloat16)
            elif args.int4_grid:
                data[name] = on_int4_grid(shape, generator)
            else:
                data[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
            weight_map[name] = file
            total += data[name].numel() * 2
        save_file(data, str(args.out / file), metadata={"format": "pt"})
        print(f"wrote {file} ({sum(t.numel() for t in data.values()) * 2 / 1e9:.2f} GB)", flush=True)
        del data
    index_data = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (args.out / "model.safetensors.index.json").write_text(json.dumps(index_data, indent=2))
    print(f"wrote {args.out}: {total / 2:.3g} parameters, {total / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
