"""How fast onnxruntime's MatMulNBits streams an artifact's quantized weights, per block size and thread count.

    python benchmarks/matmul_nbits.py ARTIFACT [--bits 4 8] [--blocks 32 64 128 256] [--rounds 7]

One decode step multiplies one row by every quantized weight of the graph. This times that, the
weights alone: one graph of independent MatMulNBits nodes with the artifact's shapes (N x K of
every MatMulNBits, the LM head included), random codes and scales (a kernel's speed does not
depend on the values), accuracy level 4 as kvforge writes them, the prepacked weights on huge
pages as `Engine.load` has them. Each (bits, block size) is timed with 1 thread and with one per
usable CPU; rounds alternate the forms, and the figures are medians over rounds. Beside each
time: the bytes the weights hold (codes and float32 scales) over that time, and that rate as a
fraction of what the machine reads with the same number of threads (`kvforge bench`'s read).
A kernel bound by memory would read near 100% of it; one bound by its own arithmetic reads
less, and gains little from a second thread when one core can read most of the bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from kvforge.runners.bench import memory_bandwidth
from kvforge.runners.cpus import usable_cpus
from kvforge.runners.hugepages import huge_pages_for_new_memory


def nbits_shapes(artifact: Path) -> list[tuple[int, int]]:
    """(N, K) of every MatMulNBits of the artifact's graph, in graph order."""
    model = onnx.load(str(artifact / "model.onnx"), load_external_data=False)
    shapes = []
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            shapes.append((int(attributes["N"]), int(attributes["K"])))
    if not shapes:
        raise SystemExit(f"{artifact / 'model.onnx'}: no MatMulNBits; build the artifact with --weights int4 or int8")
    return shapes


def nbits_session(
    shapes: list[tuple[int, int]],
    bits: int,
    block: int,
    threads: int,
    workdir: Path,
    zero_points: str | None = None,
) -> tuple[ort.InferenceSession, int]:
    """One graph of independent MatMulNBits, x_i @ W_i, and the bytes its weights hold.
    `zero_points`: None (symmetric codes), "uint8" (an integer zero point per block, packed at
    `bits`) or "float" (a float32 zero point per block)."""
    rng = np.random.default_rng(0)
    nodes, inputs, outputs, initializers = [], [], [], []
    for i, (n, k) in enumerate(shapes):
        blocks = -(-k // block)
        codes = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
        scales = rng.uniform(1e-3, 1e-2, n * blocks).astype(np.float32)
        initializers += [numpy_helper.from_array(codes, f"b{i}"), numpy_helper.from_array(scales, f"s{i}")]
        if zero_points == "uint8":
            packed = rng.integers(0, 256, (n, -(-blocks * bits // 8)), dtype=np.uint8)
            initializers.append(numpy_helper.from_array(packed, f"z{i}"))
        elif zero_points == "float":
            initializers.append(
                numpy_helper.from_array(rng.uniform(0, 2**bits - 1, n * blocks).astype(np.float32), f"z{i}")
            )
        elif zero_points is not None:
            raise ValueError(f"zero_points is None, 'uint8' or 'float', not {zero_points!r}")
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [1, k]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, n]))
        nodes.append(
            helper.make_node(
                "MatMulNBits",
                [f"x{i}", f"b{i}", f"s{i}", *([f"z{i}"] if zero_points else [])],
                [f"y{i}"],
                domain="com.microsoft",
                K=k,
                N=n,
                bits=bits,
                block_size=block,
                accuracy_level=4,
            )
        )
    graph = helper.make_graph(nodes, "nbits", inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    path = workdir / f"nbits-{bits}-{block}-{threads}-{zero_points or 'symmetric'}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(path), save_as_external_data=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    with huge_pages_for_new_memory():
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session, sum(t.nbytes for t in (numpy_helper.to_array(i) for i in initializers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 8], choices=[4, 8])
    parser.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    shapes = nbits_shapes(args.artifact)
    thread_counts = sorted({1, usable_cpus()})
    forms = [(bits, block, threads) for bits in args.bits for block in args.blocks for threads in thread_counts]
    rng = np.random.default_rng(1)
    feeds = {f"x{i}": rng.standard_normal((1, k), dtype=np.float32) for i, (_, k) in enumerate(shapes)}
    times: dict[tuple[int, int, int], list[float]] = {form: [] for form in forms}
    with tempfile.TemporaryDirectory() as tmp:
        sessions = {form: nbits_session(shapes, *form, Path(tmp)) for form in forms}
        for _ in range(args.rounds):
            for form, (session, _) in sessions.items():
                session.run(None, feeds)  # its threads awake, its weights' pages mapped
                runs = []
                for _ in range(9):
                    start = time.perf_counter()
                    session.run(None, feeds)
                    runs.append(time.perf_counter() - start)
                times[form].append(statistics.median(runs))
        weight_bytes = {form: nbytes for form, (_, nbytes) in sessions.items()}
        del sessions
    read = {threads: memory_bandwidth(threads=threads) for threads in thread_counts}
    print(
        f"{len(shapes)} MatMulNBits weights of {args.artifact}; reads: "
        + ", ".join(f"{t} thread{'s' if t > 1 else ''} {read[t] / 1e9:.1f} GB/s" for t in thread_counts)
    )
    print("bits  block  threads   step (ms)   weights (MB)   GB/s   of the read")
    for form in forms:
        seconds = statistics.median(times[form])
        rate = weight_bytes[form] / seconds
        print(
            f"{form[0]:4d}  {form[1]:5d}  {form[2]:7d}  {seconds * 1e3:10.3f}  {weight_bytes[form] / 1e6:13.1f}"
            f"  {rate / 1e9:5.1f}  {rate / read[form[2]]:10.0%}"
        )


if __name__ == "__main__":
    main()
