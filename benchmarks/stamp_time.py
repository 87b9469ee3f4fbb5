"""Export + lower time of the whole stack against stamping (`kvforge.toolchain.stamp`), side by side
in one run.

    python benchmarks/stamp_time.py CHECKPOINT [CHECKPOINT ...] [--rounds 1]

Each measurement runs in a fresh process (the same imports and one-time tracing costs for
both), loads the eager model, then times torch.export and the ONNX lowering: of the whole
stack (`export_decoder`, `to_onnx`), or of the cut-down model and the stamping
(`stamp.export`, `stamp.lower`). Every round measures each checkpoint whole, then stamped.
Prints one line per measurement and a table of medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(checkpoint: str, mode: str) -> dict[str, float]:
    from kvforge.runners.contract import DecoderIO
    from kvforge.toolchain import checkpoint as checkpoints
    from kvforge.toolchain import stamp
    from kvforge.toolchain.build import read_spec
    from kvforge.toolchain.export import eager_model, export_decoder
    from kvforge.toolchain.lower import to_onnx

    ckpt = checkpoints.load(checkpoint)
    spec = read_spec(ckpt)
    io = DecoderIO.for_spec(spec)
    model = eager_model(ckpt, spec)
    start = time.perf_counter()
    if mode == "whole":
        program = export_decoder(model, spec, io)
        middle = time.perf_counter()
        graph = to_onnx(program, io)
    else:
        cut = stamp.export(model, spec, io)
        middle = time.perf_counter()
        graph, _ = stamp.lower(cut, model, io)
    end = time.perf_counter()
    nodes = sum(1 for _ in graph.graph)
    return {"export": middle - start, "lower": end - middle, "total": end - start, "nodes": nodes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="*")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--one", nargs=2, metavar=("CHECKPOINT", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one)))
        return
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for checkpoint in args.checkpoints:
            for mode in ("whole", "stamped"):
                out = subprocess.run(
                    [sys.executable, __file__, "--one", checkpoint, mode],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                record = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault((checkpoint, mode), []).append(record)
                print(f"{Path(checkpoint).name} {mode}: {record}", flush=True)
    print("\n| checkpoint | lowering | export s | lower s | export + lower s | nodes |")
    print("|---|---|---|---|---|---|")
    for (checkpoint, mode), records in results.items():
        med = {k: statistics.median(r[k] for r in records) for k in ("export", "lower", "total", "nodes")}
        print(
            f"| {Path(checkpoint).name} | {mode} | {med['export']:.1f} | {med['lower']:.1f} | "
            f"{med['total']:.1f} | {med['nodes']:.0f} |"
        )


if __name__ == "__main__":
    main()
