"""The tensorrt target's graph passes, each on a small graph written inline: the rewrite
happens, `modified` is exact (a second run reports False), and onnxruntime computes the
same values before and after."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from kvforge.passes.targets import TARGETS
from kvforge.passes.tensorrt import (
    BoolMaskToCapacity,
    ConcatCacheToScatter,
    DropDefaultAttentionAttributes,
    FixCapacity,
    RotaryPositionIds,
)
from kvforge.passes.tensorrt_check import check_graph, check_node, support_data
from tests.passes.fusion_testing import op_count, ort_outputs

F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _model(
    nodes: list[onnx.NodeProto], inputs: list, outputs: list, opset: int = 24, inits: list | None = None
) -> ir.Model:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits or [])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return ir.from_proto(proto)


def _check_twice(p: object, model: ir.Model) -> None:
    assert p(model).modified  # type: ignore[operator]
    assert not p(model).modified  # type: ignore[operator]


# --- ConcatCacheToScatter -------------------------------------------------------------------------------


def _concat_cache_model() -> ir.Model:
    """present = Concat(past, new); y = ReduceSum(present over positions): what eager attention reads."""
    nodes = [
        helper.make_node("Concat", ["past_key_values.0.key", "new"], ["present.0.key"], axis=-2),
        helper.make_node("ReduceSum", ["present.0.key", "axes"], ["y"], keepdims=0),
    ]
    inputs = [
        helper.make_tensor_value_info("attention_mask", I64, ["batch", "total"]),
        helper.make_tensor_value_info("past_key_values.0.key", F, ["batch", 2, "past", 4]),
        helper.make_tensor_value_info("new", F, ["batch", 2, "seq", 4]),
    ]
    outputs = [
        helper.make_tensor_value_info("y", F, ["batch", 2, 4]),
        helper.make_tensor_value_info("present.0.key", F, ["batch", 2, "total", 4]),
    ]
    axes = helper.make_tensor("axes", I64, [1], [2])
    return _model(nodes, inputs, outputs, inits=[axes])


def test_concat_cache_becomes_an_in_place_scatter_read_back_through_a_slice() -> None:
    rng = np.random.default_rng(0)
    past, new = (
        rng.standard_normal((2, 2, 5, 4)).astype(np.float32),
        rng.standard_normal((2, 2, 3, 4)).astype(np.float32),
    )
    mask = np.ones((2, 8), dtype=np.int64)
    model = _concat_cache_model()
    y_before, present_before = ort_outputs(model, {"attention_mask": mask, "past_key_values.0.key": past, "new": new})

    _check_twice(ConcatCacheToScatter(), model)
    assert op_count(model, "Concat") == 0 and op_count(model, "TensorScatter") == 1
    assert model.graph.outputs[1].name == "present.0.key"
    assert model.graph.outputs[1].producer().op_type == "TensorScatter"  # wired directly, no Identity

    buffer = np.zeros((2, 2, 12, 4), dtype=np.float32)  # capacity 12: past in the first 5 positions
    buffer[:, :, :5] = past
    y_after, present_after = ort_outputs(model, {"attention_mask": mask, "past_key_values.0.key": buffer, "new": new})
    np.testing.assert_allclose(y_after, y_before, rtol=1e-6)
    np.testing.assert_array_equal(present_after[:, :, :8], present_before)
    assert not present_after[:, :, 8:].any()  # positions past the mask stay untouched


def test_concat_that_is_not_a_cache_update_is_left_alone() -> None:
    model = _concat_cache_model()
    model.graph.outputs[1].name = "something.else"
    assert not ConcatCacheToScatter()(model).modified


# --- BoolMaskToCapacity ---------------------------------------------------------------------------------


def _padded_mask_model() -> ir.Model:
    nodes = [
        helper.make_node("Constant", [], ["zeros"], value_ints=[0] * 7),
        helper.make_node("Concat", ["zeros", "free"], ["pads"], axis=0),
        helper.make_node("Constant", [], ["false"], value=helper.make_tensor("f", BOOL, [], [False])),
        helper.make_node("Pad", ["mask", "pads", "false"], ["full"]),
    ]
    inputs = [
        helper.make_tensor_value_info("mask", BOOL, ["batch", 1, "seq", "total"]),
        helper.make_tensor_value_info("free", I64, [1]),
    ]
    return _model(nodes, inputs, [helper.make_tensor_value_info("full", BOOL, ["batch", 1, "seq", "padded"])])


def test_bool_pad_of_the_mask_becomes_concat_with_false() -> None:
    rng = np.random.default_rng(1)
    feeds = {"mask": rng.random((2, 1, 3, 5)) > 0.5, "free": np.array([4], dtype=np.int64)}
    model = _padded_mask_model()
    (before,) = ort_outputs(model, feeds)
    pad = next(n for n in model.graph if n.op_type == "Pad")
    assert check_node(pad, support_data())  # the parser's Pad takes no BOOL

    _check_twice(BoolMaskToCapacity(), model)
    assert op_count(model, "Pad") == 0
    (after,) = ort_outputs(model, feeds)
    assert after.shape == (2, 1, 3, 9)
    np.testing.assert_array_equal(after, before)
    inferred = ir.from_proto(onnx.shape_inference.infer_shapes(ir.to_proto(model)))
    assert [str(v) for n in inferred.graph for v in check_node(n, support_data())] == []


# --- RotaryPositionIds ----------------------------------------------------------------------------------


def _rotary_model(scale_input: bool = False) -> ir.Model:
    """freqs = Cast(Unsqueeze(position_ids)) * inv_freq; y = RotaryEmbedding(x, Cos(freqs), Sin(freqs))."""
    inv_freq = 1.0 / (10000 ** (np.arange(0, 8, 2, dtype=np.float32) / 8))
    nodes = [
        helper.make_node("Unsqueeze", ["position_ids", "last"], ["pos3"]),
        helper.make_node("Cast", ["pos3"], ["posf"], to=F),
        helper.make_node("Mul", ["posf", "scale" if scale_input else "inv_freq"], ["freqs"]),
        helper.make_node("Cos", ["freqs"], ["cos"]),
        helper.make_node("Sin", ["freqs"], ["sin"]),
        helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"], interleaved=0),
    ]
    inputs = [
        helper.make_tensor_value_info("position_ids", I64, ["batch", "seq"]),
        helper.make_tensor_value_info("x", F, ["batch", 2, "seq", 8]),
        helper.make_tensor_value_info("past_key_values.0.key", F, ["batch", 2, 16, 8]),
    ]
    if scale_input:
        inputs.append(helper.make_tensor_value_info("scale", F, [4]))
    inits = [
        helper.make_tensor("last", I64, [1], [-1]),
        helper.make_tensor("inv_freq", F, [4], inv_freq.tolist()),
    ]
    return _model(nodes, inputs, [helper.make_tensor_value_info("y", F, ["batch", 2, "seq", 8])], opset=23, inits=inits)


def test_rotary_tables_become_constants_indexed_by_position_ids() -> None:
    rng = np.random.default_rng(2)
    positions = np.array([[0, 0, 1, 2], [3, 4, 5, 15]], dtype=np.int64)
    feeds = {
        "position_ids": positions,
        "x": rng.standard_normal((2, 2, 4, 8)).astype(np.float32),
        "past_key_values.0.key": np.zeros((2, 2, 16, 8), dtype=np.float32),
    }
    model = _rotary_model()
    (before,) = ort_outputs(model, feeds)

    _check_twice(RotaryPositionIds(), model)
    rotary = next(n for n in model.graph if n.op_type == "RotaryEmbedding")
    assert rotary.inputs[3] is model.graph.inputs[0]  # position_ids, int64
    cos_cache = ir.convenience.get_const_tensor(rotary.inputs[1])
    assert cos_cache is not None and cos_cache.shape == (16, 4)  # [S_max, rotary_dim / 2]
    (after,) = ort_outputs(model, feeds)
    np.testing.assert_allclose(after, before, atol=1e-6)
    assert not check_node(rotary, support_data())


def test_rotary_tables_that_depend_on_more_than_positions_stay() -> None:
    assert not RotaryPositionIds()(_rotary_model(scale_input=True)).modified


def test_rotary_needs_a_fixed_capacity_for_its_tables() -> None:
    model = _rotary_model()
    model.graph.inputs[2].shape = ir.Shape(["batch", 2, "capacity", 8])
    assert not RotaryPositionIds()(model).modified


# --- FixCapacity, DropDefaultAttentionAttributes --------------------------------------------------------


def test_fix_capacity_sets_the_sequence_axis_of_cache_inputs_and_outputs() -> None:
    model = _concat_cache_model()
    _check_twice(FixCapacity(64), model)
    assert list(model.graph.inputs[1].shape) == [ir.SymbolicDim("batch"), 2, 64, 4]
    assert model.graph.outputs[1].shape[2] == 64
    assert model.graph.inputs[2].shape[2] == ir.SymbolicDim("seq")  # not a cache input: untouched


def _attention_model(**attributes: object) -> ir.Model:
    nodes = [helper.make_node("Attention", ["q", "k", "v", "mask"], ["y"], **attributes)]
    inputs = [helper.make_tensor_value_info(n, F, [1, 2, 3, 4]) for n in "qkv"]
    inputs.append(helper.make_tensor_value_info("mask", BOOL, [1, 1, 3, 3]))
    return _model(nodes, inputs, [helper.make_tensor_value_info("y", F, [1, 2, 3, 4])], opset=23)


def test_default_attention_attributes_are_dropped_and_others_kept() -> None:
    model = _attention_model(softcap=0.0, qk_matmul_output_mode=0, scale=0.5)
    _check_twice(DropDefaultAttentionAttributes(), model)
    assert set(next(iter(model.graph)).attributes) == {"scale"}

    capped = _attention_model(softcap=50.0)
    assert not DropDefaultAttentionAttributes()(capped).modified
    problems = check_node(next(iter(capped.graph)), support_data())
    assert any("softcap" in str(p) for p in problems)


def test_check_graph_on_the_small_graphs_names_the_graph_level_problems() -> None:
    problems = [str(v) for v in check_graph(_attention_model())]
    assert any("opset 23" in p for p in problems)


def test_the_tensorrt_pipeline_needs_a_capacity_and_ends_with_the_checker() -> None:
    from kvforge.passes.pipeline import pass_name, phases

    with pytest.raises(ValueError, match="needs capacity"):
        phases(TARGETS["tensorrt"])
    made = phases(TARGETS["tensorrt"], capacity=128)
    assert [phase for phase, _ in made][-2:] == ["tensorrt", "finalize"]
    assert pass_name(made[-1][1][-1]) == "RequireTensorRT"
    fix = next(p for p in made[-2][1] if isinstance(p, FixCapacity))
    assert fix.capacity == 128
