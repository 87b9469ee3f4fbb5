"""GELU fusions: spelled-out erf / tanh GELU -> Gelu, Add(bias) + Gelu -> onnxruntime's BiasGelu.

Each rule on a small graph written inline (matches, must-not-match, numerics on onnxruntime with its
optimizations off, exact `modified`), then on the canonicalized graphs of tiny checkpoints.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import helper

from kvforge.passes.fuse_gelu import gelu_fusion, gelu_lowering_ort
from tests.passes.fusion_testing import canonical_graph, check_modified_is_exact, decoder_feeds, op_count, ort_outputs
from tests.passes.test_fuse_norm import (
    ATOL,
    MS,
    RTOL,
    D,
    activation,
    const,
    feeds_for,
    fresh,
    input_names,
    layer_count,
    make_model,
    weights,
)

HALF, CUBIC, SQRT_2_OVER_PI, SQRT_2 = 0.5, 0.044715, math.sqrt(2 / math.pi), math.sqrt(2)


def gelu_graph(
    approximate: str,
    *,
    half: float = HALF,
    cubic: float = CUBIC,
    erf_divisor: float = SQRT_2,
    erf_by_mul: bool = False,
    inner_read_elsewhere: bool = False,
    opset: int = 23,
) -> ir.Model:
    """y = (x * 0.5) * (1 + f(x)), spelled out as torch.onnx writes gpt2's gelu_new (tanh) or the erf form.

    `inner_read_elsewhere` makes f(x) also a graph output, so it cannot be removed.
    """

    node = helper.make_node
    nodes = [const("half", half), const("one", 1.0), node("Mul", ["x", "half"], ["half_x"])]
    if approximate == "tanh":
        nodes += [
            const("three", 3.0),
            const("cubic", cubic),
            const("k", SQRT_2_OVER_PI),
            node("Pow", ["x", "three"], ["cube"]),
            node("Mul", ["cube", "cubic"], ["scaled_cube"]),
            node("Add", ["x", "scaled_cube"], ["inner"]),
            node("Mul", ["inner", "k"], ["arg"]),
            node("Tanh", ["arg"], ["f"]),
        ]
    elif erf_by_mul:
        nodes += [const("c", 1 / erf_divisor), node("Mul", ["x", "c"], ["arg"]), node("Erf", ["arg"], ["f"])]
    else:
        nodes += [const("c", erf_divisor), node("Div", ["x", "c"], ["arg"]), node("Erf", ["arg"], ["f"])]
    nodes += [node("Add", ["f", "one"], ["one_plus"]), node("Mul", ["half_x", "one_plus"], ["y"])]
    outputs = ["y", "f"] if inner_read_elsewhere else ["y"]
    return make_model(nodes, [activation("x", ["batch", "seq", D])], outputs, opset=opset)


@pytest.mark.parametrize(
    ("approximate", "erf_by_mul", "rule"),
    [("tanh", False, "gelu_tanh"), ("none", False, "gelu_erf"), ("none", True, "gelu_erf")],
)
def test_spelled_out_gelu_becomes_gelu(approximate: str, erf_by_mul: bool, rule: str) -> None:
    model = gelu_graph(approximate, erf_by_mul=erf_by_mul)
    feeds = {"x": 3 * feeds_for(model)["x"]}  # reach the tails, where tanh and erf forms differ
    expected = ort_outputs(fresh(model), feeds)
    fusion = gelu_fusion()
    assert fusion(model).modified
    assert fusion.counts[rule] == 1 and sum(fusion.counts.values()) == 1
    (node,) = [n for n in model.graph if n.op_type != "Constant"]  # unread Constants go in canonicalize
    assert (node.domain, node.op_type, node.attributes.get_string("approximate")) == ("", "Gelu", approximate)
    assert input_names(node) == ["x"]
    for got, want in zip(ort_outputs(model, feeds), expected):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    assert not gelu_fusion()(model).modified


@pytest.mark.parametrize(
    ("case", "model", "reason"),
    [
        ("cubic coefficient 0.05", gelu_graph("tanh", cubic=0.05), "0.044715"),
        ("factor 0.4, not 0.5", gelu_graph("tanh", half=0.4), "0.5"),
        ("erf of x / 2", gelu_graph("none", erf_divisor=2.0), "1.414"),
        ("tanh read elsewhere", gelu_graph("tanh", inner_read_elsewhere=True), "other uses"),
        ("opset without Gelu", gelu_graph("none", opset=19), "opset"),
    ],
)
def test_gelu_lookalikes_are_left_alone(case: str, model: ir.Model, reason: str) -> None:
    nodes_before = len(model.graph)
    fusion = gelu_fusion()
    check_modified_is_exact(fusion, model)
    assert sum(fusion.counts.values()) == 0, case
    assert len(model.graph) == nodes_before and op_count(model, "Gelu") == 0
    assert any(reason in miss.reason for miss in fusion.explain(model)), fusion.explain(model)


def bias_gelu_graph(*, approximate: str = "none", bias: str = "vector") -> ir.Model:
    """y = Gelu(x + bias), as a Linear with bias followed by its activation.

    `bias`: "vector" is a [D] weight; "one" a [1] weight the Add broadcasts; "tensor" a [batch, seq, D] input.
    """
    inputs = [activation("x", ["batch", "seq", D])]
    initializers = []
    if bias == "tensor":
        inputs.append(activation("bias", ["batch", "seq", D]))
    else:
        initializers.append(weights("bias", [D] if bias == "vector" else [1], seed=4))
    nodes = [
        helper.make_node("Add", ["x", "bias"], ["biased"]),
        helper.make_node("Gelu", ["biased"], ["y"], approximate=approximate),
    ]
    return make_model(nodes, inputs, ["y"], initializers)


def test_bias_add_and_gelu_become_bias_gelu() -> None:
    model = bias_gelu_graph()
    feeds = feeds_for(model)
    expected = ort_outputs(fresh(model), feeds)
    lowering = gelu_lowering_ort()
    assert lowering(model).modified and lowering.counts == {"bias_gelu": 1}
    (node,) = list(model.graph)
    assert (node.domain, node.op_type) == (MS, "BiasGelu")
    assert input_names(node) == ["x", "bias"]
    for got, want in zip(ort_outputs(model, feeds), expected):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    assert not gelu_lowering_ort()(model).modified


@pytest.mark.parametrize(
    ("case", "model", "reason"),
    [
        ("tanh Gelu", bias_gelu_graph(approximate="tanh"), "tanh"),
        ("bias broadcast from [1]", bias_gelu_graph(bias="one"), "bias has shape"),
        ("a full tensor, not a bias", bias_gelu_graph(bias="tensor"), "1D"),
    ],
)
def test_bias_gelu_lookalikes_are_left_alone(case: str, model: ir.Model, reason: str) -> None:
    lowering = gelu_lowering_ort()
    check_modified_is_exact(lowering, model)
    assert lowering.counts == {"bias_gelu": 0}, case
    assert op_count(model, "Gelu") == 1 and op_count(model, "Add") == 1
    assert any(reason in miss.reason for miss in lowering.explain(model)), lowering.explain(model)


def test_standard_gelu_is_not_lowered() -> None:
    """onnxruntime's com.microsoft Gelu / FastGelu are no faster than Gelu-20, so Gelu stays standard."""
    model = gelu_graph("tanh")
    gelu_fusion()(model)
    lowering = gelu_lowering_ort()
    check_modified_is_exact(lowering, model)
    assert op_count(model, "Gelu") == 1


# --- the canonicalized graphs of tiny checkpoints ------------------------------------------------------------

# arch -> (GELUs spelled out per layer, GELUs after a bias Add per layer). gpt2's gelu_new is written out in
# Python (and its MLP bias is inside Gemm); gpt_neox uses F.gelu after a Linear with bias; gemma2 uses
# F.gelu(approximate="tanh") after a bias-free Linear, so neither pass touches it (nor its softcapping Tanh).
ARCHITECTURES = {"gpt2": (1, 0), "gpt_neox": (0, 1), "gemma2": (0, 0)}


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_tiny_decoders(arch: str, scratch: Path) -> None:
    spelled_out, after_bias = (per_layer * layer_count(arch) for per_layer in ARCHITECTURES[arch])
    model = canonical_graph(arch, scratch)
    feeds = decoder_feeds(model)
    expected = ort_outputs(model, feeds)
    gelus, tanhs, pows = (op_count(model, op) for op in ("Gelu", "Tanh", "Pow"))

    fusion = gelu_fusion()
    assert fusion(model).modified == bool(spelled_out)
    assert fusion.counts == {"gelu_erf": 0, "gelu_tanh": spelled_out}
    assert op_count(model, "Gelu") == gelus + spelled_out
    assert op_count(model, "Tanh") == tanhs - spelled_out and op_count(model, "Pow") == pows - spelled_out
    for got, want in zip(ort_outputs(model, feeds), expected):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)

    lowering = gelu_lowering_ort()
    assert lowering(model).modified == bool(after_bias)
    assert op_count(model, "BiasGelu", MS) == after_bias == lowering.counts["bias_gelu"]
    for got, want in zip(ort_outputs(model, feeds), expected):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    check_modified_is_exact(gelu_lowering_ort(), model)
