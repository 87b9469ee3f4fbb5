"""Decode tok/s of onnxruntime-genai on a kvforge artifact, beside kvforge's own runner on it
and (optionally) onnxruntime-genai on its own model builder's artifact, in one process.

    .venv/bin/python benchmarks/genai_decode.py ARTIFACT [--builder-artifact DIR] [--prompt 128] [--new-tokens 128]

Greedy, batch 1, the same prompt ids for every runtime (the artifact tokenizer's encoding of
the Python standard library's os.py, cut to --prompt tokens). Decode tok/s is
(N - 1) / (t(N) - t(1)) with t the median over --repeats of a whole generation of that many
tokens, so prefill and start-up cancel out (as /work/shared/bench/peer_one.py measures its
peers). Each runtime runs in a process of its own, the runtimes in turn within each round, so
load on a shared machine falls on all. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import onnxruntime_genai as og

from kvforge.runners.engine import Engine


def _genai(directory: Path, ids: list[int]) -> Callable[[int], list[int]]:
    model = og.Model(str(directory))

    def run(n: int) -> list[int]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + n, min_length=len(ids) + n, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        out: list[int] = []
        while not generator.is_done():
            generator.generate_next_token()
            out.append(int(generator.get_next_tokens()[0]))
        return out

    return run


def _kvforge(directory: Path, ids: list[int]) -> Callable[[int], list[int]]:
    engine = Engine.load(directory)
    engine.eos_ids = ()  # every run has its full length, as min_length does for onnxruntime-genai

    def run(n: int) -> list[int]:
        return engine.generate_tokens([ids], max_new_tokens=n, temperature=0)[0]

    return run


def _measure_one(which: str, directory: Path, ids: list[int], new_tokens: int, repeats: int) -> dict[str, object]:
    run = _kvforge(directory, ids) if which == "kvforge" else _genai(directory, ids)
    run(2)  # warm-up
    times: dict[int, list[float]] = {1: [], new_tokens: []}
    out: list[int] = []
    for _ in range(repeats):
        for n in (1, new_tokens):
            start = time.perf_counter()
            out = run(n)
            times[n].append(time.perf_counter() - start)
    return {"t1": statistics.median(times[1]), "tn": statistics.median(times[new_tokens]), "first_ids": out[:8]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--builder-artifact", type=Path, default=None)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", choices=["kvforge", "genai"], help=argparse.SUPPRESS)  # a child's measurement
    args = parser.parse_args()

    text = Path(os.__file__).read_text()
    ids = Engine.load(args.artifact, huge_pages=False).tokenizer.encode(text)[: args.prompt]
    if args.one:
        measured = args.builder_artifact or args.artifact
        print(json.dumps(_measure_one(args.one, measured, ids, args.new_tokens, args.repeats)))
        return
    runs = {"kvforge": ("kvforge", args.artifact), "genai-on-kvforge": ("genai", args.artifact)}
    if args.builder_artifact is not None:
        runs["genai-on-builder"] = ("genai", args.builder_artifact)
    results: dict[str, list[dict[str, object]]] = {name: [] for name in runs}
    # Each runtime in a process of its own (an idle onnxruntime session's spinning threads would
    # slow the next one on a small machine), the runtimes in turn within each round.
    for _ in range(args.rounds):
        for name, (which, directory) in runs.items():
            # the child reads the prompt from the kvforge artifact's tokenizer, as here
            command = [sys.executable, __file__, str(args.artifact), "--one", which, "--prompt", str(args.prompt)]
            command += ["--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
            if directory != args.artifact:
                command += ["--builder-artifact", str(directory)]
            child = subprocess.run(command, capture_output=True, text=True, check=True)
            results[name].append(json.loads(child.stdout.strip().splitlines()[-1]))
    summary = {
        "prompt": len(ids),
        "new_tokens": args.new_tokens,
        "cpus": os.cpu_count(),
        "decode_tok_s": {
            name: (args.new_tokens - 1) / statistics.median([float(r["tn"]) - float(r["t1"]) for r in rs])  # type: ignore[arg-type]
            for name, rs in results.items()
        },
        "first_token_ms": {
            name: statistics.median([float(r["t1"]) for r in rs]) * 1000  # type: ignore[arg-type]
            for name, rs in results.items()
        },
        "first_ids": {name: rs[-1]["first_ids"] for name, rs in results.items()},
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
