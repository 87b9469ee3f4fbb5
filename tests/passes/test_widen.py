"""WidenFloats: a half-precision graph computed in float32, which onnxruntime's CPU provider runs, its
weights left as stored and read through Casts."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvforge.passes.widen import WidenFloats
from tests.passes.fusion_testing import ort_outputs


def half_graph(narrow: int) -> ir.Model:
    """y = Cast(x, narrow) @ W + Constant(b) -> Cast(f32): a narrow weight, constant and Cast target."""
    rng = np.random.default_rng(0)
    dtype = ml_dtypes.bfloat16 if narrow == TensorProto.BFLOAT16 else np.float16
    weight = rng.standard_normal((4, 3)).astype(dtype)
    bias = rng.standard_normal(3).astype(dtype)
    nodes = [
        helper.make_node("Cast", ["x"], ["x16"], to=narrow),
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
        value_info=[helper.make_tensor_value_info(v, narrow, None) for v in ("x16", "xw", "b", "h")],
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))


@pytest.mark.parametrize("narrow", [TensorProto.BFLOAT16, TensorProto.FLOAT16])
def test_every_narrow_value_and_cast_becomes_float32_and_the_weight_is_read_through_a_cast(narrow: int) -> None:
    model = half_graph(narrow)
    stored = model.graph.initializers["w"].const_value.numpy()  # type: ignore[union-attr]
    assert WidenFloats(ir.DataType(narrow))(model).modified
    # the weight is the artifact's own bytes, still narrow; its one reader is a new Cast to float32
    weight = model.graph.initializers["w"]
    assert weight.dtype == ir.DataType(narrow) and weight.const_value.numpy().tobytes() == stored.tobytes()  # type: ignore[union-attr]
    ((reader, _),) = weight.uses()
    assert reader.op_type == "Cast" and reader.attributes.get_int("to") == ir.DataType.FLOAT
    assert [n.op_type for n in model.graph][:3] == [
        "Cast",
        "Cast",
        "MatMul",
    ]  # the weight's Cast right before its MatMul
    computed = {v.dtype for n in model.graph for v in n.outputs}
    assert computed == {ir.DataType.FLOAT}
    assert [n.attributes.get_int("to") for n in model.graph if n.op_type == "Cast"] == [ir.DataType.FLOAT] * 3
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    bias = half_graph(narrow).graph.node(2).attributes["value"].as_tensor().numpy().astype(np.float32)
    (y,) = ort_outputs(model, {"x": x})  # onnxruntime has no bfloat16 MatMul: it could not run the original
    # the Cast to the narrow type became one to float32, so x reaches the MatMul unrounded
    np.testing.assert_allclose(y, x @ stored.astype(np.float32) + bias, rtol=1e-5, atol=1e-5)


def test_a_second_run_and_a_float32_graph_change_nothing() -> None:
    model = half_graph(TensorProto.BFLOAT16)
    WidenFloats()(model)
    assert not WidenFloats()(model).modified
    assert not WidenFloats(ir.DataType.FLOAT16)(model).modified


def test_quantization_scales_stay_constant_for_the_ops_that_pack_them() -> None:
    """onnxruntime's MatMulNBits packs its scales at load and computes garbage from scales a
    Cast produces; widened, an fp16 MatMulNBits still matches its dequantized weight."""
    from onnxruntime import ExecutionOrder, GraphOptimizationLevel, InferenceSession, SessionOptions

    from kvforge.passes.quantize import matmul_nbits_inputs, quantize_blockwise

    rng = np.random.default_rng(2)
    k, n = 64, 96
    q = quantize_blockwise(rng.standard_normal((n, k)).astype(np.float16), 4, 32, True)
    b, scales, _ = matmul_nbits_inputs(q)
    node = helper.make_node(
        "MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=32
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, n])],
        initializer=[numpy_helper.from_array(b, "b"), numpy_helper.from_array(scales.astype(np.float16), "s")],
    )
    opsets = [helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)]
    model = ir.from_proto(helper.make_model(graph, opset_imports=opsets))
    assert WidenFloats(ir.DataType.FLOAT16)(model).modified
    assert model.graph.initializers["s"].dtype == ir.DataType.FLOAT and model.graph.initializers["s"].is_initializer()
    assert [n.op_type for n in model.graph] == ["MatMulNBits"]
    options = SessionOptions()  # as OrtSession(weights_cast_per_run=True) loads the gate's graph
    options.graph_optimization_level = GraphOptimizationLevel.ORT_DISABLE_ALL
    options.execution_order = ExecutionOrder.PRIORITY_BASED
    options.enable_cpu_mem_arena = False
    session = InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((2, k)).astype(np.float32)
    (y,) = session.run(None, {"x": x})
    np.testing.assert_allclose(y, x @ q.dequantize().astype(np.float32).T, rtol=2e-2, atol=2e-2)
