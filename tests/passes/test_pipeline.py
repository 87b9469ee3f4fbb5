"""The canonicalize phase on small graphs written inline: what it removes, what it keeps."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from kvforge.passes.pipeline import FOLD_LIMIT_ELEMENTS, PHASES, histogram, pass_name, run
from kvforge.passes.targets import TARGETS


def small_graph() -> ir.Model:
    """y = MatMul(x, Transpose(W)) + (c1 * c2) twice (a duplicate), through an Identity."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((48, 32)).astype(np.float32)  # above the fold limit
    assert weight.size > FOLD_LIMIT_ELEMENTS
    nodes = [
        helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "Wt"], ["h"]),
        helper.make_node("Mul", ["c1", "c2"], ["c"]),  # constant: folds
        helper.make_node("Add", ["h", "c"], ["a1"]),
        helper.make_node("Add", ["h", "c"], ["a2"]),  # same as a1: CSE
        helper.make_node("Identity", ["a2"], ["a2i"]),
        helper.make_node("Sub", ["a1", "a2i"], ["d"]),
        helper.make_node("Add", ["d", "a1"], ["y"]),
        helper.make_node("Neg", ["x"], ["unused"]),  # dead
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 48])],
        initializer=[
            numpy_helper.from_array(weight, "W"),
            numpy_helper.from_array(rng.standard_normal(48).astype(np.float32), "c1"),
            numpy_helper.from_array(np.float32(2.0), "c2"),
        ],
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))


def run_ort(model: ir.Model, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_canonicalize_folds_dedupes_and_removes_without_changing_numerics() -> None:
    model = small_graph()
    x = np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)
    expected = run_ort(model, x)
    report = run(model, TARGETS["onnx"])
    assert report.histogram_before == {
        "Add": 3,
        "Identity": 1,
        "MatMul": 1,
        "Mul": 1,
        "Neg": 1,
        "Sub": 1,
        "Transpose": 1,
    }
    after = histogram(model)
    assert "Mul" not in after and "Identity" not in after and "Neg" not in after
    assert after["Add"] == 2  # the duplicate Add is gone
    np.testing.assert_allclose(run_ort(model, x), expected, rtol=1e-6, atol=1e-6)
    assert report.histogram_after == after


def test_weight_transpose_is_folded_last_and_the_weight_keeps_its_name() -> None:
    model = small_graph()
    shape = model.graph.initializers["W"].shape
    run(model, TARGETS["onnx"])
    assert "W" in model.graph.initializers and "Transpose" not in histogram(model)
    assert shape is not None and model.graph.initializers["W"].shape == ir.Shape(list(reversed(list(shape))))


def test_modified_is_exact_and_a_second_run_changes_nothing() -> None:
    model = small_graph()
    first = run(model, TARGETS["onnx"])
    assert [r.modified for r in first.passes] == [r.nodes_before != r.nodes_after for r in first.passes]
    assert any(r.modified for r in first.passes)
    second = run(model, TARGETS["onnx"])
    assert not any(r.modified for r in second.passes)
    assert second.histogram_before == second.histogram_after == first.histogram_after


def test_report_is_reproducible_without_timings_and_lists_every_pass() -> None:
    reports = [run(small_graph(), TARGETS["onnx"]).to_dict(timings=False) for _ in range(2)]
    assert reports[0] == reports[1]
    names = [r["name"] for r in reports[0]["passes"]]
    assert names == [pass_name(p) for phase in TARGETS["onnx"].phases for p in PHASES[phase][1]()]
    assert reports[0]["passes"][0]["config"]["input_size_limit"] == FOLD_LIMIT_ELEMENTS


def test_summary_names_each_pass_and_node_counts() -> None:
    report = run(small_graph(), TARGETS["onnx"])
    text = report.summary()
    assert text.splitlines()[0] == (
        f"passes for target onnx: {sum(report.histogram_before.values())} -> "
        f"{sum(report.histogram_after.values())} nodes"
    )
    for record in report.passes:
        assert record.name in text
