"""Projection packing: inline graphs for q/k/v and gate/up (matches and misses), then every tiny architecture."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes import common

from kvforge.passes.pack_matmul import pack_gate_up, pack_qkv
from kvforge.passes.rewrite import FusionPass
from tests.passes.fusion_testing import canonical_graph, check_modified_is_exact, decoder_feeds, op_count, ort_outputs

FP32 = dict(rtol=1e-4, atol=1e-5)
HIDDEN = 16
QKV = {"q": 16, "k": 8, "v": 8}  # out features: grouped-query k/v narrower than q


def projection_graph(
    outs: dict[str, int],
    *,
    layers: int = 1,
    bias: bool = False,
    folded: tuple[str, ...] = (),
    weight_inputs: tuple[str, ...] = (),
    separate_inputs: bool = False,
    gate: str | None = None,
) -> ir.Model:
    """Per layer, `{name}{layer} = MatMul(x, Transpose(W))` (+ bias) for each of `outs`, weights named like a
    checkpoint's; a layer's first projection is the next layer's x.

    `folded` weights are stored [in, out] and read directly; `weight_inputs` are graph inputs, not
    initializers; `separate_inputs` gives each projection its own x; `gate` ("silu" or "gelu") combines
    two projections as act(gate) * up, the gated MLP.
    """
    rng = np.random.default_rng(0)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN])]
    nodes, initializers, outputs = [], [], []
    x = "x"
    for layer in range(layers):
        prefix = f"model.layers.{layer}.{'mlp' if gate else 'self_attn'}.{{}}_proj."
        for name, out in outs.items():
            weight, bias_name, y = prefix.format(name) + "weight", prefix.format(name) + "bias", f"{name}{layer}"
            source = f"{x}_{name}" if separate_inputs else x
            if separate_inputs:
                inputs.append(helper.make_tensor_value_info(source, TensorProto.FLOAT, ["batch", "seq", HIDDEN]))
            array = rng.standard_normal((out, HIDDEN)).astype(np.float32) / 4
            if name in weight_inputs:
                inputs.append(helper.make_tensor_value_info(weight, TensorProto.FLOAT, [out, HIDDEN]))
            else:
                initializers.append(numpy_helper.from_array(array.T.copy() if name in folded else array, weight))
            if name not in folded:
                nodes.append(helper.make_node("Transpose", [weight], [f"{y}_wt"], perm=[1, 0]))
            nodes.append(helper.make_node("MatMul", [source, weight if name in folded else f"{y}_wt"], [f"{y}_mm"]))
            if bias:
                initializers.append(numpy_helper.from_array(rng.standard_normal(out).astype(np.float32), bias_name))
                nodes.append(helper.make_node("Add", [f"{y}_mm", bias_name], [y]))
            else:
                nodes.append(helper.make_node("Identity", [f"{y}_mm"], [y]))  # named output; removed below
            outputs.append((y, out))
        x = outputs[-len(outs)][0]
    if gate == "silu":
        nodes += [helper.make_node("Sigmoid", ["gate0"], ["sig"]), helper.make_node("Mul", ["gate0", "sig"], ["act"])]
    elif gate == "gelu":
        nodes.append(helper.make_node("Gelu", ["gate0"], ["act"], approximate="tanh"))
    if gate:
        nodes.append(helper.make_node("Mul", ["act", "up0"], ["h"]))
        outputs = [("h", outs["up"])]
    graph = helper.make_graph(
        nodes,
        "projections",
        inputs,
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["batch", "seq", n]) for o, n in outputs],
        initializer=initializers,
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))
    common.IdentityEliminationPass()(model)  # canonical graphs have no Identity
    return model


def feeds_for(model: ir.Model) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    feeds = {}
    for value in model.graph.inputs:
        shape = value.shape
        assert shape is not None
        dims = [3 if isinstance(d, ir.SymbolicDim) else d for d in shape]
        feeds[value.name or ""] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def assert_fuses_exactly(
    make: Callable[[], ir.Model], pack: Callable[[], FusionPass], counts: dict[str, int]
) -> ir.Model:
    """Fuse a fresh graph from `make`: the counts, the same outputs, `modified` exact; returns the fused graph."""
    model = make()
    feeds = feeds_for(model)
    expected = ort_outputs(model, feeds)
    fusion = pack()
    fusion(model)
    assert fusion.counts == counts
    for actual, reference in zip(ort_outputs(model, feeds), expected):
        np.testing.assert_allclose(actual, reference, **FP32)
    check_modified_is_exact(pack(), make())
    return model


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_qkv_projections_become_one_matmul_and_split(bias: bool) -> None:
    model = assert_fuses_exactly(
        lambda: projection_graph(QKV, bias=bias), pack_qkv, {"qkv_bias": int(bias), "qkv": int(not bias)}
    )
    assert op_count(model, "MatMul") == 1 and op_count(model, "Split") == 1 and op_count(model, "Add") == int(bias)
    names = set(model.graph.initializers)
    prefix = "model.layers.0.self_attn."
    assert names == {f"{prefix}qkv_proj.weight"} | ({f"{prefix}qkv_proj.bias"} if bias else set())
    packed = model.graph.initializers[f"{prefix}qkv_proj.weight"].const_value
    assert packed is not None and packed.shape == (sum(QKV.values()), HIDDEN)  # [out, in], read through Transpose
    assert [o.name for o in model.graph.outputs] == ["q0", "k0", "v0"]


def test_a_folded_weight_packs_in_the_layout_the_matmul_reads() -> None:
    model = assert_fuses_exactly(lambda: projection_graph(QKV, folded=("k",)), pack_qkv, {"qkv_bias": 0, "qkv": 1})
    packed = model.graph.initializers["model.layers.0.self_attn.qkv_proj.weight"].const_value
    assert packed is not None and packed.shape == (HIDDEN, sum(QKV.values()))  # [in, out], no Transpose
    assert op_count(model, "Transpose") == 0


def test_each_layer_packs_once_under_its_own_name() -> None:
    model = assert_fuses_exactly(lambda: projection_graph(QKV, layers=6), pack_qkv, {"qkv_bias": 0, "qkv": 6})
    assert sorted(model.graph.initializers) == [f"model.layers.{i}.self_attn.qkv_proj.weight" for i in range(6)]


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: projection_graph(QKV, separate_inputs=True), "no 2 other nodes near q0 complete"),
        (lambda: projection_graph(QKV, weight_inputs=("v",)), "is not a constant initializer"),
        (lambda: projection_graph({"q": 16, "k": 8}), "no 2 other nodes"),
    ],
    ids=["separate-inputs", "weight-is-an-input", "only-two"],
)
def test_qkv_misses_are_left_alone_and_explained(make: Callable[[], ir.Model], reason: str) -> None:
    assert_fuses_exactly(make, pack_qkv, {"qkv_bias": 0, "qkv": 0})
    misses = pack_qkv().explain(make())
    assert any(m.rule == "qkv" and reason in m.reason for m in misses), misses


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_gate_and_up_become_one_matmul_and_keep_their_activation(activation: str) -> None:
    expected = {"gate_up_silu": 0, "gate_up_gelu": 0, f"gate_up_{activation}": 1}
    model = assert_fuses_exactly(
        lambda: projection_graph({"gate": 32, "up": 32}, gate=activation), pack_gate_up, expected
    )
    assert op_count(model, "MatMul") == 1 and op_count(model, "Split") == 1
    assert set(model.graph.initializers) == {"model.layers.0.mlp.gate_up_proj.weight"}
    if activation == "gelu":
        (gelu,) = [n for n in model.graph if n.op_type == "Gelu"]
        assert gelu.attributes["approximate"].value == "tanh"
    else:
        assert op_count(model, "Sigmoid") == 1 and op_count(model, "Mul") == 2


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (
            lambda: projection_graph({"gate": 32, "up": 32}, gate="silu", separate_inputs=True),
            "x bound to two different values",
        ),
        (
            lambda: projection_graph({"gate": 32, "up": 32}, gate="silu", weight_inputs=("gate",)),
            "is not a constant initializer",
        ),
    ],
    ids=["separate-inputs", "weight-is-an-input"],
)
def test_gate_up_misses_are_left_alone_and_explained(make: Callable[[], ir.Model], reason: str) -> None:
    assert_fuses_exactly(make, pack_gate_up, {"gate_up_silu": 0, "gate_up_gelu": 0})
    misses = pack_gate_up().explain(make())
    assert any(m.rule == "gate_up_silu" and reason in m.reason for m in misses), misses


# Packs per layer by rule: phi3 ships qkv_proj and gate_up_proj packed, gpt2 and gpt_neox a packed
# query_key_value and an ungated MLP.
PACKS_PER_LAYER = {
    "llama": {"qkv": 1, "gate_up_silu": 1},
    "mistral": {"qkv": 1, "gate_up_silu": 1},
    "qwen2": {"qkv_bias": 1, "gate_up_silu": 1},
    "qwen3": {"qkv": 1, "gate_up_silu": 1},
    "phi3": {},
    "gemma": {"qkv": 1, "gate_up_gelu": 1},
    "gemma2": {"qkv": 1, "gate_up_gelu": 1},
    "gpt_neox": {},
    "gpt2": {},
}


# Block, the packed weight's projection name, the projections it replaces, the rules that make it.
PACKED_WEIGHTS = [
    ("self_attn", "qkv", ("q", "k", "v"), ("qkv", "qkv_bias")),
    ("mlp", "gate_up", ("gate", "up"), ("gate_up_silu", "gate_up_gelu")),
]


@pytest.mark.slow  # exports each tiny checkpoint once per session (shared with other fusion tests)
@pytest.mark.parametrize("model_type", list(PACKS_PER_LAYER))
def test_every_projection_group_of_a_tiny_decoder_packs_without_changing_it(model_type: str, scratch: Path) -> None:
    model = canonical_graph(model_type, scratch)
    feeds = decoder_feeds(model)
    expected = ort_outputs(model, feeds)
    layers = sum(1 for v in model.graph.inputs if (v.name or "").endswith(".key"))
    qkv, gate_up = pack_qkv(), pack_gate_up()
    qkv(model)
    gate_up(model)
    per_layer = PACKS_PER_LAYER[model_type]
    assert qkv.counts == {rule: per_layer.get(rule, 0) * layers for rule in ("qkv_bias", "qkv")}
    assert gate_up.counts == {rule: per_layer.get(rule, 0) * layers for rule in ("gate_up_silu", "gate_up_gelu")}
    for actual, reference in zip(ort_outputs(model, feeds), expected):
        np.testing.assert_allclose(actual, reference, **FP32)
    names = set(model.graph.initializers)
    for block, packed, parts, rules in PACKED_WEIGHTS:
        if any(rule in per_layer for rule in rules):
            for prefix in (f"model.layers.{i}.{block}." for i in range(layers)):
                assert f"{prefix}{packed}_proj.weight" in names
                assert names.isdisjoint(f"{prefix}{part}_proj.weight" for part in parts)
