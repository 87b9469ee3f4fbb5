"""kvforge against llama.cpp, decode and first token, interleaved rounds, one JSON summary.

    python benchmarks/llamacpp_decode.py REF_CKPT --pair fp32=ART:GGUF --pair int4=ART:GGUF ...
        [--rounds 5] [--prompt 128] [--llamacpp-python PATH]

Each round runs, for every pair in turn, kvforge on the artifact and llama.cpp on the GGUF file,
each in a fresh process (`../shared/bench/peer_llamacpp.py` for llama.cpp, run with the python of
llama-cpp-python: `$KVF_EVAL_ROOT/llamacpp/venv/bin/python`, which `setup_llamacpp.sh` builds).
kvforge is measured as that script measures llama.cpp: the same prompt (REF_CKPT's tokenizer
over the standard library's os.py, repeated, cut to --prompt ids), greedy, a warm-up of 2
tokens, then t(1) and t(128) each the median of 3 whole generations, decode tok/s =
127 / (t(128) - t(1)). The summary gives each system's figures per round, their medians, the
median of the per-round ratios kvforge / llama.cpp, and steadiness: each system's slowest
round over its fastest.

    python benchmarks/llamacpp_decode.py REF_CKPT --pair int4=ART:GGUF --paired 30

`--paired N` asks where the spread from round to round comes from: kvforge and llama.cpp each
stay loaded in a process of their own and take turns, N samples each (a sample: t(1) then t(128),
one generation each, decode tok/s as above), so that each kvforge sample has a llama.cpp sample
taken just after it. It reports each system's spread (the slowest sample against the median,
the 10th and 90th percentiles) and the correlation of the paired samples' log rates: slow
samples that the two systems share are the machine's, slow samples of one system alone are
that system's own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

NEW_TOKENS = 128
PEER = Path(__file__).resolve().parents[2] / "shared" / "bench" / "peer_llamacpp.py"


def prompt_ids(checkpoint: Path, length: int) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    return (tokenizer.encode(Path(os.__file__).read_text()).ids * 8)[:length]


def measure_kvforge(artifact: Path, ids: list[int]) -> dict[str, object]:
    generate = kvforge_generator(artifact)

    def run(n: int) -> list[int]:
        return generate(ids, n)

    run(2)
    seconds: dict[int, float] = {}
    out: list[int] = []
    for n in (1, NEW_TOKENS):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            out = run(n)
            times.append(time.perf_counter() - start)
        seconds[n] = statistics.median(times)
    return {
        "decode": (NEW_TOKENS - 1) / (seconds[NEW_TOKENS] - seconds[1]),
        "first_token_ms": seconds[1] * 1000,
        "first_ids": out[:4],
    }


def llamacpp_generator(gguf: Path, length: int) -> Callable[[list[int], int], list[int]]:
    """llama.cpp loaded as `../shared/bench/peer_llamacpp.py` loads it (run with llama-cpp-python's python)."""
    import llama_cpp

    threads = os.cpu_count()
    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=length + NEW_TOKENS + 8,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )

    def run(ids: list[int], n: int) -> list[int]:
        llm.reset()
        out: list[int] = []
        for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if len(out) == n:
                break
        return out

    return run


def kvforge_generator(artifact: Path) -> Callable[[list[int], int], list[int]]:
    from kvforge.runners.engine import Engine

    engine = Engine.load(artifact)
    engine.eos_ids = ()  # every generation runs its full length
    return lambda ids, n: engine.generate_tokens([ids], max_new_tokens=n, temperature=0)[0]


def serve_samples(run: Callable[[list[int], int], list[int]], ids: list[int]) -> None:
    """A `--paired` worker: one sample (t(1), then t(128)) per line read from stdin."""
    run(ids, 2)
    print("READY", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        run(ids, 1)
        first = time.perf_counter() - start
        start = time.perf_counter()
        run(ids, NEW_TOKENS)
        whole = time.perf_counter() - start
        print("RESULT " + json.dumps({"decode": (NEW_TOKENS - 1) / (whole - first), "first_token_ms": first * 1000}))
        sys.stdout.flush()


def paired(commands: dict[str, list[str]], samples: int) -> dict[str, object]:
    """`samples` turns of each worker, alternating, with a pause between turns (each system's
    idle threads stop spinning before the other runs)."""
    workers = {
        system: subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for system, command in commands.items()
    }
    rates: dict[str, list[float]] = {system: [] for system in workers}
    try:
        for system, worker in workers.items():
            assert worker.stdout is not None
            if worker.stdout.readline().strip() != "READY":
                raise RuntimeError(f"the {system} worker did not start: {' '.join(commands[system])}")
        for _ in range(samples):
            for system, worker in workers.items():
                assert worker.stdin is not None and worker.stdout is not None
                time.sleep(0.2)
                worker.stdin.write("go\n")
                worker.stdin.flush()
                rates[system].append(float(_result(worker.stdout.readline())["decode"]))  # type: ignore[arg-type]
    finally:
        for worker in workers.values():
            worker.kill()
    logs = {system: [math.log(r) for r in values] for system, values in rates.items()}
    ours, theirs = logs["kvforge"], logs["llama.cpp"]
    ratios = [a / b for a, b in zip(rates["kvforge"], rates["llama.cpp"])]

    def spread(values: list[float]) -> dict[str, float]:
        deciles = statistics.quantiles(values, n=10)
        return {
            "median": statistics.median(values),
            "p10": deciles[0],
            "p90": deciles[-1],
            "median_over_slowest": statistics.median(values) / min(values),
            "fastest_over_slowest": max(values) / min(values),
        }

    return {
        "samples": samples,
        "decode_tok_s": rates,
        "spread": {system: spread(values) for system, values in rates.items()},
        "ratio": spread(ratios),
        "correlation_of_log_rates": statistics.correlation(ours, theirs),
    }


def _result(stdout: str) -> dict[str, object]:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    return dict(json.loads(lines[-1][len("RESULT ") :]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--pair", action="append", default=[], metavar="NAME=ARTIFACT:GGUF")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=128)
    root = Path(os.environ.get("KVF_EVAL_ROOT", Path.home() / ".cache" / "kvf-eval"))
    parser.add_argument("--llamacpp-python", type=Path, default=root / "llamacpp" / "venv" / "bin" / "python")
    parser.add_argument("--paired", type=int, metavar="SAMPLES", help="alternate two loaded systems (above)")
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # a child's kvforge measurement
    parser.add_argument("--serve", nargs=2, metavar=("SYSTEM", "PATH"), help=argparse.SUPPRESS)  # a --paired worker
    args = parser.parse_args()
    ids = prompt_ids(args.checkpoint, args.prompt)
    if args.one is not None:
        print("RESULT " + json.dumps(measure_kvforge(args.one, ids)))
        return
    if args.serve is not None:
        system, path = args.serve
        make = kvforge_generator(Path(path)) if system == "kvforge" else llamacpp_generator(Path(path), len(ids))
        serve_samples(make, ids)
        return
    pairs = {}
    for spec in args.pair:
        name, _, paths = spec.partition("=")
        artifact, _, gguf = paths.partition(":")
        if not (name and artifact and gguf):
            parser.error(f"--pair {spec!r}: expected NAME=ARTIFACT:GGUF")
        pairs[name] = (Path(artifact), Path(gguf))
    if args.paired is not None:
        base = [str(args.checkpoint), "--prompt", str(args.prompt), "--serve"]
        results = {
            name: paired(
                {
                    "kvforge": [sys.executable, __file__, *base, "kvforge", str(artifact)],
                    "llama.cpp": [str(args.llamacpp_python), __file__, *base, "llama.cpp", str(gguf)],
                },
                args.paired,
            )
            for name, (artifact, gguf) in pairs.items()
        }
        print(json.dumps({"prompt": len(ids), "new_tokens": NEW_TOKENS, **results}, indent=2))
        return
    rows: dict[str, dict[str, list[dict[str, object]]]] = {n: {"kvforge": [], "llama.cpp": []} for n in pairs}
    for round_ in range(args.rounds):
        for name, (artifact, gguf) in pairs.items():
            ours = [sys.executable, __file__, str(args.checkpoint), "--prompt", str(args.prompt)]
            ours += ["--one", str(artifact)]
            theirs = [str(args.llamacpp_python), str(PEER), str(gguf), str(args.checkpoint), str(args.prompt)]
            for system, command in (("kvforge", ours), ("llama.cpp", theirs)):
                child = subprocess.run(command, capture_output=True, text=True, check=True)
                rows[name][system].append(_result(child.stdout))
            done = [f"{s} {r[-1]['decode']:.1f} tok/s {r[-1]['first_token_ms']:.0f} ms" for s, r in rows[name].items()]
            print(f"round {round_ + 1} {name}: " + ", ".join(done), file=sys.stderr, flush=True)
    summary: dict[str, object] = {"prompt": len(ids), "new_tokens": NEW_TOKENS, "rounds": args.rounds}
    for name, systems in rows.items():
        decode = {s: [float(r["decode"]) for r in rs] for s, rs in systems.items()}  # type: ignore[arg-type]
        first = {s: [float(r["first_token_ms"]) for r in rs] for s, rs in systems.items()}  # type: ignore[arg-type]
        summary[name] = {
            "decode_tok_s": decode,
            "first_token_ms": first,
            "decode_median": {s: statistics.median(v) for s, v in decode.items()},
            "first_token_median_ms": {s: statistics.median(v) for s, v in first.items()},
            "decode_ratio_per_round": [a / b for a, b in zip(decode["kvforge"], decode["llama.cpp"])],
            "decode_ratio_median": statistics.median(a / b for a, b in zip(decode["kvforge"], decode["llama.cpp"])),
            "first_token_ratio_median": statistics.median(a / b for a, b in zip(first["kvforge"], first["llama.cpp"])),
            "steadiness_fastest_over_slowest": {s: max(v) / min(v) for s, v in decode.items()},
            "first_ids": {s: rs[-1]["first_ids"] for s, rs in systems.items()},
        }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
