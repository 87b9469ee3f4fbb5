"""Decode speed of a mixture of experts against dense models of its active and of its total size.

    python benchmarks/moe_decode.py WORKDIR [--weights int8|int4] [--tokenizer DIR (default: examples/model)]
        [--prompt 128] [--new 64] [--rounds 5]

Three random-weight checkpoints (fp32, a 32k vocabulary, hidden 512, 8 layers, 8 query heads
over 4 KV heads), built with `kvforge build` (default target, ort-cpu; `--weights` quantizes):

- `moe`: mixtral, 8 experts of width 832, top-2: about 121M parameters, 59M active per token;
- `dense-active`: mistral, intermediate 1664 (the two active experts' width): about 59M;
- `dense-total`: mistral, intermediate 6656 (all eight experts' width): about 121M;
- `moe-gather`: the `moe` checkpoint built without the mixture-of-experts passes (the graph
  as exported: each token gathers its experts' weights, then MatMul; experts unquantized).

Every round times each artifact once, in turn: decode tokens/s = (new - 1) / (t(new) - t(1))
at batch 1, greedy. Medians over rounds, and each model's ratio to `dense-active` within the
same round. A decode step that reads only the selected experts runs near `dense-active`'s
speed; one that reads every expert, near `dense-total`'s.
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
EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 832
SHAPE: dict[str, Any] = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
    sliding_window=None,
)
ROUTED: dict[str, Any] = dict(intermediate_size=EXPERT_WIDTH, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "dense-active": ("mistral", dict(intermediate_size=TOP_K * EXPERT_WIDTH)),
    "moe": ("mixtral", ROUTED),
    "dense-total": ("mistral", dict(intermediate_size=EXPERTS * EXPERT_WIDTH)),
    "moe-gather": ("mixtral", ROUTED),
}


def make(directory: Path, family: str, extra: dict[str, Any], tokenizer: Path) -> tuple[Path, int]:
    """A random-weight checkpoint and its parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=VOCAB, **SHAPE, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in model.parameters())
    if not (directory / "model.safetensors").exists():
        directory.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (tokenizer / name).exists():
                (directory / name).write_bytes((tokenizer / name).read_bytes())
        model.save_pretrained(directory, safe_serialization=True)
    return directory, parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--weights", choices=["int8", "int4"], default=None)
    parser.add_argument("--tokenizer", type=Path, default=EXAMPLE, help="a checkpoint dir whose tokenizer to use")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from kvforge import BuildOptions, Engine, build
    from kvforge.passes.quantize import WeightQuantization
    from kvforge.toolchain import moe_graph

    weights = WeightQuantization(int(args.weights[3:])) if args.weights else None
    suffix = f"-{args.weights}" if args.weights else ""
    engines = {}
    for name, (family, extra) in MODELS.items():
        source = "moe" if name == "moe-gather" else name
        checkpoint, parameters = make(args.workdir / f"ckpt-{source}", family, extra, args.tokenizer)
        active = parameters
        if family == "mixtral":
            per_expert = 3 * SHAPE["hidden_size"] * EXPERT_WIDTH * SHAPE["num_hidden_layers"]
            active = parameters - (EXPERTS - TOP_K) * per_expert
        out = args.workdir / f"art-{name}{suffix}"
        if not (out / "manifest.json").exists():
            moe_layers = moe_graph.moe_layers
            if name == "moe-gather":  # no layer counted as routing to experts: no MoE passes
                moe_graph.moe_layers = lambda model, spec: 0  # type: ignore[assignment]
            try:
                result = build(checkpoint, out, BuildOptions(force=True, weights=weights))
            finally:
                moe_graph.moe_layers = moe_layers
            fired = {r.name: sum(r.fusions.values()) for r in result.passes.passes if r.fusions}
            print(f"{name}: built; fusions {fired}; missed {sorted(result.passes.missed)}", flush=True)
        print(f"{name}: {family}, {parameters / 1e6:.1f}M parameters, {active / 1e6:.1f}M active", flush=True)
        engines[name] = Engine.load(out)
        engines[name].eos_ids = ()
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
        for name, engine in engines.items():
            short = seconds(engine, 1)
            speeds[name] = (args.new - 1) / (seconds(engine, args.new) - short)
        rounds.append(speeds)
        print("round: " + ", ".join(f"{n} {s:.1f}" for n, s in speeds.items()), flush=True)
    base = "dense-active"
    for name in MODELS:
        tok_s = statistics.median(r[name] for r in rounds)
        ratio = statistics.median(r[name] / r[base] for r in rounds)
        print(f"{name:<13} decode {tok_s:6.1f} tok/s (median of {args.rounds}), {ratio:.3f}x {base}")


if __name__ == "__main__":
    main()
