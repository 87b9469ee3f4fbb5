"""What the min terms of an imported GGUF file cost a decode step, and why onnxruntime's kernel cannot take them.

    python benchmarks/min_terms.py ARTIFACT [--rounds 3]

ARTIFACT is a default build of a GGUF file whose matrices carry a float minimum per block
(Q4_1, Q4_K, Q5_K): each such projection is `MatMulNBits` plus a min term, the input's block
sums times the minimums (a Reshape, a ReduceSum, a float MatMul and an Add; the `MinTerms`
docstring in `kvforge/passes/quantize.py`). Two measurements:

- decode: the artifact against a copy of it whose min terms are cut out (each projection's
  output is its `MatMulNBits` alone: wrong numbers, the speed the projections would have if
  the minimums cost nothing), each in a fresh process, rounds alternating, measured as
  `llamacpp_decode.py` measures kvforge (prompt 128, decode tok/s = 127 / (t(128) - t(1)),
  medians of 3), and the bytes the minimums stream per decode step (float32, as the float
  MatMul reads them);
- kernel: `MatMulNBits` over the artifact's min-term projections' shapes, one graph of
  independent nodes with random codes, in three forms: symmetric (what the import writes),
  with uint8 zero points (an integer minimum per block, the form the kernel takes), and with
  float zero points (a float minimum per block, the only form that would hold a GGUF block's
  minimum without a term beside it): medians of one decode step (M = 1) over alternating rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.llamacpp_decode import measure_kvforge, prompt_ids  # noqa: E402
from benchmarks.matmul_nbits import nbits_session  # noqa: E402

PROMPT = 128


def min_term_adds(graph: onnx.GraphProto) -> list[tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto]]:
    """(Add, its MatMulNBits product, its min-term MatMul) for each min term of the graph."""
    producer = {output: node for node in graph.node for output in node.output}
    found = []
    for node in graph.node:
        if node.op_type != "Add" or len(node.input) != 2:
            continue
        product, term = (producer.get(name) for name in node.input)
        if product is not None and term is not None and product.op_type == "MatMulNBits" and term.op_type == "MatMul":
            found.append((node, product, term))
    return found


def mins_bytes(terms: list[tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto]]) -> int:
    """Bytes of the minimums the min-term MatMuls read per step: [K / block, N] float32 each (a
    minimum stored narrower, or made from a Q4_K file's factors, is folded to float32 when
    onnxruntime loads the model)."""
    total = 0
    for _, product, _ in terms:
        attributes = {a.name: helper.get_attribute_value(a) for a in product.attribute}
        total += -(-int(attributes["K"]) // int(attributes["block_size"])) * int(attributes["N"]) * 4
    return total


def without_min_terms(artifact: Path, out: Path) -> int:
    """A copy of `artifact` whose min terms are cut out; the files other than the graph are
    linked (or copied) and the manifest's hash of the graph is the new graph's. Returns the
    number of min terms cut."""
    model = onnx.load(str(artifact / "model.onnx"), load_external_data=False)
    graph = model.graph
    terms = min_term_adds(graph)
    dropped = {id(add) for add, _, _ in terms}
    for add, product, _ in terms:
        for node in graph.node:
            for i, name in enumerate(node.input):
                if name == add.output[0]:
                    node.input[i] = product.output[0]
        for output in graph.output:
            if output.name == add.output[0]:
                raise SystemExit(f"{artifact}: a min term's sum is a graph output; this graph is not an import's")
    needed = {output.name for output in graph.output}
    kept: list[onnx.NodeProto] = []
    for node in reversed(graph.node):  # the graph is in order: readers after what they read
        if id(node) not in dropped and any(name in needed for name in node.output):
            kept.append(node)
            needed.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    out.mkdir(parents=True)
    for item in artifact.iterdir():
        if item.name in ("model.onnx", "manifest.json"):
            continue
        try:
            os.link(item, out / item.name)
        except OSError:
            shutil.copy2(item, out / item.name)
    onnx.save(model, str(out / "model.onnx"))
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["files"]["model.onnx"] = hashlib.sha256((out / "model.onnx").read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return len(terms)


def kernel_forms(shapes: list[tuple[int, int]], block: int, rounds: int) -> dict[str, float]:
    """Median ms of one decode step over `shapes` ((N, K) each, 4-bit codes in blocks of `block`)
    in the three forms (`matmul_nbits.nbits_session`)."""
    from kvforge.runners.cpus import usable_cpus

    forms = {"symmetric": None, "uint8 zero points": "uint8", "float zero points": "float"}
    rng = np.random.default_rng(1)
    feeds = {f"x{i}": rng.standard_normal((1, k)).astype(np.float32) for i, (_, k) in enumerate(shapes)}
    times: dict[str, list[float]] = {form: [] for form in forms}
    with tempfile.TemporaryDirectory() as work:
        sessions = {
            form: nbits_session(shapes, 4, block, usable_cpus(), Path(work), zero_points)[0]
            for form, zero_points in forms.items()
        }
        for _ in range(rounds):
            for form, session in sessions.items():
                session.run(None, feeds)
                runs = []
                for _ in range(5 if form == "float zero points" else 30):
                    start = time.perf_counter()
                    session.run(None, feeds)
                    runs.append(time.perf_counter() - start)
                times[form].append(statistics.median(runs) * 1000)
        del sessions
    return {form: statistics.median(values) for form, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: measure ARTIFACT once
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure_kvforge(args.artifact, prompt_ids(args.artifact, PROMPT))))
        return
    model = onnx.load(str(args.artifact / "model.onnx"), load_external_data=False)
    terms = min_term_adds(model.graph)
    if not terms:
        raise SystemExit(
            f"{args.artifact}: no min terms (MatMulNBits plus a MatMul of block sums); "
            "give the default build of a GGUF file whose matrices carry minimums (Q4_1, Q4_K, Q5_K)"
        )
    shapes, blocks = [], set()
    for _, product, _ in terms:
        attributes = {a.name: helper.get_attribute_value(a) for a in product.attribute}
        shapes.append((int(attributes["N"]), int(attributes["K"])))
        blocks.add(int(attributes["block_size"]))
    if len(blocks) != 1:
        raise SystemExit(
            f"{args.artifact}: min-term projections in blocks of {sorted(blocks)}; the kernel is timed in one"
        )
    with tempfile.TemporaryDirectory() as work:
        stripped = Path(work) / "without-min-terms"
        without_min_terms(args.artifact, stripped)
        decode: dict[str, list[float]] = {"with": [], "without": []}
        for _ in range(args.rounds):
            for name, artifact in (("with", args.artifact), ("without", stripped)):
                command = [sys.executable, __file__, str(artifact), "--one"]
                child = subprocess.run(command, capture_output=True, text=True, check=True)
                line = next(line for line in child.stdout.splitlines() if line.startswith("RESULT "))
                decode[name].append(json.loads(line[len("RESULT ") :])["decode"])
    kernel = kernel_forms(shapes, blocks.pop(), args.rounds)
    with_, without = statistics.median(decode["with"]), statistics.median(decode["without"])
    summary = {
        "artifact": str(args.artifact),
        "min_terms": len(terms),
        "mins_bytes_per_step": mins_bytes(terms),
        "decode_tok_s": {"with": decode["with"], "without": decode["without"]},
        "decode_median": {"with": with_, "without": without},
        "step_ms_median": {"with": 1000 / with_, "without": 1000 / without},
        "min_terms_share_of_step": 1 - with_ / without,
        "kernel_ms_median": kernel,
        "float_zero_points_over_symmetric": kernel["float zero points"] / kernel["symmetric"],
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
