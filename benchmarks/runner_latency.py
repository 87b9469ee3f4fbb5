"""First-token latency and decode speed of an artifact, measured the way the peers are.

    python benchmarks/runner_latency.py ARTIFACT [--prompt 128] [--new 128] [--batch 1] [--repeats 3]

Greedy, --batch random prompts of --prompt ids each. Decode tokens/s = batch * (new - 1) /
(t(new) - t(1)), so prompt processing and start-up cancel out; medians over --repeats runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvforge import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    engine = Engine.load(args.artifact)
    engine.eos_ids = ()  # always generate the full length
    vocab = engine.session.io.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, vocab, args.prompt).tolist() for _ in range(args.batch)]

    def seconds(new: int) -> float:
        start = time.perf_counter()
        engine.generate_tokens(prompts, max_new_tokens=new, temperature=0.0)
        return time.perf_counter() - start

    runs = [(seconds(1), seconds(args.new)) for _ in range(args.repeats)]
    first = statistics.median(a for a, _ in runs)
    decode = statistics.median(args.batch * (args.new - 1) / (b - a) for a, b in runs)
    where = f"prompt {args.prompt}, batch {args.batch}, median of {args.repeats}"
    print(f"first token {first * 1000:.0f} ms, decode {decode:.1f} tokens/s ({where})")


if __name__ == "__main__":
    main()
