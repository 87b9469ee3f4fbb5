"""The TensorRT checker (passes/tensorrt_check.py) and its data file, on small graphs written inline."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvforge.passes.tensorrt_check import (
    RULES,
    RequireTensorRT,
    UnsupportedByTensorRT,
    check_graph,
    check_node,
    min_tensorrt_version,
    support_data,
)

F, F16, I64, BOOL = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64, TensorProto.BOOL


def _model(nodes: list, inputs: list, outputs: list, inits: list | None = None, opset: int = 24) -> ir.Model:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits or [])
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def _problems(model: ir.Model, op_type: str) -> list[str]:
    node = next(n for n in model.graph if n.op_type == op_type)
    return [v.problem for v in check_node(node, support_data())]


# --- the data file --------------------------------------------------------------------------------------


def test_data_file_names_a_version_known_types_and_only_implemented_rules() -> None:
    data = support_data()
    assert min_tensorrt_version() == data["tensorrt"] == "10.15"
    assert data["opset"]["required"] == 24
    for op, entry in data["ops"].items():
        assert entry["types"], op
        for name in entry["types"]:
            assert name in ir.DataType.__members__, (op, name)
        for rule in entry.get("rules", ()):
            assert rule["rule"] in RULES, (op, rule)
            assert rule["source"] in ("parser", "target") and rule.get("why", "x"), (op, rule)
    for op in ("If", "Loop", "Scan"):
        assert op in data["forbidden"] and op not in data["ops"]
    for op in ("SequenceConstruct", "SplitToSequence", "NonZero_typo"):
        assert op not in data["ops"]


# --- DequantizeLinear: weight-only quantization ---------------------------------------------------------


def _dequantize_model(
    bits: int = 4,
    axis: int = 0,
    block_size: int | None = 16,
    zero_point: int | None = None,
    scale_sign: float = 1.0,
    consumer: str = "MatMul",
) -> ir.Model:
    """y = consumer(x, DequantizeLinear(W [32, 8], scale, zero_point?, axis, block_size))."""
    k, n = 32, 8
    rng = np.random.default_rng(0)
    dtype = TensorProto.INT4 if bits == 4 else TensorProto.INT8
    weight = helper.make_tensor("W", dtype, [k, n], rng.integers(-7, 8, k * n).tolist())
    if block_size:
        scale_shape = [k // block_size, n] if axis == 0 else [k, n // block_size]
    else:
        scale_shape = [[k, n][axis]]
    scale = numpy_helper.from_array((scale_sign * rng.uniform(0.01, 0.1, scale_shape)).astype(np.float32), "scale")
    inits = [weight, scale]
    dq_inputs = ["W", "scale"]
    if zero_point is not None:
        inits.append(helper.make_tensor("zp", dtype, scale_shape, [zero_point] * int(np.prod(scale_shape))))
        dq_inputs.append("zp")
    attrs: dict[str, int] = {"axis": axis}
    if block_size:
        attrs["block_size"] = block_size
    nodes = [helper.make_node("DequantizeLinear", dq_inputs, ["Wf"], **attrs)]
    if consumer == "MatMul":
        nodes.append(helper.make_node("MatMul", ["x", "Wf"], ["y"]))
        x = helper.make_tensor_value_info("x", F, ["batch", k])
    else:
        nodes.append(helper.make_node(consumer, ["x", "Wf"], ["y"]))
        x = helper.make_tensor_value_info("x", F, [k, n])
    return _model(nodes, [x], [helper.make_tensor_value_info("y", F, None)], inits)


def test_int4_symmetric_blockwise_over_axis_0_feeding_matmul_conforms() -> None:
    assert _problems(_dequantize_model(), "DequantizeLinear") == []


def test_int8_per_channel_conforms() -> None:
    model = _dequantize_model(bits=8, axis=1, block_size=None)
    assert _problems(model, "DequantizeLinear") == []


@pytest.mark.parametrize(
    ("variant", "expected"),
    [
        (dict(zero_point=3), "x_zero_point must be zero"),
        (dict(axis=1), "axis=1"),
        (dict(block_size=None), "no block_size"),
        (dict(scale_sign=-1.0), "scale <= 0"),
        (dict(consumer="Add"), "read by Add"),
        (dict(bits=8, block_size=16), "block_size=16"),
    ],
)
def test_non_conforming_dequantize_linear_is_named_with_the_reason(variant: dict, expected: str) -> None:
    model = _dequantize_model(**variant)  # type: ignore[arg-type]
    problems = _problems(model, "DequantizeLinear")
    assert any(expected in p for p in problems), problems


def test_zero_zero_point_is_accepted() -> None:
    assert _problems(_dequantize_model(zero_point=0), "DequantizeLinear") == []


def test_the_pass_fails_the_pipeline_naming_the_node() -> None:
    model = _dequantize_model(zero_point=3)
    next(n for n in model.graph if n.op_type == "DequantizeLinear").name = "layers.0.mlp.down_proj.dq"
    with pytest.raises(UnsupportedByTensorRT, match=r"DequantizeLinear\(layers\.0\.mlp\.down_proj\.dq\)"):
        RequireTensorRT()(model)


# --- attention, cache update, rotary, norms -------------------------------------------------------------


def _attention(**attrs: object) -> ir.Model:
    inputs = [helper.make_tensor_value_info(n, F, [1, 2, 3, 4]) for n in "qkv"]
    inputs.append(helper.make_tensor_value_info("mask", BOOL, [1, 1, 3, 3]))
    node = helper.make_node("Attention", ["q", "k", "v", "mask"], ["y"], **attrs)
    return _model([node], inputs, [helper.make_tensor_value_info("y", F, [1, 2, 3, 4])])


def test_attention_needs_is_causal_0_and_reads_the_scattered_cache() -> None:
    problems = _problems(_attention(is_causal=1), "Attention")
    assert any("is_causal=1" in p for p in problems)
    assert any("not a TensorScatter output" in p for p in problems)  # k and v here are plain inputs


def test_attention_with_cache_inputs_or_softcap_is_refused() -> None:
    inputs = [helper.make_tensor_value_info(n, F, [1, 2, 3, 4]) for n in ("q", "k", "v", "pk", "pv")]
    inputs.append(helper.make_tensor_value_info("mask", BOOL, [1, 1, 3, 3]))
    node = helper.make_node("Attention", ["q", "k", "v", "mask", "pk", "pv"], ["y"], softcap=30.0)
    model = _model([node], inputs, [helper.make_tensor_value_info("y", F, [1, 2, 3, 4])])
    problems = _problems(model, "Attention")
    assert any("input 4 (pk) is set" in p for p in problems)
    assert any("softcap" in p for p in problems)


def _scatter(axis: int = -2, mode: str = "linear", through_identity: bool = False) -> ir.Model:
    nodes = [
        helper.make_node("Shape", ["new"], ["b"], start=0, end=1),
        helper.make_node("Expand", ["w0", "b"], ["w"]),
        helper.make_node("TensorScatter", ["past_key_values.0.key", "new", "w"], ["s"], axis=axis, mode=mode),
    ]
    nodes.append(helper.make_node("Identity", ["s"], ["present.0.key"]))
    if not through_identity:
        nodes = nodes[:-1]
        nodes[-1].output[0] = "present.0.key"
    inputs = [
        helper.make_tensor_value_info("past_key_values.0.key", F, ["batch", 2, 16, 4]),
        helper.make_tensor_value_info("new", F, ["batch", 2, "seq", 4]),
    ]
    inits = [helper.make_tensor("w0", I64, [1], [0])]
    return _model(nodes, inputs, [helper.make_tensor_value_info("present.0.key", F, ["batch", 2, 16, 4])], inits)


def test_a_fixed_cache_update_wired_to_the_output_passes() -> None:
    assert _problems(_scatter(), "TensorScatter") == []
    assert [str(v) for v in check_graph(_scatter()) if "TensorScatter" in str(v) or "input past" in str(v)] == []


@pytest.mark.parametrize(
    ("variant", "expected"),
    [(dict(axis=2), "axis=2"), (dict(mode="circular"), "mode='circular'")],
)
def test_cache_update_attributes_are_checked(variant: dict, expected: str) -> None:
    assert any(expected in p for p in _problems(_scatter(**variant), "TensorScatter"))  # type: ignore[arg-type]


def test_a_cache_update_behind_an_identity_is_refused() -> None:
    model = _scatter(through_identity=True)
    assert any("not a present.* graph output" in p for p in _problems(model, "TensorScatter"))
    assert any("not TensorScatter(past, ...) wired directly" in str(v) for v in check_graph(model))


def test_a_cache_of_unfixed_length_is_refused() -> None:
    model = _scatter()
    model.graph.inputs[0].shape = ir.Shape(["batch", 2, "capacity", 4])
    assert any("fixed length S_max" in str(v) for v in check_graph(model))


def test_rotary_without_position_ids_and_rms_norm_with_another_stash_type_are_refused() -> None:
    inputs = [
        helper.make_tensor_value_info("x", F, [1, 2, 3, 8]),
        helper.make_tensor_value_info("cos", F, [1, 3, 4]),
        helper.make_tensor_value_info("sin", F, [1, 3, 4]),
        helper.make_tensor_value_info("scale", F, [8]),
    ]
    nodes = [
        helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["r"]),
        helper.make_node("RMSNormalization", ["r", "scale"], ["y"], stash_type=TensorProto.DOUBLE),
    ]
    model = _model(nodes, inputs, [helper.make_tensor_value_info("y", F, [1, 2, 3, 8])])
    assert any("input 3 is missing" in p for p in _problems(model, "RotaryEmbedding"))
    assert any("stash_type=11" in p for p in _problems(model, "RMSNormalization"))


# --- graph-wide rules -----------------------------------------------------------------------------------


def test_custom_domains_control_flow_and_unsupported_ops_are_named() -> None:
    x = helper.make_tensor_value_info("x", F, [2])
    nodes = [
        helper.make_node("FastGelu", ["x"], ["a"], domain="com.microsoft", name="gelu"),
        helper.make_node("NonZero", ["a"], ["b"], name="nz"),
        helper.make_node("Unique", ["x"], ["c"], name="uniq"),
    ]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("c", F, [None])])
    proto = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("com.microsoft", 1)]
    )
    problems = [str(v) for v in check_graph(ir.from_proto(proto))]
    assert any(p.startswith("FastGelu(gelu): domain 'com.microsoft'") for p in problems)
    assert any(p.startswith("Unique(uniq): Unique is not supported") for p in problems)
    assert any("imports domain 'com.microsoft'" in p for p in problems)


def test_if_is_forbidden_even_though_the_parser_imports_it() -> None:
    branch = helper.make_graph([], "b", [], [helper.make_tensor_value_info("x", F, [1])])
    node = helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch, name="branch")
    model = _model(
        [node],
        [helper.make_tensor_value_info("cond", BOOL, []), helper.make_tensor_value_info("x", F, [1])],
        [helper.make_tensor_value_info("y", F, [1])],
    )
    assert any("If(branch): If is not allowed" in str(v) for v in check_graph(model))


def test_strongly_typed_every_float_in_the_compute_dtype() -> None:
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=F16, name="down"), helper.make_node("Relu", ["h"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, [2])], [helper.make_tensor_value_info("y", F16, [2])])
    model.graph.node(0).outputs[0].dtype = ir.DataType.FLOAT16
    problems = [str(v) for v in check_graph(model)]
    assert any(p.startswith("Cast(down): h is FLOAT16, not the compute dtype FLOAT") for p in problems)
    assert not any("FLOAT16" in str(v) for v in check_graph(model, compute_dtype="float16") if "Cast" in str(v))


def test_a_clean_pass_reports_no_change() -> None:
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", F, [2])],
        [helper.make_tensor_value_info("y", F, [2])],
    )
    assert RequireTensorRT()(model).modified is False
