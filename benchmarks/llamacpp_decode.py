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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

NEW_TOKENS = 128
PEER = Path(__file__).resolve().parents[2] / "shared" / "bench" / "peer_llamacpp.py"


def prompt_ids(checkpoint: Path, length: int) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    return (tokenizer.encode(Path(os.__file__).read_text()).ids * 8)[:length]


def measure_kvforge(artifact: Path, ids: list[int]) -> dict[str, object]:
    from runners.engine import Engine

    engine = Engine.load(artifact)
    engine.eos_ids = ()  # every generation runs its full length

    def run(n: int) -> list[int]:
        return engine.generate_tokens([ids], max_new_tokens=n, temperature=0)[0]

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
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # a child's kvforge measurement
    args = parser.parse_args()
    ids = prompt_ids(args.checkpoint, args.prompt)
    if args.one is not None:
        print("RESULT " + json.dumps(measure_kvforge(args.one, ids)))
        return
    pairs = {}
    for spec in args.pair:
        name, _, paths = spec.partition("=")
        artifact, _, gguf = paths.partition(":")
        if not (name and artifact and gguf):
            parser.error(f"--pair {spec!r}: expected NAME=ARTIFACT:GGUF")
        pairs[name] = (Path(artifact), Path(gguf))
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
