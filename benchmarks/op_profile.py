"""Where an artifact's prefill and decode step go, op by op, as onnxruntime's profiler times them.

    python benchmarks/op_profile.py ARTIFACT [--prompt 64] [--new-tokens 33] [--top 8]

One greedy generation of `--new-tokens` tokens after a `--prompt`-token prompt of token ids
(after a warm-up generation of the same shape, whose runs are left out), the artifact loaded as
`kvforge generate` loads it (`Engine.load`), with onnxruntime's profiler on
(`SessionOptions.enable_profiling`). The profiler's trace holds each run of the graph
(`model_run`) and each node's kernel time inside it: the first run of the generation is the
prefill, the others its decode steps. Kernel times are summed per run into groups:

- `MatMulNBits` by its bits and block size, with the LM head (the product the logits come
  from, back along first inputs) apart;
- a GGUF import's min terms (`MinTerms` in `kvforge/passes/quantize.py`): the float MatMuls
  by the minimums (those whose input is a block sum), their Adds, and the block sums they
  read (Reshape and ReduceSum, or a MatMul by a block indicator);
- every other op by its type.

Prints one JSON object: per phase (`prefill`, `decode`: the median over the decode steps of
each group's milliseconds, and the step's own wall time as the profiler saw it), groups sorted
by time, `--top` of them named and the rest summed. The profiler adds its own cost to every
node (about a microsecond), so the sum is a little above an unprofiled step's time; the
shares are what to read.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
import onnxruntime

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

_PRODUCTS = {"MatMul", "MatMulNBits", "Gemm"}


def node_groups(model_path: Path, logits: str) -> dict[str, str]:
    """Each node's name -> the group its kernel time counts in."""
    model = onnx.load(str(model_path), load_external_data=False)
    nodes = list(model.graph.node)
    producer = {out: node for node in nodes for out in node.output}
    head, value = None, logits
    for _ in range(16):  # back from the logits along first inputs (reshapes, a softcap) to the head's product
        node = producer.get(value)
        if node is None or not node.input:
            break
        if node.op_type in _PRODUCTS:
            head = node.name
            break
        value = node.input[0]
    # a min term: a MatMul by the minimums of the input's block sums, which are a ReduceSum over
    # a Reshape into blocks or a MatMul by a block indicator; a ReduceSum feeding anything else
    # keeps its op type
    candidates = {
        node.output[0]: node
        for node in nodes
        if node.op_type == "ReduceSum" or (node.op_type == "MatMul" and "kvforge.block_sum" in node.input[1])
    }
    terms = [node for node in nodes if node.op_type == "MatMul" and node.input[0] in candidates]
    mins = {node.output[0] for node in terms}
    sums = {node.input[0] for node in terms}
    splits = {candidates[s].input[0] for s in sums if candidates[s].op_type == "ReduceSum"}
    groups = {}
    for node in nodes:
        attrs = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
        group = node.op_type
        if node.op_type == "MatMulNBits":
            group = f"MatMulNBits {attrs.get('bits', 4)}-bit, blocks of {attrs.get('block_size')}"
        if node.name == head:
            group = f"LM head ({group})"
        elif node.output[0] in mins:
            group = "min terms: MatMul by the minimums"
        elif node.op_type == "Add" and any(i in mins for i in node.input):
            group = "min terms: their Add"
        elif node.output[0] in sums or node.output[0] in splits:
            group = "min terms: block sums"
        groups[node.name] = group
    return groups


def profiled_generation(artifact: Path, prompt: int, new_tokens: int, trace_dir: Path) -> Path:
    """Two greedy generations of `new_tokens` after `prompt` token ids, the artifact's session
    profiled (the first generation a warm-up); the trace's path."""
    from kvforge.runners.engine import Engine

    plain = onnxruntime.SessionOptions

    class Profiled(plain):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = str(trace_dir / "trace")

    onnxruntime.SessionOptions = Profiled
    try:
        engine = Engine.load(artifact)
    finally:
        onnxruntime.SessionOptions = plain
    ids = np.random.default_rng(0).integers(100, 1000, prompt).tolist()
    for _ in range(2):
        engine.generate_tokens([ids], max_new_tokens=new_tokens, temperature=0)
    del engine  # the session writes its trace when it closes
    gc.collect()
    traces = sorted(trace_dir.glob("trace*.json"))
    if not traces:
        raise SystemExit(f"onnxruntime wrote no profile under {trace_dir}")
    return traces[-1]


def per_run(trace: Path, groups: dict[str, str]) -> list[tuple[float, dict[str, float]]]:
    """Each run of the graph in order: its wall milliseconds and its kernel milliseconds by group."""
    events = json.loads(trace.read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    totals: list[dict[str, float]] = [defaultdict(float) for _ in runs]
    starts = [start for start, _ in runs]
    for event in events:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        index = int(np.searchsorted(starts, event["ts"], side="right")) - 1
        if index < 0 or event["ts"] > runs[index][1]:
            continue
        node = event["name"][: -len("_kernel_time")]
        totals[index][groups.get(node, event.get("args", {}).get("op_name", "?"))] += event["dur"] / 1000
    return [((end - start) / 1000, dict(t)) for (start, end), t in zip(runs, totals)]


def summary(runs: list[tuple[float, dict[str, float]]], top: int) -> dict[str, object]:
    names = {name for _, groups in runs for name in groups}
    ms = {name: statistics.median(groups.get(name, 0.0) for _, groups in runs) for name in names}
    ranked = sorted(ms.items(), key=lambda item: -item[1])
    kernels = sum(ms.values())
    shown = {name: {"ms": round(value, 3), "share": round(value / kernels, 3)} for name, value in ranked[:top]}
    rest = sum(value for _, value in ranked[top:])
    if rest:
        shown["everything else"] = {"ms": round(rest, 3), "share": round(rest / kernels, 3)}
    return {
        "runs": len(runs),
        "run_ms": round(statistics.median(w for w, _ in runs), 3),
        "kernel_ms": round(kernels, 3),
        "groups": shown,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args(argv)
    manifest = json.loads((args.artifact / "manifest.json").read_text())
    logits = manifest["io"]["outputs"][0]["name"]
    groups = node_groups(args.artifact / "model.onnx", logits)
    with tempfile.TemporaryDirectory() as tmp:
        runs = per_run(profiled_generation(args.artifact, args.prompt, args.new_tokens, Path(tmp)), groups)
    # the trace holds both generations, the warm-up's runs first: the second's are measured
    generation = runs[len(runs) // 2 :]
    print(
        json.dumps(
            {
                "artifact": str(args.artifact),
                "prompt": args.prompt,
                "new_tokens": args.new_tokens,
                "prefill": summary(generation[:1], args.top),
                "decode": summary(generation[1:], args.top),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
