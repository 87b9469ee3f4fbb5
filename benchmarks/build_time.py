"""A whole build's wall time and peak memory beside the peers' builders, in one run.

    python benchmarks/build_time.py CHECKPOINT [CHECKPOINT ...] WORKDIR [--rounds 3]
                                    [--tools kvforge genai optimum] [kvforge@SOURCE_TREE ...]

Each round runs every tool once on every checkpoint, one build after the other (the order
turns round by round, so no build always runs first or last), each a fresh process under
`/usr/bin/time`, each writing a fresh output directory under WORKDIR. Several checkpoints
compare the same model's builds from different files side by side (a GGUF file against the
safetensors directory of its dequantized weights, say): the medians of each are given over
the first checkpoint's, tool by tool.

- kvforge: `python -m kvforge build CHECKPOINT -o OUT` (fp32, ort-cpu, the parity
  gate included), with this interpreter and the lowering cache off (every build traces and
  lowers: a first build); its stage times are read off its last line;
- kvforge+cache: the same with a lowering cache under WORKDIR, which one build before the
  first round fills (unmeasured): a rebuild of the same model, which reads its lowered
  layers back instead of tracing them (`kvforge.toolchain.lowering_cache`);
  `kvforge@DIR` (or `kvforge+cache@DIR`) runs the same from another source tree (a worktree or a copy of an earlier
  commit, given to the interpreter as pyproject.toml maps it: `source_view`), for a
  before-and-after in the same rounds;
- genai: onnxruntime-genai's model builder, `python -m onnxruntime_genai.models.builder
  -i CHECKPOINT -o OUT -p fp32 -e cpu -c OUT.cache`;
- optimum: `optimum-cli export onnx --model CHECKPOINT --task text-generation-with-past OUT`.

The peers run from the environments `../shared/bench/setup_peers.sh` makes (under
KVF_EVAL_ROOT, default ~/.cache/kvf-eval), as `../shared/bench/peer_one.py` runs them.
Prints one JSON line per build (wall seconds, CPU seconds (user + system, every thread of
the process and its children), peak resident memory in GB, the load average when it
started, kvforge's stages and the share of `/usr/bin/time`'s wall that they add up to) and
the medians per tool and checkpoint. On a machine other jobs share, the CPU seconds vary less
between runs than the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

EVAL_ROOT = Path(os.environ.get("KVF_EVAL_ROOT", Path.home() / ".cache" / "kvf-eval"))
REPO = Path(__file__).resolve().parent.parent
KVFORGE = ("kvforge", "kvforge+cache")


def command(tool: str, checkpoint: str, out: Path) -> list[str]:
    if tool.split("@")[0] in KVFORGE:
        return [sys.executable, "-m", "kvforge", "build", checkpoint, "-o", str(out), "-q"]
    if tool == "genai":
        python = str(EVAL_ROOT / "genai" / "bin" / "python")
        builder = [python, "-m", "onnxruntime_genai.models.builder"]
        return [*builder, "-i", checkpoint, "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", f"{out}.cache"]
    if tool == "optimum":
        cli = str(EVAL_ROOT / "peers" / "bin" / "optimum-cli")
        return [cli, "export", "onnx", "--model", checkpoint, "--task", "text-generation-with-past", str(out)]
    raise SystemExit(f"unknown tool {tool}")


def measure(tool: str, checkpoint: str, workdir: Path) -> dict[str, float]:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", tool)
    out = workdir / f"out-{slug}"
    for stale in (out, Path(f"{out}.cache")):
        shutil.rmtree(stale, ignore_errors=True)
    load = os.getloadavg()[0]
    timed = ["/usr/bin/time", "-f", "TIME %e %M %U %S", *command(tool, checkpoint, out)]
    name, _, tree = tool.partition("@")
    cwd, environment = REPO, dict(os.environ)
    if name in KVFORGE:
        cache = workdir / f"lowering-cache-{slug}" if name == "kvforge+cache" else None
        environment["KVFORGE_LOWERING_CACHE"] = "off" if cache is None else str(cache)
        if tree:
            # run from the view: `-m` puts the working directory first on sys.path, where another
            # tree's own kvforge/ would be found first, its subpackages then this interpreter's
            cwd = source_view(Path(tree), workdir)
            environment["PYTHONPATH"] = str(cwd)
    done = subprocess.run(timed, capture_output=True, text=True, cwd=cwd, env=environment)
    if done.returncode:
        raise SystemExit(f"{tool} failed:\n{done.stderr[-3000:]}")
    found = re.search(r"TIME (\S+) (\d+) (\S+) (\S+)", done.stderr)
    assert found is not None
    wall, peak, user, system = found.groups()
    row = {
        "wall": float(wall),
        "cpu": round(float(user) + float(system), 2),
        "peak_gb": int(peak) * 1024 / 1e9,
        "loadavg": round(load, 2),
    }
    stages = re.search(r"built \S+ (?:in [\d.]+s )?\((.*)\)", done.stderr)  # "in N s" since the summary has it
    if stages is not None:
        times = {name: float(s) for name, s in re.findall(r"(\w+) ([\d.]+)s", stages.group(1))}
        row |= times | {"stages_share": round(sum(times.values()) / row["wall"], 3)}
    return row


def source_view(tree: Path, workdir: Path) -> Path:
    """A folder for PYTHONPATH holding `tree`'s kvforge as pyproject.toml maps it: `kvforge/`
    with `toolchain/`, `passes/` and `runners/` beneath it, as links. `tree` on PYTHONPATH
    alone gives its `kvforge/` only: the subpackages would come from whichever tree this
    interpreter's editable install maps."""
    view = workdir / f"tree-{re.sub(r'[^A-Za-z0-9]+', '-', str(tree.resolve()))}"
    shutil.rmtree(view, ignore_errors=True)
    (view / "kvforge").mkdir(parents=True)
    for part in (tree / "kvforge").iterdir():
        if part.name != "__pycache__":
            (view / "kvforge" / part.name).symlink_to(part.resolve())
    for package in ("toolchain", "passes", "runners"):
        (view / "kvforge" / package).symlink_to((tree / package).resolve())
    return view


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT")
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tools", nargs="+", default=["kvforge", "genai", "optimum"])
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    builds = [(tool, checkpoint) for checkpoint in args.checkpoints for tool in args.tools]
    rows: dict[tuple[str, str], list[dict[str, float]]] = {build: [] for build in builds}
    for tool, checkpoint in builds:  # a rebuild's cache: filled by a first build, not measured
        if tool.partition("@")[0] == "kvforge+cache":
            measure(tool, checkpoint, args.workdir)
    for round_ in range(args.rounds):
        shift = round_ % len(builds)
        for tool, checkpoint in builds[shift:] + builds[:shift]:
            row = measure(tool, checkpoint, args.workdir)
            rows[tool, checkpoint].append(row)
            print(json.dumps({"round": round_ + 1, "tool": tool, "checkpoint": checkpoint} | row), flush=True)
    print("medians:")
    medians = {
        build: {k: statistics.median(r[k] for r in measured if k in r) for k in measured[0]}
        for build, measured in rows.items()
    }
    for (tool, checkpoint), median in medians.items():
        print(json.dumps({"tool": tool, "checkpoint": checkpoint} | {k: round(v, 3) for k, v in median.items()}))
    first = args.checkpoints[0]
    for tool, checkpoint in builds:  # the same tool's build of another file of the model, over the first's
        if checkpoint != first:
            base = medians[tool, first]
            ratios = {f"{k}_ratio": round(medians[tool, checkpoint][k] / base[k], 2) for k in ("wall", "cpu")}
            print(json.dumps({"tool": tool, "checkpoint": checkpoint, "against": first} | ratios))
    for checkpoint in args.checkpoints:  # the measure: each tool's medians over onnxruntime-genai's builder's
        if ("genai", checkpoint) in medians:
            base = medians["genai", checkpoint]
            for tool in args.tools:
                median = medians[tool, checkpoint]
                ratios = {f"{k}_ratio": round(median[k] / base[k], 2) for k in ("wall", "cpu", "peak_gb")}
                print(json.dumps({"tool": tool, "checkpoint": checkpoint, "against": "genai"} | ratios))


if __name__ == "__main__":
    main()
