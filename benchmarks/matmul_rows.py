"""How an artifact's MatMul weights cost at 1 row and at more rows, on this machine.

    python benchmarks/matmul_rows.py ARTIFACT [--rows 1 8] [--repeats 15]

One decode step at batch B multiplies B rows by every MatMul weight of the graph. This
times exactly that, weights alone (no attention, no small ops), with onnxruntime's MatMul
(MLAS, the kernel a decode step runs; one intra-op thread per usable CPU and the prepacked
weights on huge pages, as `Engine.load` has them). Rounds alternate the row counts;
figures are medians.

At 1 row the product is bound by streaming the weights from memory; more rows add
multiply-adds over the same bytes. The last column is what the rows' multiply-adds take at
the fp32 GEMM rate NumPy reaches on a large square product (the machine's compute limit):
a kernel that overlapped that arithmetic with the weight stream would take about the
larger of the 1-row time and that column, one that does not about their sum.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from kvforge.runners.cpus import usable_cpus
from kvforge.runners.hugepages import huge_pages_for_new_memory


def matmul_weights(artifact: Path) -> list[np.ndarray]:
    """Every 2-D float32 initializer that is the second input of a MatMul, in graph order."""
    model = onnx.load(str(artifact / "model.onnx"))
    inits = {t.name: t for t in model.graph.initializer}
    weights = []
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.domain == "" and node.input[1] in inits:
            tensor = inits[node.input[1]]
            if tensor.data_type == TensorProto.FLOAT and len(tensor.dims) == 2:
                weights.append(numpy_helper.to_array(tensor, base_dir=str(artifact)))
    if not weights:
        raise SystemExit(
            f"{artifact / 'model.onnx'}: no MatMul reads a 2-D float32 initializer; this script times fp32 "
            "weights as `kvforge build` stores them (an artifact built with --weights int8/int4 has none)"
        )
    return weights


def ort_matmuls(weights: list[np.ndarray], workdir: Path) -> ort.InferenceSession:
    """One graph of independent MatMuls, x_i @ w_i, the weights as initializers."""
    nodes, inputs, outputs = [], [], []
    for i, w in enumerate(weights):
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, ["rows", w.shape[0]]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["rows", w.shape[1]]))
        nodes.append(helper.make_node("MatMul", [f"x{i}", f"w{i}"], [f"y{i}"]))
    initializers = [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)]
    graph = helper.make_graph(nodes, "matmuls", inputs, outputs, initializers)
    path = workdir / "matmuls.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path), save_as_external_data=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = usable_cpus()
    with huge_pages_for_new_memory():
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def gemm_rate(size: int = 2048, repeats: int = 10) -> float:
    """Multiply-adds per second of NumPy's fp32 GEMM on a square product: the compute limit."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((size, size), dtype=np.float32) for _ in range(2))
    a @ b
    best = min(_seconds(lambda: a @ b) for _ in range(repeats))
    return size**3 / best


def _seconds(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    weights = matmul_weights(args.artifact)
    params = sum(w.size for w in weights)
    rng = np.random.default_rng(0)
    xs = {m: [rng.standard_normal((m, w.shape[0]), dtype=np.float32) for w in weights] for m in args.rows}
    with tempfile.TemporaryDirectory() as tmp:
        session = ort_matmuls(weights, Path(tmp))
        feeds = {m: {f"x{i}": x for i, x in enumerate(xs[m])} for m in args.rows}
        times: dict[int, list[float]] = {m: [] for m in args.rows}
        for _ in range(args.repeats + 1):  # the first round warms up and is dropped
            for m, runs in times.items():
                runs.append(_seconds(session.run, None, feeds[m]))
        del session
    rate = gemm_rate()
    print(f"{len(weights)} MatMul weights, {params / 1e6:.1f}M parameters, {4 * params / 1e6:.0f} MB fp32")
    print(f"fp32 GEMM rate (NumPy, 2048 x 2048 x 2048): {rate / 1e9:.1f} G multiply-adds/s")
    base = statistics.median(times[min(args.rows)][1:]) * 1e3
    print(f"rows  onnxruntime MatMul  vs {min(args.rows)} row(s)  multiply-adds at the GEMM rate")
    for m in args.rows:
        ms = statistics.median(times[m][1:]) * 1e3
        print(f"{m:4d}  {ms:15.1f} ms  {ms / base:10.2f}x  {m * params / rate * 1e3:27.1f} ms")


if __name__ == "__main__":
    main()
