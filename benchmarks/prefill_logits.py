"""Prefill time of artifacts that differ in the positions their graph returns logits for.

    python benchmarks/prefill_logits.py ARTIFACT [ARTIFACT ...] [--prompt 128] [--repeats 5]

Each artifact is loaded once; a round runs one prefill of the same --prompt random ids on
each artifact in turn (a fresh cache each time, the first artifact first in even rounds and
last in odd ones), timing `generate.forward` as the generation loop calls it: a default
build (`io.logits_positions` `keep`) is asked for the last position, as a prefill is. One
untimed round first. Prints, per artifact, its `logits_positions`, the logits shape of the
prefill and the median milliseconds over --repeats rounds, with the ratio to the first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvforge import Engine
from kvforge.runners.cache import device_of
from kvforge.runners.generate import empty_cache, forward


def prefill_seconds(engine: Engine, ids: np.ndarray) -> tuple[float, tuple[int, ...]]:
    session = engine.session
    cache = empty_cache(session.io, 1, ids.shape[1] + 1, device_of(session))
    mask = np.ones_like(ids)
    start = time.perf_counter()
    logits, _ = forward(session, ids, mask, cache)
    return time.perf_counter() - start, logits.shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    engines = [Engine.load(path) for path in args.artifacts]
    vocab = engines[0].session.io.vocab_size
    ids = np.random.default_rng(0).integers(2, vocab, (1, args.prompt)).astype(np.int64)
    times: list[list[float]] = [[] for _ in engines]
    shapes: list[tuple[int, ...]] = [() for _ in engines]
    for round_ in range(args.repeats + 1):
        order = list(range(len(engines)))
        for index in order if round_ % 2 == 0 else reversed(order):
            seconds, shapes[index] = prefill_seconds(engines[index], ids)
            if round_:  # the first round warms each session
                times[index].append(seconds)
    first = statistics.median(times[0])
    for path, engine, shape, runs in zip(args.artifacts, engines, shapes, times):
        median = statistics.median(runs)
        positions = engine.session.io.logits_positions
        print(
            f"{path}: logits_positions {positions}, logits {list(shape)}, {args.prompt}-token prefill "
            f"{median * 1e3:.2f} ms (median of {len(runs)}), {median / first:.2f}x the first"
        )


if __name__ == "__main__":
    main()
