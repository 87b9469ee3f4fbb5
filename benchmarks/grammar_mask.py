"""What a JSON-schema token mask costs per token, next to a decode step, at batch 1.

    python benchmarks/grammar_mask.py ARTIFACT [--new 64] [--repeats 5]

Decode step: (t(new tokens) - t(1 token)) / (new - 1), greedy, unconstrained, median of
--repeats. Mask: a reply is generated under the schema below (seeded, temperature 1), then
replayed token by token through a fresh `GrammarMask`: computing the allowed set, applying
it to a row of logits and advancing the matcher, timed per token (median and p90). The
overhead is mask / decode step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvforge import Engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "ok", "count", "color", "tags"],
    "additionalProperties": False,
}


def decode_step_s(engine: Engine, new: int, repeats: int) -> float:
    prompt = [engine.encode("def main():")]

    def seconds(n: int) -> float:
        start = time.perf_counter()
        engine.generate_tokens(prompt, max_new_tokens=n, temperature=0.0)
        return time.perf_counter() - start

    return statistics.median((seconds(new) - seconds(1)) / (new - 1) for _ in range(repeats))


def mask_times_s(engine: Engine, repeats: int) -> tuple[list[float], int]:
    grammar = engine.compile_grammar(json_schema=SCHEMA)
    assert grammar is not None
    reply = engine.generate("{", json_schema=SCHEMA, temperature=1.0, seed=0, max_new_tokens=200, logprobs=0)
    tokens = reply.tokens  # type: ignore[union-attr]
    logits = np.random.default_rng(0).standard_normal((1, engine.session.io.vocab_size))
    times: list[float] = []
    for _ in range(repeats):
        mask = engine.decoder(engine.sampling(), [1], grammar).processors[-1]
        for token in tokens:
            start = time.perf_counter()
            mask(logits)
            mask.accept(token)
            times.append(time.perf_counter() - start)
    return times, len(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    engine = Engine.load(args.artifact)
    engine.eos_ids = ()  # the decode timing generates its full length
    step = decode_step_s(engine, args.new, args.repeats)
    engine = Engine.load(args.artifact)  # with its eos: the reply ends where the schema does
    times, length = mask_times_s(engine, args.repeats)
    median, p90 = statistics.median(times), float(np.percentile(times, 90))
    print(f"vocabulary {engine.session.io.vocab_size}, reply of {length} tokens")
    print(f"decode step, batch 1: {step * 1e3:.2f} ms")
    print(f"JSON-schema mask per token: median {median * 1e3:.3f} ms, p90 {p90 * 1e3:.3f} ms")
    print(f"overhead: {median / step:.1%} of a decode step (p90 {p90 / step:.1%})")


if __name__ == "__main__":
    main()
