"""Norm fusions: RMSNorm -> RMSNormalization, residual Add + norm -> onnxruntime's Skip ops.

Each rule on a small graph written inline (matches, must-not-match, numerics on onnxruntime with its
optimizations off, exact `modified`), then on the canonicalized graphs of tiny checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvforge.passes.fuse_norm import norm_fusion, norm_lowering_ort
from tests.passes.fusion_testing import canonical_graph, check_modified_is_exact, decoder_feeds, op_count, ort_outputs
from tests.tiny import ARCH_CONFIGS

D = 16
EPS = 1e-6
# float32, fused against unfused. The whole tiny decoders differ by at most 6e-7 (logits of magnitude ~2).
ATOL, RTOL = 1e-5, 1e-4
MS = "com.microsoft"


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[str],
    initializers: Sequence[onnx.TensorProto] = (),
    value_info: Sequence[onnx.ValueInfoProto] = (),
    opset: int = 23,
) -> ir.Model:
    graph = helper.make_graph(
        nodes,
        "g",
        list(inputs),
        [activation(name, ["batch", "seq", D]) for name in outputs],
        initializer=list(initializers),
        value_info=list(value_info),
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    proto.ir_version = 10
    return ir.from_proto(proto)


def fresh(model: ir.Model) -> ir.Model:
    """An independent copy, so a pass can run on one and the reference on the other."""
    return ir.from_proto(ir.to_proto(model))


def weights(name: str, shape: Sequence[int], seed: int = 0, offset: float = 0.0) -> onnx.TensorProto:
    values = offset + np.random.default_rng(seed).standard_normal(shape)
    return numpy_helper.from_array(values.astype(np.float32), name)


def const(name: str, value: float) -> onnx.NodeProto:
    """A float32 scalar Constant node, as torch.onnx writes the literals in a formula."""
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, np.float32)))


def activation(name: str, shape: Sequence[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def input_names(node: ir.Node) -> list[str | None]:
    return [v.name if v is not None else None for v in node.inputs]


def feeds_for(model: ir.Model, seed: int = 1) -> dict[str, np.ndarray]:
    """Random float inputs for an inline graph: symbolic dims batch=2, seq=3."""
    rng = np.random.default_rng(seed)
    sizes = {"batch": 2, "seq": 3}
    feeds = {}
    for value in model.graph.inputs:
        assert value.shape is not None
        shape = [d if isinstance(d, int) else sizes[str(d.value)] for d in value.shape]
        feeds[value.name or ""] = rng.standard_normal(shape).astype(np.float32)
    return feeds


# --- RMSNorm -> RMSNormalization --------------------------------------------------------------------------


def rms_norm_graph(
    *,
    weight_first: bool = True,
    axes: Sequence[int] = (-1,),
    epsilon_input: bool = False,
    scale_shape: Sequence[int | str] | None = None,
    weight_offset: bool = False,
    opset: int = 23,
) -> ir.Model:
    """y = weight * (x / sqrt(mean(x^2, axes) + eps)), spelled out as torch.onnx writes it.

    `scale_shape` makes the factor a graph input of that shape instead of a [D] weight; `weight_offset`
    makes it (1 + weight) computed in the graph, as gemma's is at real sizes.
    """
    inputs = [activation("x", ["batch", "seq", D])]
    initializers = []
    value_info = []
    nodes = [
        const("two", 2.0),
        helper.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array(axes, np.int64))),
        helper.make_node("Pow", ["x", "two"], ["square"]),
        helper.make_node("ReduceMean", ["square", "axes"], ["mean"], keepdims=1, noop_with_empty_axes=0),
        helper.make_node("Add", ["mean", "eps"], ["mean_eps"]),
        helper.make_node("Sqrt", ["mean_eps"], ["rms"]),
        helper.make_node("Reciprocal", ["rms"], ["inv_rms"]),
        helper.make_node("Mul", ["x", "inv_rms"], ["normalized"]),
    ]
    if epsilon_input:
        inputs.append(activation("eps", []))
    else:
        nodes.insert(0, const("eps", EPS))
    if scale_shape is not None:
        inputs.append(activation("scale", scale_shape))
    elif weight_offset:
        initializers.append(weights("weight", [D]))
        nodes.append(helper.make_node("Add", ["weight", "one"], ["scale"]))
        nodes.insert(0, const("one", 1.0))
        value_info.append(activation("scale", [D]))  # what shape inference gives the pipeline's graphs
    else:
        initializers.append(weights("scale", [D], offset=1.0))
    factors = ["scale", "normalized"] if weight_first else ["normalized", "scale"]
    nodes.append(helper.make_node("Mul", factors, ["y"]))
    return make_model(nodes, inputs, ["y"], initializers, value_info, opset)


def fused_exactly_once(model: ir.Model, rule: str) -> None:
    """Run norm_fusion on `model`: `rule` fires once, numerics hold, a second run changes nothing."""
    feeds = feeds_for(model)
    expected = ort_outputs(fresh(model), feeds)
    fusion = norm_fusion()
    result = fusion(model)
    assert result.modified
    assert fusion.counts[rule] == 1 and sum(fusion.counts.values()) == 1
    for got, want in zip(ort_outputs(model, feeds), expected):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    assert not norm_fusion()(model).modified


@pytest.mark.parametrize(("weight_first", "rule"), [(True, "rms_norm_weight_first"), (False, "rms_norm_weight_last")])
def test_rms_norm_becomes_rms_normalization(weight_first: bool, rule: str) -> None:
    model = rms_norm_graph(weight_first=weight_first)
    fused_exactly_once(model, rule)
    (node,) = [n for n in model.graph if n.op_type == "RMSNormalization"]
    assert node.domain == ""
    assert input_names(node) == ["x", "scale"]
    assert node.attributes.get_int("axis") == -1
    assert node.attributes.get_int("stash_type") == ir.DataType.FLOAT
    assert node.attributes.get_float("epsilon") == pytest.approx(EPS)
    assert op_count(model, "Pow") == op_count(model, "ReduceMean") == op_count(model, "Reciprocal") == 0


def test_gemma_one_plus_weight_stays_the_scale_input() -> None:
    """At real sizes gemma's (1 + weight) is not constant-folded; its Add output becomes the scale."""
    model = rms_norm_graph(weight_first=False, weight_offset=True)
    fused_exactly_once(model, "rms_norm_weight_last")
    (node,) = [n for n in model.graph if n.op_type == "RMSNormalization"]
    scale = node.inputs[1]
    producer = scale.producer() if scale is not None else None
    assert producer is not None and producer.op_type == "Add"


@pytest.mark.parametrize(
    ("case", "model", "reason"),
    [
        ("mean over another axis", rms_norm_graph(axes=(1,)), "mismatch"),
        ("mean over two axes", rms_norm_graph(axes=(-2, -1)), "shape"),
        ("epsilon not constant", rms_norm_graph(epsilon_input=True), "Epsilon"),
        ("factor is a per-token tensor", rms_norm_graph(scale_shape=["batch", "seq", D]), "scale has shape"),
        ("factor is a scalar", rms_norm_graph(scale_shape=[1]), "scale has shape"),
        ("opset without RMSNormalization", rms_norm_graph(opset=22), "opset"),
    ],
)
def test_rms_norm_lookalikes_are_left_alone(case: str, model: ir.Model, reason: str) -> None:
    nodes_before = len(model.graph)
    fusion = norm_fusion()
    check_modified_is_exact(fusion, model)
    assert sum(fusion.counts.values()) == 0, case
    assert len(model.graph) == nodes_before and op_count(model, "RMSNormalization") == 0
    assert any(reason in miss.reason for miss in fusion.explain(model)), fusion.explain(model)


# --- residual Add + norm -> Skip*Normalization --------------------------------------------------------------


def skip_norm_graph(
    norm: str,
    *,
    residual: bool,
    bias: bool = True,
    skip_shape: Sequence[int | str] = ("batch", "seq", D),
    x_shape: Sequence[int | str] = ("batch", "seq", D),
    axis: int = -1,
) -> ir.Model:
    """y = Norm(x + skip); with `residual` the sum is also read by the next residual Add, as in a decoder."""
    initializers = [weights("gamma", [D], seed=2, offset=1.0)]
    if norm == "rms":
        norm_node = helper.make_node("RMSNormalization", ["sum", "gamma"], ["y"], axis=axis, epsilon=EPS)
    else:
        norm_inputs = ["sum", "gamma", "beta"] if bias else ["sum", "gamma"]
        norm_node = helper.make_node("LayerNormalization", norm_inputs, ["y"], axis=axis, epsilon=1e-5)
        if bias:
            initializers.append(weights("beta", [D], seed=3))
    nodes = [helper.make_node("Add", ["x", "skip"], ["sum"]), norm_node]
    outputs = ["y"]
    if residual:
        nodes.append(helper.make_node("Add", ["sum", "y"], ["next"]))
        outputs.append("next")
    return make_model(nodes, [activation("x", x_shape), activation("skip", skip_shape)], outputs, initializers)


@pytest.mark.parametrize(
    ("norm", "residual", "bias", "rule", "op_type"),
    [
        ("rms", True, True, "skip_rms_norm_residual", "SkipSimplifiedLayerNormalization"),
        ("rms", False, True, "skip_rms_norm", "SkipSimplifiedLayerNormalization"),
        ("layer", True, True, "skip_layer_norm_residual", "SkipLayerNormalization"),
        ("layer", False, True, "skip_layer_norm", "SkipLayerNormalization"),
        ("layer", True, False, "skip_layer_norm_residual", "SkipLayerNormalization"),
    ],
)
def test_add_and_norm_become_a_skip_op(norm: str, residual: bool, bias: bool, rule: str, op_type: str) -> None:
    model = skip_norm_graph(norm, residual=residual, bias=bias)
    feeds = feeds_for(model)
    expected = ort_outputs(fresh(model), feeds)
    lowering = norm_lowering_ort()
    assert lowering(model).modified
    assert lowering.counts[rule] == 1 and sum(lowering.counts.values()) == 1
    if residual:  # the Add and the norm are gone; the next residual Add reads output 3
        node, next_add = list(model.graph)
        assert next_add.inputs[0] is node.outputs[3]
    else:
        (node,) = list(model.graph)
    assert (node.domain, node.op_type) == (MS, op_type)
    assert len(node.outputs) == (4 if residual else 1)
    assert input_names(node) == ["x", "skip", "gamma"] + (["beta"] if norm == "layer" and bias else [])
    for got, want in zip(ort_outputs(model, feeds), expected):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    assert not norm_lowering_ort()(model).modified


RANK_4: list[int | str] = [2, "batch", "seq", D]


@pytest.mark.parametrize(
    ("case", "model", "reason"),
    [
        ("skip broadcast over batch", skip_norm_graph("rms", residual=True, skip_shape=["seq", D]), "broadcasts"),
        ("rank 4 input", skip_norm_graph("rms", residual=False, x_shape=RANK_4, skip_shape=RANK_4), "rank 2 or 3"),
        ("layer norm over two axes", skip_norm_graph("layer", residual=True, axis=1), "axis"),
        ("rms norm over two axes", skip_norm_graph("rms", residual=False, axis=-2), "axis"),
    ],
)
def test_skip_lookalikes_are_left_alone(case: str, model: ir.Model, reason: str) -> None:
    lowering = norm_lowering_ort()
    check_modified_is_exact(lowering, model)
    assert sum(lowering.counts.values()) == 0, case
    assert op_count(model, "Add") >= 1
    assert any(reason in miss.reason for miss in lowering.explain(model)), lowering.explain(model)


def test_rms_normalization_alone_is_not_lowered() -> None:
    """Without a residual Add there is nothing to lower: onnxruntime's RMSNormalization-23 is as fast."""
    model = rms_norm_graph()
    norm_fusion()(model)
    lowering = norm_lowering_ort()
    check_modified_is_exact(lowering, model)
    assert op_count(model, "RMSNormalization") == 1


# --- the canonicalized graphs of tiny checkpoints ------------------------------------------------------------

# arch -> (norms per decoder layer, norm op, Skip ops after lowering given the layer count). A norm that reads
# a residual Add fuses with it; a layer's first norm reads the embeddings in layer 0 (except in gpt2, where
# token + position embeddings are an Add); gemma2's post-attention / post-feedforward norms read the sublayer
# output, not an Add; gpt_neox's parallel residual has both norms of a layer read one Add, which fuses once.
# llama, mistral, qwen2 and phi3 are qwen3 without q_norm / k_norm, gemma is gemma2 without the sandwich norms.
ARCHITECTURES: dict[str, tuple[int, str, Callable[[int], int]]] = {
    "qwen3": (4, "RMSNormalization", lambda layers: 2 * layers),  # input, post-attention, q_norm, k_norm
    "gemma2": (4, "RMSNormalization", lambda layers: 2 * layers),  # input, post-attention, pre/post-feedforward
    "gpt2": (2, "LayerNormalization", lambda layers: 2 * layers + 1),
    "gpt_neox": (2, "LayerNormalization", lambda layers: layers),
}
SKIP_OP = {"RMSNormalization": "SkipSimplifiedLayerNormalization", "LayerNormalization": "SkipLayerNormalization"}


def layer_count(arch: str) -> int:
    config = ARCH_CONFIGS[arch]
    return int(config.get("num_hidden_layers", config.get("n_layer", 0)))


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_tiny_decoders(arch: str, scratch: Path) -> None:
    per_layer, norm_op, skip_ops_for = ARCHITECTURES[arch]
    norms, skip_ops = per_layer * layer_count(arch) + 1, skip_ops_for(layer_count(arch))
    model = canonical_graph(arch, scratch)
    feeds = decoder_feeds(model)
    expected = ort_outputs(model, feeds)

    fusion = norm_fusion()
    assert fusion(model).modified == (norm_op == "RMSNormalization")  # torch.onnx already emits LayerNormalization
    assert op_count(model, norm_op) == norms == sum(fusion.counts.values()) + op_count(model, "LayerNormalization")
    assert op_count(model, "ReduceMean") == 0
    if norm_op == "RMSNormalization":
        assert op_count(model, "Pow") == 0 and op_count(model, "Reciprocal") == 0
    for got, want in zip(ort_outputs(model, feeds), expected):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)

    lowering = norm_lowering_ort()
    assert lowering(model).modified
    assert op_count(model, SKIP_OP[norm_op], MS) == skip_ops == sum(lowering.counts.values())
    assert op_count(model, norm_op) == norms - skip_ops
    for got, want in zip(ort_outputs(model, feeds), expected):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    check_modified_is_exact(norm_lowering_ort(), model)


@pytest.mark.slow
def test_a_float16_gemma_norm_that_scales_in_float32_fuses_on_its_float32_input(scratch: Path) -> None:
    """gemma computes (1 + weight) * normalized in float32 and casts after: the fused norm reads x cast to
    float32, since RMSNormalization's result has its input's type."""
    model = canonical_graph("gemma", scratch, "float16")
    feeds = decoder_feeds(model)
    expected = ort_outputs(model, feeds)
    fusion = norm_fusion()
    fusion(model)
    norms = [n for n in model.graph if n.op_type == "RMSNormalization"]
    assert len(norms) == 2 * layer_count("gemma") + 1 == sum(fusion.counts.values())
    for norm in norms:
        x, scale = norm.inputs
        assert x is not None and scale is not None and x.dtype == scale.dtype == norm.outputs[0].dtype
    for got, want in zip(ort_outputs(model, feeds), expected):
        np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
