"""WidenFloats: a bfloat16 graph becomes the same graph in float32, which onnxruntime's CPU provider runs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from passes.widen import WidenFloats
from tests.passes.fusion_testing import ort_outputs

BF16 = TensorProto.BFLOAT16


def bf16_graph() -> ir.Model:
    """y = Cast(x, bf16) @ W + Constant(b) -> Cast(f32): a bfloat16 weight, constant and Cast target."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4, 3)).astype(ml_dtypes.bfloat16)
    bias = rng.standard_normal(3).astype(ml_dtypes.bfloat16)
    nodes = [
        helper.make_node("Cast", ["x"], ["x16"], to=BF16),
        helper.make_node("MatMul", ["x16", "w"], ["xw"]),
        helper.make_node("Constant", [], ["b"], value=numpy_helper.from_array(bias)),
        helper.make_node("Add", ["xw", "b"], ["h"]),
        helper.make_node("Cast", ["h"], ["y"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        initializer=[numpy_helper.from_array(weight, "w")],
        value_info=[helper.make_tensor_value_info(v, BF16, None) for v in ("x16", "xw", "b", "h")],
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))


def test_every_bfloat16_tensor_type_and_cast_becomes_float32_with_the_same_values() -> None:
    model = bf16_graph()
    weight = model.graph.initializers["w"].const_value.numpy().astype(np.float32)  # type: ignore[union-attr]
    assert WidenFloats()(model).modified
    types = {v.dtype for n in model.graph for v in (*n.inputs, *n.outputs) if v is not None}
    assert ir.DataType.BFLOAT16 not in types
    assert model.graph.initializers["w"].dtype == ir.DataType.FLOAT
    np.testing.assert_array_equal(model.graph.initializers["w"].const_value.numpy(), weight)  # type: ignore[union-attr]
    assert [n.attributes.get_int("to") for n in model.graph if n.op_type == "Cast"] == [ir.DataType.FLOAT] * 2
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    bias = bf16_graph().graph.node(2).attributes["value"].as_tensor().numpy().astype(np.float32)
    (y,) = ort_outputs(model, {"x": x})  # onnxruntime has no bfloat16 MatMul: it could not run the original
    # the Cast to bfloat16 became one to float32, so x reaches the MatMul unrounded
    np.testing.assert_allclose(y, x @ weight + bias, rtol=1e-5, atol=1e-5)


def test_a_second_run_and_a_float32_graph_change_nothing() -> None:
    model = bf16_graph()
    WidenFloats()(model)
    assert not WidenFloats()(model).modified
