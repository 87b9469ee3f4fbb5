"""Time `Engine.load` of an artifact against reading its files once, with where the time goes.

    python benchmarks/load_time.py ARTIFACT [--runs 5] [--no-huge-pages]

Each load runs in a fresh process (the files stay in the page cache: the first run warms it,
so every run reads warm), which also reports the parts of its load: onnxruntime's session
creation, the huge-page advice given while the session is created (in a thread) and after
it, the sha256 checks (as their threads spent it) and how long the load waited for them
once the session was made. "read once" is one pass over the files
in 16 MiB reads, after the loads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, sys, threading, time
import onnxruntime
from kvforge.runners import engine, hugepages, manifest

parts = {"session": 0.0, "huge_pages_during": 0.0, "huge_pages_after": 0.0, "hash_threads": 0.0, "hash_wait": 0.0}

def timed(owner, name, part):
    inner = getattr(owner, name)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            key = part(threading.current_thread()) if callable(part) else part
            parts[key] += time.perf_counter() - start
    setattr(owner, name, wrapper)

timed(onnxruntime.InferenceSession, "__init__", "session")
timed(hugepages, "_advise", lambda t: "huge_pages_during" if t.name == "kvforge-huge-pages" else "huge_pages_after")
timed(manifest, "sha256_file", "hash_threads")
if hasattr(manifest, "FileHashes"):  # loads before the hashes ran beside the session had none
    timed(manifest.FileHashes, "failure", "hash_wait")
start = time.perf_counter()
engine.Engine.load(sys.argv[1], huge_pages=sys.argv[2] == "1")
parts["load"] = time.perf_counter() - start
print(json.dumps(parts))
"""


def read_once(directory: Path) -> float:
    start = time.perf_counter()
    for path in sorted(directory.iterdir()):
        with open(path, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-huge-pages", action="store_true")
    args = parser.parse_args()
    size = sum(p.stat().st_size for p in args.artifact.iterdir())
    read_once(args.artifact)  # into the page cache
    huge = "0" if args.no_huge_pages else "1"
    runs = []
    for _ in range(args.runs):
        child = subprocess.run(
            [sys.executable, "-c", CHILD, str(args.artifact), huge], capture_output=True, text=True, check=True
        )
        runs.append(json.loads(child.stdout.splitlines()[-1]))
        print("  ".join(f"{k} {v:.2f}" for k, v in runs[-1].items()), flush=True)
    read = read_once(args.artifact)
    load = statistics.median(r["load"] for r in runs)
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"{args.artifact}: {size / 1e9:.2f} GB, read once {read:.2f} s")
    print(
        f"Engine.load median of {args.runs}: {load:.2f} s ({load / read:.1f}x the read); medians: "
        + ", ".join(f"{k} {v:.2f}" for k, v in medians.items() if k != "load")
    )


if __name__ == "__main__":
    main()
