"""How long `kvforge` takes to answer when it has nothing heavy to do.

    python benchmarks/cli_startup.py [--runs 7] [--root CHECKOUT] [--json]

Each command runs `--runs` times in a fresh process (`python -m kvforge`, the console
script's code), timed from the start of the process to its exit; the table gives the median
and the fastest run. The commands: `--version`, `--help`, `build --help`, a checkpoint
directory that does not exist, an `-o` that cannot be written (/proc/nope, refused before any
export), a checkpoint passed to `generate`, an artifact passed to `build` (refused from its
manifest.json), `inspect examples/model` (config and headers: parameters, weight and KV-cache
bytes), and, for scale, `python -c pass` and `python -c "import torch"` (what every command
paid before the heavy imports moved into the commands). `--root` times the kvforge of another
checkout (an older commit, to compare); the checkpoint used is this checkout's examples/model
either way.

Every run sets PYTHONDONTWRITEBYTECODE=1, as many container images do: a module whose bytecode
is not cached is compiled at every run, so the figures are what such an environment pays.
`--uncached` also points PYTHONPYCACHEPREFIX at an empty directory, so that no bytecode is found
at all: an install made with `pip install --no-compile` in such an environment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "model"  # a checkpoint directory kept in the repository


def cases(scratch: Path) -> dict[str, tuple[list[str], int]]:
    """Name -> (argv after the interpreter, the exit status it must have)."""
    cli = [sys.executable, "-m", "kvforge"]
    return {
        "python -c pass": ([sys.executable, "-c", "pass"], 0),
        "python -c 'import torch'": ([sys.executable, "-c", "import torch"], 0),
        "kvforge --version": ([*cli, "--version"], 0),
        "kvforge --help": ([*cli, "--help"], 0),
        "kvforge build --help": ([*cli, "build", "--help"], 0),
        "kvforge build missing-dir -o x": ([*cli, "build", str(scratch / "missing-dir"), "-o", str(scratch / "x")], 2),
        "kvforge build CKPT -o /proc/nope": ([*cli, "build", str(EXAMPLE), "-o", "/proc/nope"], 2),
        "kvforge generate CKPT hi": ([*cli, "generate", str(EXAMPLE), "hi"], 2),
        "kvforge build ARTIFACT -o x": ([*cli, "build", str(_artifact(scratch)), "-o", str(scratch / "x")], 2),
        "kvforge inspect CKPT": ([*cli, "inspect", str(EXAMPLE)], 0),
    }


def _artifact(scratch: Path) -> Path:
    """A directory as a build leaves it, as far as `build` looks: its manifest.json."""
    artifact = scratch / "artifact"
    artifact.mkdir(exist_ok=True)
    (artifact / "manifest.json").write_text(json.dumps({"schema_version": 3}))
    return artifact


def time_once(argv: list[str], expected: int, root: Path, pycache: Path | None = None) -> float:
    start = time.perf_counter()
    env = os.environ | {"PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    if pycache is not None:
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != expected:  # an older checkout may lack an option: said, and timed all the same
        last = (done.stderr.strip().splitlines() or [""])[-1]
        print(f"{' '.join(argv[1:])}: exit {done.returncode}, expected {expected}: {last}", file=sys.stderr)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--root", type=Path, default=ROOT, help="The checkout whose kvforge is timed.")
    parser.add_argument("--json", action="store_true", help="Print the results as JSON.")
    parser.add_argument("--uncached", action="store_true", help="Find no bytecode: every module compiled each run.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        measured = cases(Path(scratch))
        times: dict[str, list[float]] = {name: [] for name in measured}
        for _ in range(args.runs):  # rounds, so that a slow moment of a shared machine falls on every case
            for name, (argv, expected) in measured.items():
                pycache = Path(scratch) / "no-bytecode" if args.uncached else None
                times[name].append(time_once(argv, expected, args.root.resolve(), pycache))
    results = {name: {"median_s": statistics.median(t), "min_s": min(t), "runs": len(t)} for name, t in times.items()}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    width = max(map(len, results))
    print(f"{'command':<{width}}  median   fastest")
    for name, r in results.items():
        print(f"{name:<{width}}  {r['median_s']:5.2f} s  {r['min_s']:5.2f} s")


if __name__ == "__main__":
    main()
