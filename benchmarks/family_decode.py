"""Decode speed of 125M-shaped checkpoints of several families, side by side with the
llama-shaped reference of the same size, in one run.

    python benchmarks/family_decode.py WORKDIR [--families llama olmo2 gemma3_text cohere]
        [--tokenizer DIR (default: examples/model)] [--prompt 128] [--new 64] [--rounds 5]

Each family gets the reference's shape (hidden 768, intermediate 2048, 12 layers, 12 query
heads over 4 KV heads, a 32k vocabulary; random weights, fp32), is built with `kvforge
build` (default target), and its fusions are reported. Then every round times each
artifact once, in turn: decode tokens/s = (new - 1) / (t(new) - t(1)) at batch 1, greedy.
Medians over rounds, and each family's ratio to llama within the same round.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 32000
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "model"
SHAPE: dict[str, Any] = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
)
# What a family needs beyond the shared shape to be itself (a window under the prompt for
# gemma3's sliding layers, as its real configs have).
EXTRA: dict[str, dict[str, Any]] = {
    "gemma3_text": dict(head_dim=64, sliding_window=512, query_pre_attn_scalar=64),
    # three gated delta nets to one attention layer, as Qwen3.5's configs interleave them
    "qwen3_5_text": dict(
        head_dim=64,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 3,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
    ),
}


def make(directory: Path, family: str, tokenizer: Path) -> Path:
    """A random-weight checkpoint of `family` in the reference's shape, with `tokenizer`'s files
    (its ids index the 32k table whatever its own vocabulary)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (directory / "model.safetensors").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer / name).exists():
            (directory / name).write_bytes((tokenizer / name).read_bytes())
    config = AutoConfig.for_model(family, vocab_size=VOCAB, **SHAPE, **EXTRA.get(family, {}))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, safe_serialization=True)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--families", nargs="+", default=["llama", "olmo2", "gemma3_text", "cohere"])
    parser.add_argument("--tokenizer", type=Path, default=EXAMPLE, help="a checkpoint dir whose tokenizer to use")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from kvforge import BuildOptions, Engine, build

    engines = {}
    for family in args.families:
        out = args.workdir / f"art-{family}"
        if not (out / "manifest.json").exists():
            result = build(make(args.workdir / f"ckpt-{family}", family, args.tokenizer), out, BuildOptions(force=True))
            fired = {r.name: sum(r.fusions.values()) for r in result.passes.passes if r.fusions}
            print(f"{family}: built; fusions {fired}; missed {sorted(result.passes.missed)}", flush=True)
        engines[family] = Engine.load(out)
        engines[family].eos_ids = ()
    vocab = min(e.session.io.vocab_size for e in engines.values())
    prompt = [np.random.default_rng(0).integers(2, vocab, args.prompt).tolist()]

    def seconds(engine: Any, new: int) -> float:
        start = time.perf_counter()
        engine.generate_tokens(prompt, max_new_tokens=new, temperature=0.0)
        return time.perf_counter() - start

    for engine in engines.values():  # first runs allocate and page in the weights
        seconds(engine, 2)
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        speeds = {}
        for family, engine in engines.items():
            short = seconds(engine, 1)
            speeds[family] = (args.new - 1) / (seconds(engine, args.new) - short)
        rounds.append(speeds)
        print("round: " + ", ".join(f"{f} {s:.1f}" for f, s in speeds.items()), flush=True)
    base = args.families[0]
    for family in args.families:
        tok_s = statistics.median(r[family] for r in rounds)
        ratio = statistics.median(r[family] / r[base] for r in rounds)
        print(f"{family:<14} decode {tok_s:6.1f} tok/s (median of {args.rounds}), {ratio:.3f}x {base}")


if __name__ == "__main__":
    main()
